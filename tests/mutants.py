"""Does the suite fail when the recipe is applied wrong? Each mutant below is one plausible slip in a
line of train.py, optim.py or model.py that carries the recipe (or of decoding, drafting,
eval.py's metrics, the reasoning tasks and their accuracy); this script applies them one at a
time to a copy of the tree and runs the tests that pin that line (-x: it stops at the first
failure).
A mutant the tests let through is printed as SURVIVED: a line no test pins yet.

    python tests/mutants.py                 # every mutant (about 25 minutes on 2 cores)
    python tests/mutants.py optim.py 3      # those of one file, or the ones whose index is given

Not part of the suite (pytest collects test_*.py only); docs/testing.md says when to run it."""
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = ["tests/test_recipe.py"]
PLAN = ["tests/test_planning.py"]
SHORT_RUN = ["tests/test_train.py::test_short_run_learns_logs_and_saves"]
OPTIM = ["tests/test_optim.py"] + RECIPE
MODEL = ["tests/test_model.py", "tests/test_variable_loops.py", "tests/test_padded_generate.py"]
LOOP_CACHE = ["tests/test_loop_cache.py"]
SPECULATIVE = ["tests/test_speculative.py"]
STATIC = ["tests/test_static_decode.py"]
TASKS = ["tests/test_tasks.py"]
EVAL = ["tests/test_eval.py"]

# (file, the line's text, the slip, the tests that pin it)
MUTANTS = [
    # train.py: the recipe's arithmetic
    ("train.py", "n_head = math.ceil(n_embd / 128)", "n_head = math.ceil(n_embd / 64)", PLAN),
    ("train.py", "tokens_per_fwdbwd = device_batch_size * sequence_len * world_size",
     "tokens_per_fwdbwd = device_batch_size * sequence_len", RECIPE),
    ("train.py", 'params["non_embedding"] = params["all"] - config.padded_vocab * n_embd',
     'params["non_embedding"] = params["all"] - config.vocab_size * n_embd', PLAN),
    ("train.py", "horizon_tokens = {count: 20 * n for", "horizon_tokens = {count: 10 * n for", PLAN),
    ("train.py", "num_steps = max(1, horizon_tokens[horizon_params] // total_batch_size)",
     'num_steps = max(1, horizon_tokens["all"] // total_batch_size)', PLAN),
    ("train.py", "train_files, val_files = shards[:-1], shards[-1:]",
     "train_files, val_files = shards, shards[-1:]", RECIPE),
    ("train.py", "torch.manual_seed(seed)", "torch.manual_seed(seed + rank)", RECIPE),
    ("train.py", "last_step = step == num_steps", "last_step = step == num_steps - 1", RECIPE),
    ("train.py", "loss = loss / grad_accum", "loss = loss", RECIPE),
    ("train.py", "train_loss += loss.detach()", "train_loss = loss.detach() * grad_accum", RECIPE),
    ("train.py", '{"loss": train_loss / world_size,', '{"loss": train_loss,', RECIPE),
    ("train.py", 'for k in ("loss", "grad_norm", "resid_sum")', 'for k in ("loss", "grad_norm")',
     ["tests/test_train.py::test_a_dead_model_stops_with_a_nonzero_exit"]),
    ("train.py", ".double().sum().sqrt()", ".double().sum()", RECIPE),
    ("train.py", 'clip = clip_coefficient(numbers["grad_norm"], grad_clip)',
     'clip = clip_coefficient(numbers["grad_norm"], 1.0)', RECIPE),
    ("train.py", "opt.step(grad_scale=clip)", "opt.step()", RECIPE),
    ("train.py", "lrm = lr_multiplier(step, num_steps, warmdown_frac)",
     "lrm = lr_multiplier(step + 1, num_steps, warmdown_frac)", RECIPE),
    ("train.py", 'group["lr"] = group["initial_lr"] * lrm', 'group["lr"] = group["initial_lr"]', RECIPE),
    ("train.py", 'group["lr"] = group["initial_lr"] * lrm', 'group["lr"] = group["lr"] * lrm', RECIPE),
    ("train.py", 'group["momentum"] = muon_momentum(step, momentum_warmup_steps)',
     'group["momentum"] = muon_momentum(step - start_step, momentum_warmup_steps)', RECIPE),
    ("train.py", "model.zero_grad(set_to_none=True)", "pass", RECIPE),
    ("train.py", "truncated_bptt = None if bptt_loops == -1 else bptt_loops", "truncated_bptt = None", RECIPE),
    ("train.py", "loss, looped = model(x, y, loops=K,", "loss, looped = model(x, y, loops=loops,",
     ["tests/test_variable_loops.py::test_sampled_loops_same_on_every_rank_and_after_resume"]),
    ("train.py", "flops_per_token = model.estimate_flops(K, truncated_bptt)", "flops_per_token = model.estimate_flops()",
     RECIPE),
    ("train.py", "if step > start_step and (step % save_interval == 0",
     "if step >= start_step and (step % save_interval == 0", RECIPE),
    ("train.py", "if step % eval_interval == 0 or last_step:", "if step % eval_interval == 1 or last_step:", SHORT_RUN),
    # a task's score at the trained K, counted again from model(x) by the end-to-end test
    ("train.py", "acc = task and tasks.accuracy(model, val_chunks[n_tokens], task.levels, [config.loops])[0]",
     "acc = task and tasks.accuracy(model, val_chunks[n_tokens][:1], task.levels, [config.loops])[0]",
     ["tests/test_tasks.py::test_train_and_eval_a_task_end_to_end"]),
    # optim.py: Muon, AdamW, the reduction, the groups, the schedules
    ("optim.py", "a, b, c = (3.4445, -4.7750, 2.0315)", "a, b, c = (3.4445, -4.7750, 2.0)", OPTIM),
    ("optim.py", "X = X / (X.norm() + eps)", "X = X / (X.abs().max() + eps)", OPTIM),
    ("optim.py", "for _ in range(steps):", "for _ in range(steps - 1):", OPTIM),
    ("optim.py", "momentum_buffer.mul_(momentum).add_(grad)", "momentum_buffer.mul_(momentum).add_(grad, alpha=1 - momentum)", OPTIM),
    ("optim.py", "nesterov = grad.add(momentum_buffer, alpha=momentum)", "nesterov = momentum_buffer", OPTIM),
    ("optim.py", "max(1.0, grad.size(0) / grad.size(1)) ** 0.5", "max(1.0, grad.size(1) / grad.size(0)) ** 0.5", OPTIM),
    ("optim.py", "grad.mul_(grad_scale)", "grad.mul_(1.0)", OPTIM),
    ("optim.py", "op=dist.ReduceOp.AVG", "op=dist.ReduceOp.SUM", OPTIM),
    ("optim.py", 'param.mul_(1 - lr * group["weight_decay"])', 'param.mul_(1 - group["weight_decay"])', OPTIM),
    ("optim.py", "exp_avg.lerp_(grad, 1 - beta1)", "exp_avg.lerp_(grad, beta1)", OPTIM),
    ("optim.py", "step_size = lr / (1 - beta1 ** step)", "step_size = lr", OPTIM),
    ("optim.py", "(1 - beta2 ** step) ** 0.5).add_(eps)", "(1 - beta2 ** step)).add_(eps)", OPTIM),
    ("optim.py", "scale = (768 / model.config.n_embd) ** 0.5", "scale = (model.config.n_embd / 768) ** 0.5", OPTIM),
    ("optim.py", "betas=(0.8, 0.95), eps=1e-10", "betas=(0.9, 0.95), eps=1e-10", OPTIM),
    ("optim.py", "betas=(0.8, 0.95), eps=1e-10", "betas=(0.8, 0.95), eps=1e-8", OPTIM),
    ("optim.py", "Muon(matrices, lr=matrix_lr, momentum=0.95", "Muon(matrices, lr=matrix_lr, momentum=0.9", OPTIM),
    ("optim.py", "return 1.0 if step <= num_steps - warmdown else", "return 1.0 if step < num_steps - warmdown else",
     OPTIM),
    ("optim.py", "frac = min(step / warmup_steps, 1.0)", "frac = min((step + 1) / warmup_steps, 1.0)", OPTIM),
    ("optim.py", "return min(1.0, max_norm / (total_norm + 1e-6))", "return max_norm / (total_norm + 1e-6)", OPTIM),
    ("optim.py", "dist.all_reduce(values)", "dist.all_reduce(values, op=dist.ReduceOp.AVG)", OPTIM),
    # an older torch's collectives: the fallback is the same operations
    ("optim.py", '("reduce_scatter_tensor", "all_gather_into_tensor"))',
     '("all_gather_into_tensor", "reduce_scatter_tensor"))', ["tests/test_collectives.py"]),
    ("optim.py", "for p in COLLECTIVES if", "for p in COLLECTIVES[1:] if",
     ["tests/test_collectives.py"]),
    # model.py: the backbone and the loop
    ("model.py", "return torch.cat([x1 * cos + x2 * sin, x2 * cos - x1 * sin], dim=-1)",
     "return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)", MODEL),
    ("model.py", "inv_freq = 1.0 / (10000 **", "inv_freq = 1.0 / (100000 **", MODEL),
    ("model.py", "q, k = norm(apply_rotary(q, *rope)), norm(apply_rotary(k, *rope))",
     "q, k = norm(apply_rotary(q, *rope)), apply_rotary(k, *rope)", MODEL),
    ("model.py", "c = norm(self.c_kv_down(kv_in))", "c = self.c_kv_down(kv_in)", MODEL),
    ("flt/decoding.py", "visible = (j <= i) & (i - j < window)",
     "visible = (j <= i) & (i - j <= window)", MODEL),
    ("model.py", "tiled[-1] = \"L\"", "pass", MODEL),
    ("model.py", "return self.c_proj(F.relu(self.c_fc(x)).square())", "return self.c_proj(F.relu(self.c_fc(x)))", MODEL),
    ("model.py", "x = norm(x + h_prev)", "x = x + h_prev", MODEL),
    ("model.py", 'q_in = h_prev if inject == "attn" else kv_in', 'q_in = kv_in', MODEL),
    ("model.py", "return norm(e + h_prev)", "return norm(e) + h_prev", MODEL),
    ("model.py", '"LT_ai": "attn" if layer == 0 else None', '"LT_ai": "attn" if layer == 1 else None', MODEL),
    ("model.py", "nn.init.normal_(self.lm_head.weight, std=0.001)", "nn.init.normal_(self.lm_head.weight, std=0.01)",
     MODEL),
    ("model.py", "s = math.sqrt(3 / self.config.n_embd)", "s = math.sqrt(1 / self.config.n_embd)", MODEL),
    ("model.py", "norms.append(x.detach().float().norm(dim=-1).mean())", "norms.append(x.detach().float().norm(dim=-1).max())",
     MODEL),
    ("model.py", "return 15 * torch.tanh(logits / 15)", "return 30 * torch.tanh(logits / 30)", MODEL),
    ("model.py", "ignore_index=-1)", "ignore_index=0)", MODEL),
    ("model.py", "outputs.mean() if targets is not None", "outputs.sum() if targets is not None", MODEL),
    ("model.py", "with torch.no_grad() if t <= frozen else nullcontext():",
     "with torch.no_grad() if t < frozen else nullcontext():", MODEL),
    ("model.py", "if t == 1:\n            return x0, [None] * self.config.n_layer",
     "if t == 0:\n            return x0, [None] * self.config.n_layer", MODEL),
    ("model.py", "(2 * block + attn // 3) * (3 * G + (K - G))",
     "(2 * block + attn // 3) * 3 * G", MODEL),
    ("flt/decoding.py", "kl = F.kl_div(self.logp, logp_prev, log_target=True",
     "kl = F.kl_div(logp_prev, self.logp, log_target=True", MODEL),
    ("flt/decoding.py", "kth = torch.topk(logits, min(top_k, logits.size(-1))).values[..., -1:]",
     "kth = torch.topk(logits, min(top_k, logits.size(-1))).values[..., -2:-1]", MODEL),
    ("model.py", "return -(-self.vocab_size // 64) * 64", "return -(-self.vocab_size // 32) * 32", MODEL),
    ("model.py", "\n        x0 = norm(e)\n", "\n        x0 = e\n", MODEL),
    ("model.py", "h_prev = norm(x)", "h_prev = x", MODEL),
    ("flt/decoding.py", "hs.append(model.norm(x))", "hs.append(x)", LOOP_CACHE),
    ("model.py", "kv_in = norm(x)", "kv_in = x", MODEL),
    ("model.py", "return x + self.mlp(norm(x))", "return x + self.mlp(x)", MODEL),
    ("model.py", "z.repeat_interleave(self.n_head // self.n_kv_head, dim=1)",
     "z.repeat(1, self.n_head // self.n_kv_head, 1, 1)", MODEL),
    ("flt/decoding.py", "logits = logits / temperature", "logits = logits * temperature", MODEL),
    ("model.py", "heads = (6 * G + 4 * (K - G)) if c.loss_all_loops else 6",
     "heads = 6", MODEL),
    ("flt/decoding.py", "hs[-1] = torch.where(self.done[..., None], hs[-2], hs[-1])", "pass",
     MODEL),
    ("train.py", 'ns_dtype=torch.bfloat16 if dtype == "bf16" else torch.float32', "ns_dtype=None",
     ["tests/test_train.py::test_bf16_two_ranks_with_loop_checkpointing"]),
    ("optim.py", "math.log(loops - 1) - sigma**2 / 2", "math.log(loops - 1)", ["tests/test_variable_loops.py"]),
    # flt/decoding.py: the loop cache (m slots per layer, loop t in slot t mod m)
    ("flt/decoding.py", "index = (loop - 1) % self.cache_slots",
     "index = min(loop - 1, self.cache_slots - 1)", LOOP_CACHE),
    ("flt/decoding.py", "self.cache_slots = loops if cache_slots is None else cache_slots",
     "self.cache_slots = 1 if cache_slots is None else cache_slots", LOOP_CACHE),
    ("flt/decoding.py", "1 <= cache_slots <= K:", "1 <= cache_slots:", LOOP_CACHE),
    ("flt/decoding.py", "k_prev, v_prev = self.slot(loop - 1, layer, k)",
     "k_prev, v_prev = self.slot(loop, layer, k)", LOOP_CACHE),
    # flt/decoding.py: drafting with fewer loops, verifying with all K
    ("flt/decoding.py", "cache.rewind(start + emitted.size(1))", "cache.rewind(start + n)", SPECULATIVE),
    ("flt/decoding.py", "LoopSpan(K, start=K_d, h_start=torch.cat(states, 1))",
     "LoopSpan(K, start=K_d - 1, h_start=torch.cat(states, 1))", SPECULATIVE),
    ("flt/decoding.py", "(p.gather(-1, at) / q.gather(-1, at)).clamp(max=1)",
     "(q.gather(-1, at) / p.gather(-1, at)).clamp(max=1)", SPECULATIVE),
    ("flt/decoding.py", "emitted = tokens[:, :min(m + 1, n)]", "emitted = tokens[:, :n]",
     SPECULATIVE),
    # flt/decoding.py: the static decode step (one shape a step, a mask over the capacity)
    ("flt/decoding.py", "mask = attention_mask(k.size(2), self.capacity, self.at, window, k.device, self.pad)",
     "mask = attention_mask(k.size(2), self.capacity, self.at, window, k.device)", STATIC),
    ("flt/decoding.py", "mask = attention_mask(k.size(2), self.capacity, self.at, window, k.device, self.pad)",
     "mask = attention_mask(k.size(2), self.capacity, self.at, None, k.device, self.pad)", STATIC),
    ("flt/decoding.py", "v_all.index_copy_(2, at, v.to(v_all.dtype))", "v_all.index_copy_(2, at, v)", STATIC),
    ("flt/decoding.py", "self.at.add_(n)", "self.at.add_(1)", STATIC),
    ("flt/decoding.py", "self.pad.copy_(0 if pad is None else pad)", "pass", STATIC),
    ("flt/decoding.py", "start = idx.size(1) + done - 1", "start = idx.size(1) + done", SPECULATIVE),
    ("flt/decoding.py", "    if max_new_tokens < 1:\n        return\n", "", SPECULATIVE),
    ("flt/decoding.py", "if cache is None or cache.key != key or cache.owner() is not None:",
     "if cache is None or cache.key != key:", STATIC),
    ("flt/decoding.py", "h_prev = span.h_start", "h_prev = None", SPECULATIVE),
    # the reasoning tasks: their answers, the held-out split, the stream, the accuracy
    ("flt/tasks.py", "running.append(int(task.table[running[-1], g]))",
     "running.append(int(task.table[g, running[-1]]))", TASKS),
    ("flt/tasks.py", "targets += [-1, int(roots[j])]", "targets += [-1, int(roots[0])]", TASKS),
    ("flt/tasks.py", "if not self.is_test(item[0]):", "if True:", TASKS),
    ("flt/tasks.py", "first = self.next_item + self.rank * n", "first = self.next_item", TASKS),
    ("flt/tasks.py", "self.next_item += n * self.world", "self.next_item += n", TASKS),
    ("flt/tasks.py", "rhs = roots[j] if h == 0 else names[j, h - 1]",
     "rhs = roots[j] if h == 0 else names[j, 0]", TASKS),
    ("flt/tasks.py", "pred = model.head(hs[K - 1][scored]).argmax(dim=-1)",
     "pred = model.head(hs[-1][scored]).argmax(dim=-1)", TASKS),
    ("flt/tasks.py", "right[i] += torch.bincount(d[scored], weights=is_right, minlength=n)\n        answers += "
     "torch.bincount(d[scored], minlength=n)", "right[i] += torch.bincount(d[scored], weights=is_right, "
     "minlength=n)\n        answers += torch.bincount(d[scored].clamp(max=1), minlength=n)", TASKS),
    ("flt/tasks.py", "if len(self.perms) ** difficulty < MIN_ITEMS:", "if False:", TASKS),
    # train.py's settings: truncated backprop refused where the embedding would get no gradient
    ("flt/planning.py", 'and e_in_loop_1_only(s["variant"]):', 'and False:', PLAN),
    # eval.py: bits per byte (nats over the bytes of the targets that have bytes)
    ("eval.py", "nats[i] += torch.stack([loss[counts > 0].sum() for loss in losses]).double()",
     "nats[i] += torch.stack([loss[counts >= 0].sum() for loss in losses]).double()", EVAL),
    ("eval.py", "n_bytes[i] += counts.sum()", "n_bytes[i] += (counts > 0).sum()", EVAL),
    ("eval.py", "bits = nats / (math.log(2) * n_bytes[:, None])", "bits = nats / n_bytes[:, None]", EVAL),
    # eval.py: the exit rule's curve, the perplexity
    ("eval.py", "loops_run[i] += looped.exit_loops[counts > 0].sum().double()",
     "loops_run[i] += looped.exit_loops.sum().double()",
     ["tests/test_variable_loops.py::test_exit_curve_counts_loops_and_nats_of_the_targets_with_bytes"]),
    ("eval.py", "n_targets += y.numel()", "n_targets += y.size(0)", EVAL),
]


def run(index, path, old, new, tests, tree):
    text = open(os.path.join(ROOT, path)).read()
    if text.count(old) != 1:
        return f"{index:3d} NOT FOUND {path}: {old!r} (appears {text.count(old)} times)"
    with open(os.path.join(tree, path), "w") as f:
        f.write(text.replace(old, new))
    start = time.time()
    p = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests], cwd=tree,
                       capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    with open(os.path.join(tree, path), "w") as f:
        f.write(text)
    failed = [line for line in p.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
    verdict = f"caught by {failed[0].split()[1]}" if p.returncode else "SURVIVED"
    return f"{index:3d} {verdict} ({time.time() - start:.0f} s) {path}: {old!r} -> {new!r}"


def main(argv):
    chosen = [(i, m) for i, m in enumerate(MUTANTS)
              if not argv or m[0] in argv or str(i) in argv]
    tree = tempfile.mkdtemp(prefix="mutants")
    shutil.copytree(ROOT, tree, dirs_exist_ok=True, ignore=shutil.ignore_patterns(".git", "out", "data", "__pycache__"))
    try:
        for i, (path, old, new, tests) in chosen:
            print(run(i, path, old, new, tests, tree), flush=True)
    finally:
        shutil.rmtree(tree, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1:])
