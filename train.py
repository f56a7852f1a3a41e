"""
Train a looped transformer. One flat script, from a CPU smoke test to 8 GPUs:
    python train.py --loops=3 --device=cpu                      # embedded corpus, minutes
    torchrun --nproc_per_node=8 train.py config/flt_base.py     # the paper's base FLT
Every module-level variable below is a setting: a config file (positional) overrides
them, --key=value overrides both (configurator.py). The defaults are the CPU smoke test;
config/paper.py holds the paper's recipe (SPEC 6).
"""
import json
import math
import os
import shutil
import sys
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import data
from configurator import configure
from eval import evaluate_bpb
from model import GPT, GPTConfig, load_model, model_state, peak_flops
from optim import build_optimizers

# ----------------------------------------------------------------------------- settings
# I/O
out_dir = "out"
resume = False              # continue from the newest checkpoint in out_dir
eval_interval = 100         # validation bits-per-byte every N steps (and at the last step)
eval_tokens = 2**15         # validation tokens per evaluation
save_interval = 100         # checkpoint every N steps (and at the last step)
keep_checkpoints = 2        # older step_* directories are deleted
sample_tokens = 64          # tokens sampled at the end of training (0 = no sample)
# data
dataset = "embedded"        # embedded (built from Python's own docs, no network) | fineweb
data_dir = "data"
num_shards = 8              # fineweb: training shards to download (+ the validation shard)
tokenizer = "bpe"           # bpe = train a byte-level BPE on the corpus; or a tokenizer.json / hub name
bpe_vocab_size = 4096
# model (SPEC 2-3): d_model = 64 * depth, n_head = ceil(d_model / 128), depth blocks
depth = 3
n_kv_head = None            # None = n_head (MHA); fewer = GQA
sequence_len = 256
loops = 3                   # K
variant = "FLT"             # LT | LT_i | LT_ai | FLT_res | FLT
attn = "full"               # full | mla
kv_rank = 128               # MLA latent rank
window_pattern = "L"        # L = full, S = sliding window of sequence_len // 4
loss_all_loops = False      # loss = mean over every loop's output (default: the last loop only)
checkpoint_loops = False    # per-loop activation checkpointing
# optimisation (SPEC 6)
total_batch_size = 8 * 256  # tokens per optimizer step (the paper: 2**19)
device_batch_size = 8       # sequences per forward on one device
num_steps = 250             # -1 = the paper's horizon: 20 tokens per non-embedding parameter
matrix_lr = 0.02            # Muon
embedding_lr = 0.2          # AdamW, times sqrt(768 / d_model)
unembedding_lr = 0.004      # AdamW, times sqrt(768 / d_model)
warmdown_frac = 0.2         # constant LR, then linear to 0 over the last 20% of steps
momentum_warmup_steps = 300  # Muon momentum 0.85 -> 0.95
grad_clip = 1.0
# system
device = ""                 # cuda | cpu | mps; empty = autodetect
compile = "auto"            # torch.compile: auto (CUDA only; on CPU it costs more than it saves) | on | off
seed = 1337
settings = configure(globals(), sys.argv[1:])
# Settings a resumed run may change; everything else must match the checkpoint.
RESUMABLE = {"resume", "num_steps", "eval_interval", "eval_tokens", "save_interval", "keep_checkpoints",
             "sample_tokens", "device", "compile", "data_dir", "out_dir"}

# ----------------------------------------------------------------------------- setup
ddp = "RANK" in os.environ
rank, local_rank, world_size = 0, 0, 1
if ddp:
    rank, local_rank, world_size = (int(os.environ[k]) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
device = device or ("cuda" if torch.cuda.is_available() else "cpu")
if device == "cuda":
    device = f"cuda:{local_rank}"
    torch.cuda.set_device(device)
if ddp:
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
master = rank == 0
cuda = device.startswith("cuda")


def print0(*args, **kwargs):
    if master:
        print(*args, **kwargs, flush=True)


torch.manual_seed(seed)
torch.backends.cuda.matmul.allow_tf32 = True
autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda)
tokens_per_fwd = device_batch_size * sequence_len * world_size
if total_batch_size % tokens_per_fwd:
    raise ValueError(f"total_batch_size={total_batch_size} is not a multiple of device_batch_size * "
                     f"sequence_len * world_size = {tokens_per_fwd}")
grad_accum = total_batch_size // tokens_per_fwd

if compile not in ("auto", "on", "off"):
    raise ValueError(f"compile={compile!r}: expected 'auto', 'on' or 'off'")
if dataset not in ("embedded", "fineweb"):
    raise ValueError(f"dataset={dataset!r}: expected 'embedded' or 'fineweb'")

# Data: rank 0 builds or downloads the corpus and the tokenizer first, then every rank loads them.


def prepare():
    shards = data.embedded_corpus(data_dir) if dataset == "embedded" else data.download_shards(num_shards, data_dir)
    # A 'bpe' tokenizer is cached beside the shards it was trained on, one per corpus.
    return shards, data.get_tokenizer(tokenizer, os.path.dirname(shards[0]), shards[:-1], bpe_vocab_size)


if ddp and not master:
    dist.barrier()
shards, tok = prepare()
if ddp and master:
    dist.barrier()
train_files, val_files = shards[:-1], shards[-1:]  # the last shard is the validation split
token_bytes = tok.token_bytes().to(device)

# Model: fresh, or exactly as saved (a resumed run may change only the bookkeeping in RESUMABLE).
ckpt_path = None
if resume:
    model, meta = load_model(out_dir, device)
    ckpt_path, step = meta["path"], meta["step"]
    changed = [k for k, v in meta["settings"].items() if settings.get(k) != v and k not in RESUMABLE]
    if changed:
        raise ValueError(f"--resume: settings {changed} differ from the checkpoint {ckpt_path}; "
                         f"only {sorted(RESUMABLE)} may change")
    print0(f"resuming from {ckpt_path} (step {step})")
else:
    n_head = math.ceil(64 * depth / 128)
    config = GPTConfig(sequence_len=sequence_len, vocab_size=tok.vocab_size, n_layer=depth, n_head=n_head,
                       n_kv_head=n_kv_head or n_head, n_embd=64 * depth, loops=loops, variant=variant,
                       attn=attn, kv_rank=kv_rank, window_pattern=window_pattern,
                       loss_all_loops=loss_all_loops, checkpoint_loops=checkpoint_loops)
    with torch.device(device):
        model = GPT(config)
    model.init_weights()
    step = 0
start_step, raw_model, config = step, model, model.config
if cuda:
    model.transformer.wte.to(torch.bfloat16)  # SPEC 6: the embedding table lives in bf16 on CUDA
n_params = model.num_params()
n_matrix = n_params - model.transformer.wte.weight.numel()
if num_steps < 0:  # SPEC 6 horizon: tokens = 20 x parameters excluding the token embedding
    num_steps = max(1, 20 * n_matrix // total_batch_size)
flops_per_token = model.estimate_flops()  # counts the loops
print0(f"{config.variant}, {config.loops} loops, {n_params:,} parameters ({n_matrix:,} without the "
       f"embedding); {num_steps} steps of {total_batch_size:,} tokens (grad accumulation {grad_accum}); "
       f"{flops_per_token:.3e} FLOPs/token; {device} x {world_size}")

optimizers = build_optimizers(model, distributed=ddp, matrix_lr=matrix_lr, embedding_lr=embedding_lr,
                              unembedding_lr=unembedding_lr)
loader_state = None
if ckpt_path:
    rank_state = torch.load(os.path.join(ckpt_path, f"rank{rank}.pt"), weights_only=False)
    if rank_state["world_size"] != world_size:
        raise ValueError(f"{ckpt_path} was saved by {rank_state['world_size']} ranks, this run has "
                         f"{world_size}: resume with the same world size")
    for opt, state in zip(optimizers, rank_state["optimizers"]):
        opt.load_state_dict(state)
    loader_state = rank_state["loader"]
    torch.set_rng_state(rank_state["rng"])
    if cuda:
        torch.cuda.set_rng_state(rank_state["cuda_rng"])
if compile == "on" or (compile == "auto" and cuda):
    model = torch.compile(model, dynamic=False)
if ddp:
    model = DDP(model, device_ids=[local_rank] if cuda else None)
loader = data.DataLoader(train_files, tok, device_batch_size, sequence_len, rank, world_size, device,
                         state=loader_state)


def lr_multiplier(it):
    """Trapezoid without warm-up (SPEC 6): flat, then linear to 0 over the last warmdown_frac."""
    flat = round((1 - warmdown_frac) * num_steps)
    return 1.0 if it < flat else (num_steps - it) / max(1, num_steps - flat)


def muon_momentum(it):
    frac = min(it / momentum_warmup_steps, 1.0) if momentum_warmup_steps > 0 else 1.0
    return (1 - frac) * 0.85 + frac * 0.95


# Pre-clip gradient norms of the modules the paper's Figure 3 follows (SPEC 5).
mid = config.n_layer // 2
watched = {"mlp_first": raw_model.transformer.h[0].mlp, "lm_head": raw_model.lm_head,
           "mlp_mid": raw_model.transformer.h[mid].mlp, "attn_mid": raw_model.transformer.h[mid].attn}


def grad_norm(module):
    return torch.stack([p.grad.float().norm() for p in module.parameters()]).norm().item()


def validate():
    """Validation bits-per-byte at the trained loop count, on the same held-out tokens each time."""
    val = data.DataLoader(val_files, tok, device_batch_size, sequence_len, rank, world_size, device)
    model.eval()  # evaluate_bpb applies bf16 autocast on CUDA itself
    bpb = evaluate_bpb(raw_model, (next(val) for _ in range(max(1, eval_tokens // tokens_per_fwd))),
                       token_bytes, [config.loops])
    model.train()
    return bpb[config.loops]


def save_checkpoint(it):
    """Atomic: every rank writes into tmp_step_N, which rank 0 then renames to step_N, so a
    kill at any moment leaves the previous checkpoint complete and loadable."""
    final, tmp = (os.path.join(out_dir, f"{p}step_{it:06d}") for p in ("", "tmp_"))
    if master:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        torch.save(model_state(raw_model, step=it, settings=settings), os.path.join(tmp, "model.pt"))
        tok.save(os.path.join(tmp, "tokenizer.json"))
    if ddp:
        dist.barrier()
    torch.save(dict(optimizers=[o.state_dict() for o in optimizers], loader=loader.state_dict(),
                    rng=torch.get_rng_state(), cuda_rng=torch.cuda.get_rng_state() if cuda else None,
                    world_size=world_size), os.path.join(tmp, f"rank{rank}.pt"))
    if ddp:
        dist.barrier()
    if master:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in sorted(d for d in os.listdir(out_dir) if d.startswith("step_"))[:-keep_checkpoints]:
            shutil.rmtree(os.path.join(out_dir, old))
    if ddp:
        dist.barrier()


# ----------------------------------------------------------------------------- training
os.makedirs(out_dir, exist_ok=True)
log = open(os.path.join(out_dir, "log.jsonl"), "a") if master else None
peak = peak_flops(device)
while True:
    last_step = step == num_steps  # the last step only evaluates and saves
    record = {"step": step}
    if step % eval_interval == 0 or last_step:
        record["val_bpb"] = validate()
        print0(f"step {step:5d} | val bpb {record['val_bpb']:.4f}")
    if step > start_step and (step % save_interval == 0 or last_step):
        save_checkpoint(step)
    if last_step:
        break

    t0 = time.time()
    train_loss = torch.zeros((), device=device)
    for micro in range(grad_accum):
        x, y = next(loader)
        # DDP averages gradients once, on the last micro-step (optim.py does not average again).
        sync = not ddp or micro == grad_accum - 1
        with (nullcontext() if sync else model.no_sync()), autocast:
            loss = model(x, y) / grad_accum
        loss.backward()
        train_loss += loss.detach()
    if ddp:
        dist.all_reduce(train_loss, op=dist.ReduceOp.AVG)
    if not torch.isfinite(train_loss):
        print0(f"step {step}: loss is {train_loss.item()}; stopping. Parameters were not updated; "
               f"the last good checkpoint is in {out_dir}")
        sys.exit(1)
    record.update({f"grad_{k}": grad_norm(m) for k, m in watched.items()})
    record["grad_norm"] = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), grad_clip).item()
    lrm = lr_multiplier(step)
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = group["initial_lr"] * lrm
    for group in optimizers[1].param_groups:
        group["momentum"] = muon_momentum(step)
    for opt in optimizers:
        opt.step()
    model.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize()
    dt = time.time() - t0  # training only: evaluation and checkpoints are not timed
    tok_per_s = total_batch_size / dt
    record.update(loss=train_loss.item(), lrm=lrm, resid_norms=raw_model.resid_norms.tolist(),
                  tok_per_s=tok_per_s, dt=dt, mfu=flops_per_token * tok_per_s / (peak * world_size)
                  if peak else None)
    mfu = f" | mfu {100 * record['mfu']:.1f}%" if peak else ""
    print0(f"step {step:5d}/{num_steps} | loss {record['loss']:.4f} | lrm {lrm:.2f} | grad {record['grad_norm']:.2f}"
           f" | resid {record['resid_norms'][-1]:.1f} | {tok_per_s:,.0f} tok/s{mfu}")
    if log:
        log.write(json.dumps(record) + "\n")
        log.flush()
    step += 1

if log:
    log.write(json.dumps(record) + "\n")
    log.close()
if master and sample_tokens > 0:
    prompt = torch.tensor([[tok.bos_id] + tok.encode("The")], device=device)
    n = min(sample_tokens, config.sequence_len - prompt.size(1))
    with autocast:
        sample = [t.item() for t in raw_model.generate(prompt, n, temperature=0.8, top_k=50, seed=seed)]
    print0("sample:", repr(tok.decode(prompt[0].tolist() + sample)))
if ddp:
    dist.barrier()  # rank 0 may still be sampling; no rank tears gloo/NCCL down under another
    dist.destroy_process_group()
