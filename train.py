"""
Train a looped transformer. One flat script, from a CPU smoke test to 8 GPUs:
    python train.py --loops=3 --device=cpu                    # embedded corpus, minutes
    torchrun --nproc_per_node=8 train.py config/flt_base.py   # the paper's base FLT
Every module-level variable below is a setting: a config file (positional) overrides them,
--key=value overrides both (configurator.py). The defaults are the CPU smoke test;
config/paper.py holds the paper's recipe, and docs/recipe.md explains each setting.
The duties of a real run (preemption, disk, divergence, resume) live in flt/, one call each.
"""
import math
import os
import sys
from datetime import timedelta

import torch

import data
import eval as evaluation
from configurator import configure
from flt import checkpoint, cluster, core, corpus, diagnostics, errors, inputs, planning, runtime
from flt import tasks, tracking
from flt.guard import Guard, restore_ranks, resume_point
from flt.runtime import print0
from model import GPT, GPTConfig
from optim import build_optimizers, clip_coefficient, lr_multiplier, muon_momentum
from optim import reduce_gradients, sample_loops

# a mistake in a setting, path or file: one line on stderr, exit 1
errors.install("train.py")

# ----------------------------------------------------------------------------- settings
# The loop (Sec. 4): where each of the K loops starts, what it injects (model.py)
variant = "FLT"             # one of model.py's VARIANTS: where loops restart, what they inject
loops = 3                   # K
loss_all_loops = False
# K sampled per step (evaluation runs at `loops`)
loops_sampler = "fixed"     # fixed | uniform | lognormal_poisson
loops_min = 1
loops_max = -1              # uniform: the largest K; lognormal_poisson: a cap (-1 = none)
bptt_loops = -1             # gradients through the last N loops only (-1 = all)
# The backbone: d_model = aspect_ratio * depth, n_head = ceil(d_model / 128)
depth = 3
aspect_ratio = 64
n_kv_head = -1              # -1 = n_head; fewer = GQA
sequence_len = 256
attn = "full"               # full | mla
kv_rank = 128
window_pattern = "L"        # per layer: L = full, S = a window of sequence_len // 4
checkpoint_loops = False
# The optimizers (Muon, AdamW) and their schedules
total_batch_size = 8 * 256  # tokens per optimizer step (the paper: 2**19)
device_batch_size = 8       # sequences per forward on one device
num_steps = 250             # -1 = the horizon: 20 tokens per parameter
horizon_params = "all"      # all | non_embedding
matrix_lr = 0.02
embedding_lr = 0.2
unembedding_lr = 0.004
warmdown_frac = 0.2
momentum_warmup_steps = 300
grad_clip = 1.0
seed = 1337
# The data: text, or a reasoning task of flt/tasks.py (task_difficulty: its knob)
dataset = "embedded"        # embedded (Python's docs, no network) | fineweb | s3 | s5 | chains
#                             | your text: a folder, file or glob (flt/owndata.py, docs/own-data.md)
val_dataset = ""            # your text held out (empty: 1 document in 20, by its hash)
task_difficulty = 8
data_dir = "data"
num_shards = corpus.AUTHORS_TRAIN_SHARDS  # fineweb's training shards; -1 = as the horizon needs
tokenizer = "bpe"           # bpe (trained on the corpus) | a tokenizer.json | a hub name
bpe_vocab_size = 4096
bos_token = "<|endoftext|>"
loader_prefetch = 2
# Evaluation: validation bits per byte, CORE (Fig. 9), a sample
eval_interval = 100
eval_tokens = 2**15
final_eval_tokens = 2**16   # at the last step (the paper: 40 * 2**19)
core_interval = 0           # 0 = never
core_max_per_task = 500
bundle_dir = ""             # empty = data_dir/eval_bundle
sample_tokens = 64          # 0 = none
# What training watches: gradient norms (Figs. 3 and 8), divergence
watch_layer = -1            # -1 = the paper's "5th layer", or the last
log_clipped_norms = False
log_interval = 10           # print a step's line every N steps (log.jsonl: every step)
divergence_window = 0       # stop after N steps diverged by divergence_nats (0 = never)
divergence_nats = 1.0
wandb_project = ""          # empty = off
# The run directory and its checkpoints
out_dir = ""                # empty = out_root/<size>_<variant>_k<loops>...
out_root = "out"
resume = False              # True | "auto" (if out_dir holds a checkpoint)
overwrite = False
save_interval = 100
save_interval_minutes = 0.0  # 0 = off
keep_checkpoints = 2        # the newest N; 0 = every one
keep_every = 0
# The machine, and the run plan
device = ""                 # cuda | cpu | mps; empty = autodetect
dtype = "auto"              # bf16 | fp32 | auto (bf16 on CUDA)
compile = "auto"            # on | off | auto (CUDA only)
dist_timeout = 1800
dry_run = False
gpu = ""                    # dry_run: the accelerator to plan for
_ALSO_ACCEPTS = {"resume": ("auto",)}
_defaults = dict(globals())
settings = configure(globals(), sys.argv[1:])
# errors that name the setting, before any work; the run's directory, e.g. out/base_flt_k9
planning.check_settings(settings, _defaults)
out_dir = settings["out_dir"] = planning.out_dir_of(settings)

# ----------------------------------------------------------------------------- setup
# The process: torchrun's rank and world size, this rank's device, its precision (flt/runtime.py);
# rank 0, the master, prints, logs, and writes what the ranks share
rt = runtime.setup(device)
rank, world_size, master, device = rt.rank, rt.world, rt.master, rt.device
cuda = rt.device_type == "cuda"
dtype = runtime.resolve_dtype(dtype, rt.device_type)

# Gradient accumulation: an optimizer step sees total_batch_size tokens whatever the hardware, as
# grad_accum forwards of device_batch_size sequences on each rank, their gradients summed.
tokens_per_fwdbwd = device_batch_size * sequence_len * world_size
planning.check_grad_accum(total_batch_size, tokens_per_fwdbwd)
grad_accum = total_batch_size // tokens_per_fwdbwd

# The model's shape from one integer (nanochat's): aspect_ratio (64) dimensions per layer, heads
# of at most 128, so a deeper model is a wider one too; GPTConfig checks it before any work
n_embd = aspect_ratio * depth
n_head = math.ceil(n_embd / 128)
kv_heads = n_head if n_kv_head == -1 else n_kv_head
config = GPTConfig(sequence_len=sequence_len, n_layer=depth, n_head=n_head, n_kv_head=kv_heads,
                   n_embd=n_embd, loops=loops, variant=variant, attn=attn, kv_rank=kv_rank,
                   window_pattern=window_pattern, loss_all_loops=loss_all_loops,
                   checkpoint_loops=checkpoint_loops)

# The run directory: checked and locked (held while the run lives) before any data is built or
# fetched; --dry_run plans without one
if master and not dry_run:
    run_lock = checkpoint.claim_out_dir(out_dir, resume, overwrite)
    print(f"run directory: {out_dir}")
# The vocabulary: the tokenizer's (flt/inputs.py builds the embedded corpus's BPE here)
config.vocab_size = inputs.vocab_size(settings)
# its size and cost, before any memory is spent: on the meta device
with torch.device("meta"):
    meta_model = GPT(config)

# The horizon: 20 training tokens per parameter, counting every parameter as the authors' code
# does, or (horizon_params="non_embedding") all but the token embedding, as the appendix says.
params = {"all": meta_model.num_params()}
params["non_embedding"] = params["all"] - config.padded_vocab * n_embd
horizon_tokens = {count: 20 * n for count, n in params.items()}
if num_steps == -1:
    num_steps = max(1, horizon_tokens[horizon_params] // total_batch_size)

# --dry_run: what the run would cost (size, horizon, FLOPs, data, memory, hours), then exit
if dry_run:
    print(planning.plan(settings, meta_model, params, horizon_tokens, num_steps, world_size))
    sys.exit(0)
# the settings each checkpoint saves hold the precision resolved: eval.py runs it at that
settings["dtype"] = dtype
tracker = tracking.Tracker(wandb_project, out_dir, settings) if master and wandb_project else None

# Text's shards (validation last) and tokenizer, flt/inputs.py; a task: no files, its own vocabulary
task = tasks.task_of(settings)
shards = [] if task else inputs.shards(settings, num_steps * total_batch_size)
train_files, val_files = shards[:-1], shards[-1:]
tok = tasks.tokenizer(task) if task else inputs.tokenizer(settings, train_files)
bundle_dir = bundle_dir or os.path.join(data_dir, "eval_bundle")
if core_interval and rt.local_rank == 0:  # CORE's tasks, on each node's data_dir
    corpus.fetch_bundle(bundle_dir, core.BUNDLE_URL)

# The process group (NCCL on CUDA, gloo on CPU) of a torchrun job, once the data is ready; every
# rank must see out_dir, where each writes its part of every checkpoint
if rt.ddp:
    torch.distributed.init_process_group(
        "nccl" if cuda else "gloo", timeout=timedelta(seconds=dist_timeout),
        device_id=torch.device(device) if cuda else None)
cluster.check_shared_out_dir(out_dir, rt)
torch.manual_seed(seed)
torch.backends.cuda.matmul.allow_tf32 = True
byte_tables = {count: tok.token_bytes(count).to(device) for count in evaluation.BYTE_COUNTS}
core_tasks = corpus.load_bundle(bundle_dir) if core_interval else None

# The model: fresh, or exactly as the newest readable checkpoint saved it (flt/guard.py)
ckpt_path, meta = resume_point(rt, out_dir, resume, settings, num_steps, tok)
with torch.device(device):
    model = GPT(GPTConfig(**meta["config"]) if meta else config)
if meta:
    model.load_state_dict(meta["model"])
else:
    model.init_weights()
step = meta["step"] if meta else 0
start_step = step
config = model.config
# bf16: the token embedding stored in bf16 (the authors' base_train.py), the matmuls autocast
runtime.store_embedding(model, dtype)
autocast = torch.autocast(rt.device_type, dtype=torch.bfloat16, enabled=dtype == "bf16")
print0(planning.summary(model, params, settings, num_steps, grad_accum, device, world_size))

# The optimizers (optim.py); a resumed rank restores its own state or, saved by another number of
# ranks, every rank's (resharded), and the RNGs (flt/guard.py)
adamw, muon = build_optimizers(model, distributed=world_size > 1, matrix_lr=matrix_lr,
                               embedding_lr=embedding_lr, unembedding_lr=unembedding_lr,
                               ns_dtype=torch.bfloat16 if dtype == "bf16" else torch.float32)
# in this order in every checkpoint's rank state
optimizers = [adamw, muon]
loader_state, monitor, saved_ranks = restore_ranks(rt, ckpt_path, meta, optimizers)
# torch.compile of the blocks, not the whole model: checkpoint_loops keeps working
if compile == "on" or (compile == "auto" and cuda):
    model.compile_regions(dynamic=False)

# The loader: this rank's (x, y) batches, continued where the checkpoint left off. A synthetic task
# generates its items from the seed; its y[i] is the answer at x[i] itself
loader = task.loader(device_batch_size, rank, world_size, device, seed, loader_state) if task else \
    data.DataLoader(train_files, tok, device_batch_size, sequence_len, rank, world_size, device,
                    state=loader_state, prefetch=loader_prefetch)
resharded = ckpt_path and checkpoint.resharded(ckpt_path, step, saved_ranks, world_size,
                                               loader.skipped_documents, log=print0)
# the modules whose gradient norms Figures 3 and 8 show (and, rank 0, the authors' clipped view)
watch = diagnostics.Watch(model, watch_layer, clipped=master and log_clipped_norms)
# n_tokens -> this rank's validation chunks: the same held-out tokens every time
val_chunks = {}


def validate(n_tokens):
    """{"val_bpb", "val_bpb_utf8", "val_tokens"} at the trained K, each rank its share (the authors'
    loop); a task's on its test items, with "val_acc": its answers' share right (tasks.accuracy)."""
    if task and n_tokens not in val_chunks:
        val_chunks[n_tokens] = task.batches(n_tokens, device_batch_size, rank, world_size)
    elif n_tokens not in val_chunks:
        val_chunks[n_tokens] = data.protocol_chunks(val_files, tok, sequence_len, n_tokens,
                                                    world_size, device_batch_size, rank,
                                                    world_size)[0]
    with runtime.evaluating(model, autocast):
        bpb, n = evaluation.evaluate_bpb(model, val_chunks[n_tokens], byte_tables, [config.loops])
        acc = task and tasks.accuracy(model, val_chunks[n_tokens], task.levels, [config.loops])[0]
    record = {"val_bpb": bpb["authors"][config.loops], "val_bpb_utf8": bpb["utf8"][config.loops],
              "val_tokens": n}
    return record | ({"val_acc": acc[config.loops]["task_acc"]} if task else {})


def core_score():
    """CORE at the trained K on the first core_max_per_task items of every task (Fig. 9)."""
    with runtime.evaluating(model, autocast):
        result = evaluation.evaluate_core(model, tok, core_tasks, [config.loops], device_batch_size,
                                          core_max_per_task, log=lambda *args: None)
    return result[config.loops]["CORE"]


def save(step):
    """This step's checkpoint: the model, and each rank's optimizers, loader position, divergence
    monitor and RNGs; its path. A stop's save keeps a run --overwrite set aside (checkpoint.py)."""
    rank_state = checkpoint.rank_state(optimizers, loader, guard.monitor, cuda)
    return checkpoint.save(out_dir, step, model, rank_state, settings=settings, rank=rank,
                           keep=keep_checkpoints, keep_every=keep_every,
                           files={"tokenizer.json": tok.save}, stopping=guard.preempted)


def set_schedules(step):
    """The LR multiplier on every group and Muon's momentum warm-up (0.85 to 0.95): functions of
    the step alone, so a resumed run continues them exactly. Returns the multiplier."""
    lrm = lr_multiplier(step, num_steps, warmdown_frac)
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = group["initial_lr"] * lrm
    for group in muon.param_groups:
        group["momentum"] = muon_momentum(step, momentum_warmup_steps)
    return lrm


# ----------------------------------------------------------------------------- training
log = diagnostics.Log(out_dir if master else None, settings | {"num_steps": num_steps}, tracker,
                      resumed_at=start_step if ckpt_path else None)
if resharded:
    log.write(resharded)
# truncated backprop through the loops (model.py): the last bptt_loops loops; None = every loop
truncated_bptt = None if bptt_loops == -1 else bptt_loops
peak = planning.peak_flops(torch.cuda.get_device_name(device) if cuda else str(device))
# preemption, time-based saves, the last good checkpoint, a full disk, divergence (flt/guard.py)
guard = Guard(rt, log, save, last_good=ckpt_path, monitor=monitor, divergence_nats=divergence_nats,
              save_interval_minutes=save_interval_minutes, divergence_window=divergence_window)
# a step's seconds by the host's clock (no sync), evaluations and saves left out
timer = diagnostics.StepTimer()
# One optimizer step a pass: evaluate and save; schedules; forward and backward over the
# micro-batches; the reduction (optim.py: reduce_gradients) and one host read; clip and step; log.
# to_sum rides on the reduction's all-reduce: the loss (loss / W on each rank sums to the mean),
# the last micro-batch's loop norms (checked finite), the guard's 0/1 signals; not finite: no update
# Clipping is a scale: each optimizer steps with clip x the averaged gradient (_Sharded.step).
while True:
    last_step = step == num_steps  # it only evaluates and saves: step num_steps is the final model
    record = {"step": step}
    # Evaluate and save, not timed; the checkpoint first: a preempted run has seconds, not minutes
    timer.pause()
    if step > start_step and (step % save_interval == 0 or last_step or guard.save_due):
        guard.save(step)
    guard.leave_if_preempted(step, last_step)
    if step % eval_interval == 0 or last_step:
        record.update(validate(eval_tokens))
        print0(diagnostics.val_line(record))
    if core_interval and (step % core_interval == 0 or last_step):
        record["core"] = core_score()
        print0(f"step {step:5d} | CORE {record['core']:.4f}")
    if last_step:  # the paper's final number, on more tokens than the in-training checks
        record.update({f"final_{k}": v for k, v in validate(final_eval_tokens).items()})
        print0(diagnostics.val_line(record, final=True))
        break
    timer.resume()
    # Forward and backward: each loss / grad_accum, so the gradients sum to the step's mean
    lrm = set_schedules(step)
    train_loss = torch.zeros((), device=device)  # summed on the device: no sync per micro-batch
    K = sample_loops(loops_sampler, step, seed, loops, loops_min, loops_max)
    for micro in range(grad_accum):
        x, y = next(loader)
        with autocast:
            loss, looped = model(x, y, loops=K, bptt_loops=truncated_bptt, return_loops=True)
            loss = loss / grad_accum
        loss.backward()
        train_loss += loss.detach()
    # The reduction (optim.py): gradients averaged; one all-reduce sums norms' shares and to_sum
    to_sum = {"loss": train_loss / world_size, "resid_sum": looped.resid_norms.sum()}
    to_sum |= {k: torch.full((), v, device=device) for k, v in guard.signals().items()}
    sq_norms, sums = reduce_gradients(optimizers, to_sum)
    grad_norm = torch.stack(list(sq_norms.values())).double().sum().sqrt()
    # The one host read, one .tolist(): these 0-d tensors and watch's logged norms (device tensors)
    tensors = {"grad_norm": grad_norm, **sums, **watch.tensors(sq_norms, looped)}
    numbers = dict(zip(tensors, torch.stack([t.double() for t in tensors.values()]).tolist()))
    if not all(math.isfinite(numbers[k]) for k in ("loss", "grad_norm", "resid_sum")):
        guard.exit_before_update(step, numbers)
    clip = clip_coefficient(numbers["grad_norm"], grad_clip)
    for opt in optimizers:
        opt.step(grad_scale=clip)
    model.zero_grad(set_to_none=True)  # None, not zeros: frees the memory until the backward
    dt = timer.lap()
    # a preemption or a save due on any rank (the ranks agreed): acted on at the next pass's start
    guard.take_signals(numbers)

    # Log every step to log.jsonl, a line every log_interval steps (flt/diagnostics.py): grad_norm,
    # grad_<module> (Figs. 3, 8), loop norms (rank 0's last micro-batch), tok/s, MFU, CUDA memory
    flops_per_token = model.estimate_flops(K, truncated_bptt)
    record.update(grad_norm=numbers["grad_norm"], **watch.record(numbers, grad_clip))
    record.update(loss=numbers["loss"], lrm=lrm, loops=K)
    record.update(diagnostics.speed(total_batch_size, dt, flops_per_token, peak, world_size,
                                    memory=cuda and step < start_step + 10))
    if step % log_interval == 0:
        print0(diagnostics.step_line(record, num_steps, timer))
    log.write(record)
    guard.watch_divergence(step, numbers["loss"])
    step += 1

log.write(record)
log.close()
if master and sample_tokens > 0:  # the trained model continues "The"
    with runtime.evaluating(model, autocast):
        text = runtime.sample(model, tok, "The", sample_tokens, temperature=0.8, top_k=50,
                              seed=seed)
    print(runtime.framed("sample: temperature 0.8, top_k 50", text))
print0(f"run directory: {out_dir}; its last checkpoint: {guard.last_good}")
runtime.finish(rt)
