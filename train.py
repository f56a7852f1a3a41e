"""
Train a looped transformer. One flat script, from a CPU smoke test to 8 GPUs:
    python train.py --loops=3 --device=cpu                      # embedded corpus, minutes
    torchrun --nproc_per_node=8 train.py config/flt_base.py     # the paper's base FLT
Every module-level variable below is a setting: a config file (positional) overrides
them, --key=value overrides both (configurator.py). The defaults are the CPU smoke test;
config/paper.py holds the paper's recipe (docs/recipe.md).
"""
import math
import os
import sys
import time

import torch

import data
import eval as evaluation
from configurator import configure
from flt import checkpoint, cluster, corpus, diagnostics, errors, planning, runtime, tracking
from flt.runtime import print0
from model import GPT, GPTConfig
from optim import build_optimizers, clip_coefficient, lr_multiplier, muon_momentum, reduce_gradients, sample_loops

errors.install("train.py")  # a mistake in a setting, path or file: one line on stderr, exit code 1

# ----------------------------------------------------------------------------- settings
# I/O
out_dir = ""                # empty = out_root/<size>_<variant>_k<loops>[_<attention>], e.g. out/base_flt_k9
out_root = "out"
resume = False              # continue from the newest readable checkpoint in out_dir; "auto": that if out_dir
                            # holds one, else start fresh (the same command for a job and its requeues)
overwrite = False           # a fresh run may delete the run already in out_dir (else it refuses)
eval_interval = 100         # validation bits-per-byte every N steps (and at the last step)
eval_tokens = 2**15         # validation tokens per evaluation during training (at most the whole split, once)
final_eval_tokens = 2**16   # validation tokens at the last step (the paper: 40 * 2**19)
save_interval = 100         # checkpoint every N steps (and at the last step)
save_interval_minutes = 0.0  # also checkpoint once this many minutes have passed since the last one (0 = off)
keep_checkpoints = 2        # the newest N step_* directories are kept; 0 = keep every one
keep_every = 0              # checkpoints at multiples of this step are never deleted (0 = none)
core_interval = 0           # CORE on a subset every N steps, logged as `core` (Fig. 9; the authors: 2000)
core_max_per_task = 500     # items per CORE task during training (the authors: 500)
bundle_dir = ""             # the DCLM eval bundle for core_interval; empty = data_dir/eval_bundle
sample_tokens = 64          # tokens sampled at the end of training (0 = no sample)
wandb_project = ""          # log to Weights & Biases under this project (tracking.py); empty = off
# data
dataset = "embedded"        # embedded (built from Python's own docs, no network) | fineweb
data_dir = "data"
num_shards = corpus.AUTHORS_TRAIN_SHARDS  # fineweb training shards (the authors': 0-248, validation 249);
                            # -1 = only as many as the horizon needs
tokenizer = "bpe"           # bpe = train a byte-level BPE on the corpus; or a tokenizer.json / hub name
bpe_vocab_size = 4096
bos_token = "<|endoftext|>"  # the document token before every document (the paper's Qwen3 runs: <|im_start|>)
# model (the paper's backbone, Sec. 4's variants): d_model = 64 * depth, n_head = ceil(d_model / 128), depth blocks
depth = 3
n_kv_head = -1              # -1 = n_head (MHA); fewer = GQA (must divide n_head)
sequence_len = 256
loops = 3                   # K
variant = "FLT"             # LT | LT_i | LT_ai | FLT_res | FLT
attn = "full"               # full | mla
kv_rank = 128               # MLA latent rank
window_pattern = "L"        # L = full, S = sliding window of sequence_len // 4
loss_all_loops = False      # loss = mean over every loop's output (default: the last loop only)
checkpoint_loops = False    # per-loop activation checkpointing
loops_sampler = "fixed"     # K per optimizer step: fixed (= loops) | uniform (on [loops_min, loops_max]) |
                            # lognormal_poisson (Huginn's, mean = loops); eval and validation run at loops
loops_min = 1               # uniform: the smallest K
loops_max = -1              # uniform: the largest K; lognormal_poisson: a cap (-1 = none)
bptt_loops = -1             # truncated backprop: gradients through the last N loops only (-1 = all)
# optimisation (the paper's recipe, docs/recipe.md)
total_batch_size = 8 * 256  # tokens per optimizer step (the paper: 2**19)
device_batch_size = 8       # sequences per forward on one device
num_steps = 250             # -1 = the horizon: 20 tokens per parameter (see horizon_params)
horizon_params = "all"      # all: 20 x every parameter (the authors' code) | non_embedding (the appendix)
matrix_lr = 0.02            # Muon
embedding_lr = 0.2          # AdamW, times sqrt(768 / d_model)
unembedding_lr = 0.004      # AdamW, times sqrt(768 / d_model)
warmdown_frac = 0.2         # constant LR, then linear to 0 over the last 20% of steps
momentum_warmup_steps = 300  # Muon momentum 0.85 -> 0.95
grad_clip = 1.0
divergence_window = 0       # stop once the smoothed loss has been > divergence_nats above its
divergence_nats = 1.0       # running minimum for this many steps in a row (0 = never stop for that)
watch_layer = -1            # layer whose MLP/attention gradient norms are logged; -1 = the paper's
                            # "5th layer" (index 4), or the last layer of a shallower model
log_clipped_norms = False   # also log grad_<module>_clipped, the authors' view (an extra pass over the gradients)
loader_prefetch = 2         # row groups tokenized ahead of the one in use (~1.6 s of data each for a GPU at K=3)
# system
device = ""                 # cuda | cpu | mps; empty = autodetect
compile = "auto"            # torch.compile of the blocks: auto (CUDA only; costs more than it saves on CPU) | on | off
dtype = "auto"              # bf16 | fp32 | auto (bf16 on CUDA, fp32 elsewhere); bf16 runs on CPU too
dry_run = False             # print the run plan (size, horizon, FLOPs, data, memory, hours) and exit
gpu = ""                    # dry_run: the accelerator to plan for, e.g. "H100"; empty = this machine's
dist_timeout = 1800         # seconds a rank waits in a collective before the job ends with an error
seed = 1337
_WORDS = {"resume": ("auto",)}  # a setting that takes these words besides its type's values
_defaults = dict(globals())
settings = configure(globals(), sys.argv[1:])
planning.check_settings(settings, _defaults)  # errors that name the setting, before any data, model or process group
out_dir = settings["out_dir"] = planning.run_dir(settings)  # e.g. out/base_flt_k9: a grid of runs never collides

# ----------------------------------------------------------------------------- setup
rt = runtime.setup(device)
rank = rt.rank
world_size = rt.world
master = rt.master  # rank 0: prints, logs, and writes what the ranks share
device = rt.device
cuda = rt.device_type == "cuda"

if dry_run:  # the plan reads the vocabulary's size from the settings: nothing is locked, built or fetched
    vocab_size = planning.planned_vocab(settings)
else:
    dtype = settings["dtype"] = runtime.resolve_dtype(dtype, rt.device_type)  # saved: eval uses it
    # Gradient accumulation: an optimizer step sees total_batch_size tokens whatever the hardware, as
    # grad_accum forwards of device_batch_size sequences on each rank, their gradients summed.
    tokens_per_fwdbwd = device_batch_size * sequence_len * world_size  # one forward on every rank
    planning.check_grad_accum(total_batch_size, tokens_per_fwdbwd)  # a ValueError unless it divides
    grad_accum = total_batch_size // tokens_per_fwdbwd

    # The run directory: checked and locked before any minute is spent on data or the model.
    run_lock = checkpoint.claim_out_dir(out_dir, resume, overwrite) if master else None  # held while the run lives
    tracker = tracking.Tracker(wandb_project, out_dir, settings) if master and wandb_project else None

    # Data: every rank prepares it before the process group exists (a download of many GB would
    # outlast a collective's timeout); file locks make one process do each piece of work.
    if dataset == "embedded":
        shards = corpus.embedded_corpus(data_dir)
    if tokenizer != "bpe":
        tok = data.load_tokenizer(tokenizer, cache_dir=data_dir, bos=bos_token)
    elif dataset == "embedded":  # the local BPE is trained on the training shards, cached beside them
        tok = data.get_tokenizer("bpe", os.path.dirname(shards[0]), shards[:-1], bpe_vocab_size, bos=bos_token)
    else:
        tok = None  # trained once the shards are here; the horizon below counts bpe_vocab_size ids
    vocab_size = tok.vocab_size if tok else bpe_vocab_size

# The model: the paper's backbone from one integer (nanochat's): 64 dimensions per layer, heads of
# at most 128 dimensions, so a deeper model is a wider one too.
n_embd = 64 * depth
n_head = math.ceil(n_embd / 128)
kv_heads = n_head if n_kv_head == -1 else n_kv_head  # fewer than n_head: GQA
config = GPTConfig(sequence_len=sequence_len, vocab_size=vocab_size, n_layer=depth, n_head=n_head,
                   n_kv_head=kv_heads, n_embd=n_embd, loops=loops, variant=variant, attn=attn, kv_rank=kv_rank,
                   window_pattern=window_pattern, loss_all_loops=loss_all_loops, checkpoint_loops=checkpoint_loops)
with torch.device("meta"):  # its size and cost, before any data is fetched or memory spent
    sized = GPT(config)
# The horizon: 20 training tokens per parameter, counting every parameter as the authors' code does,
# or (horizon_params="non_embedding") all but the token embedding, as the paper's appendix says.
params = {"all": sized.num_params()}
params["non_embedding"] = params["all"] - config.padded_vocab * n_embd
horizon_tokens = {count: 20 * n for count, n in params.items()}
if num_steps == -1:
    num_steps = max(1, horizon_tokens[horizon_params] // total_batch_size)  # at least one step
if dry_run:
    print(planning.plan(settings, sized, params, horizon_tokens, num_steps, world_size))
    sys.exit(0)

if dataset == "fineweb":
    shards = corpus.download_shards(planning.training_shards(settings, num_steps * total_batch_size), data_dir)
if tok is None:
    tok = data.get_tokenizer("bpe", data_dir, shards[:-1], bpe_vocab_size, bos=bos_token)
train_files, val_files = shards[:-1], shards[-1:]  # the last shard is the validation split
bundle_dir = bundle_dir or os.path.join(data_dir, "eval_bundle")
if core_interval and rt.local_rank == 0:  # every node loads it, and data_dir may be the node's own disk
    corpus.fetch_bundle(bundle_dir, evaluation.bundle_url)

runtime.init_group(rt, dist_timeout)
cluster.check_shared_out_dir(out_dir, rt)  # every rank writes its part of each checkpoint there
resume = resume is True or (resume == "auto" and bool(checkpoint.list_checkpoints(out_dir)))
torch.manual_seed(seed)
torch.backends.cuda.matmul.allow_tf32 = True
byte_tables = {count: tok.token_bytes(count).to(device) for count in evaluation.BYTE_COUNTS}
core_tasks = evaluation.load_bundle(bundle_dir) if core_interval else None  # on this node before the group

# Model: fresh, or exactly as saved (a resumed run may change only the bookkeeping in RESUMABLE).
ckpt_path, monitor = None, diagnostics.NEW_MONITOR
if resume:
    ckpt_path, meta = checkpoint.load_newest(out_dir, device, rank_files=True, log=print0)
    step, changed = meta["step"], planning.resume_changes(meta["settings"], settings, ckpt_path)
    if step >= num_steps:
        runtime.stop(rt, f"--resume: {ckpt_path} is at step {step} and num_steps={num_steps}: nothing to do "
                     f"(raise --num_steps to train further); checkpoints untouched", 0 if step == num_steps else 2)
    print0(f"resuming from {ckpt_path} (step {step}); settings changed: {', '.join(changed)}")
    with torch.device(device):
        model = GPT(GPTConfig(**meta["config"]))
    model.load_state_dict(meta["model"])
    if master:  # newer but unreadable checkpoints must not outrank the ones this run will write
        checkpoint.set_aside_newer(out_dir, step, log=print0)
else:
    with torch.device(device):
        model = GPT(config)
    model.init_weights()
    step = 0
start_step, config = step, model.config
autocast = runtime.precision(model, rt.device_type, dtype)  # the same numerics eval.py will use
flops_per_token = model.estimate_flops()  # counts the loops
print0(f"{config.variant}, {config.loops} loops, {params['all']:,} parameters, {params['non_embedding']:,} without "
       f"the embedding; {num_steps} steps of {total_batch_size:,} tokens = {num_steps * total_batch_size:,} tokens "
       f"(horizon_params={horizon_params!r}); grad accumulation {grad_accum}; {flops_per_token:.3e} FLOPs/token; "
       f"{device} x {world_size}")

adamw, muon = build_optimizers(model, distributed=world_size > 1, matrix_lr=matrix_lr, embedding_lr=embedding_lr,
                               unembedding_lr=unembedding_lr, ns_dtype=torch.bfloat16 if dtype == "bf16" else None)
optimizers = [adamw, muon]  # in this order in every checkpoint's rank state
loader_state = None
if ckpt_path:  # this rank's own state; or, saved by another number of ranks, every rank's (resharded)
    rank_states = checkpoint.load_rank_states(ckpt_path, meta, rank, world_size, device)
    loader_state, monitor = checkpoint.restore_rank_state(rank_states, optimizers, rank, cuda)  # and the RNGs
if compile == "on" or (compile == "auto" and cuda):
    model.compile_regions(dynamic=False)  # the blocks, not the whole model: checkpoint_loops keeps working
loader = data.DataLoader(train_files, tok, device_batch_size, sequence_len, rank, world_size, device,
                         state=loader_state, prefetch=loader_prefetch)
resharded = ckpt_path and checkpoint.resharded(ckpt_path, step, len(rank_states), world_size,
                                               loader.skipped_documents, log=print0)
watched = diagnostics.watched_modules(model, watch_layer)  # gradient norms of Figures 3 and 8
val_chunks = {}  # n_tokens -> this rank's validation chunks: the same held-out tokens every time


def validate(n_tokens):
    """{"val_bpb", "val_bpb_utf8", "val_tokens"} at the trained K, each rank its share (the authors' loop)."""
    if n_tokens not in val_chunks:
        val_chunks[n_tokens] = evaluation.protocol_chunks(val_files, tok, sequence_len, n_tokens, world_size,
                                                          device_batch_size, rank, world_size)[0]
    with runtime.evaluating(model, autocast):  # eval mode, eager
        bpb, n = evaluation.evaluate_bpb(model, val_chunks[n_tokens], byte_tables, [config.loops])
    return {"val_bpb": bpb["authors"][config.loops], "val_bpb_utf8": bpb["utf8"][config.loops], "val_tokens": n}


def core():
    """CORE at the trained loop count on the first core_max_per_task items of every task (Fig. 9)."""
    with runtime.evaluating(model, autocast):
        result = evaluation.evaluate_core(model, tok, core_tasks, [config.loops], device_batch_size,
                                          core_max_per_task, log=lambda *args: None)
    return result[config.loops]["CORE"]


def fail(message, code):  # every rank stops, naming the checkpoint to go back to
    runtime.stop(rt, f"{message}. Last good checkpoint: {last_good or 'none yet'}", code)


def save(it):
    rank_state = checkpoint.rank_state(optimizers, loader, monitor, cuda)
    clock.reset()
    try:
        return checkpoint.save(out_dir, it, model, rank_state, settings=settings, rank=rank, keep=keep_checkpoints,
                               keep_every=keep_every, files={"tokenizer.json": tok.save})
    except runtime.DiskSpaceError as e:  # too little disk, or it filled while written: every rank, one message
        fail(f"step {it}: {e}; the earlier checkpoints are untouched", 1)


# ----------------------------------------------------------------------------- training
log = diagnostics.Log(out_dir if master else None, settings | {"num_steps": num_steps}, tracker)
if resharded:
    log.write(resharded)
bptt = None if bptt_loops == -1 else bptt_loops
peak = planning.peak_flops(torch.cuda.get_device_name(device) if cuda else str(device))  # or None
last_good = ckpt_path  # the checkpoint a failed run points back to
# SIGTERM / SIGUSR1 end the run at the next step's end, with a checkpoint (cluster.py); so may a clock
preemption = cluster.Preemption()
clock = cluster.Clock(save_interval_minutes)
preempted = save_due = False  # what the ranks agreed at the last step
last_read = time.time()  # of the last step's values: the step time is the time between two reads
# The loop, one optimizer step a pass, in five parts: evaluate and save (validate, save; the last
# step does only these, then leaves); forward and backward (model(x, y), loss.backward(), grad_accum
# times); reduce and read (reduce_gradients: one all-reduce; diagnostics.read: one host sync); clip
# and step (clip_coefficient, the schedules, opt.step); log (print0, log.write, divergence check).
while True:
    last_step = step == num_steps  # the last step only evaluates and saves: step num_steps is the final model
    record = {"step": step}
    paused = time.time()  # evaluation and checkpoints are not timed
    if step > start_step and (step % save_interval == 0 or last_step or save_due or preempted):
        last_good = save(step)  # before evaluating: a preempted run has seconds, not minutes
    if preempted and not last_step:  # at the last step the checkpoint is the run: finish it
        log.write({"step": step, "preempted": preemption.signal or "another rank", "checkpoint": last_good})
        runtime.stop(rt, f"preempted ({preemption.signal or 'signal on another rank'}): saved {last_good}; exit "
                     f"{cluster.PREEMPTED}: requeue with --resume=auto", cluster.PREEMPTED)
    if step % eval_interval == 0 or last_step:
        record.update(validate(eval_tokens))
        print0(f"step {step:5d} | val bpb {record['val_bpb']:.4f} ({record['val_tokens']:,} tokens)")
    if core_interval and (step % core_interval == 0 or last_step):
        record["core"] = core()
        print0(f"step {step:5d} | CORE {record['core']:.4f}")
    if last_step:  # the paper's final number, on more tokens than the in-training checks
        record.update({f"final_{k}": v for k, v in validate(final_eval_tokens).items()})
        print0(f"final val bpb ({record['final_val_tokens']:,} tokens): {record['final_val_bpb']:.4f}")
        break
    paused = time.time() - paused

    # Forward and backward: each micro-batch's loss / grad_accum, so the gradients sum to the step's mean.
    train_loss = torch.zeros((), device=device)  # summed on the device: no sync per micro-batch
    K = sample_loops(loops_sampler, step, seed, loops, loops_min, loops_max)  # the same on every rank
    for micro in range(grad_accum):  # gradients stay local and summed; the optimizers average them
        x, y = next(loader)
        with autocast:
            loss, looped = model(x, y, loops=K, bptt_loops=bptt, return_loops=True)
            loss = loss / grad_accum
        loss.backward()
        train_loss += loss.detach()
    # Every rank takes the same decisions below (stop, save, diverge): the all-reduce of the squared gradient norms
    # also sums the loss, the largest residual norm (an overflowed stream can give a finite, useless loss), and
    # whether any rank was signalled or is due to save; a non-finite value anywhere stays so.
    own = diagnostics.own_gradient_norms(model, watched) if master and log_clipped_norms else None  # pre-averaging
    flags = {"preempted": preemption.requested, "save_due": clock.due()}
    summed = {"loss": train_loss, "resid": looped.resid_norms.max()} | {
        name: torch.full((), float(flag), device=device) for name, flag in flags.items()}  # no host copy
    norms, summed = reduce_gradients(optimizers, summed)  # {parameter: squared norm of its averaged gradient}
    host = diagnostics.read(**summed, norms=diagnostics.gradient_norms(norms, watched), own=own,
                            resid_norms=looped.resid_norms)  # the step's one host sync: all it decides or logs
    now = time.time()
    dt = now - last_read - paused  # training only: evaluation and checkpoints are not timed
    last_read = now
    train_loss, resid = host["loss"] / world_size, host["resid"]
    preempted, save_due = host["preempted"] > 0, host["save_due"] > 0
    record.update(diagnostics.norm_record(host["norms"], watched), **diagnostics.norm_record(
        host.get("own"), watched, grad_clip))  # grad_<module>_clipped: only with log_clipped_norms
    total_norm = record["grad_norm"]
    if not all(map(math.isfinite, (train_loss, total_norm, resid))):  # before any parameter moves
        log.write({"step": step, "diverged": True, "loss": train_loss, "grad_norm": total_norm})
        fail(f"step {step}: loss {train_loss}, gradient norm {total_norm}, residual norm {resid}: not finite; "
             f"stopped before the optimizer step, so the parameters were not updated", 1)

    # The optimizer step. Clipping scales the rank-averaged gradient (the optimizers apply it);
    # the schedules are functions of the step alone, so a resumed run continues them exactly.
    clip = clip_coefficient(total_norm, grad_clip)
    lrm = lr_multiplier(step, num_steps, warmdown_frac)
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = group["initial_lr"] * lrm
    for group in muon.param_groups:  # Muon's momentum warms up from 0.85 to 0.95
        group["momentum"] = muon_momentum(step, momentum_warmup_steps)
    for opt in optimizers:
        opt.step(grad_scale=clip)
    model.zero_grad(set_to_none=True)  # None, not zeros: frees the memory until the next backward

    # Logging. dt is the step time in steady state: no torch.cuda.synchronize, the read above is the one wait.
    tok_per_s = total_batch_size / dt
    flops_per_token = model.estimate_flops(K, bptt)  # the K actually run, backprop as run
    record.update(loss=train_loss, lrm=lrm, loops=K, resid_norms=host["resid_norms"], tok_per_s=tok_per_s, dt=dt,
                  mfu=flops_per_token * tok_per_s / (peak * world_size) if peak else None)
    if cuda and step < start_step + 10:  # the first steps show whether the memory estimate holds
        record["mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
    mfu = f" | mfu {100 * record['mfu']:.1f}%" if peak else ""
    print0(f"step {step:5d}/{num_steps} | loss {record['loss']:.4f} | K {K} | lrm {lrm:.2f} | "
           f"grad {record['grad_norm']:.2f} | resid {record['resid_norms'][-1]:.1f} | {tok_per_s:,.0f} tok/s{mfu}")
    log.write(record)
    # Divergence: the smoothed loss far above its running minimum for divergence_window steps.
    monitor = diagnostics.divergence(monitor, record["loss"], divergence_nats)
    if divergence_window and monitor["above"] >= divergence_window:
        log.write({"step": step, "diverged": True, "loss": record["loss"]})
        fail(diagnostics.diverged(step, monitor, divergence_nats, divergence_window), 3)
    step += 1

log.write(record)
log.close()
if master and sample_tokens > 0:  # the trained model continues "The"
    with runtime.evaluating(model, autocast):
        text = runtime.sample(model, tok, "The", sample_tokens, temperature=0.8, top_k=50,
                              seed=seed)
    print(runtime.framed("sample: temperature 0.8, top_k 50", text))
runtime.finish(rt)  # rank 0 may still have been sampling
