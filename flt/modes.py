"""eval.py's modes (docs/evaluation.md), each a plan and a run. A mode plans first: it fetches and
counts its inputs, no forward yet, and returns a Plan: its plan line, the forwards this process will
run (the time estimate's unit) and run(), which computes one of eval.py's metrics and returns
({K: {key: value}}, what was measured). eval.py's main plans every mode, estimates, then runs each
and merges it into eval.json. A mode run with one of its CHOICES off the default keeps its results
apart, under metric[setting=value,...] (plan).

    metrics = modes.Metrics(sweep=loop_losses, bpb=evaluate_bpb, ...)    # eval.py's functions
    job = modes.Job(settings, model, meta, rt, loops_list, exits, metrics)   # what they share
    planned = {mode: modes.plan(mode, settings, defaults, job) for mode in run_modes}
    seconds = modes.estimate(settings, job, planned)            # {mode: Span(low, mid, high)}
    by_K, measured = planned["bpb"].run()

The paper's metrics are eval.py's functions (evaluate_bpb, evaluate_exit, evaluate_ppl,
evaluate_core, loop_losses), which eval.py's main hands over in a Metrics: imports flow one way,
from eval.py to this package, never back. These modes hold no arithmetic of their own; the tasks
mode, beyond the paper, runs flt/tasks.py's accuracy.
"""
import functools
import itertools
import os
from types import SimpleNamespace
from typing import Callable, NamedTuple

import torch

import data
from flt import checkpoint, corpus, inputs, report, runtime, tasks
from flt.runtime import print0

# The sample mode's prompts, unless --prompt gives others: '|' between two, since prompts hold commas
SAMPLE_PROMPTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time,")
# Where a mode's inputs are when it could not fetch them (no network): the settings that point at
# local files
OFFLINE = {"bpb": "--val_files=<parquet shards>", "exit": "--val_files=<parquet shards>",
           "wiki": "--wiki_path=<wikitext-2-v1 test parquet or wiki.test.tokens>",
           "core": "--bundle_dir=<unpacked eval_bundle>"}


class Plan(NamedTuple):
    """A mode's plan: the line eval.py prints, the forwards this process will run, and run()."""
    line: str
    forwards: float
    run: Callable


class Metrics(NamedTuple):
    """eval.py's metrics, which the modes run: a mode's function by its name, the budget sweep
    that the estimate times, and the names of bits per byte's tables (Tokenizer.token_bytes)."""
    sweep: Callable
    bpb: Callable
    exit: Callable
    wiki: Callable
    core: Callable
    byte_counts: tuple


class Job:
    """What the modes of one eval.py run share: the model and the settings it was trained with,
    this process (rt), the loop budgets (sorted: loops[-1] is the largest), the exit rules'
    thresholds ({rule: thresholds}, eval_settings.exit_plan), eval.py's metrics (Metrics), the
    tokenizer saved with the weights, the numerics the run trained with (bf16 embedding and
    autocast, or fp32: runtime.precision), where downloads land, and the validation batches once
    built (validation)."""

    def __init__(self, settings, model, meta, rt, loops, exits, metrics):
        self.model = model
        self.metrics = metrics
        self.trained = meta.get("settings", {})
        # your own data: the documents the run trained on (flt/owndata.py: run_shards)
        self.data = meta.get("data")
        self.rt = rt
        self.rank = rt.rank
        self.world = rt.world
        self.device = rt.device
        self.loops = loops
        self.exits = exits
        self.seq_len = model.config.sequence_len
        self.tokenizer = checkpoint.run_tokenizer(meta)
        dtype = settings.dtype or self.trained.get("dtype", "fp32")
        self.numerics = runtime.precision(model, rt.device_type, dtype)
        self.data_dir = settings.data_dir or self.trained.get("data_dir", corpus.DEFAULT_DATA_DIR)
        self.val = None
        self.tables = None

    def progress(self, label, total, unit="forwards"):
        """Progress lines on rank 0 (corpus.Progress); None on the other ranks."""
        return corpus.Progress(label, total, unit, log=print0) if self.rank == 0 else None

    def exits_named(self):
        """The exit rules a plan line names: "kl at [0.1, 0.01], argmax at [1, 2]"."""
        return ", ".join(f"{rule} at {thresholds}" for rule, thresholds in self.exits.items())


def validation(settings, job):
    """The bpb and exit modes' batches, built once: this process's share of the authors' chunks,
    with the byte tables of eval.py's byte counts (Metrics.byte_counts)."""
    if job.val is not None:
        return job.val
    if settings.val_files:
        files = settings.val_files.split(",")
    else:
        shard = functools.partial(inputs.val_shard, job.trained, job.data_dir, job.data)
        files = [runtime.rank0_first(job.rt, shard)]
    ranks, batch = settings.protocol_ranks, settings.protocol_batch
    layout = f"as the authors' {ranks} ranks x batch {batch} cut it"
    chunks, targets, n, requested = scored(files, job, settings.bpb_tokens, ranks, batch)
    # Their layout gives each rank its own row groups: on a file of few or uneven row groups, a rank
    # runs out while another stops at its share, and tokens that bpb_tokens asks for go unscored.
    # One stream then scores min(bpb_tokens, all) of them: it is taken when it scores more than the
    # ranks' chunk boundaries account for. A FineWeb run's own shard keeps their layout, always.
    authors = not settings.val_files and job.trained.get("dataset") == "fineweb"
    if targets < requested and not authors:
        stream = scored(files, job, settings.bpb_tokens, 1, batch)
        if stream[1] > targets + ranks:
            layout = (f"in one stream at batch {batch}: the authors' {ranks} ranks would score "
                      f"{targets:,}, its row groups being too few to share")
            chunks, targets, n, requested = stream
            ranks = 1
    if targets == requested:
        what = f"{targets:,} tokens of {files[-1]} ({layout})"
    else:
        what = (f"{targets:,} tokens of {files[-1]}: fewer than bpb_tokens={settings.bpb_tokens:,}, "
                f"so every one of them once ({layout}; their loader would have wrapped around and "
                "scored tokens again)")
    n_forwards = -(-n * batch // settings.batch_size)
    job.val = SimpleNamespace(
        batches=data.rows(chunks, settings.batch_size), what=what,
        measured=dict(tokens=targets, requested=requested, files=files, ranks=ranks, batch=batch),
        forwards=f"{n_forwards:,} forwards of {settings.batch_size} x {job.seq_len}")
    job.tables = {count: job.tokenizer.token_bytes(count).to(job.device)
                  for count in job.metrics.byte_counts}
    return job.val


def scored(files, job, n_tokens, ranks, batch):
    """(this process's chunks, targets, chunks and tokens requested, summed over the processes) of
    data.protocol_chunks at `ranks` simulated ranks of device batch `batch`."""
    chunks, n_chunks = data.protocol_chunks(files, job.tokenizer, job.seq_len, n_tokens, ranks,
                                            batch, job.rank, job.world)
    n_targets = sum(int((y >= 0).sum()) for _, y in chunks)
    counts = torch.tensor([n_targets, len(chunks)], device=job.device)
    runtime.all_reduce_sum(counts)
    targets, n = counts.tolist()
    return chunks, targets, n, n_chunks * batch * job.seq_len


def bpb_mode(settings, job):
    """Bits per byte on the validation tokens, at each K (Metrics.bpb: eval.evaluate_bpb)."""
    val = validation(settings, job)

    def run():
        progress = job.progress("val bpb", len(val.batches))
        bpb, _ = job.metrics.bpb(job.model, val.batches, job.tables, job.loops, progress)
        utf8 = "  ".join(f"{v:.4f}" for v in bpb["utf8"].values())
        print0(f"val bpb: {report.per_K(bpb['authors'], '.4f')}  (true UTF-8 bytes: {utf8})")
        results = {K: {"val_bpb": bpb["authors"][K], "val_bpb_utf8": bpb["utf8"][K]}
                   for K in job.loops}
        return results, val.measured
    return Plan(f"{val.what}; {val.forwards} at K={job.loops[-1]}", len(val.batches), run)


def exit_mode(settings, job):
    """bpb and loops per token under each exit rule at each of its thresholds (Metrics.exit): kl's
    curve under "exit", as ever; the other rules' under "exit_rules", {rule: curve}. eval.json
    merges both by (rule, threshold) (report.merge)."""
    val, K_max = validation(settings, job), job.loops[-1]
    # a forward per batch, rule and threshold
    n_thresholds = sum(map(len, job.exits.values()))
    n = n_thresholds * len(val.batches)

    def run():
        progress = job.progress("exit", n)
        curves = {}
        for rule, thresholds in job.exits.items():
            curves[rule] = job.metrics.exit(job.model, val.batches, job.tables["authors"], K_max,
                                            thresholds, rule, progress)
            print0(f"exit rule {rule}, K <= {K_max}: " + "  ".join(
                f"{r['threshold']:g}: {r['val_bpb']:.4f} bpb at {r['mean_loops']:.2f} loops"
                for r in curves[rule]))
        results = {"exit": curves.pop("kl")} if "kl" in curves else {}
        if curves:
            results["exit_rules"] = curves
        return {K_max: results}, val.measured
    return Plan(f"the bpb mode's tokens, K <= {K_max}, exit rules {job.exits_named()}: "
                f"{n_thresholds} x {val.forwards}", n, run)


def wiki_mode(settings, job):
    """WikiText-2 test perplexity at each K (Metrics.wiki: eval.evaluate_ppl)."""
    fetch = functools.partial(corpus.fetch_wikitext, settings.wiki_url, job.data_dir)
    path = settings.wiki_path or runtime.rank0_first(job.rt, fetch)
    rows = corpus.load_rows(path)
    windows = data.wiki_windows(job.tokenizer, rows, job.seq_len, settings.protocol_batch)
    batch_size = settings.batch_size
    n = -(-len(windows[job.rank::job.world]) // batch_size)
    tokens = len(windows) * job.seq_len

    def run():
        ppl = job.metrics.wiki(job.model, windows, job.loops, batch_size,
                               job.progress("wikitext-2", n))
        print0(f"wikitext-2 test ppl: {report.per_K(ppl, '.2f')}")
        return {K: {"wiki_ppl": v} for K, v in ppl.items()}, {"tokens": tokens}
    forwards = -(-len(windows) // batch_size)
    return Plan(f"{tokens:,} tokens of {path} ({len(windows):,} rows of {job.seq_len}); "
                f"{forwards:,} forwards of {batch_size} x {job.seq_len} at K={job.loops[-1]}",
                n, run)


def core_mode(settings, job):
    """CORE and Table 1's downstream accuracies at each K (Metrics.core: eval.evaluate_core)."""
    bundle_dir = settings.bundle_dir or os.path.join(job.data_dir, "eval_bundle")
    fetch = functools.partial(corpus.fetch_bundle, bundle_dir, settings.bundle_url)
    bundle = runtime.rank0_first(job.rt, fetch)
    bundle_tasks = corpus.load_bundle(bundle)
    items = [it for task in bundle_tasks for it in corpus.load_items(task, settings.max_per_task)]
    n_seqs = sum(len(it["choices"] if "choices" in it else it.get("context_options", [0]))
                 for it in items)
    n = -(-n_seqs // (settings.batch_size * job.world))

    def run():
        core = job.metrics.core(job.model, job.tokenizer, bundle_tasks, job.loops,
                                settings.batch_size, settings.max_per_task, log=print0,
                                progress=True)
        print0(f"CORE: {report.per_K({K: r['CORE'] for K, r in core.items()}, '.4f')}")
        return core, {"items": len(items), "sequences": n_seqs}
    return Plan(f"{len(items):,} items in {len(bundle_tasks)} tasks of {bundle}: {n_seqs:,} "
                f"sequences, about {n * job.world:,} forwards of up to {settings.batch_size} at "
                f"K={job.loops[-1]}", n, run)


def sample_prompts(value):
    """The prompts of a --prompt setting: SAMPLE_PROMPTS for "", else the texts between its '|', each
    as written (spaces too). An empty one ("a||b", a '|' at an end) is a ValueError."""
    if not value:
        return SAMPLE_PROMPTS
    prompts = tuple(value.split("|"))
    if "" in prompts:
        raise ValueError(f"--prompt={value!r}: an empty prompt; expected one text, or several with "
                         "'|' between two, e.g. --prompt='Once upon a time,|def main():'")
    return prompts


def sample_mode(settings, job):
    """The prompts (--prompt, else SAMPLE_PROMPTS) continued at each K on rank 0, decoding cached;
    with draft_loops, each K above it drafts (model.generate), the others decode without drafting.
    forwards: the decoding steps, in steps at max(loops)."""
    texts = sample_prompts(settings.prompt)
    # the tokens each is continued by: runtime.sample's, sample_tokens or what sequence_len leaves
    steps = {}
    for text in texts:
        ids = 1 + len(job.tokenizer.encode(text))
        if ids >= job.seq_len:
            shown = text if len(text) <= 40 else text[:40] + "..."
            raise ValueError(f"--prompt: {shown!r} is {ids} tokens with its BOS, and the model reads "
                             f"{job.seq_len} (sequence_len): at most {job.seq_len - 1}, so that a token "
                             "can follow")
        steps[text] = min(settings.sample_tokens, job.seq_len - ids)
    prompts = [(K, p) for K in job.loops for p in texts] if job.rank == 0 else []
    draft_loops = settings.draft_loops
    drafted = [K for K in job.loops if draft_loops is not None and K > draft_loops]

    def run():
        progress, texts = job.progress("sample", len(prompts), "samples"), {}
        for K, prompt in prompts:
            text = runtime.sample(job.model, job.tokenizer, prompt, settings.sample_tokens, loops=K,
                                  temperature=settings.temperature, seed=settings.seed,
                                  cache_slots=settings.cache_slots,
                                  draft_loops=draft_loops if K in drafted else None,
                                  draft_len=settings.draft_len)
            texts.setdefault(K, []).append(text)
            progress()
        print0("\n".join(runtime.framed(f"sample at K={K}", x) for K in texts for x in texts[K]))
        return {K: {"samples": t} for K, t in texts.items()}, {}
    cache = "exact" if settings.cache_slots is None else f"{settings.cache_slots} loop slot(s) a layer"
    drafts = ""
    if draft_loops is not None:
        drafts = (f", drafting {settings.draft_len} tokens a round with {draft_loops} loops, verified "
                  "with all K")
    undrafted = [str(K) for K in job.loops if draft_loops is not None and K not in drafted]
    if undrafted:
        drafts += f"; K={','.join(undrafted)} without drafting, which needs K > {draft_loops}"
    forwards = sum(K * steps[p] for K, p in prompts) / job.loops[-1]
    return Plan(f"{len(texts)} prompts x {settings.sample_tokens} tokens at each K in "
                f"{job.loops}, cached decoding ({cache} cache{drafts})", forwards, run)


def tasks_mode(settings, job):
    """A reasoning task's accuracy on its held-out items (flt/tasks.py), beyond the paper: the task is
    rebuilt from the settings the run trained with; run() scores task_items test items at every K
    (tasks.accuracy: task_acc, task_acc_by_difficulty) and, under exit rules, at the largest K
    (tasks.exit_accuracy: task_exit), and prints a line each."""
    task = tasks.task_of(job.trained)
    items = task.test_items(settings.task_items)
    batches = task.batches_of(items, settings.batch_size, job.rank, job.world)
    # a small test bucket repeats its items: the plan says how many differ
    distinct = len({tuple(tokens) for tokens, _, _ in items})
    # the largest budget (job.loops is sorted)
    K_max = job.loops[-1]
    n_exit = sum(map(len, job.exits.values())) * len(batches)

    def run():
        progress = job.progress(f"{task.name} accuracy", len(batches) + n_exit)
        results, answers = tasks.accuracy(job.model, batches, task.levels, job.loops, progress)
        for K, r in results.items():
            print0(f"{task.name} K={K}: accuracy {r['task_acc']:.4f}; by difficulty "
                   + " ".join(f"{d}:{a:.2f}" for d, a in r["task_acc_by_difficulty"].items()))
        # depth per token (eval_settings.exit_plan): each rule's accuracy and loops per answer
        task_exit = {}
        for rule, thresholds in job.exits.items():
            task_exit[rule] = tasks.exit_accuracy(job.model, batches, task.levels, K_max, rule,
                                                  thresholds, progress)
            for r in task_exit[rule]:
                print0(f"{task.name} exit rule {rule} {r['threshold']:g}, K <= {K_max}: accuracy "
                       f"{r['acc']:.4f} at {r['mean_loops']:.2f} loops; loops by difficulty "
                       + " ".join(f"{d}:{v:.2f}" for d, v in r["loops_by_difficulty"].items()))
        if task_exit:
            results.setdefault(K_max, {})["task_exit"] = task_exit
        return results, {"task": task.name, "difficulty": task.D, "items": settings.task_items,
                         "answers": answers}
    exits = f"; and {n_exit} forwards under exit rules {job.exits_named()}" if job.exits else ""
    line = (f"{settings.task_items:,} held-out {task.name} items ({distinct:,} distinct) of "
            f"difficulty {task.D} ({len(task.levels)} levels), {len(batches)} forwards of "
            f"{settings.batch_size} x {job.seq_len} at K={K_max}{exits}")
    return line, len(batches) + n_exit, run


# eval.py's modes, in the order they run
PLANS = {"bpb": bpb_mode, "wiki": wiki_mode, "core": core_mode, "sample": sample_mode,
         "exit": exit_mode, "tasks": tasks_mode}
# The settings that change a mode's numbers (docs/evaluation.md). Results computed with any of them
# off its default are kept in eval.json under metric[setting=value,...], beside the default ones.
# Where the inputs are (val_files, wiki_path, bundle_dir: local copies) is no such choice.
PROTOCOL = ("bpb_tokens", "protocol_ranks", "protocol_batch")
CHOICES = {"bpb": PROTOCOL, "exit": PROTOCOL, "wiki": ("protocol_batch",), "core": ("max_per_task",),
           "sample": ("temperature", "cache_slots", "draft_loops", "draft_len"),
           "tasks": ("task_items",)}


def label(settings, defaults, mode):
    """The label of a mode's results: its CHOICES set off their defaults, "key=value,..."; "" if
    none (the paper's protocol, greedy exact decoding)."""
    off = [key for key in CHOICES[mode] if getattr(settings, key) != defaults[key]]
    return ",".join(f"{key}={getattr(settings, key)}" for key in off)


def plan(mode, settings, defaults, job):
    """mode's Plan (PLANS): its inputs fetched and counted, no forward yet. Where the settings leave
    one of its CHOICES off the default, its results are stored as metric[label] and its plan line
    says so."""
    planned = Plan(*PLANS[mode](settings, job))
    tag = label(settings, defaults, mode)
    if not tag:
        return planned

    def run_labelled():
        by_K, measured = planned.run()
        return {K: {f"{key}[{tag}]": v for key, v in r.items()} for K, r in by_K.items()}, measured
    return Plan(f"{planned.line}; off the default, kept apart in eval.json as <metric>[{tag}]",
                planned.forwards, run_labelled)


# The estimate's sample: calls of each kind of forward timed, after one to warm up
TIMED_CALLS = 5


class Span(NamedTuple):
    """A mode's estimated seconds: were every forward as fast as the fastest call timed (low), as
    their mean (mid), as the slowest (high). On a shared machine the calls' spread is the noise."""
    low: float
    mid: float
    high: float


def span(forwards, seconds):
    """The Span of `forwards` forwards, each call of `seconds` (one forward's time each) a sample."""
    return Span(forwards * min(seconds), forwards * sum(seconds) / len(seconds),
                forwards * max(seconds))


def shared_cpu(device):
    """(the 1-minute load average, this process's cores) where the forwards run on a CPU that more
    runnable work than it has cores loads (this process's included), else None: there the time a
    forward takes changes several-fold from one moment to the next, and the estimate says so."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    return (load, cores) if torch.device(device).type == "cpu" and load > cores else None


@torch.no_grad()
def estimate(settings, job, planned, calls=TIMED_CALLS):
    """{mode: Span of seconds} each planned mode should take: its forwards times the time of one of
    its own kind, timed `calls` times after one to warm up, at max(loops) on a batch_size x
    sequence_len batch. The kinds: the budget sweep's (Metrics.sweep, the head at every K); the
    exit rule's forward for exit (its KL reads every loop's logits), on text, where tokens exit
    depending on it, each call at the next (rule, threshold); for samples a decoding step's (a
    generate call's tokens after its first, whose time holds the prefill). The mean, not the
    fastest: on a loaded machine the fastest call is the lucky one, and the mode runs at the
    mean."""
    K_max = job.loops[-1]
    x = torch.zeros(settings.batch_size, job.seq_len, dtype=torch.long, device=job.device)

    def sweep():
        return runtime.timed(lambda: job.metrics.sweep(job.model, x, x, job.loops), job.device)

    # the exit rule's text: the first validation batch (validation, the exit mode's plan built it)
    text = job.val.batches[0][0].to(job.device) if job.val and job.val.batches else x
    exits = itertools.cycle([(rule, t) for rule, ts in job.exits.items() for t in ts])

    def exit_rule():
        rule, threshold = next(exits)
        return runtime.timed(lambda: job.model(text, loops=K_max, exit_threshold=threshold,
                                               exit_rule=rule, return_loops=True), job.device)

    def step():
        # a prompt of up to 8 tokens, and up to 17 tokens after it: 16 steps timed
        prompt = x[:1, :min(8, job.seq_len // 2)]
        n = min(17, job.seq_len - prompt.size(1))
        tokens = job.model.generate(prompt, n, loops=K_max, cache_slots=settings.cache_slots,
                                    draft_loops=settings.draft_loops, draft_len=settings.draft_len)
        # the first token: the prefill's
        next(tokens).item()
        return runtime.timed(lambda: [t.item() for t in tokens], job.device) / max(1, n - 1)
    kinds = {"exit": exit_rule, "sample": step}
    seconds = {}
    with job.numerics:
        for mode in planned:
            kind = kinds.get(mode, sweep)
            if kind not in seconds and (mode != "sample" or job.rank == 0):
                kind()
                seconds[kind] = [kind() for _ in range(calls)]
    return {mode: span(p.forwards, seconds.get(kinds.get(mode, sweep), [0.0]))
            for mode, p in planned.items()}
