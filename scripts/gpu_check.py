"""
Does the recipe run well on this GPU? One command checks and measures it, part by part:
    python -m scripts.gpu_check                   # a CUDA GPU: about 8 minutes on one H100
    python -m scripts.gpu_check --tiny --device=cpu --compile=off   # the same code, tiny (the tests)
It prints one table and writes it as JSON (--out; by default gpu_check.json in the work folder it
names, beside the quick start's runs), after every part, so a part that fails or a run that is cut
short keeps what the others measured. The parts:
  quickstart  the README's quick start on this device (bf16, compiled): exit status, final val bpb
              against the CPU fp32 quick start, graphs compiled, host reads per step
  base        config/flt_base.py's model at K = 9, then K = 1: tokens/s and MFU by the model's
              own FLOP count (the loops counted), peak memory against the planner's estimate;
              then the authors' gpt.py at the same shape, if --authors_dir holds their nanochat/
  decode      the eager cache, the captured static step and recomputing the whole forward per
              token, batch 1 and 16
  numerics    the same weights' logits in bf16 here against fp32 on the CPU, and the first steps'
              losses against an fp32 CPU run of the same steps
docs/testing.md has the table measured on an H100-class GPU and what it answers.
"""
import json
import math
import os
import runpy
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings

# The profiler's own log lines (kineto's, at each start and stop) are noise in this report: level 6
# is above all of them, its errors too. Set before torch loads kineto; a KINETO_LOG_LEVEL given wins.
os.environ.setdefault("KINETO_LOG_LEVEL", "6")

import pyarrow.parquet as pq  # noqa: E402
import torch  # noqa: E402

import data
from configurator import configure, settings_of
from flt import checkpoint, diagnostics, planning
from flt import errors
from flt.errors import user_errors
from flt.runtime import Timer, atomic_write, precision, resolve_dtype, setup, timed
from model import GPT, GPTConfig
from optim import build_optimizers

device = "cuda"             # cuda | cuda:N; cpu only with --tiny
tiny = False                # every part at a tiny size: what the test suite runs on CPU
compile = "on"              # on | off: torch.compile of the blocks (train.py's compile_regions), and
                            # decode's captured step (off: the static step uncompiled)
parts = "quickstart,base,decode,numerics"
data_dir = "data"           # quickstart, numerics: the embedded corpus and its BPE (train.py builds them)
authors_dir = "authors"     # base: a folder holding the authors' nanochat/ (gpt.py and what it imports)
batch_size = -1             # base: sequences per step; -1 = the largest of 32, 16, 8, ... the planner fits
steps = 20                  # base: timed steps, after three warm-up steps
out = ""                    # the JSON file; "" = gpu_check.json in the work folder (a new temporary one)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARTS = ("quickstart", "base", "decode", "numerics")
# The parts that read each setting; one off its default that no part asked for reads would do nothing
READ_BY = {"compile": ("quickstart", "base", "decode"), "data_dir": ("quickstart", "numerics"),
           "authors_dir": ("base",), "batch_size": ("base",), "steps": ("base",)}
# The CPU fp32 quick start's final val bpb (README; `python train.py --loops=3 --device=cpu`)
QUICKSTART_BPB = 1.9765
QUICKSTART = ["--loops=3"]
# The tiny size: one layer, short sequences, four steps (train.py settings)
TINY = ["--depth=1", "--sequence_len=32", "--device_batch_size=4", "--total_batch_size=128",
        "--bpe_vocab_size=512", "--num_steps=4", "--eval_interval=100", "--eval_tokens=256",
        "--final_eval_tokens=256", "--momentum_warmup_steps=5"]
# fp32 steps on the CPU to compare the first losses with (the LR is constant for 80% of them)
REFERENCE_STEPS = 20


def sizes():
    """The shapes each part runs at: the paper's base FLT, or the tiny one."""
    if tiny:
        return dict(depth=1, sequence_len=64, vocab=512, loops=3, prompt=8, new=8, batches=(1, 2))
    return dict(depth=12, sequence_len=1024, vocab=151669, loops=9, prompt=32, new=64, batches=(1, 16))


def base_config(loops, s):
    """config/flt_base.py's model (config/base.py's depth, config/paper.py's sequence and Qwen3
    vocabulary), with train.py's shape from depth."""
    n_embd = 64 * s["depth"]
    n_head = math.ceil(n_embd / 128)
    return GPTConfig(sequence_len=s["sequence_len"], vocab_size=s["vocab"], n_layer=s["depth"],
                     n_head=n_head, n_kv_head=n_head, n_embd=n_embd, loops=loops, variant="FLT")


def median_seconds(fn, repeats):
    """Median seconds of fn over `repeats` calls, the device drained around each (runtime.timed)."""
    return statistics.median(timed(fn, device) for _ in range(repeats))


# ----------------------------------------------------------------------------- quickstart

def traced_train(argv, report):
    """train.py argv in this process; then `report` gets the graphs dynamo compiled and, between
    consecutive optimizer steps, the host reads (tensor-to-Python reads) and CUDA syncs."""
    reads_at, syncs = [], [0]

    def counted(message, *args, **kwargs):
        syncs[0] += "synchronizing" in str(message)
    if torch.cuda.is_available():
        torch.cuda.set_sync_debug_mode("warn")
        warnings.simplefilter("always")
        warnings.showwarning = counted
    # a mark once a step, just before its one read: Watch.tensors, whose tensors it reads
    tensors = diagnostics.Watch.tensors

    def step_read(*args, **kwargs):
        reads_at.append((sum(counts.values()), syncs[0]))
        return tensors(*args, **kwargs)
    diagnostics.Watch.tensors = step_read
    sys.argv = ["train.py", *argv]
    code = 0
    try:
        with diagnostics.count_host_reads() as counts:
            runpy.run_path(os.path.join(ROOT, "train.py"), run_name="__main__")
    except SystemExit as e:
        code = e.code or 0
    from torch._dynamo.utils import counters
    between = [(b[0] - a[0], b[1] - a[1]) for a, b in zip(reads_at, reads_at[1:])]
    result = {"exit": code, "graphs": counters["stats"]["unique_graphs"],
              "graph_breaks": sum(counters["graph_break"].values()),
              "reads_per_step": statistics.median(r for r, _ in between) if between else None,
              "syncs_per_step": statistics.median(s for _, s in between) if between else None}
    with open(report, "w") as f:
        json.dump(result, f)


def train_process(argv, out_dir, report=None, env=None):
    """A Popen of train.py argv (traced when report is given), its output to out_dir/console.txt."""
    os.makedirs(out_dir, exist_ok=True)
    code = f"from scripts.gpu_check import traced_train; traced_train({argv!r}, {report!r})"
    cmd = [sys.executable, "-c", code] if report else [sys.executable, "train.py", *argv]
    console = open(os.path.join(out_dir, "console.txt"), "w")
    env = dict(os.environ, PYTHONPATH=ROOT) | (env or {})
    return subprocess.Popen(cmd, cwd=ROOT, stdout=console, stderr=subprocess.STDOUT, env=env)


def logged_losses(out_dir):
    """{step: training loss} from a run's log.jsonl."""
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return {r["step"]: r["loss"] for r in records if "loss" in r}, records


def quickstart(work):
    """The quick start on this device and, beside it on the CPU, fp32 steps to compare losses with."""
    size = TINY if tiny else QUICKSTART
    common = [*size, f"--data_dir={data_dir}", "--overwrite"]
    run = os.path.join(work, "quickstart")
    here = [*common, f"--device={device}", "--dtype=bf16", f"--compile={compile}", f"--out_dir={run}"]
    reference = os.path.join(work, "reference")
    ref_steps = [] if tiny else [f"--num_steps={REFERENCE_STEPS}", "--final_eval_tokens=4096"]
    cpu = [*common, *ref_steps, "--device=cpu", "--dtype=fp32", "--sample_tokens=0",
           f"--out_dir={reference}"]
    report = os.path.join(work, "quickstart.json")
    # the CPU run's threads leave cores to the device run's host thread
    threads = {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // 2))}
    with Timer() as took:
        runs = [train_process(here, run, report), train_process(cpu, reference, env=threads)]
        codes = [p.wait() for p in runs]
    result = {"seconds": round(took.seconds, 1), "exit": codes[0], "reference_exit": codes[1]}
    with open(os.path.join(run, "console.txt")) as f:
        result["console_tail"] = f.read()[-2000:]
    if os.path.exists(report):
        with open(report) as f:
            result |= json.load(f)
    losses, records = logged_losses(run)
    final = [r["final_val_bpb"] for r in records if "final_val_bpb" in r]
    result["final_val_bpb"] = final[-1] if final else None
    if not tiny:
        result["reference_bpb"] = QUICKSTART_BPB
    else:
        result["reference_bpb"] = logged_losses(reference)[1][-1].get("final_val_bpb")
    result["run"], result["reference_run"] = run, reference
    ref_losses = logged_losses(reference)[0]
    warmdown = int(0.8 * min(len(losses), len(ref_losses)))
    compared = [s for s in sorted(ref_losses) if s in losses and s < max(1, warmdown)]
    result["first_losses"] = {s: [losses[s], ref_losses[s]] for s in compared}
    return result


# ----------------------------------------------------------------------------- base

def fit_batch(model, loops, s):
    """The largest batch the planner fits in 85% of this device's memory (or --batch_size)."""
    if batch_size > 0 or tiny:
        return batch_size if batch_size > 0 else 2
    total = torch.cuda.get_device_properties(device).total_memory
    for b in (32, 16, 8, 4, 2, 1):
        planned = planning.estimate_memory(model, b, "bf16", compiled=compile == "on", loops=loops)
        if planned["total"] < 0.85 * total:
            return b
    return 1


def train_steps(model, loops, batch, optimize=True):
    """A step function: forward and backward in bf16 at `loops` (None: the authors' model, its K
    fixed), then (optimize) Muon and AdamW."""
    autocast = precision(model, torch.device(device).type, "bf16")
    optimizers = build_optimizers(model) if optimize else []
    vocab = model.config.vocab_size
    idx = torch.randint(0, vocab, (batch, model.config.sequence_len), device=device)
    kwargs = {} if loops is None else {"loops": loops}

    def step():
        with autocast:
            loss = model(idx, idx, **kwargs)
        if isinstance(loss, list):
            # the authors' forward returns the supervised loops' losses; base_train.py averages them
            loss = torch.stack(loss).mean()
        loss.backward()
        for opt in optimizers:
            opt.step()
        model.zero_grad(set_to_none=True)
    return step


def measure(step, model, loops, batch, s):
    """tok/s, MFU, peak memory and the planner's estimate for `step` at this batch."""
    with Timer(device) as warm:
        for _ in range(1 if tiny else 3):
            step()
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    dt = median_seconds(step, 1 if tiny else steps)
    tok_s = batch * s["sequence_len"] / dt
    cuda = device.startswith("cuda")
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    peak = planning.peak_flops(name)
    flops = model.estimate_flops(loops)
    planned = planning.estimate_memory(model, batch, "bf16", compiled=compile == "on", loops=loops,
                                       device_type=torch.device(device).type)
    row = {"loops": loops, "batch": batch, "warmup_s": round(warm.seconds, 1), "ms_per_step": dt * 1e3,
           "tok_per_s": tok_s, "flops_per_token": flops,
           "mfu": flops * tok_s / peak if peak else None, "planned_gib": planned["total"] / 2**30}
    row["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None
    return row


def top_kernels(step, n=15):
    """Where one training step's time goes: the n kernels (CPU: operators) with the most self
    time, each with its share of the step's total."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    cuda = device.startswith("cuda")
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    # the Timer drains the step's kernels before the profile ends
    with torch.profiler.profile(activities=activities) as prof, Timer(device):
        step()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    # ranges a Python annotation opened (Optimizer.step#Muon.step) span kernels counted already
    events = [e for e in prof.key_averages()
              if getattr(e, key) > 0 and not getattr(e, "is_user_annotation", False)
              and "#" not in e.key]
    if cuda:
        # kernels, not the CPU-side operators that launched them
        events = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(getattr(e, key) for e in events) or 1
    events.sort(key=lambda e: getattr(e, key), reverse=True)
    return [{"name": e.key[:90], "ms": getattr(e, key) / 1e3, "share": getattr(e, key) / total,
             "calls": e.count} for e in events[:n]]


def authors_model(loops, s):
    """The authors' GPT (nanochat/gpt.py from --authors_dir) at our shape, as their base_train.py
    builds it (meta, to_empty, init_weights), its blocks compiled as ours are."""
    sys.path.insert(0, os.path.abspath(authors_dir))
    from nanochat.gpt import GPT as TheirGPT, GPTConfig as TheirConfig
    c = base_config(loops, s)
    with torch.device("meta"):
        theirs = TheirGPT(TheirConfig(model_type="FLT", K=loops, sequence_len=c.sequence_len,
                                      vocab_size=c.vocab_size, n_layer=c.n_layer, n_head=c.n_head,
                                      n_kv_head=c.n_kv_head, n_embd=c.n_embd))
    theirs.to_empty(device=device)
    theirs.init_weights()
    if compile == "on":
        for block in theirs.transformer.h:
            block.compile(dynamic=False)
    return theirs


def base(work):
    """The base FLT at K = 9 and K = 1 (training steps), and forward + backward beside the
    authors' gpt.py at K = 9."""
    s = sizes()
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(base_config(s["loops"], s))
    model.init_weights()
    if compile == "on":
        model.compile_regions(dynamic=False)
    batch = fit_batch(model, s["loops"], s)
    result = {"params": model.num_params(), "rows": []}
    for loops in (s["loops"], 1):
        step = train_steps(model, loops, batch)
        result["rows"].append(measure(step, model, loops, batch, s))
        if loops == s["loops"]:
            result["top_kernels"] = top_kernels(step)
    if not os.path.isdir(os.path.join(authors_dir, "nanochat")):
        result["authors"] = f"skipped: no {authors_dir}/nanochat"
        return result
    try:
        result["authors"] = beside_authors(model, batch, s)
    except Exception as e:
        result["authors"] = f"failed: {type(e).__name__}: {e}"
    return result


def beside_authors(model, batch, s):
    """Forward and backward at K, ours and then the authors' gpt.py, at the same shape."""
    ours = measure(train_steps(model, s["loops"], batch, optimize=False), model, s["loops"], batch, s)
    del model
    theirs_model = authors_model(s["loops"], s)
    theirs_step = train_steps(theirs_model, None, batch, optimize=False)
    # warm-up (their blocks compile), then timed as ours
    median_seconds(theirs_step, 1 if tiny else 3)
    theirs_ms = median_seconds(theirs_step, 1 if tiny else steps) * 1e3
    return {"ours_fwd_bwd_ms": ours["ms_per_step"], "theirs_fwd_bwd_ms": theirs_ms,
            "ours_over_theirs": ours["ms_per_step"] / theirs_ms}


# ----------------------------------------------------------------------------- decode

def decode(work):
    """Greedy decoding at K: the eager KV cache, the static step captured (compiled; CUDA graphs on
    CUDA, flt/decoding.py: Decoder) and recomputing the whole forward for every new token; tok/s
    at each batch and whether all give the same tokens."""
    s = sizes()
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(base_config(s["loops"], s))
    model.init_weights()
    # the output projections start at 0 (every block the identity): small weights instead, so
    # the loops change the tokens and "the same tokens" means something
    for name, p in model.named_parameters():
        if name.endswith("c_proj.weight"):
            torch.nn.init.normal_(p, std=0.02)
    model.eval()
    captured = "compiled" if compile == "on" else "static"
    # train.py's default numerics: bf16 on a GPU, fp32 on the CPU (exact greedy ties there)
    kind = torch.device(device).type
    autocast = precision(model, kind, resolve_dtype("auto", kind))
    rows = []
    for batch in s["batches"]:
        prompt = torch.randint(0, s["vocab"], (batch, s["prompt"]), device=device)
        tokens = {}

        def generate(path):
            @torch.no_grad()
            def run():
                with autocast:
                    steps = model.generate(prompt, s["new"], temperature=0, decode=path)
                    tokens[path] = torch.cat(list(steps), 1)
            return run

        @torch.no_grad()
        def recompute():
            seq = prompt
            with autocast:
                for _ in range(s["new"]):
                    h = model.loop_states(seq, s["loops"]).states[-1][:, -1:]
                    seq = torch.cat([seq, model.head(h).argmax(-1)], dim=1)
            tokens["recompute"] = seq[:, prompt.size(1):]
        times = {}
        paths = (("eager", generate("eager")), (captured, generate(captured)),
                 ("recompute", recompute))
        for name, fn in paths:
            # one warm-up call (it compiles), then the median of three
            fn()
            times[name] = median_seconds(fn, 1 if tiny else 3)
        same = min((tokens[name] == tokens["recompute"]).float().mean().item()
                   for name in ("eager", captured))
        rows.append({"batch": batch, "loops": s["loops"], "new_tokens": s["new"],
                     "captured_path": captured,
                     "cached_tok_s": batch * s["new"] / times["eager"],
                     "captured_tok_s": batch * s["new"] / times[captured],
                     "recompute_tok_s": batch * s["new"] / times["recompute"],
                     "same_tokens": same})
    return {"rows": rows}


# ----------------------------------------------------------------------------- numerics

def validation_batch(tok, seq_len, rows=4):
    """(rows, seq_len) tokens: the validation shard's first documents, each after BOS."""
    files = sorted(f for f in os.listdir(os.path.join(data_dir, "embedded")) if f.endswith(".parquet"))
    texts = pq.read_table(os.path.join(data_dir, "embedded", files[-1])).column("text").to_pylist()
    ids = [i for doc in tok.encode_batch(texts[:64]) for i in [tok.bos_id, *doc]]
    return torch.tensor(ids[:rows * seq_len]).view(rows, seq_len)


def numerics(work, runs):
    """The quick start's final weights: logits in bf16 on this device against fp32 on the CPU."""
    run = runs.get("quickstart", {}).get("run")
    if not run or not checkpoint.list_checkpoints(run):
        return {"logits": "skipped: no quick-start checkpoint"}
    step_dir, meta = checkpoint.load_newest(run, "cpu", log=lambda *a: None)
    tok = data.load_tokenizer(os.path.join(step_dir, "tokenizer.json"))
    config = GPTConfig(**meta["config"])
    idx = validation_batch(tok, config.sequence_len)
    logits = {}
    for name, where, dtype in (("here", device, "bf16"), ("cpu", "cpu", "fp32")):
        with torch.device(where):
            model = GPT(config)
        model.load_state_dict(meta["model"])
        model.eval()
        with torch.no_grad(), precision(model, torch.device(where).type, dtype):
            logits[name] = model(idx.to(where)).float().cpu()
    diff = (logits["here"] - logits["cpu"]).abs()
    first = runs["quickstart"].get("first_losses", {})
    loss_diff = [abs(a - b) for a, b in first.values()]
    return {"logits_max_diff": diff.max().item(), "logits_mean_diff": diff.mean().item(),
            "logits_std": logits["cpu"].std().item(),
            "argmax_same": (logits["here"].argmax(-1) == logits["cpu"].argmax(-1)).float().mean().item(),
            "first_losses_max_diff": max(loss_diff) if loss_diff else None,
            "first_steps_compared": len(loss_diff)}


# ----------------------------------------------------------------------------- report

def fmt(x, spec=".4g"):
    return "n/a" if x is None else format(x, spec) if isinstance(x, (int, float)) else str(x)


def table(results, where):
    """The rows a reader compares with the goals (docs/testing.md)."""
    rows = [("device", where, "")]
    q = results.get("quickstart", {})
    if "error" in q or "exit" in q:
        ref = q.get("reference_bpb")
        bpb = q.get("final_val_bpb")
        off = f"{100 * (bpb / ref - 1):+.2f}% vs {ref:.4f}" if bpb and ref else q.get("error", "")
        rows += [("quick start: exit, final val bpb", f"{q.get('exit')}, {fmt(bpb, '.4f')}", off),
                 ("quick start: graphs compiled, graph breaks",
                  f"{q.get('graphs')}, {q.get('graph_breaks')}", ""),
                 ("quick start: host reads, CUDA syncs per step",
                  f"{fmt(q.get('reads_per_step'))}, {fmt(q.get('syncs_per_step'))}", "goal 1")]
    for row in results.get("base", {}).get("rows", []):
        mfu = f"MFU {100 * row['mfu']:.1f}%" if row["mfu"] else "MFU n/a"
        rows.append((f"base FLT K={row['loops']} B={row['batch']}: tok/s",
                     f"{row['tok_per_s']:,.0f}", mfu))
        rows.append((f"base FLT K={row['loops']}: peak / planned GiB",
                     f"{fmt(row['peak_gib'], '.3g')} / {row['planned_gib']:.3g}", ""))
    authors = results.get("base", {}).get("authors")
    if isinstance(authors, dict):
        rows.append(("fwd+bwd ms: ours / the authors' gpt.py",
                     f"{authors['ours_fwd_bwd_ms']:.1f} / {authors['theirs_fwd_bwd_ms']:.1f}",
                     f"ratio {authors['ours_over_theirs']:.2f}"))
    elif authors:
        rows.append(("the authors' gpt.py", authors, ""))
    for row in results.get("decode", {}).get("rows", []):
        rows.append((f"decode K={row['loops']} B={row['batch']}: eager / {row['captured_path']} / "
                     "recompute tok/s",
                     f"{row['cached_tok_s']:,.0f} / {row['captured_tok_s']:,.0f} / "
                     f"{row['recompute_tok_s']:,.0f}",
                     f"same tokens {row['same_tokens']:.2f}"))
    n = results.get("numerics", {})
    if "logits_max_diff" in n:
        rows.append(("logits bf16 here vs fp32 CPU: max, mean |diff|",
                     f"{n['logits_max_diff']:.3f}, {n['logits_mean_diff']:.4f}",
                     f"logit std {n['logits_std']:.2f}, argmax same {n['argmax_same']:.3f}"))
        rows.append((f"first {n['first_steps_compared']} losses vs fp32 CPU: max |diff|",
                     fmt(n["first_losses_max_diff"], ".2g"), ""))
    for part in PARTS:
        if "error" in results.get(part, {}):
            rows.append((f"{part}: failed", results[part]["error"], ""))
    width = max(len(r[0]) for r in rows)
    return "\n".join(f"{a:<{width}}  {b:<24} {c}".rstrip() for a, b, c in rows)


def main(defaults):
    chosen = [p for p in parts.split(",") if p]
    for p in chosen:
        if p not in PARTS:
            raise ValueError(f"--parts={parts}: {p!r} is not one of {','.join(PARTS)}")
    for key, readers in READ_BY.items():
        if globals()[key] != defaults[key] and not set(readers) & set(chosen):
            raise ValueError(f"--{key}={globals()[key]!r} does nothing with --parts={parts}: only "
                             f"{', '.join(readers)} read it")
    if not tiny and not (device.startswith("cuda") and torch.cuda.is_available()):
        raise ValueError(f"--device={device}: the full check needs a CUDA GPU, and this torch "
                         f"({torch.__version__}) sees none; --tiny --device=cpu runs its code on "
                         "the CPU at a tiny size")
    if compile not in ("on", "off"):
        raise ValueError(f"--compile={compile}: expected on or off")
    if steps < 1 or batch_size == 0 or batch_size < -1:
        raise ValueError(f"--steps={steps}, --batch_size={batch_size}: expected steps >= 1 and "
                         "a batch >= 1 (or -1: the largest that fits)")
    if out:
        errors.output_file("--out", out)
    errors.directory("--data_dir", data_dir)
    rt = setup(device)
    where = torch.cuda.get_device_name(rt.device) if rt.device_type == "cuda" else "cpu"
    head = {"device": where, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
            "tiny": tiny, "compile": compile}
    results = {"meta": head}
    # the parts' runs and files, kept for a look afterwards
    work = tempfile.mkdtemp(prefix="gpu_check")
    path = out or os.path.join(work, "gpu_check.json")
    for part in chosen:
        print(f"{part} ...", flush=True)
        with Timer() as took:
            try:
                results[part] = (numerics(work, results) if part == "numerics"
                                 else globals()[part](work))
            except Exception as e:
                results[part] = {"error": f"{type(e).__name__}: {e}",
                                 "traceback": traceback.format_exc()[-3000:]}
        results[part]["part_seconds"] = round(took.seconds, 1)
        print(f"{part}: {results[part]['part_seconds']} s", flush=True)
        atomic_write(path, json.dumps(results, indent=1, default=str))
    print(table(results, where))
    print(f"written to {path}; the parts' runs and files are in {work}")


if __name__ == "__main__":
    with user_errors("scripts.gpu_check"):
        _defaults = settings_of(globals())
        configure(globals(), sys.argv[1:])
        main(_defaults)
