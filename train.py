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
import torch.distributed as dist

from flt import checkpoint
from flt import cluster
from flt import corpus
import data
from flt import diagnostics
from configurator import configure
import eval as evaluation
from model import GPT, GPTConfig
from flt import planning
from flt import runtime
from flt.runtime import print0
from flt import tracking
from optim import build_optimizers, clip_coefficient, lr_multiplier, muon_momentum, reduce_gradients, sample_loops

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
ddp, rank, world_size, master, device = rt.ddp, rt.rank, rt.world, rt.master, rt.device
cuda = rt.device_type == "cuda"


def stop(message, code):
    runtime.stop(rt, message, code)


if dry_run:
    print(planning.plan(settings, world_size))
    sys.exit(0)
dtype = settings["dtype"] = runtime.resolve_dtype(dtype, rt.device_type)  # saved: eval uses it
grad_accum = planning.grad_accum(settings, world_size)  # forwards per rank and optimizer step

# The run directory: checked and locked before any minute is spent on data or the model.
run_lock = None
if master:
    checkpoint.prepare_out_dir(out_dir, resume, overwrite)
    run_lock = checkpoint.lock_out_dir(out_dir)
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
config = planning.model_config(settings, tok.vocab_size if tok else bpe_vocab_size)
_, horizon, num_steps = planning.size_and_horizon(settings, config)
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
        stop(f"--resume: {ckpt_path} is at step {step} and num_steps={num_steps}: nothing to do "
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
print0(f"{config.variant}, {config.loops} loops, {horizon['all']:,} parameters, {horizon['non_embedding']:,} without "
       f"the embedding; {num_steps} steps of {total_batch_size:,} tokens = {num_steps * total_batch_size:,} "
       f"tokens (horizon_params={horizon_params!r}); grad accumulation {grad_accum}; "
       f"{flops_per_token:.3e} FLOPs/token; {device} x {world_size}")

optimizers = build_optimizers(model, distributed=ddp, matrix_lr=matrix_lr, embedding_lr=embedding_lr,
                              unembedding_lr=unembedding_lr, ns_dtype=torch.bfloat16 if dtype == "bf16" else None)
loader_state = None
if ckpt_path:  # this rank's own state; or, saved by another number of ranks, every rank's (resharded)
    rank_states = checkpoint.load_rank_states(ckpt_path, meta, rank, world_size, device)
    for i, opt in enumerate(optimizers):
        checkpoint.load_optimizer(opt, [s["optimizers"][i] for s in rank_states])
    own = rank_states[rank % len(rank_states)]
    loader_state, monitor = [s["loader"] for s in rank_states], own["monitor"]
    torch.set_rng_state(own["rng"].cpu())
    if cuda and own["cuda_rng"] is not None:
        torch.cuda.set_rng_state(own["cuda_rng"].cpu())
if compile == "on" or (compile == "auto" and cuda):
    model.compile_regions(dynamic=False)  # the blocks, not the whole model: checkpoint_loops keeps working
loader = data.DataLoader(train_files, tok, device_batch_size, sequence_len, rank, world_size, device,
                         state=loader_state)
resharded = ckpt_path and len(rank_states) != world_size and {
    "step": step, "saved_world_size": len(rank_states), "skipped_documents": loader.skipped_documents}
if resharded:
    print0(f"{len(rank_states)} ranks saved {ckpt_path}, {world_size} resume it: the optimizer state is resharded "
           f"exactly; the data continues after the furthest row group any rank had begun, skipping "
           f"{loader.skipped_documents:,} documents no rank had reached")
watched = diagnostics.watched_modules(model, watch_layer)  # gradient norms of Figures 3 and 8
val_chunks = {}  # n_tokens -> this rank's validation chunks: the same held-out tokens every time


# Evaluation runs the blocks eagerly: its calls (under no_grad; CORE prompts of every length) would each
# compile graphs of their own and fill the cache that training's calls need (model.compile_regions).
@torch.compiler.set_stance("force_eager")
def validate(n_tokens):
    """{"val_bpb", "val_bpb_utf8", "val_tokens"} at the trained loop count, as the authors' training
    loop measures it: each rank scores n_tokens // (world_size * device_batch_size * sequence_len)
    chunks of its own validation stream (eval.protocol_chunks), never more than one pass."""
    if n_tokens not in val_chunks:
        val_chunks[n_tokens] = evaluation.protocol_chunks(val_files, tok, sequence_len, n_tokens, world_size,
                                                          device_batch_size, rank, world_size)[0]
    model.eval()
    with autocast:
        bpb, n = evaluation.evaluate_bpb(model, val_chunks[n_tokens], byte_tables, [config.loops])
    model.train()
    return {"val_bpb": bpb["authors"][config.loops], "val_bpb_utf8": bpb["utf8"][config.loops], "val_tokens": n}


@torch.compiler.set_stance("force_eager")
def core():
    """CORE at the trained loop count on the first core_max_per_task items of every task (Fig. 9)."""
    model.eval()
    with autocast:
        result = evaluation.evaluate_core(model, tok, core_tasks, [config.loops], device_batch_size,
                                          core_max_per_task, log=lambda *args: None)
    model.train()
    return result[config.loops]["CORE"]


def save(it):
    rank_state = dict(optimizers=[o.state_dict() for o in optimizers], loader=loader.state_dict(),
                      rng=torch.get_rng_state(), cuda_rng=torch.cuda.get_rng_state() if cuda else None,
                      monitor=monitor)
    clock.reset()
    try:
        return checkpoint.save(out_dir, it, model, rank_state, settings=settings, rank=rank, keep=keep_checkpoints,
                               keep_every=keep_every, files={"tokenizer.json": tok.save})
    except runtime.DiskSpaceError as e:  # too little disk, or it filled while written: every rank, one message
        stop(f"step {it}: {e}; the earlier checkpoints are untouched. Last good checkpoint: "
             f"{last_good or 'none yet'}", 1)


# ----------------------------------------------------------------------------- training
log = diagnostics.Log(out_dir if master else None, settings | {"num_steps": num_steps}, tracker)
if resharded:
    log.write(resharded)
bptt = None if bptt_loops == -1 else bptt_loops
peak, last_good = planning.peak_flops(torch.cuda.get_device_name(device)) if cuda else None, ckpt_path
# SIGTERM / SIGUSR1 end the run at the next step's end, with a checkpoint (cluster.py); so may a clock
preemption, clock, preempted, save_due = cluster.Preemption(), cluster.Clock(save_interval_minutes), False, False
while True:
    last_step = step == num_steps  # the last step only evaluates and saves
    record = {"step": step}
    if step > start_step and (step % save_interval == 0 or last_step or save_due or preempted):
        last_good = save(step)  # before evaluating: a preempted run has seconds, not minutes
    if preempted and not last_step:  # at the last step the checkpoint is the run: finish it
        log.write({"step": step, "preempted": preemption.signal or "another rank", "checkpoint": last_good})
        stop(f"preempted ({preemption.signal or 'signal on another rank'}): saved {last_good}; exit "
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
    if last_step:
        break

    t0 = time.time()
    train_loss = torch.zeros((), device=device)
    K = sample_loops(loops_sampler, step, seed, loops, loops_min, loops_max)  # the same on every rank
    for micro in range(grad_accum):  # gradients stay local and summed; the optimizers average them
        x, y = next(loader)
        with autocast:
            loss, looped = model(x, y, loops=K, bptt_loops=bptt, return_loops=True)
            loss = loss / grad_accum
        loss.backward()
        train_loss += loss.detach()
    # The loss and the largest residual norm, summed over ranks (a non-finite value anywhere stays
    # non-finite), so every rank takes the same decision below. An overflowed stream can still
    # give a finite, useless loss, hence the residual norm.
    # Summed with them: whether any rank was signalled, or its clock says a checkpoint is due.
    flags = torch.tensor([preemption.requested, clock.due()], dtype=train_loss.dtype, device=device)
    stats = torch.cat([torch.stack([train_loss, looped.resid_norms.max().to(train_loss.device)]), flags])
    if ddp:
        dist.all_reduce(stats)
    train_loss, resid, preempted, save_due = stats[0].item() / world_size, stats[1].item(), *(stats[2:] > 0).tolist()
    if master:  # before the averaging below: the authors' view of the gradient, rank 0's own
        record.update(diagnostics.clipped_norms(model, watched, grad_clip))
    norms = reduce_gradients(optimizers)  # {parameter: squared norm of its rank-averaged gradient}
    total_norm = math.sqrt(sum(norms.values()))
    if not all(map(math.isfinite, (train_loss, total_norm, resid))):  # before any parameter moves
        log.write({"step": step, "diverged": True, "loss": train_loss, "grad_norm": total_norm})
        stop(f"step {step}: loss {train_loss}, gradient norm {total_norm}, residual norm {resid}: not finite; "
             f"stopped before the optimizer step, so the parameters were not updated. Last good "
             f"checkpoint: {last_good or 'none yet'}", 1)
    record.update(diagnostics.module_norms(norms, watched))
    record["grad_norm"] = total_norm
    clip = clip_coefficient(total_norm, grad_clip)  # of the rank-averaged gradient
    lrm = lr_multiplier(step, num_steps, warmdown_frac)
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = group["initial_lr"] * lrm
    for group in optimizers[1].param_groups:
        group["momentum"] = muon_momentum(step, momentum_warmup_steps)
    for opt in optimizers:
        opt.step(grad_scale=clip)
    model.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize()
    dt = time.time() - t0  # training only: evaluation and checkpoints are not timed
    tok_per_s = total_batch_size / dt
    flops_per_token = model.estimate_flops(K, bptt)  # the K actually run, backprop as run
    record.update(loss=train_loss, lrm=lrm, loops=K, resid_norms=looped.resid_norms.tolist(),
                  tok_per_s=tok_per_s, dt=dt, mfu=flops_per_token * tok_per_s / (peak * world_size)
                  if peak else None)
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
        stop(f"step {step}: diverged: the smoothed loss {monitor['ema']:.3f} has been more than "
             f"divergence_nats={divergence_nats} above its minimum {monitor['best']:.3f} for "
             f"{monitor['above']} steps (divergence_window={divergence_window}). Last good checkpoint: "
             f"{last_good or 'none yet'}", 3)
    step += 1

log.write(record)
log.close()
if master and sample_tokens > 0:
    with autocast:
        print0("sample:", repr(runtime.sample(model, tok, "The", sample_tokens, temperature=0.8, top_k=50, seed=seed)))
runtime.finish(rt)  # rank 0 may still have been sampling
