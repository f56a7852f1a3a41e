"""
Speed and memory checks, measured side by side in one run.
    python -m scripts.bench                               # CPU fp32 ratios: depth 4, T=256, B=8
    python -m scripts.bench --mode=train --device=cuda --depth=12 --loops=9 --batch_size=8
        # a training step: graph breaks, compile time, tokens/s, MFU, peak memory
    python -m scripts.bench --mode=memory --depth=6 --batch_size=2 --sequence_len=1024 --loops=12
        # peak memory of a training step, checkpoint_loops off/on, regional vs whole-model compile
    python -m scripts.bench --mode=loader     # data.DataLoader tokens/s on the embedded corpus
    python -m scripts.bench --mode=syncs --depth=12 --sequence_len=64 --batch_size=1
        # host syncs, operations and collectives per optimizer step, 8 ranks simulated in one process
    python -m scripts.bench --mode=lmeval     # lm_eval_flt: loglikelihoods at K=1,3,6,9,12 in one sweep vs five passes
    python -m scripts.bench --mode=hf         # transformers' generate on an exported folder vs model.generate
    python -m scripts.bench --mode=cache --run=out/d3_flt_k3,out/d3_lt_k3 --plot=loop_cache.png --baseline=d88e2bf
        # the loop cache (cache_slots = m of K): bytes, bpb price, greedy agreement, tokens/s per m
    python -m scripts.bench --mode=speculative --run=out/d3_flt_k3,out/d3_lt_k3 --plot=spec.png
        # self-speculative decoding (draft with K_d loops, verify with K): tok/s, acceptance
    python -m scripts.bench --mode=decode --run=out/d3_flt_k3
        # generate's decode paths at batch 1 and 16: eager, the static step eager and compiled
        # (CUDA graphs on CUDA), drafting on the compiled step: tok/s, share of the bandwidth limit
Ratio timings alternate between the two sides and keep the median of several repeats, so
machine noise hits both sides alike.
"""
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import types
from contextlib import nullcontext
from dataclasses import asdict

import torch
import torch.distributed as dist
from torch.nn.attention import SDPBackend, sdpa_kernel
import torch.nn.functional as F
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode

from flt import corpus, diagnostics
import data
from configurator import configure, settings_of
from model import GPT, GPTConfig
from flt.decoding import check_draft
from flt.planning import consumed_tokens_per_s, peak_flops
from flt import errors
from flt.errors import user_errors
from flt.runtime import Timer, precision, resolve_dtype, setup, timed
from optim import build_optimizers, clip_coefficient, reduce_gradients

mode = "ratios"             # ratios | train | memory | loader | syncs | lmeval | hf | cache | speculative | decode
device = "cpu"              # cpu | cuda | cuda:N | mps; empty = cuda if there is one, else cpu
depth = 4
sequence_len = 256
batch_size = 8
loops = 3
repeats = 5                 # ratios, lmeval, hf, cache, speculative: timed repeats of each side
gen_tokens = 256            # ratios, hf: tokens generated (ratios: with and without the KV cache)
variant = "FLT"             # train, memory and syncs modes
attn = "full"               # train mode: full | mla
n_kv_head = None            # train mode: None = n_head
window_pattern = "L"        # train mode
vocab_size = 151669         # train, memory, syncs, decode modes: the Qwen3 vocabulary (padded to 151,680)
world_size = 8              # syncs mode: ranks simulated in this process by a fake process group
checkpoint_loops = False    # train mode (memory runs both)
compile_mode = "regional"   # train mode (memory runs all three): eager | regional (compile_regions) | whole
dtype = "auto"              # bf16 | fp32 | auto = bf16 on CUDA, fp32 on CPU (runtime.precision)
steps = 10                  # train mode: timed steps, after two warm-up steps
data_dir = "data"           # loader, lmeval and hf modes: the embedded corpus
run = ""                    # hf mode: a run's out_dir or step dir; "" = a fresh FLT of this depth, saved and exported
                            # cache mode: comma-separated runs; "" = the quick start's out/d3_flt_k3
plot = ""                   # cache, speculative modes: a PNG (the price against memory; the speed-up)
baseline = ""               # cache, speculative, decode (with --run) modes: a git commit whose default decoding
                            # is timed beside
seconds = 5.0               # loader mode
draft_loops = 2             # decode mode: the drafting row's K_d (below loops); 0 = no drafting row
draft_len = 4               # decode mode: the drafting row's tokens drafted a round
COMPILE_MODES = ("eager", "regional", "whole")
MODES = ("ratios", "train", "memory", "memory_step", "loader", "syncs", "lmeval", "hf", "cache",
         "speculative", "decode")
# The modes that read each setting (a fresh model of `depth` is make()'s); `mode` serves all. A setting off
# its default given to another mode would do nothing, and is refused.
BUILT = ("ratios", "train", "memory", "memory_step", "syncs", "lmeval", "decode")
ON_DEVICE = tuple(m for m in MODES if m != "loader")
READ_BY = {"device": ON_DEVICE, "dtype": ON_DEVICE, "depth": (*BUILT, "hf"), "loops": (*BUILT, "loader", "hf"),
           "sequence_len": (*BUILT, "loader"),
           # decode runs its own batches (DECODE_BATCHES)
           "batch_size": (*(m for m in BUILT if m != "decode"), "loader", "hf"),
           "repeats": ("ratios", "lmeval", "hf", "cache", "speculative", "decode"),
           "gen_tokens": ("ratios", "hf"),
           "variant": ("train", "memory", "memory_step", "syncs"),
           "attn": ("train",), "n_kv_head": ("train",), "window_pattern": ("train",),
           "vocab_size": ("train", "memory", "memory_step", "syncs", "decode"), "world_size": ("syncs",),
           "checkpoint_loops": ("train", "memory_step"), "compile_mode": ("train", "memory_step"),
           "steps": ("train",), "data_dir": ("loader", "lmeval", "hf"),
           "run": ("hf", "cache", "speculative", "decode"), "plot": ("cache", "speculative"),
           "baseline": ("cache", "speculative", "decode"), "seconds": ("loader",), "draft_loops": ("decode",),
           "draft_len": ("decode",)}
_defaults = settings_of(globals())
with user_errors("scripts.bench"):  # a bad setting: one line and exit status 1, no traceback
    configure(globals(), sys.argv[1:])
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}: expected one of {', '.join(m for m in MODES if m != 'memory_step')}")
    for key, modes_reading in READ_BY.items():
        if globals()[key] != _defaults[key] and mode not in modes_reading:
            readers = ", ".join(m for m in modes_reading if m != "memory_step")
            raise ValueError(f"--{key}={globals()[key]!r} does nothing in --mode={mode}: only {readers} "
                             "read it")
    for key in ("depth", "sequence_len", "batch_size", "loops", "repeats", "gen_tokens", "steps", "world_size"):
        errors.positive(f"--{key}", globals()[key])
    if seconds <= 0:
        raise ValueError(f"--seconds={seconds!r}: expected a positive number of seconds")
    if mode in ("hf", "decode") and run and not os.path.isdir(run):
        raise FileNotFoundError(f"--run={run}: no such run directory")
    rt = setup(device)  # the device checks of train.py and eval.py; "cuda" becomes "cuda:0"
    device, cuda = rt.device, rt.device_type == "cuda"
    dtype = resolve_dtype(dtype, rt.device_type)
    if compile_mode not in COMPILE_MODES:
        raise ValueError(f"compile_mode={compile_mode!r}: expected one of {COMPILE_MODES}")
    if mode == "decode" and draft_loops:
        check_draft(loops, draft_loops, draft_len, prefix="--")
    if mode == "decode" and baseline and not run:
        raise ValueError(f"--baseline={baseline} in --mode=decode needs --run: the weights both decode with")


def gpt_config(depth, **overrides):
    """train.py's shape from depth: d_model = 64 * depth, ceil(d_model / 128) heads; overrides any field."""
    n_embd = 64 * depth
    n_head = math.ceil(n_embd / 128)
    return GPTConfig(**dict(n_layer=depth, n_embd=n_embd, n_head=n_head, n_kv_head=n_head) | overrides)


def make(variant="FLT", seq=sequence_len, vocab=4096, **kw):  # 4096: train.py's CPU BPE
    """(model, the autocast context to run it in), numerics from runtime.precision."""
    torch.manual_seed(0)
    model = GPT(gpt_config(depth, sequence_len=seq, vocab_size=vocab, variant=variant, loops=loops, **kw))
    model.init_weights()
    model.to(device)
    return model, precision(model, rt.device_type, dtype)


def compiled(model):
    """The callable a training step runs, per compile_mode (dynamic=False, as train.py)."""
    if compile_mode == "regional":
        return model.compile_regions(dynamic=False)
    return torch.compile(model, dynamic=False) if compile_mode == "whole" else model


def ratio(name, fn_a, fn_b, bound):
    """Median time of fn_a / fn_b, alternating the two after one warm-up call each."""
    fn_a(), fn_b()
    ta, tb = [], []
    for _ in range(repeats):
        ta.append(timed(fn_a, device))
        tb.append(timed(fn_b, device))
    a, b = statistics.median(ta), statistics.median(tb)
    print(f"{name:<56} {a * 1e3:9.1f} ms / {b * 1e3:9.1f} ms = {a / b:5.2f}  (target {bound})")
    return a / b


def fwd_bwd(model, idx, K, autocast):
    def step():
        with autocast:
            loss = model(idx, idx, loops=K)
        loss.backward()
        model.zero_grad(set_to_none=True)
    return step


def ratios():
    idx = torch.randint(0, 4096, (batch_size, sequence_len), device=device)
    (flt, autocast), (lt, _) = make("FLT"), make("LT")
    print(f"device {device}, depth {depth}, T={sequence_len}, B={batch_size}, median of {repeats}")
    ratio(f"fwd+bwd FLT / LT, loops {loops}", fwd_bwd(flt, idx, loops, autocast),
          fwd_bwd(lt, idx, loops, autocast), "0.95-1.05")
    ratio("fwd+bwd loops 6 / loops 3 (FLT)", fwd_bwd(flt, idx, 6, autocast), fwd_bwd(flt, idx, 3, autocast), "<= 2.1")

    budgets = [1, 3, 6, 9, 12]

    @torch.no_grad()
    def one_pass():
        with autocast:
            hs = flt.loop_states(idx, max(budgets)).states
            [flt.head(hs[K - 1]) for K in budgets]

    @torch.no_grad()
    def separate():
        with autocast:
            [flt(idx, loops=K) for K in budgets]

    ratio(f"loops {budgets}: one all-loops pass / five passes", one_pass, separate, "<= 0.45")

    gen = make("FLT", seq=2 * gen_tokens)[0].eval()
    prompt = torch.randint(0, 4096, (1, 16), device=device)

    def cached():
        with autocast:
            for _ in gen.generate(prompt, gen_tokens, temperature=0, loops=loops):
                pass

    @torch.no_grad()
    def recompute():  # the LM head on the last position only, as a careful uncached loop would
        seq = prompt
        with autocast:
            for _ in range(gen_tokens):
                last = gen.head(gen.loop_states(seq, loops).states[-1][:, -1:])
                seq = torch.cat([seq, last.argmax(-1)], dim=1)

    r = ratio(f"generate {gen_tokens} tokens, loops {loops}: cached / recompute", cached, recompute, "<= 0.2")
    print(f"cached generation is {1 / r:.1f}x faster than recomputing the full forward per token")


def train():
    """One optimizer step of the real recipe (Muon + AdamW, runtime.precision, compiled)."""
    model, autocast = make(variant, vocab=vocab_size, attn=attn, window_pattern=window_pattern,
                           checkpoint_loops=checkpoint_loops, **({"n_kv_head": n_kv_head} if n_kv_head else {}))
    optimizers = build_optimizers(model)
    idx = torch.randint(0, vocab_size, (batch_size, sequence_len), device=device)
    with torch.no_grad():  # tracing only: batch 1, no activations kept (the checkpoint branch is traced in tests)
        explain = torch._dynamo.explain(model)(idx[:1], idx[:1])
    print(f"graph breaks: {explain.graph_break_count} {[str(b.reason) for b in explain.break_reasons]}")
    torch._dynamo.reset()
    fwd = compiled(model)

    # Full causal attention (self- and injected) must run the flash kernel: allow only that
    # backend, so a fallback to the math kernel is an error rather than a silent slowdown.
    flash_only = cuda and attn == "full" and set(window_pattern) == {"L"}
    kernels = sdpa_kernel([SDPBackend.FLASH_ATTENTION]) if flash_only else nullcontext()

    def step():
        with autocast, kernels:
            loss = fwd(idx, idx)
        loss.backward()
        for opt in optimizers:
            opt.step()
        model.zero_grad(set_to_none=True)

    first = timed(step, device)  # includes compilation
    timed(step, device)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    dt = statistics.median(timed(step, device) for _ in range(steps))
    tok_s = batch_size * sequence_len / dt
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    peak = peak_flops(name)
    mfu = f"{100 * model.estimate_flops() * tok_s / peak:.1f}%" if peak else "n/a"
    mem = f"{torch.cuda.max_memory_allocated() / 2**30:.1f} GiB" if cuda else "n/a"
    print(f"{name} | {variant} depth {depth} loops {loops} attn {attn} B={batch_size} T={sequence_len} "
          f"ckpt={checkpoint_loops} compile={compile_mode} | first step {first:.1f} s | {dt * 1e3:.1f} ms/step | "
          f"{tok_s:,.0f} tok/s | MFU {mfu} | peak {mem} | flash-only attention {flash_only}")


def peak_memory(fn):
    """Bytes by which memory peaks above its current level while fn runs. CUDA: the allocator's
    peak. CPU: the process's peak resident set (VmHWM, reset by writing 5 to /proc/self/clear_refs),
    which sees everything a step holds at once: saved activations, what checkpointing keeps by
    reference (saved-tensor hooks never see it), the loop recomputed in backward, the gradients."""
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        fn()
        return torch.cuda.max_memory_allocated() - before

    def status(key):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status("VmRSS:")
    fn()
    return status("VmHWM:") - before


def memory_step():
    """One configuration of `memory`, in its own process: compile warm-up, then a step's peak."""
    model, autocast = make(variant, vocab=vocab_size, checkpoint_loops=checkpoint_loops)
    step = fwd_bwd(compiled(model), torch.randint(0, vocab_size, (batch_size, sequence_len), device=device),
                   loops, autocast)
    first, dt = timed(step, device), timed(step, device)
    print(json.dumps(dict(peak=peak_memory(step), warmup=first - dt, step=dt)))


def memory():
    """Peak memory of a training step with checkpoint_loops off and on, side by side, for eager,
    regional and whole-model compilation, and the first step's extra time (compile warm-up, from
    an empty inductor cache). Each run is a fresh process: compiled graphs, the allocator and the
    peak are per process. glibc's mmap threshold is pinned, so freed tensors go back to the OS
    and the resident set follows live memory."""
    print(f"{device} {dtype}, {variant} depth {depth} loops {loops} B={batch_size} T={sequence_len} V={vocab_size}")
    print(f"{'compile':<9} {'peak ckpt off':>14} {'peak ckpt on':>13} {'on/off':>7} {'warm-up off/on':>15} "
          f"{'step off/on':>13}")
    for name in COMPILE_MODES:
        runs = []
        for ckpt in (False, True):
            with tempfile.TemporaryDirectory() as cache:
                env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", TORCHINDUCTOR_CACHE_DIR=cache)
                out = subprocess.run([sys.executable, "-m", "scripts.bench", *sys.argv[1:], "--mode=memory_step",
                                      f"--compile_mode={name}", f"--checkpoint_loops={ckpt}"],
                                     env=env, capture_output=True, text=True, check=True).stdout
            runs.append(json.loads(out.splitlines()[-1]))
        off, on = runs
        print(f"{name:<9} {off['peak'] / 2**20:10.0f} MiB {on['peak'] / 2**20:9.0f} MiB "
              f"{on['peak'] / off['peak']:7.2f} {off['warmup']:7.1f}/{on['warmup']:.1f} s "
              f"{off['step']:6.1f}/{on['step']:.1f} s", flush=True)


def loader():
    """Tokens/s of the streaming loader (tokenization included; the tokenizer threads and prefetch as
    train.py's) on the embedded corpus, against what one GPU consumes at the small and base shapes
    (planning.consumed_tokens_per_s: the Qwen3 vocabulary, config/paper.py's T=1024, K=loops, 40% MFU)."""
    files = corpus.embedded_corpus(data_dir)
    tok = data.get_tokenizer("bpe", os.path.dirname(files[0]), files[:-1], 4096)
    batches = data.DataLoader(files[:-1], tok, batch_size, sequence_len, prefetch=2)
    n = 0
    with Timer() as took:
        while took.elapsed() < seconds:
            next(batches)
            n += 1
    tok_s = n * batch_size * sequence_len / took.seconds
    print(f"loader: {tok_s:,.0f} tokens/s per process (B={batch_size}, T={sequence_len}, "
          f"{os.environ['RAYON_NUM_THREADS']} tokenizer threads of {len(os.sched_getaffinity(0))} CPUs)")
    for name, shape in (("small", 6), ("base", 12)):
        with torch.device("meta"):
            model = GPT(gpt_config(shape, sequence_len=1024, vocab_size=data.QWEN3_VOCAB, loops=loops))
        need = consumed_tokens_per_s(model, "H100", 0.40)
        print(f"{name} (depth {shape}, K={loops}): one H100 at 40% MFU consumes {need:,.0f} tokens/s; "
              f"loader / consumption = {tok_s / need:.2f}")


class Launches(TorchDispatchMode):
    """Counts the operations dispatched inside the block (each a kernel launch on a GPU, views aside) and
    among them the collectives (the c10d namespace)."""

    def __init__(self):
        super().__init__()
        self.ops = self.collectives = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        self.collectives += func.namespace in ("c10d", "_c10d_functional")
        return func(*args, **(kwargs or {}))


def syncs():
    """One optimizer step as train.py's loop takes it (forward and backward, the all-reduce of the squared
    norms with the loop's numbers, the one read, the optimizer step), world_size ranks simulated by a fake
    process group (its collectives move nothing): host syncs, operations and collectives it issues."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    model, autocast = make(variant, vocab=vocab_size)
    optimizers = build_optimizers(model, distributed=True)
    watch = diagnostics.Watch(model)
    idx = torch.randint(0, vocab_size, (batch_size, sequence_len), device=device)

    def step():
        with autocast:
            loss, looped = model(idx, idx, return_loops=True)
        loss.backward()
        signals = {name: torch.full((), 0.0, device=device)
                   for name in ("preempted", "interrupted", "save_due")}
        to_sum = {"loss": loss.detach(), "resid_sum": looped.resid_norms.sum()} | signals
        norms, summed = reduce_gradients(optimizers, to_sum)
        grad_norm = torch.stack(list(norms.values())).double().sum().sqrt()
        tensors = {"grad_norm": grad_norm, **summed, **watch.tensors(norms, looped)}
        numbers = dict(zip(tensors, torch.stack([t.double() for t in tensors.values()]).tolist()))
        for opt in optimizers:
            opt.step(grad_scale=clip_coefficient(numbers["grad_norm"], 1.0))
        model.zero_grad(set_to_none=True)
    step()  # the optimizers' state is created
    with diagnostics.count_host_reads() as reads, Launches() as launched:
        step()
    dist.destroy_process_group()
    print(f"{variant} depth {depth} K={loops} vocab {model.config.padded_vocab:,} B={batch_size} T={sequence_len}, "
          f"{world_size} ranks (fake process group), one optimizer step: {sum(reads.values())} host syncs "
          f"{dict(reads)}, {launched.ops:,} operations, {launched.collectives} collectives")


def lmeval():
    """lm_eval_flt's budget sweep, side by side: the harness's loglikelihood requests (a context from the
    embedded validation shard, four continuations each, as hellaswag asks) at K = 1,3,6,9,12 through one
    adapter, whose first call (K=12) scores every K and whose others find their scores, against a fresh
    adapter per K (five passes), and against one pass at K=12 alone. Needs requirements/lmeval.txt."""
    from lm_eval.api.instance import Instance
    from scripts import lm_eval_flt
    files = corpus.embedded_corpus(data_dir)
    tok = data.get_tokenizer("bpe", os.path.dirname(files[0]), files[:-1], 4096)
    n = 2 * sequence_len  # characters of context: about half of sequence_len in tokens
    docs = [text for text in corpus.load_rows(files[-1]) if len(text) >= n + n // 4][:4 * batch_size + 3]
    requests = [Instance("loglikelihood", {}, (doc[:n], " " + docs[i + j][n:n + n // 4]), 4 * i + j)
                for i, doc in enumerate(docs[:-3]) for j in range(4)]
    model, autocast = make("FLT")
    budgets = [1, 3, 6, 9, 12]

    def adapter(loops):
        return lm_eval_flt.LoopedLM(model, tok, loops, autocast, batch_size=batch_size, log=lambda *args: None)

    def sweep():
        lm = adapter(budgets)
        for K in reversed(budgets):
            lm.at(K).loglikelihood(requests, disable_tqdm=True)

    def separate():
        for K in budgets:
            adapter([K]).loglikelihood(requests, disable_tqdm=True)

    def largest():
        adapter(budgets[-1:]).loglikelihood(requests, disable_tqdm=True)

    print(f"device {device}, depth {depth}, T={sequence_len}, B={batch_size}, {len(requests)} requests, "
          f"median of {repeats}")
    ratio(f"lm-eval loops {budgets}: one sweep / five passes", sweep, separate, "<= 0.45")
    ratio(f"lm-eval loops {budgets}: one sweep / one pass at K={budgets[-1]}", sweep, largest, "<= 1.25")


def hf():
    """The transformers wrapper's overhead: model.generate(do_sample=False) of the exported folder (FLTForCausalLM,
    the same KVCache) against the project's model.generate(temperature=0) on the same run, the same prompt
    (B=batch_size, 16 tokens), the same gen_tokens tokens (checked equal). Needs requirements/hf.txt."""
    from transformers import AutoModelForCausalLM
    from flt import checkpoint
    from scripts import export_hf
    with tempfile.TemporaryDirectory() as tmp:
        source = run
        if not source:  # the embedded corpus's 4096-id BPE (data_dir): make()'s vocabulary
            files = corpus.embedded_corpus(data_dir)
            tok = data.get_tokenizer("bpe", os.path.dirname(files[0]), files[:-1], 4096)
            source = os.path.join(tmp, "run")
            checkpoint.save(source, 0, make("FLT", seq=16 + gen_tokens)[0], {}, settings={},
                            files={"tokenizer.json": tok.save})
        folder = export_hf.export(source, os.path.join(tmp, "hf"), log=lambda *args: None)
        ours = checkpoint.load_model(folder, device, log=lambda *args: None)[0].eval()
        theirs = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).to(device).eval()
    autocast = precision(ours, rt.device_type, dtype)
    precision(theirs.model, rt.device_type, dtype)
    K, T = ours.config.loops, ours.config.sequence_len
    n = min(gen_tokens, T - 16)
    prompt = torch.randint(0, ours.config.vocab_size, (batch_size, 16), generator=torch.Generator().manual_seed(0))
    prompt = prompt.to(device)

    def project():
        with autocast:
            # the eager KVCache, as the wrapper's (on CUDA the default would be the captured step)
            return torch.cat(list(ours.generate(prompt, n, temperature=0, decode="eager")), 1)

    @torch.no_grad()
    def transformers():  # eos_token_id=None: no stop at the document token, so both make all n tokens
        with autocast:
            return theirs.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, do_sample=False,
                                   eos_token_id=None)[:, prompt.size(1):]

    if not torch.equal(project(), transformers()):
        raise RuntimeError("transformers' generate and model.generate made different tokens")
    print(f"device {device}, depth {ours.config.n_layer}, B={batch_size}, loops {K}, {n} tokens after 16, "
          f"median of {repeats}")
    r = ratio(f"generate {n} tokens: transformers / project", transformers, project, "<= 1.25")
    print(f"the transformers wrapper's generate takes {r:.2f}x the time of the project's")


# ----------------------------------------------------------------------------- the loop cache
CACHE_SEQS = 16    # cache mode: whole validation sequences of sequence_len scored, and the prompts' source
PROMPT_TOKENS = 32  # cache mode: each greedy prompt, the first tokens of one of those sequences
GEN = 64           # cache mode: tokens generated greedily per prompt


def cache_bytes(kv_cache):
    """Bytes of the key and value tensors a KVCache has allocated."""
    return sum(z.numel() * z.element_size() for kv in kv_cache.kv.values() for z in kv)


@torch.no_grad()
def teacher_forced(model, autocast, x, y, K, m):
    """(per-target losses (B, T) in nats, cache bytes per token): x decoded one token a step, as generation
    feeds its tokens, with a cache of m loop slots per layer."""
    kv_cache, losses = model.new_kv_cache(x.size(0), K, cache_slots=m), []
    with autocast:
        for i in range(x.size(1)):
            logits = model(x[:, i:i + 1], loops=K, kv_cache=kv_cache)[:, 0]
            losses.append(F.cross_entropy(logits, y[:, i].clamp(min=0), reduction="none"))
    return torch.stack(losses, 1).double(), cache_bytes(kv_cache) / (x.size(0) * kv_cache.capacity)


def agreement(tokens, exact):
    """(mean fraction of each row's tokens before its first difference from exact, fraction equal overall)."""
    same = tokens == exact
    before = torch.where(same.all(1), same.size(1), (~same).int().argmax(1))
    return (before.double() / same.size(1)).mean().item(), same.double().mean().item()


def validation_run(path):
    """(model in eval mode, meta, x, y, tokenizer, shard): a run and the first CACHE_SEQS whole
    validation sequences of its stream (x: inputs, y: targets), as eval.py's loader cuts them."""
    from flt import checkpoint
    model, meta = checkpoint.load_model(path, device, log=lambda *args: None)
    model.eval()
    settings, T = meta.get("settings", {}), model.config.sequence_len
    tok = data.load_tokenizer(os.path.join(meta["path"], "tokenizer.json"),
                              bos=settings.get("bos_token", data.BOS))
    shard = corpus.val_shard(settings, settings.get("data_dir", data_dir))
    chunks, _ = data.protocol_chunks([shard], tok, T, CACHE_SEQS * T, 1, 1)
    x, y = (torch.cat(z).to(device) for z in zip(*chunks))
    return model, meta, x, y, tok, shard


def loop_cache_rows(path):
    """One run's rows of the cache table: {K: {m: row}} at its trained K and at K' = 2K."""
    from scripts.plot import run_name
    model, meta, x, y, tok, shard = validation_run(path)
    autocast = precision(model, rt.device_type, dtype)
    T = model.config.sequence_len
    token_bytes = tok.token_bytes("authors").to(device)[y.clamp(min=0)] * (y >= 0)
    scored, denominator = token_bytes > 0, math.log(2) * token_bytes.sum().item()
    prompts, name = x[:, :PROMPT_TOKENS], run_name(path)
    what = (f"{name} ({meta['path']}): the first {len(x)} sequences of {T} + 1 tokens of {shard}'s stream (BOS "
            f"before each document; eval.py's loader, 1 rank, batch 1), {int(scored.sum()):,} targets with bytes; "
            f"greedy: {GEN} tokens after the first {PROMPT_TOKENS} tokens of each")
    print(what, flush=True)
    K0, rows = model.config.loops, {}
    for K in (K0, 2 * K0):
        slots = sorted({1, 2, -(-K0 // 2), K0} & set(range(1, K + 1))) if K == K0 else list(range(1, K + 1))
        with torch.no_grad(), autocast:
            full = F.cross_entropy(model(x, loops=K).flatten(0, 1), y.flatten().clamp(min=0),
                                   reduction="none").view_as(y).double()

        def greedy(m):
            with autocast:
                return torch.cat(list(model.generate(prompts, GEN, temperature=0, loops=K, cache_slots=m)), 1)
        exact, times = greedy(K), {m: [] for m in slots}
        for _ in range(repeats):  # side by side: every m once per round
            for m in slots:
                times[m].append(timed(lambda: greedy(m), device))
        rows[K] = {}
        for m in slots:
            losses, per_token = teacher_forced(model, autocast, x, y, K, m)
            diff = (losses - full)[scored]
            rows[K][m] = dict(bytes=per_token, bpb_full=full[scored].sum().item() / denominator,
                              bpb=losses[scored].sum().item() / denominator, price=diff.sum().item() / denominator,
                              se=diff.std().item() * math.sqrt(diff.numel()) / denominator,
                              agree=agreement(greedy(m), exact), tok_s=len(prompts) * GEN / statistics.median(times[m]))
            print(f"{name} K={K} m={m}: price {rows[K][m]['price']:+.5f} +- {rows[K][m]['se']:.5f} bpb", flush=True)
    return types.SimpleNamespace(name=name, what=what, K=K0, rows=rows)


def cache_table(results):
    """The Markdown table of loop_cache_rows' results, a row per (run, K, m)."""
    lines = ["| run | K | m | cache bytes/token | / exact | bpb full forward | bpb cached | price | s.e. | "
             "greedy same before 1st diff | greedy same overall | decode tok/s |", "|---" * 12 + "|"]
    for r in results:
        for K, by_m in r.rows.items():
            for m, row in by_m.items():
                before, overall = row["agree"]
                lines.append(f"| {r.name} | {K} | {m} | {row['bytes']:,.0f} | {row['bytes'] / by_m[K]['bytes']:.2f} | "
                             f"{row['bpb_full']:.4f} | {row['bpb']:.4f} | {row['price']:+.5f} | {row['se']:.5f} | "
                             f"{before:.2f} | {overall:.2f} | {row['tok_s']:,.0f} |")
    return "\n".join(lines)


def cache_plot(results, out):
    """The bpb price (with its standard error) against the memory ratio: a line per run at its trained K
    (solid) and at K' = 2K (dashed)."""
    from scripts.plot import pyplot, save
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8.4, 4.8))
    lowest = 0.0
    for i, r in enumerate(results):
        for K, style in ((r.K, "o-"), (2 * r.K, "s--")):
            points = sorted((m / K, row["price"], row["se"]) for m, row in r.rows[K].items())
            ax.errorbar(*zip(*points), fmt=style, color=f"C{i}", capsize=3, label=f"{r.name}, K={K}")
            lowest = min([lowest] + [price - se for _, price, se in points])
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_yscale("symlog", linthresh=1e-4)  # prices from noise level (1e-5) to tenths of a bit
    ax.set_ylim(bottom=min(-1e-4, 2 * lowest))
    ax.set(title=f"Loop cache: the bpb price of m of K slots ({device})", ylabel="bpb, cached - full forward",
           xlabel="cache memory / exact cache (m / K)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    save(fig, out)


def baseline_model(commit, model):
    """GPT of `commit`'s model.py (git show), with model's config and weights."""
    source = subprocess.run(["git", "show", f"{commit}:model.py"], cwd=os.path.dirname(os.path.dirname(__file__)),
                            capture_output=True, text=True, check=True).stdout
    module = sys.modules[f"model_{commit}"] = types.ModuleType(f"model_{commit}")
    exec(compile(source, f"{commit}:model.py", "exec"), module.__dict__)
    old = module.GPT(module.GPTConfig(**asdict(model.config)))
    old.load_state_dict(model.state_dict())
    return old.to(device).eval()


def default_decoding(path):
    """The default decode path (cache_slots=None) against `baseline`'s, side by side: the same tokens, and
    the time ratio (greedy, GEN tokens after PROMPT_TOKENS random tokens, B = CACHE_SEQS)."""
    from flt import checkpoint
    model = checkpoint.load_model(path, device, log=lambda *args: None)[0].eval()
    old, autocast = baseline_model(baseline, model), precision(model, rt.device_type, dtype)
    prompt = torch.randint(0, model.config.vocab_size, (CACHE_SEQS, PROMPT_TOKENS),
                           generator=torch.Generator().manual_seed(0)).to(device)

    def decode(gpt):
        def run():
            with autocast:
                return torch.cat(list(gpt.generate(prompt, GEN, temperature=0)), 1)
        return run
    same = torch.equal(decode(model)(), decode(old)())
    r = ratio(f"default generate, this commit / {baseline} ({path})", decode(model), decode(old), "0.95-1.05")
    print(f"default decode path: the same tokens as {baseline}'s: {same}; time ratio {r:.2f}")


def checked_runs():
    """(`run`'s paths, the file --plot's figure goes to: None without one), each checked before any
    measuring, with --baseline's commit: a missing run, directory or revision is one line naming it.
    --plot is checked as scripts.plot checks its --out (plot.out_file): the file savefig writes (with
    .png where it has no extension), replaced only if a figure of scripts.plot or bench (save marks
    both) is there."""
    from flt import checkpoint
    from scripts.plot import out_file
    runs = (run or "out/d3_flt_k3").split(",")
    for path in runs:
        if not os.path.isdir(path):
            raise FileNotFoundError(f"--run: {path}: no such run directory")
        checkpoint.candidates(path)
    figure = out_file("--plot", plot, figure=True) if plot else None
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if baseline and subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{baseline}^{{commit}}"],
                                   cwd=root, capture_output=True).returncode:
        raise ValueError(f"--baseline={baseline}: no such git commit in {root}")
    return runs, figure


def cache():
    """The loop cache's price (flt/decoding.py's KVCache, cache_slots: m loop slots per layer) for each run of `run`:
    at its trained K for m in {1, 2, ceil(K/2), K} and at K' = 2K for every m, the cache's bytes per token
    (counted from the tensors it allocated) and their ratio to the exact cache (m = K); val bpb of
    teacher-forced cached decoding (one token a step, as generation feeds them) and of the full forward on
    CACHE_SEQS whole validation sequences, their difference (the price) and its standard error from the
    per-token differences; greedy agreement with exact decoding (GEN tokens after each of CACHE_SEQS
    prompts: the mean fraction before the first difference, and overall); decode tokens/s per m, timed
    side by side (every m once a round, median of `repeats`). plot: the figure; baseline: default_decoding."""
    runs, figure = checked_runs()
    results = [loop_cache_rows(path) for path in runs]
    print(f"\ndevice {device}, {dtype}; price = bpb cached - bpb full forward; decode tok/s (prefill included): "
          f"median of {repeats}, every m once a round")
    print("\n".join(r.what for r in results) + "\n" + cache_table(results))
    if figure:
        cache_plot(results, figure)
    if baseline:
        default_decoding(runs[0])


# speculative mode: (draft loops K_d, draft length) of the grid, at K = 3 and 6, batch 1 and 16
DRAFTS = [(1, 2), (1, 4), (1, 8), (2, 2), (2, 4), (2, 8)]


def speculative_rows(path):
    """One run's rows: {(K, B): {(K_d, draft_len): row}}, greedy decoding of GEN tokens after
    the first PROMPT_TOKENS of B validation sequences, exact against drafted, side by side."""
    from flt.decoding import draft_and_verify
    from scripts.plot import run_name
    model, meta, x, _, _, shard = validation_run(path)
    autocast = precision(model, rt.device_type, dtype)
    name, rows = run_name(path), {}
    print(f"{name} ({meta['path']}): prompts = the first {PROMPT_TOKENS} tokens of the first "
          f"validation sequences of {shard}; {GEN} greedy tokens each", flush=True)
    for K in (3, 6):
        for B in (1, CACHE_SEQS):
            prompts = x[:B, :PROMPT_TOKENS]

            def decode(draft_loops=None, draft_len=4):
                with torch.no_grad(), autocast:
                    return torch.cat(list(model.generate(
                        prompts, GEN, temperature=0, loops=K, draft_loops=draft_loops,
                        draft_len=draft_len)), 1)
            cells = [(None, 4)] + DRAFTS
            times = {cell: [] for cell in cells}
            # side by side: every cell once a round
            for _ in range(repeats):
                for cell in cells:
                    times[cell].append(timed(lambda: decode(*cell), device))
            exact = decode()
            base = statistics.median(times[None, 4])
            rows[K, B] = {}
            for draft_loops, draft_len in DRAFTS:
                stats = {}
                with torch.no_grad(), autocast:
                    tokens = torch.cat(list(draft_and_verify(
                        model, prompts, GEN, K, draft_loops, draft_len, stats=stats)), 1)
                t = statistics.median(times[draft_loops, draft_len])
                rows[K, B][draft_loops, draft_len] = dict(
                    exact_tok_s=B * GEN / base, tok_s=B * GEN / t, speedup=base / t,
                    accept=stats["accepted"] / stats["drafted"],
                    per_round=(GEN - 1) / stats["rounds"], same=torch.equal(tokens, exact))
            print(f"{name} K={K} B={B}: " + ", ".join(
                f"K_d={d} g={g} x{r['speedup']:.2f}" for (d, g), r in rows[K, B].items()),
                flush=True)
    return types.SimpleNamespace(name=name, rows=rows)


def speculative_table(results):
    """The Markdown table of speculative_rows' results, a row per (run, K, B, K_d, g)."""
    lines = ["| run | K | batch | K_d | g | exact tok/s | drafted tok/s | speed-up | "
             "drafts accepted | tokens a round | identical |", "|---" * 11 + "|"]
    for r in results:
        for (K, B), cells in r.rows.items():
            for (d, g), row in cells.items():
                lines.append(f"| {r.name} | {K} | {B} | {d} | {g} | {row['exact_tok_s']:,.0f} | "
                             f"{row['tok_s']:,.0f} | {row['speedup']:.2f} | {row['accept']:.2f} | "
                             f"{row['per_round']:.2f} | {'yes' if row['same'] else 'no'} |")
    return "\n".join(lines)


def speculative_plot(results, out):
    """Speed-up against the draft length at batch 1, a panel per K, a line per run and K_d."""
    from scripts.plot import pyplot, save
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2), sharey=True)
    for ax, K in zip(axes, (3, 6)):
        for i, r in enumerate(results):
            for d, style in ((1, "o-"), (2, "s--")):
                points = sorted((g, row["speedup"]) for (kd, g), row in r.rows[K, 1].items()
                                if kd == d)
                ax.plot(*zip(*points), style, color=f"C{i}", label=f"{r.name}, K_d={d}")
        ax.axhline(1, color="grey", lw=0.8)
        ax.set(title=f"K = {K}, batch 1 ({device})", xlabel="draft length g", xticks=[2, 4, 8])
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("tok/s drafted / tok/s exact (same tokens)")
    axes[1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    save(fig, out)


def speculative():
    """Self-speculative decoding (generate(draft_loops=K_d, draft_len=g)) on each run of `run`:
    for K in {3, 6}, batch 1 and CACHE_SEQS, every (K_d, g) of DRAFTS against exact K-loop
    decoding: tokens/s side by side (every cell once a round, median of `repeats`), the share of
    drafts accepted, tokens a round, and whether the tokens are identical. plot: the figure;
    baseline: the default decode path against that commit's."""
    runs, figure = checked_runs()
    results = [speculative_rows(path) for path in runs]
    print(f"\ndevice {device}, {dtype}; greedy, {GEN} tokens after {PROMPT_TOKENS}; tok/s: median "
          f"of {repeats}, prefill included")
    print(speculative_table(results))
    if figure:
        speculative_plot(results, figure)
    if baseline:
        default_decoding(runs[0])


# ----------------------------------------------------------------------------- the decode paths
# HBM bandwidth in bytes/s by (part of) the device's name, more specific names first (datasheets)
BANDWIDTH = (("H200", 4.8e12), ("H100 PCIe", 2.0e12), ("H100 NVL", 3.9e12), ("H100", 3.35e12),
             ("A100", 2.0e12))
DECODE_BATCHES = (1, 16)


def decode_model():
    """(model in eval mode, autocast, what it is): `run`'s, or a fresh FLT of depth, sequence_len,
    loops and vocab_size with every weight drawn (init_weights zeroes the output projections: each
    block would be the identity, and every path's tokens trivially equal)."""
    if run:
        from flt import checkpoint
        model = checkpoint.load_model(run, device, log=lambda *args: None)[0]
        what = f"{run} (depth {model.config.n_layer}, T={model.config.sequence_len})"
    else:
        model = make("FLT", vocab=vocab_size)[0]
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("c_proj.weight"):
                    p.uniform_(-(3 / p.size(1)) ** 0.5, (3 / p.size(1)) ** 0.5)
        what = f"a fresh FLT, depth {depth}, T={sequence_len}, every weight drawn"
    return model.eval(), precision(model, rt.device_type, dtype), what


def decode_steps(model, autocast, prompt, **kwargs):
    """(greedy tokens (B, GEN), seconds of the steps after the prefill's first token)."""
    with torch.no_grad(), autocast:
        stream = model.generate(prompt, GEN, temperature=0, loops=loops, **kwargs)
        first = next(stream)
        with Timer(device) as took:
            rest = list(stream)
    return torch.cat([first, *rest], 1), took.seconds


def decode():
    """generate's decode paths side by side (flt/decoding.py: Decoder), greedy, GEN tokens after
    PROMPT_TOKENS random ones at batch 1 and 16, at K = loops: today's eager KV cache, the static
    step run eagerly, the static step compiled (on CUDA captured as CUDA graphs), and drafting
    (draft_loops, draft_len) on the compiled step. Each path's first call is its warm-up (the
    compiled one compiles then), then every path once a round, median of `repeats`; tok/s counts
    the steps after the prefill. The bandwidth limit is the issue's: a step reads the blocks'
    weights K times and the LM head once, in bf16, whatever the batch. baseline: the default path
    against that commit's (default_decoding)."""
    if run:
        checked_runs()
    model, autocast, what = decode_model()
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    bandwidth = next((bw for key, bw in BANDWIDTH if key.lower() in name.lower()), None)
    blocks = sum(p.numel() for p in model.transformer.h.parameters())
    step_bytes = 2 * (loops * blocks + model.lm_head.weight.numel())
    compiled = "captured (CUDA graphs)" if cuda else "compiled (inductor)"
    paths = {"eager (KVCache, as before)": dict(decode="eager"), "static, eager": dict(decode="static"),
             f"static, {compiled}": dict(decode="compiled")}
    if draft_loops:
        paths[f"drafting K_d={draft_loops} g={draft_len}, {compiled}"] = dict(
            decode="compiled", draft_loops=draft_loops, draft_len=draft_len)
    print(f"{name}, {dtype}, torch {torch.__version__}; {what}; K={loops}; greedy, {GEN} tokens after "
          f"{PROMPT_TOKENS}; median of {repeats}; a step reads {step_bytes / 1e9:.3f} GB of weights "
          f"(bf16)" + ("" if bandwidth else "; no bandwidth figure for this device"), flush=True)
    lines = ["| batch | path | tok/s | x eager | share of bandwidth limit | identical tokens | "
             "first call (s) |", "|---" * 7 + "|"]
    for B in DECODE_BATCHES:
        prompt = torch.randint(0, model.config.vocab_size, (B, PROMPT_TOKENS),
                               generator=torch.Generator().manual_seed(B)).to(device)
        first, tokens, times = {}, {}, {path: [] for path in paths}
        for path, kwargs in paths.items():
            with Timer(device) as took:
                tokens[path] = decode_steps(model, autocast, prompt, **kwargs)[0]
            first[path] = took.seconds
        # side by side: every path once a round
        for _ in range(repeats):
            for path, kwargs in paths.items():
                times[path].append(decode_steps(model, autocast, prompt, **kwargs)[1])
        reference = next(iter(paths))
        base = B * (GEN - 1) / statistics.median(times[reference])
        for path in paths:
            tok_s = B * (GEN - 1) / statistics.median(times[path])
            share = f"{tok_s * step_bytes / (B * bandwidth):.1%}" if bandwidth else "n/a"
            equal = (tokens[path] == tokens[reference]).double().mean().item()
            same = "reference" if path == reference else "yes" if equal == 1 else f"no ({equal:.0%} equal)"
            lines.append(f"| {B} | {path} | {tok_s:,.0f} | {tok_s / base:.2f} | {share} | {same} | "
                         f"{first[path]:.1f} |")
            print(lines[-1], flush=True)
    # a CUDA graph skipped (a mutated input not marked static, say) leaves the step uncaptured
    counts = torch._dynamo.utils.counters
    print(f"\ngraphs compiled: {counts['stats']['unique_graphs']}; CUDA graphs skipped: "
          f"{counts['inductor']['cudagraph_skips']}")
    print("\n".join(lines))
    if baseline:
        default_decoding(run)


if __name__ == "__main__":
    modes = {"ratios": ratios, "train": train, "memory": memory, "memory_step": memory_step, "loader": loader,
             "syncs": syncs, "lmeval": lmeval, "hf": hf, "cache": cache, "speculative": speculative,
             "decode": decode}
    with user_errors("scripts.bench"):  # a bad setting or input: one line and exit status 1
        modes[mode]()
