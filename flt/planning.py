"""Support for train.py: run planning and settings checks, kept out of the tutorial's way.

What a run will cost before it starts (the memory estimate, accelerators' peak FLOP/s, the
--dry_run plan), and train.py's settings checks (values, settings that would do nothing, what a
resumed run may change, the run directory's name, whether the batch splits into forwards). The recipe's
arithmetic (the model's shape, gradient accumulation, the horizon) is train.py's own: it passes the results here.
"""
import functools
import math
import os
from collections import Counter

import torch

from flt import checkpoint
from flt import corpus
from flt import errors
import data
from flt import owndata
from flt import tasks
from flt import tracking
from model import ATTNS, VARIANTS, norm, restart
from optim import LOOP_SAMPLERS
from flt.runtime import dtype_bytes, resolve_dtype


# ---------------------------------------------------------------------------- memory and accelerators
def estimate_memory(model, batch_size, dtype="bf16", compiled=False, checkpoint_loops=None, loops=None,
                    world_size=1, device_type="cuda"):
    """Peak training bytes per GPU of `model` (a GPT, on the meta device will do): {parameters,
    gradients, optimizer, activations, total}. Optimizer state: AdamW's two slots (in the parameter's
    dtype) for wte and lm_head, sharded over world_size; Muon's fp32 momentum for the block matrices,
    each owned by one rank: rank 0 owns the first of every world_size matrices of one shape (Muon's
    blocks). Activations, per token, d = n_embd, kv = n_kv_head * head_dim, b = 2 (bf16 autocast)
    or 4 bytes, s = bytes of the residual stream (norm's output: bf16 on CPU, fp32 under CUDA's
    autocast), V = padded vocabulary:
      eager, per layer and loop: the stream twice (2s d), the normed inputs of the four
        linears (shared when s = b: 2b d, else one bf16 copy each: 4b d), q and k after
        RoPE (fp32: the cos/sin tables are, 4(d + kv)), SDPA's q, k, v and output
        (b(2d + 2kv)), ReLU and its square (8b d), and with a bf16 stream (CPU autocast) the fp32
        copies norm (F.rms_norm) keeps of it (8d), or with CUDA's autocast QK-norm's fp32 q and
        k (4(d + kv)); per loop also h(t) and the stream (s d)
      compiled (compile_regions; inductor recomputes the norms' copies): 2s d + 4(d + kv) +
        b(2d + 2kv) + 8b d, as measured on an H200 (scripts/gpu_check.py, docs/testing.md)
      checkpoint_loops: per loop only what crosses loops (2s d), plus one loop recomputed
      logits: eager keeps tanh and log-softmax outputs (8V) and peaks with two fp32
        gradients (8V) in backward; compiled keeps the bf16 logits (bV) and peaks at +4V.
    Checked against CPU measurements (bf16 autocast, eager) and the H200's (compiled) in
    tests/test_planning.py."""
    c, K = model.config, model.loop_count(loops)
    ckpt = c.checkpoint_loops if checkpoint_loops is None else checkpoint_loops
    b = dtype_bytes(dtype)
    s = 2 if (b == 2 and device_type == "cpu") else 4
    d, kv, L, V = c.n_embd, c.n_kv_head * (c.n_embd // c.n_head), c.n_layer, c.padded_vocab
    if compiled:
        layer = 2 * s * d + 4 * (d + kv) + b * (2 * d + 2 * kv) + 8 * b * d
        head, head_peak = b * V, 4 * V
    else:
        layer = 2 * s * d + (2 if s == b else 4) * b * d + 4 * (d + kv) + b * (2 * d + 2 * kv) + 8 * b * d
        layer += 8 * d if s == 2 else 0  # norm (F.rms_norm) saves an fp32 copy of a bf16 stream, twice a layer
        # CUDA's autocast: QK-norm returns q and k in fp32, kept beside the bf16 copies (H200-measured)
        layer += 4 * (d + kv) if s == 4 and b == 2 else 0
        head, head_peak = 8 * V, 8 * V
    N, loop = batch_size * c.sequence_len, L * layer + s * d
    held = N * (K * (2 * s * d if ckpt else loop) + 2 * s * d + head)  # + e and norm(e)
    wte, lm_head = model.transformer.wte.weight, model.lm_head.weight
    # autocast's bf16 copies of the weights, saved for backward (the blocks' only while a loop is live)
    blocks = 2 * sum(p.numel() for p in model.transformer.h.parameters()) if b == 2 else 0
    held += 2 * lm_head.numel() if b == 2 else 0
    peak = max(N * head_peak, N * loop + blocks) if ckpt else N * head_peak + blocks

    def size(p, n):  # bytes of n elements of p: wte is stored in bf16 under bf16 (precision)
        return n * (2 if p is wte and b == 2 else 4)
    nbytes = {"parameters": sum(size(p, p.numel()) for p in model.parameters())}
    nbytes["gradients"] = nbytes["parameters"]
    shapes = Counter(tuple(p.shape) for p in model.transformer.h.parameters())
    nbytes["optimizer"] = (sum(2 * size(p, -(-p.numel() // world_size)) for p in (wte, lm_head))
                           + sum(4 * math.prod(shape) * -(-n // world_size) for shape, n in shapes.items()))
    nbytes["activations"] = held + peak
    nbytes["total"] = sum(nbytes.values())
    return nbytes


# Dense (no sparsity) bf16 tensor-core peak FLOP/s, for MFU and the run planner (train.py --dry_run):
# NVIDIA's datasheets halve their "with sparsity" figures, the H100 and Ada whitepapers give both. H200 is
# the H100 SXM's GH100 with more memory. A name that contains another comes before it ("A100", "A10").
PEAK_FLOPS = (("H200", 989.4e12), ("H100 PCIe", 756.5e12), ("H100 NVL", 835.5e12), ("H100", 989.4e12),
              ("A100", 312e12), ("L40S", 362.05e12), ("4090", 165.2e12), ("A10", 125e12))


def peak_flops(name):
    """Peak FLOP/s of an accelerator by (part of) its name, e.g. torch.cuda.get_device_name(), or
    None if unknown (a CPU). More specific names come first: "H100 NVL" before "H100"."""
    return next((flops for key, flops in PEAK_FLOPS if key.lower() in name.lower()), None)


def consumed_tokens_per_s(model, gpu="H100", mfu=0.40):
    """Training tokens/s one GPU consumes at `mfu` of its peak: peak FLOP/s x mfu / the model's FLOPs per
    token (the loops counted): what each rank's loader must deliver (scripts/bench.py --mode=loader)."""
    return peak_flops(gpu) * mfu / model.estimate_flops()


# ---------------------------------------------------------------------------- train.py's settings
# The functions below take train.py's settings (the dict configure returns, or any mapping of them)
# and return or raise; train.py calls them before any data, model or process group exists.

# The largest learning rate a setting may name: far past any that trains, far below fp32's overflow
MAX_LR = 1e6
# Settings a resumed run may change (bookkeeping); everything else must match the checkpoint.
RESUMABLE = {"resume", "overwrite", "out_dir", "out_root", "num_steps", "eval_interval", "eval_tokens",
             "final_eval_tokens", "save_interval", "save_interval_minutes", "keep_checkpoints", "keep_every",
             "sample_tokens", "device", "compile", "dtype", "data_dir", "divergence_window", "divergence_nats",
             "dist_timeout", "dry_run", "gpu", "wandb_project", "loader_prefetch", "log_clipped_norms",
             "log_interval"}


def e_in_loop_1_only(variant):
    """Whether `variant` reads the token embedding e in loop 1 alone: its restart of loops t >= 2
    (model.py: restart) does not depend on e."""
    e = torch.ones(4, requires_grad=True)
    return not restart(variant, e, norm(e), torch.ones(4)).requires_grad


def heads_of(aspect_ratio, depth):
    """train.py's n_head for d_model = aspect_ratio * depth (heads of at most 128 dimensions), or
    None where d_model does not split into n_head heads of one even dimension (GPTConfig's rule)."""
    n_embd = aspect_ratio * depth
    n_head = math.ceil(n_embd / 128)
    return n_head if n_embd % n_head == 0 and (n_embd // n_head) % 2 == 0 else None


def check_settings(s, defaults):
    """ValueErrors that name the setting: values out of range, and settings that would do nothing (set
    to other than their `defaults` where nothing reads them). A value checked where it is used is not
    checked again here: device (runtime.setup), dtype (runtime.resolve_dtype), the model's shape
    (GPTConfig, but depth and aspect_ratio here: heads_of), bptt_loops' range (the model's forward);
    keep_checkpoints by checkpoint.check_keep."""
    def bad(key, allowed):
        raise ValueError(f"{key}={s[key]!r}: expected {allowed}")
    for key in ("eval_interval", "save_interval", "device_batch_size", "total_batch_size", "eval_tokens",
                "final_eval_tokens", "sequence_len", "depth", "bpe_vocab_size", "dist_timeout", "kv_rank",
                "core_max_per_task", "loader_prefetch", "loops", "aspect_ratio", "log_interval"):
        if s[key] < 1:
            bad(key, "a positive integer")
    if not heads_of(s["aspect_ratio"], s["depth"]):
        fit = [d for d in range(1, 4 * s["depth"]) if heads_of(s["aspect_ratio"], d)]
        near = sorted(fit, key=lambda d: abs(d - s["depth"]))[:2]
        raise ValueError(f"depth={s['depth']}, aspect_ratio={s['aspect_ratio']}: d_model = aspect_ratio * depth = "
                         f"{s['aspect_ratio'] * s['depth']} does not split into heads of one even dimension "
                         f"<= 128 (train.py's shape); e.g. depth=" + " or ".join(map(str, sorted(near)))
                         + f" at aspect_ratio={s['aspect_ratio']}")
    for key in ("keep_every", "core_interval", "divergence_window"):
        if s[key] < 0:
            bad(key, "an integer >= 0 (0 = off / keep all)")
    checkpoint.check_keep(s["keep_checkpoints"])
    for key in ("n_kv_head", "num_steps", "num_shards", "watch_layer"):
        if s[key] == 0 or s[key] < -1:
            bad(key, "-1 (automatic) or a positive integer" if key != "watch_layer" else "-1 or a layer index")
    if s["watch_layer"] >= s["depth"]:
        bad("watch_layer", f"a layer index below depth={s['depth']}, or -1")
    if owndata.is_own(s["dataset"]):  # your own files: they must exist, of kinds it reads
        owndata.files_of(s["dataset"])
        owndata.check_data_dir(s["dataset"], s["data_dir"])
        if s["val_dataset"]:
            owndata.files_of(s["val_dataset"], "val_dataset")
    for key, allowed in (("compile", ("auto", "on", "off")),
                         ("horizon_params", ("all", "non_embedding")), ("loops_sampler", LOOP_SAMPLERS),
                         ("variant", VARIANTS), ("attn", ATTNS)):
        if s[key] not in allowed:
            bad(key, " or ".join(map(repr, allowed)))
    sampler, fixed = s["loops_sampler"], s["loops_sampler"] == "fixed"
    if sampler == "uniform" and not 1 <= s["loops_min"] <= s["loops_max"]:
        bad("loops_max", f"an integer >= loops_min={s['loops_min']} >= 1 with loops_sampler='uniform'")
    if sampler == "lognormal_poisson" and s["loops"] < 2:
        bad("loops", "an integer >= 2 with loops_sampler='lognormal_poisson' (loops is its mean)")
    # a variant whose later loops restart without e (LT) reads the token embedding in loop 1 only:
    # truncated backprop that can leave loop 1 without a graph leaves the embedding no gradient
    k_max = s["loops"] if fixed else s["loops_max"]
    if s["bptt_loops"] != -1 and (k_max == -1 or k_max > s["bptt_loops"]) and e_in_loop_1_only(s["variant"]):
        bad("bptt_loops", f"-1 with variant={s['variant']!r} while K can exceed it: its loops after the first "
                          "restart without the token embedding (model.py: restart), so only loop 1 reads it; "
                          "run without a graph, the embedding would never train")
    if s["divergence_nats"] <= 0:
        bad("divergence_nats", "a positive number of nats")
    # finite and at most MAX_LR: an update lr times larger than that overflows fp32 in AdamW's step
    for key in ("matrix_lr", "embedding_lr", "unembedding_lr"):
        if not (math.isfinite(s[key]) and 0 < s[key] <= MAX_LR):
            bad(key, f"a positive learning rate, at most {MAX_LR:g}")
    if not s["grad_clip"] > 0:
        bad("grad_clip", "a positive gradient norm")
    if not 0 <= s["warmdown_frac"] <= 1:
        bad("warmdown_frac", "a fraction of the steps from 0 to 1")
    for key in ("momentum_warmup_steps", "sample_tokens"):
        if s[key] < 0:
            bad(key, "a number >= 0 (0 = off)")
    if s["save_interval_minutes"] < 0:
        bad("save_interval_minutes", "minutes >= 0 (0 = off)")
    tasks.check_settings(s, defaults)
    if s["wandb_project"]:
        tracking.require(f"wandb_project={s['wandb_project']!r}")  # installed? imported only when set
    # A setting that would do nothing is a mistake in the command, not something to ignore.
    for key, inert, why in (("kv_rank", s["attn"] != "mla", "unless attn='mla'"),
                            ("horizon_params", s["num_steps"] != -1, "unless num_steps=-1"),
                            ("num_shards", s["dataset"] != "fineweb", "unless dataset='fineweb'"),
                            ("val_dataset", not owndata.is_own(s["dataset"]),
                             "unless dataset is your own files (a folder, file or glob)"),
                            ("bpe_vocab_size", s["tokenizer"] != "bpe", "unless tokenizer='bpe'"),
                            ("divergence_nats", s["divergence_window"] == 0, "unless divergence_window > 0"),
                            ("loss_all_loops", s["loops"] == 1 and fixed, "with loops=1"),
                            ("variant", s["loops"] == 1 and fixed, "with loops=1 (one loop is the plain transformer)"),
                            ("core_max_per_task", s["core_interval"] == 0, "unless core_interval > 0"),
                            ("bundle_dir", s["core_interval"] == 0, "unless core_interval > 0"),
                            ("out_root", s["out_dir"] != "", "when out_dir is given"),
                            ("gpu", not s["dry_run"], "unless dry_run=True"),
                            ("keep_every", s["keep_checkpoints"] == 0, "with keep_checkpoints=0 (every one is kept)"),
                            ("loader_prefetch", s["dataset"] in tasks.TASKS,
                             "with a task dataset (its items are made, not read)"),
                            ("loops_min", sampler != "uniform", "unless loops_sampler='uniform'"),
                            ("loops_max", fixed, "with loops_sampler='fixed'"),
                            ("bptt_loops", fixed and s["bptt_loops"] >= s["loops"],
                             "with loops_sampler='fixed' unless below loops")):
        if inert and s[key] != defaults[key]:
            raise ValueError(f"{key}={s[key]!r} does nothing {why}: remove it (or a config file's "
                             f"value: --{key}={defaults[key]!r}, its default), or set what it needs")
    # the paths, before out_dir is claimed or anything is built there
    errors.directory("data_dir", s["data_dir"])
    tokenizer = s["tokenizer"]
    if tokenizer.endswith(".json") and not os.path.isfile(tokenizer):
        raise FileNotFoundError(f"tokenizer={tokenizer!r}: no such file; give a tokenizer.json path, a hub "
                                "name like 'Qwen/Qwen3-0.6B', or bpe")


# Resumable settings that define the schedule: a run continued under another value is neither run
# (a 6-step run continued to 12 has had its LR warm-down already), so only --resume=True changes them.
SCHEDULE = ("num_steps",)


def resume_changes(saved, s, path):
    """The settings that differ from those saved in the checkpoint at path (in their saved order); a
    ValueError if any is outside RESUMABLE: the model, the data and the recipe stay as they were;
    with resume="auto" (a requeue: the same command again), also if any in SCHEDULE differs."""
    changed = [k for k, v in saved.items() if s.get(k) != v]
    if refused := [k for k in changed if k not in RESUMABLE]:
        raise ValueError(f"--resume: settings {refused} differ from the checkpoint {path}; "
                         f"only {sorted(RESUMABLE)} may change")
    # what the run chose to keep stays: a resume that would prune more must say so on purpose
    kept, keep = saved.get("keep_checkpoints", 0), s.get("keep_checkpoints", 0)
    every = saved.get("keep_every", 0)
    if keep and (not kept or keep < kept) or every and s.get("keep_every") != every:
        raise ValueError(f"--resume: keep_checkpoints={keep}, keep_every={s.get('keep_every', 0)} would delete "
                         f"checkpoints the run kept (it had keep_checkpoints={kept}, keep_every={every}): give "
                         f"--keep_checkpoints={kept} --keep_every={every}, or delete the ones you do not want "
                         "yourself")
    schedule = [f"{k}={s[k]} (the checkpoint's run: {saved[k]})" for k in changed if k in SCHEDULE]
    if s.get("resume") == "auto" and schedule:
        raise ValueError(f"--resume=auto: {', '.join(schedule)} differs from {path}: that would "
                         f"continue another run's schedule, not start this one; start this run in "
                         f"another --out_dir, or continue that one on purpose with --resume=True")
    return changed


def out_dir_of(s):
    """out_dir, or out_root/<size>[_ar<aspect_ratio>]_<variant>_k<loops>[_<attention>][_<sampler>][_<data>],
    e.g. out/base_flt_k9: one directory per run, named by what makes it different, so a grid of runs
    never collides; <data>: a task's name, or your own data's (owndata.name_of)."""
    if s["out_dir"]:
        return s["out_dir"]
    size = {6: "small", 12: "base"}.get(s["depth"], f"d{s['depth']}")
    size += f"_ar{s['aspect_ratio']}" if s.get("aspect_ratio", 64) != 64 else ""
    attention = (f"_gqa{s['n_kv_head']}" if s["n_kv_head"] != -1 else "") + ("_mla" if s["attn"] == "mla" else "") + \
        (f"_swa_{s['window_pattern']}" if s["window_pattern"] != "L" else "") + \
        (f"_{s['loops_sampler']}" if s["loops_sampler"] != "fixed" else "")
    task = f"_{s['dataset']}" if s["dataset"] in tasks.TASKS else ""
    task += f"_{owndata.name_of(s['dataset'])}" if owndata.is_own(s["dataset"]) else ""
    return os.path.join(s["out_root"], f"{size}_{s['variant'].lower()}_k{s['loops']}{attention}{task}")


def check_grad_accum(total_batch_size, tokens_per_fwdbwd):
    """A ValueError unless train.py's total_batch_size is a whole number of forwards of device_batch_size
    sequences on every rank (tokens_per_fwdbwd tokens)."""
    if total_batch_size % tokens_per_fwdbwd:
        raise ValueError(f"total_batch_size={total_batch_size} is not a multiple of device_batch_size * "
                         f"sequence_len * world_size = {tokens_per_fwdbwd}")


def training_shards(s, tokens):
    """FineWeb-Edu training shards to fetch: num_shards, or -1: enough for `tokens`. Too few for the
    horizon is said up front; the loader says again when it starts a second pass."""
    n = s["num_shards"] if s["num_shards"] > 0 else corpus.shards_for_tokens(tokens)
    if tokens > n * corpus.SHARD_TOKENS:
        print(f"warning: {tokens:.3e} training tokens from {n} shards of ~{corpus.SHARD_TOKENS:.2g} tokens: the run "
              f"will see its data more than once (num_shards={s['num_shards']})", flush=True)
    return n


def planned_vocab(s):
    """The vocabulary's size for --dry_run (and flt/inputs.py: vocab_size), nothing downloaded or
    written: from the settings alone, but your own data's BPE's, which may have fewer ids than
    bpe_vocab_size (own_tokenizer)."""
    tokenizer = s["tokenizer"]
    if s["dataset"] in tasks.TASKS:
        return tasks.tokenizer(tasks.task_of(s)).vocab_size
    if tokenizer == "bpe" and owndata.is_own(s["dataset"]):
        return own_tokenizer(s)[0].vocab_size
    if tokenizer == "bpe" or os.path.isfile(tokenizer):
        return s["bpe_vocab_size"] if tokenizer == "bpe" else data.load_tokenizer(tokenizer).vocab_size
    if "qwen3" in tokenizer.lower():
        return data.QWEN3_VOCAB
    raise ValueError(f"dry_run: tokenizer={tokenizer!r} is not a local file; give its tokenizer.json path")


@functools.lru_cache(maxsize=None)
def own_bpe(spec, val_spec, vocab_size, bos):
    """The BPE the run trains on your training documents (data.bpe), trained in memory, once a
    process, and never saved."""
    tok = data.bpe([owndata.split(spec, val_spec)[0]], vocab_size)
    return data.Tokenizer(tok, name="the BPE of your training documents", bos=bos)


def own_tokenizer(s):
    """--dry_run on your own data: (the tokenizer its run will use, which one), nothing written: a
    tokenizer.json is loaded; "bpe" is the BPE a run cached for the corpus, else the one it would
    train (bpe_vocab_size on the same training documents: the same tokens), trained in memory
    (own_bpe); a hub name's file is the run's to download: (None, why)."""
    spec, val_spec, tokenizer = s["dataset"], s["val_dataset"], s["tokenizer"]
    vocab, bos = s["bpe_vocab_size"], s["bos_token"]
    folder = owndata.cache_dir(spec, val_spec, s["data_dir"])
    # where inputs.tokenizer has data.get_tokenizer cache the BPE: in the corpus's shard folder
    cached = os.path.join(folder, f"tokenizer_bpe{vocab}.json")
    if tokenizer == "bpe" and os.path.isfile(cached):
        return data.load_tokenizer(cached, bos=bos), f"the run's BPE, cached: {cached}"
    if tokenizer == "bpe":
        tok = own_bpe(spec, val_spec, vocab, bos)
        n_train = len(owndata.split(spec, val_spec)[0])
        return tok, (f"the BPE the run would train, {tok.vocab_size:,} ids on the {n_train:,} "
                     f"training documents: trained here in memory, not saved")
    if os.path.isfile(tokenizer):
        return data.load_tokenizer(tokenizer, bos=bos), f"tokenizer={tokenizer}"
    return None, f"counted by the run, once it has {tokenizer}'s tokenizer.json"


def own_data(s):
    """--dry_run's lines on your own data: owndata.describe's, with the tokens of the tokenizer its
    run will use (own_tokenizer), and which that is."""
    tok, source = own_tokenizer(s)
    described = owndata.describe(s["dataset"], s["val_dataset"], tok)
    if tok is None:
        return f"{described} (tokens: {source})"
    return f"{described}\n              (tokens of {source})"


def plan(s, model, params, horizon_tokens, steps, world_size=1):
    """--dry_run: what the run costs, as text: size, horizon, FLOPs, data, memory per GPU and hours on
    world_size GPUs (one process: 8). train.py computes the rest from the settings alone (nothing is
    downloaded or trained): the model (on the meta device will do), its parameter counts and each
    count's horizon ({"all", "non_embedding"}), and the steps it will train."""
    config = model.config
    batch, other = s["total_batch_size"], "non_embedding" if s["horizon_params"] == "all" else "all"
    tokens, gpus = steps * batch, world_size if world_size > 1 else 8
    name = s["gpu"] or (torch.cuda.get_device_name() if torch.cuda.is_available() else "H100")
    flops = model.estimate_flops()
    dtype = resolve_dtype(s["dtype"], "cuda")  # the plan is for GPUs
    gib = {(c, k): estimate_memory(model, s["device_batch_size"], dtype, compiled=c, checkpoint_loops=k,
                                   world_size=gpus)["total"] / 2**30
           for c in (False, True) for k in (False, True)}
    shards = training_shards(s, tokens) if s["dataset"] == "fineweb" else 0
    peak = peak_flops(name)
    hours = {m: flops * tokens / (gpus * peak * m) / 3600 for m in (0.30, 0.45)} if peak else {}
    # your own data's BPE may be trained to count its tokens, in memory: nothing is written
    done = "written" if owndata.is_own(s["dataset"]) else "trained"
    return (f"run plan for {s['out_dir']} (nothing downloaded or {done})\n"
            f"  model       {config.variant}, K={config.loops}, depth {s['depth']} (d_model {config.n_embd}, "
            f"{config.n_head} heads, {config.n_kv_head} kv), vocab {config.vocab_size:,} "
            f"(padded {config.padded_vocab:,})\n"
            f"  parameters  {params['all']:,} all, {params['non_embedding']:,} without the token embedding\n"
            f"  horizon     {steps:,} steps x {batch:,} tokens = {tokens:.3e} tokens "
            f"(horizon_params={s['horizon_params']!r}; the other count: {horizon_tokens[other] // batch:,} steps)\n"
            f"  FLOPs       {flops:.3e} per token (the loops counted), {flops * tokens:.3e} in all\n"
            f"  data        " + (f"{shards} FineWeb-Edu training shards + 1 validation, about "
                                 f"{(shards + 1) * corpus.SHARD_GB:.1f} GB, ~{shards * corpus.SHARD_TOKENS:.2e} tokens "
                                 f"for {tokens:.2e}" if shards else "the embedded corpus"
                                 if s["dataset"] == "embedded" else
                                 own_data(s) if owndata.is_own(s["dataset"]) else
                                 f"{s['dataset']} items, generated from the seed") + "\n"
            f"  memory/GPU  device_batch_size={s['device_batch_size']}, {dtype}, {gpus} GPUs (estimate, GiB):\n"
            f"              eager {gib[False, False]:.1f}, checkpoint_loops {gib[False, True]:.1f}; "
            f"compiled {gib[True, False]:.1f}, checkpoint_loops {gib[True, True]:.1f}\n"
            f"  time        " + (f"{gpus} x {name}: {hours[0.30]:.1f} h at 30% MFU, {hours[0.45]:.1f} h at 45%; "
                                 f"each GPU consumes {consumed_tokens_per_s(model, name) / 1e6:.2f} M tokens/s at 40%"
                                 if peak else f"unknown accelerator {name!r} (--gpu=H100, A100, ...)"))


def summary(model, params, s, steps, grad_accum, device, world_size):
    """train.py's line on what it trains: the model, its size, the steps and their tokens, the FLOPs
    per token at the trained K, the machine."""
    config, batch = model.config, s["total_batch_size"]
    return (f"{config.variant}, {config.loops} loops, {params['all']:,} parameters, "
            f"{params['non_embedding']:,} without the embedding; {steps} steps of {batch:,} tokens = "
            f"{steps * batch:,} tokens (horizon_params={s['horizon_params']!r}); grad accumulation "
            f"{grad_accum}; {model.estimate_flops():.2e} FLOPs/token; {device} x {world_size}")
