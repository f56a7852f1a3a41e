"""eval.py's modes, planned and then run (docs/evaluation.md). A mode plans first: it fetches and
counts its inputs, no forward yet, and returns (its plan line, the forwards this process will run,
run); run() computes one of eval.py's metrics and returns ({K: {key: value}}, what was measured).
`plan_and_run` is eval.py's command line after the checkpoint loads: the plan lines, the time
estimate, each mode run and merged into eval.json (report.run_modes, report.write_results), the
table of everything eval.json then holds. A mode run with one of its CHOICES off the default keeps
its results apart, under metric[setting=value,...] (labelled).

    results, failures = plan_and_run(c, defaults, model, meta, rt, run_modes, loops, thresholds,
                                     metrics)

`metrics` holds eval.py's functions: sweep (loop_losses), bpb, exit, ppl, core and byte_counts
(BYTE_COUNTS); the modes hold no arithmetic of their own.
"""
import functools
import os
from types import SimpleNamespace

import torch

import data
from flt import corpus, report, runtime, tasks, tracking
from flt.runtime import print0

SAMPLE_PROMPTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time,")


def progress_of(ctx, label, total, unit="forwards"):
    """Progress lines on rank 0 (corpus.Progress); None on the other ranks."""
    return corpus.Progress(label, total, unit, log=print0) if ctx.rank == 0 else None


def validation(c, ctx):
    """The bpb and exit modes' batches, built once: this process's share of the authors' chunks."""
    if ctx.val is not None:
        return ctx.val
    if c.val_files:
        files = c.val_files.split(",")
    else:
        shard = functools.partial(corpus.val_shard, ctx.settings, ctx.data_dir)
        files = [runtime.rank0_first(ctx.rt, shard)]
    chunks, n_chunks = data.protocol_chunks(files, ctx.tokenizer, ctx.seq_len, c.bpb_tokens,
                                            c.protocol_ranks, c.protocol_batch, ctx.rank, ctx.world)
    n_targets = sum(int((y >= 0).sum()) for _, y in chunks)
    counts = torch.tensor([n_targets, len(chunks)], device=ctx.dev)
    runtime.all_reduce_sum(counts)
    (targets, n), requested = counts.tolist(), n_chunks * c.protocol_batch * ctx.seq_len
    layout = f"as the authors' {c.protocol_ranks} ranks x batch {c.protocol_batch} cut it"
    if targets == requested:
        what = f"{targets:,} tokens of {files[-1]} ({layout})"
    else:
        what = (f"{targets:,} tokens of {files[-1]}: fewer than bpb_tokens={c.bpb_tokens:,}, so "
                f"every one of them once ({layout}; their loader would have wrapped around and "
                "scored tokens again)")
    measured = dict(tokens=targets, requested=requested, files=files, ranks=c.protocol_ranks,
                    batch=c.protocol_batch)
    n_forwards = -(-n * c.protocol_batch // c.batch_size)
    forwards = f"{n_forwards:,} forwards of {c.batch_size} x {ctx.seq_len}"
    ctx.val = SimpleNamespace(batches=data.rows(chunks, c.batch_size), what=what, measured=measured,
                              forwards=forwards)
    ctx.tables = {count: ctx.tokenizer.token_bytes(count).to(ctx.dev)
                  for count in ctx.metrics.byte_counts}
    return ctx.val


def bpb_mode(c, ctx):
    val = validation(c, ctx)

    def run():
        progress = progress_of(ctx, "val bpb", len(val.batches))
        bpb, _ = ctx.metrics.bpb(ctx.model, val.batches, ctx.tables, ctx.loops, progress)
        utf8 = "  ".join(f"{v:.4f}" for v in bpb["utf8"].values())
        print0(f"val bpb: {report.per_K(bpb['authors'], '.4f')}  (true UTF-8 bytes: {utf8})")
        results = {K: {"val_bpb": bpb["authors"][K], "val_bpb_utf8": bpb["utf8"][K]}
                   for K in ctx.loops}
        return results, val.measured
    return f"{val.what}; {val.forwards} at K={ctx.loops[-1]}", len(val.batches), run


def exit_mode(c, ctx):
    val, K_max = validation(c, ctx), ctx.loops[-1]
    n = len(ctx.thresholds) * len(val.batches)

    def run():
        curve = ctx.metrics.exit(ctx.model, val.batches, ctx.tables["authors"], K_max,
                                 ctx.thresholds, progress_of(ctx, "exit", n))
        print0(f"exit rule, K <= {K_max}: " + "  ".join(
            f"{r['threshold']:g}: {r['val_bpb']:.4f} bpb at {r['mean_loops']:.2f} loops"
            for r in curve))
        return {K_max: {"exit": curve}}, val.measured
    return (f"the bpb mode's tokens, K <= {K_max}, thresholds {ctx.thresholds}: "
            f"{len(ctx.thresholds)} x {val.forwards}", n, run)


def wiki_mode(c, ctx):
    fetch = functools.partial(corpus.fetch_wikitext, c.wiki_url, ctx.data_dir)
    path = c.wiki_path or runtime.rank0_first(ctx.rt, fetch)
    rows = corpus.load_rows(path)
    windows = data.wiki_windows(ctx.tokenizer, rows, ctx.seq_len, c.protocol_batch)
    n, tokens = -(-len(windows[ctx.rank::ctx.world]) // c.batch_size), len(windows) * ctx.seq_len

    def run():
        ppl = ctx.metrics.ppl(ctx.model, windows, ctx.loops, c.batch_size,
                              progress_of(ctx, "wikitext-2", n))
        print0(f"wikitext-2 test ppl: {report.per_K(ppl, '.2f')}")
        return {K: {"wiki_ppl": v} for K, v in ppl.items()}, {"tokens": tokens}
    forwards = -(-len(windows) // c.batch_size)
    return (f"{tokens:,} tokens of {path} ({len(windows):,} rows of {ctx.seq_len}); "
            f"{forwards:,} forwards of {c.batch_size} x {ctx.seq_len} at K={ctx.loops[-1]}", n, run)


def core_mode(c, ctx):
    bundle_dir = c.bundle_dir or os.path.join(ctx.data_dir, "eval_bundle")
    bundle = runtime.rank0_first(ctx.rt, functools.partial(corpus.fetch_bundle, bundle_dir,
                                                           c.bundle_url))
    tasks = corpus.load_bundle(bundle)
    items = [it for task in tasks for it in corpus.load_items(task, c.max_per_task)]
    n_seqs = sum(len(it["choices"] if "choices" in it else it.get("context_options", [0]))
                 for it in items)
    n = -(-n_seqs // (c.batch_size * ctx.world))

    def run():
        core = ctx.metrics.core(ctx.model, ctx.tokenizer, tasks, ctx.loops, c.batch_size,
                                c.max_per_task, log=print0, progress=True)
        print0(f"CORE: {report.per_K({K: r['CORE'] for K, r in core.items()}, '.4f')}")
        return core, {"items": len(items), "sequences": n_seqs}
    return (f"{len(items):,} items in {len(tasks)} tasks of {bundle}: {n_seqs:,} sequences, about "
            f"{n * ctx.world:,} forwards of up to {c.batch_size} at K={ctx.loops[-1]}", n, run)


def sample_mode(c, ctx):
    """SAMPLE_PROMPTS continued at each K on rank 0, decoding cached; forwards: max(loops) steps."""
    prompts = [(K, p) for K in ctx.loops for p in SAMPLE_PROMPTS] if ctx.rank == 0 else []

    def run():
        progress, texts = progress_of(ctx, "sample", len(prompts), "samples"), {}
        for K, prompt in prompts:
            text = runtime.sample(ctx.model, ctx.tokenizer, prompt, c.sample_tokens, loops=K,
                                  temperature=c.temperature, seed=c.seed, cache_slots=c.cache_slots,
                                  draft_loops=c.draft_loops, draft_len=c.draft_len)
            texts.setdefault(K, []).append(text)
            progress()
        print0("\n".join(runtime.framed(f"sample at K={K}", x) for K in texts for x in texts[K]))
        return {K: {"samples": t} for K, t in texts.items()}, {}
    cache = "exact" if c.cache_slots is None else f"{c.cache_slots} loop slot(s) a layer"
    drafts = "" if c.draft_loops is None else (f", drafting {c.draft_len} tokens a round with "
                                               f"{c.draft_loops} loops, verified with all K")
    return (f"{len(SAMPLE_PROMPTS)} prompts x {c.sample_tokens} tokens at each K in {ctx.loops}, "
            f"cached decoding ({cache} cache{drafts})",
            sum(K * c.sample_tokens for K, _ in prompts) / ctx.loops[-1], run)


# The settings that change a mode's numbers (docs/evaluation.md). Results computed with any of them
# off its default are kept in eval.json under metric[setting=value,...], beside the default ones.
# Where the inputs are (val_files, wiki_path, bundle_dir: local copies) is no such choice.
PROTOCOL = ("bpb_tokens", "protocol_ranks", "protocol_batch")
CHOICES = {"bpb": PROTOCOL, "exit": PROTOCOL, "wiki": ("protocol_batch",), "core": ("max_per_task",),
           "sample": ("temperature", "cache_slots", "draft_loops", "draft_len"), "tasks": ("task_items",)}


def label(c, defaults, mode):
    """The label of a mode's results: its CHOICES set off their defaults, "key=value,..."; "" if
    none (the paper's protocol, greedy exact decoding)."""
    off = [key for key in CHOICES.get(mode, ()) if getattr(c, key) != defaults[key]]
    return ",".join(f"{key}={getattr(c, key)}" for key in off)


def labelled(plan, tag):
    """plan() (a mode's), its results stored as metric[tag] and its plan line saying so."""
    line, n, run = plan()
    if not tag:
        return line, n, run

    def run_labelled():
        by_K, measured = run()
        return {K: {f"{key}[{tag}]": v for key, v in r.items()} for K, r in by_K.items()}, measured
    return f"{line}; off the default, kept apart in eval.json as <metric>[{tag}]", n, run_labelled


def tasks_mode(c, ctx):
    """A synthetic task's held-out items (flt/tasks.py), scored by exact match at each K."""
    task = tasks.get(ctx.settings) if "dataset" in ctx.settings else None
    if task is None:
        raise ValueError(f"the tasks mode scores a model trained on a task "
                         f"({', '.join(tasks.TASKS)}); this one was trained on "
                         f"dataset={ctx.settings.get('dataset')!r}")
    batches = task.batches(c.task_items * task.item_len, c.batch_size, ctx.rank, ctx.world,
                           difficulty=True)

    def run():
        progress = progress_of(ctx, f"{task.name} accuracy", len(batches))
        accuracy, overall, answers = ctx.metrics.tasks(ctx.model, batches, task.levels, ctx.loops,
                                                       progress)
        results = {}
        for K, by_level in accuracy.items():
            levels = {str(d): a for d, a in by_level.items()}
            results[K] = {"task_acc": overall[K], "task_acc_by_difficulty": levels}
            print0(f"{task.name} K={K}: accuracy {overall[K]:.4f}; by difficulty "
                   + " ".join(f"{d}:{a:.2f}" for d, a in levels.items()))
        return results, {"task": task.name, "difficulty": task.D, "items": c.task_items,
                         "answers": {str(d): n for d, n in answers.items()}}
    return (f"{c.task_items:,} held-out {task.name} items of difficulty {task.D} "
            f"({len(task.levels)} levels), {len(batches)} forwards of {c.batch_size} x "
            f"{ctx.seq_len} at K={ctx.loops[-1]}", len(batches), run)


PLANS = {"bpb": bpb_mode, "wiki": wiki_mode, "core": core_mode, "sample": sample_mode,
         "exit": exit_mode, "tasks": tasks_mode}


@torch.no_grad()
def estimate(c, ctx, planned):
    """Seconds each planned mode should take: its forwards times one of its own kind, timed at
    max(loops) on a batch_size x sequence_len batch (the best of two after a warm-up): the budget
    sweep's (loop_losses), the exit rule's forward for exit (its KL reads every loop's logits), and
    for samples a decoding step's (20 tokens less 4, so that the prefill drops out)."""
    K_max = ctx.loops[-1]
    x = torch.zeros(c.batch_size, ctx.seq_len, dtype=torch.long, device=ctx.dev)

    def sweep():
        return ctx.metrics.sweep(ctx.model, x, x, [K_max])

    def exit_rule():
        return ctx.model(x, loops=K_max, exit_threshold=ctx.thresholds[0], return_loops=True)

    def decode(n):
        return list(ctx.model.generate(x[:1, :8], n, loops=K_max, cache_slots=c.cache_slots,
                                       draft_loops=c.draft_loops, draft_len=c.draft_len))

    def step():
        return best(functools.partial(decode, 20)) - best(functools.partial(decode, 4))
    kinds = {"exit": exit_rule, "sample": step}
    seconds = {}
    with ctx.numerics:
        for mode in planned:
            kind = kinds.get(mode, sweep)
            if kind not in seconds and (mode != "sample" or ctx.rank == 0):
                seconds[kind] = step() / 16 if kind is step else best(kind)
    return {mode: n * seconds.get(kinds.get(mode, sweep), 0.0) for mode, (_, n, _) in planned.items()}


def best(work):
    """The shorter of two timed calls of work(), after one to warm up."""
    return min(report.seconds(work, warmup=1), report.seconds(work))


def context(c, model, meta, rt, loops, thresholds, metrics):
    """What the modes share: the model, the run's settings, the process, the tokenizer saved with
    the weights, and the numerics the run trained with (bf16 embedding and autocast, or fp32)."""
    settings = meta.get("settings", {})
    tokenizer = data.load_tokenizer(os.path.join(meta["path"], "tokenizer.json"),
                                    bos=settings.get("bos_token", data.BOS))
    numerics = runtime.precision(model, rt.device_type, c.dtype or settings.get("dtype", "fp32"))
    return SimpleNamespace(model=model, settings=settings, rt=rt, rank=rt.rank, world=rt.world,
                           dev=rt.device, val=None, loops=loops, thresholds=thresholds,
                           seq_len=model.config.sequence_len, metrics=metrics,
                           data_dir=c.data_dir or settings.get("data_dir", corpus.DEFAULT_DATA_DIR),
                           numerics=numerics, tokenizer=tokenizer)


def plan_and_run(c, defaults, model, meta, rt, run_modes, loops, thresholds, metrics):
    """Each mode of run_modes planned, then run and merged into eval.json (c.out, or the step
    directory's) after it ends, on rank 0, labelled where the settings (c) leave the defaults in
    one of its CHOICES; the table of all eval.json then holds, and that to W&B if c.wandb.
    Returns ({K: results}, the closing line when a mode could not run, else None)."""
    ctx = context(c, model, meta, rt, loops, thresholds, metrics)
    json_path, step = c.out or os.path.join(meta["path"], "eval.json"), meta.get("step")
    print0(f"{meta['path']} (step {step}): {model.config.variant}, trained at K="
           f"{model.config.loops}; evaluating K in {loops} on {rt.device}, world {rt.world}")
    record = {"checkpoint": meta["path"], "step": step, "settings": vars(c), "time": report.now()}

    held = {}

    def save(results, measured):
        if rt.rank == 0:
            # another eval.py of this checkpoint merges in turn
            with corpus.locked(json_path):
                doc = report.write_results(json_path, record, results, measured,
                                           runtime.atomic_write)
            held.update(doc["results"])
    plans = {mode: functools.partial(labelled, functools.partial(PLANS[mode], c, ctx),
                                     label(c, defaults, mode)) for mode in run_modes}
    results, measured, failed = report.run_modes(plans, functools.partial(estimate, c, ctx),
                                                 ctx.numerics, save, loops, print0)
    if measured:
        # the table of what the file holds now: this run's entries and those of earlier runs
        print0(f"\n{json_path} now holds:\n" + report.summary(held) + f"written to {json_path}")
    else:
        print0("\nnothing computed")
    # all eval.json holds, to the run's W&B (flt/tracking.py)
    if c.wandb and rt.rank == 0 and measured:
        tracking.log_results(os.path.dirname(meta["path"]), json_path, step)
    failures = report.failures(failed, len(run_modes), json_path, measured) if failed else None
    return results, failures
