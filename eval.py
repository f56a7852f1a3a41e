"""
Evaluate one looped checkpoint at several loop budgets K: a row of the paper's Table 1 per K.

    python eval.py out/base_flt_k9 --modes=bpb,wiki,core,sample --loops=1,3,6,9,12
    python eval.py out/base_flt_k9 --modes=bpb,exit --loops=1,2,4,8 --exit_thresholds=0.1,0.01
    torchrun --nproc_per_node=8 eval.py out/base_flt_k9/step_004000 --max_per_task=500

The argument is a run's out_dir (its newest step_*), a step directory (or its model.pt) or an
exported Hugging Face folder. Results merge into <step dir>/eval.json by (K, metric); eval.md
beside it tables them.

The budget sweep (the paper's Fig. 6): every loop's output h(t) is a valid prediction point, so
ONE forward at max(loops) yields each K's logits as head(h(K)) (loop_losses).

The metrics, each as the authors' scripts compute it (FuRuF-11/FullyLoopedTransformer):
- val bpb: the targets' losses in nats / (ln 2 * their bytes) (evaluate_bpb)
- exit, beyond the paper: bpb and loops per token under each exit rule (evaluate_exit)
- WikiText-2 test perplexity: exp(mean NLL) (evaluate_ppl)
- CORE (DCLM, nanochat's core_eval): the mean centered accuracy of the bundle's tasks, and
  Table 1's six downstream accuracies (evaluate_core)
- tasks, beyond the paper: per-answer accuracy by difficulty on a synthetic reasoning task's
  held-out items, and its loops under exit rules (flt/tasks.py: accuracy, exit_accuracy)
Which tokens and items are scored never depends on this machine: batch_size and the number of
processes change the speed only. The protocols, the modes and eval.json: docs/evaluation.md.
"""
import math
import os
import statistics
import sys
from itertools import islice

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

from configurator import settings_of
from flt import core, corpus, errors, eval_settings, report, runtime, tracking
from flt.checkpoint import load_model
from flt.decoding import LoopSpan, cached_loops
from flt.modes import OFFLINE, Job, Metrics, estimate, plan, shared_cpu
from flt.runtime import print0
from model import ROPE_SPAN

# ----------------------------------------------------------------------------- settings
modes = "bpb,wiki,core,sample"  # any of bpb, wiki, core, sample, exit, tasks
loops = "1,3,6,9,12"            # loop budgets K (bpb, wiki, core: all from one forward at the
                                # largest; exit: a forward a threshold; sample: a decode a K)
device = ""                     # cuda | cuda:N | cpu | mps; empty = cuda if there is one, else cpu
batch_size = 8                  # sequences per forward here: speed only, never which are scored
bpb_tokens = 40 * 2**19         # validation tokens for bpb: the authors' eval.sh count
# the authors' eval.sh ran 4 GPUs at device batch 4: these fix which tokens bpb and WikiText score
protocol_ranks = 4
protocol_batch = 4              # (chunks of protocol_batch * seq_len + 1 tokens per rank)
val_files = ""                  # parquet files, comma-separated; empty = the checkpoint's val shard
data_dir = ""                   # empty = the checkpoint's data_dir; downloads land here
wiki_path = ""                  # wikitext-2-v1 test: parquet (text column) or wiki.test.tokens;
                                # empty = wiki_url
wiki_url = ("https://huggingface.co/datasets/Salesforce/wikitext/resolve/main/"
            "wikitext-2-v1/test-00000-of-00001.parquet")
bundle_dir = ""                 # DCLM eval bundle directory; empty = data_dir/eval_bundle
bundle_url = core.BUNDLE_URL
max_per_task = -1               # CORE items per task after the seeded shuffle; -1 = all (nanochat)
sample_tokens = 48              # sample mode: tokens generated per prompt and K
prompt = ""                     # sample mode: the prompts, '|' between two (a prompt holds
                                # commas, never a '|'); empty = flt/modes.py: SAMPLE_PROMPTS
temperature = 0.0               # sample mode: 0 = greedy
wandb = False                   # also log the results to the run's W&B run
                                # (train.py's wandb_project)
seed = 42                       # sample mode: sampling seed when temperature > 0
cache_slots = None              # sample mode: KV cache loop slots per layer, 1..K; None = K (exact)
draft_loops = None              # sample mode: draft with K_d < K loops, verify with all K
draft_len = 4                   # sample mode: tokens drafted a round (with draft_loops)
out = ""                        # a .json (new, or eval.py's); empty = <step dir>/eval.json
dtype = ""                      # bf16 | fp32; empty = the dtype the checkpoint was trained with
exit_rules = "kl"               # exit (and tasks) mode: comma-separated rules of EXIT_RULES
exit_thresholds = ""            # exit mode: comma-separated thresholds of its rules but argmax
argmax_counts = "1,2,3"         # exit mode: the argmax rule's thresholds (loops the top-1 is kept)
task_items = 2048               # tasks mode: the held-out items scored (the test set's first N)

# a token's bytes (data.py: Tokenizer.token_bytes): "authors" (val_bpb, the paper's) counts
# len(decode([id]).encode()), 0 for added tokens; "utf8" its true bytes, 0 for special tokens
BYTE_COUNTS = ("authors", "utf8")


# ----------------------------------------------------------------------------- the budget sweep
def token_losses(logits, targets):
    """Cross-entropy of each target (any shape; logits have one more dimension, the vocabulary);
    0 for targets of -1."""
    flat = logits.flatten(0, -2)
    loss = F.cross_entropy(flat, targets.flatten(), ignore_index=-1, reduction="none")
    return loss.view_as(targets)


@torch.no_grad()
def loop_losses(model, idx, targets, loops_list, exit_threshold=None):
    """{K: (per-token loss (B, T), argmax (B, T))} from ONE forward at max K, inside the caller's
    precision context (runtime.precision). The LM head runs on scored targets only (targets of -1:
    loss 0, argmax -1): a CORE prompt's span is a few of its tokens. exit_threshold: the KL exit
    rule (flt/decoding.py: ExitRule), whose h(K) at budget K is that forward's too, since the rule
    at loop t reads only loops <= t."""
    K_max = max(loops_list)
    if exit_threshold is None:
        hs = model.loop_states(idx, K_max).states
    else:
        # the exit rule runs decoding's loop
        hs, _ = cached_loops(model, idx, LoopSpan(K_max), exit_threshold=exit_threshold)
    scored = targets >= 0
    result = {}
    # the head, one K at a time: the (scored targets, vocab) logits are the big tensor
    for K in loops_list:
        logits = model.head(hs[K - 1][scored])
        loss = torch.zeros(targets.shape, device=targets.device)
        pred = torch.full_like(targets, -1)
        loss[scored] = token_losses(logits, targets[scored])
        pred[scored] = logits.argmax(dim=-1)
        result[K] = (loss, pred)
    return result


# ----------------------------------------------------------------------------- bits per byte
def byte_counts(token_bytes, y):
    """Bytes of each target (B, T) by the table token_bytes; 0 for ignored (-1) targets."""
    return torch.where(y >= 0, token_bytes.to(y.device)[y.clamp(min=0)], 0)


def evaluate_bpb(model, batches, tables, loops_list, progress=None):
    """({count: {K: bits per byte}}, targets y >= 0) over (x, y) batches (a task's third tensor,
    the difficulty, unread), for each table of `tables` ({count: token_bytes(count)} of
    BYTE_COUNTS), as nanochat's evaluate_bpb: the targets' losses in nats / (ln 2 * their bytes),
    targets of 0 bytes out of both sums. All-reduced: under torchrun each rank passes its own
    share."""
    device = next(model.parameters()).device
    f64 = dict(dtype=torch.float64, device=device)
    # per byte table: each K's nats over the targets that have bytes, and those bytes
    nats = torch.zeros(len(tables), len(loops_list), **f64)
    n_bytes = torch.zeros(len(tables), **f64)
    # every target scored (y >= 0), for the caller's count
    n_tokens = torch.zeros((), **f64)
    for x, y, *_ in batches:
        x, y = x.to(device), y.to(device)
        # the budget sweep: each K's token losses, (B, T), from one forward at max(loops_list)
        losses = [loss for loss, _ in loop_losses(model, x, y, loops_list).values()]
        for i, token_bytes in enumerate(tables.values()):
            counts = byte_counts(token_bytes, y)
            # a target of 0 bytes (a special token) is out of both sums
            nats[i] += torch.stack([loss[counts > 0].sum() for loss in losses]).double()
            n_bytes[i] += counts.sum()
        n_tokens += (y >= 0).sum()
        if progress:
            progress()
    runtime.all_reduce_sum(nats, n_bytes, n_tokens)
    if (n_bytes == 0).any():
        raise ValueError("evaluate_bpb: the batches hold no target tokens with a byte count > 0")
    bits = nats / (math.log(2) * n_bytes[:, None])
    bpb = {name: dict(zip(loops_list, row)) for name, row in zip(tables, bits.tolist())}
    return bpb, int(n_tokens)


@torch.no_grad()
def evaluate_exit(model, batches, token_bytes, loops, thresholds, exit_rule="kl", progress=None):
    """[{threshold, val_bpb, mean_loops}]: bpb as evaluate_bpb's, and the mean loops per target
    with bytes, with exit_rule (EXIT_RULES) at each threshold and at most `loops` loops. One
    forward per threshold: where a token exits changes the tokens after it."""
    device = next(model.parameters()).device
    f64 = dict(dtype=torch.float64, device=device)
    # per threshold: the nats and the loops run over the targets that have bytes
    nats = torch.zeros(len(thresholds), **f64)
    loops_run = torch.zeros(len(thresholds), **f64)
    # those targets' bytes, and how many they are
    n_bytes = torch.zeros((), **f64)
    n_tokens = torch.zeros((), **f64)
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        counts = byte_counts(token_bytes, y)
        for i, threshold in enumerate(thresholds):
            logits, looped = model(x, loops=loops, exit_threshold=threshold, exit_rule=exit_rule,
                                   return_loops=True)
            nats[i] += token_losses(logits, y)[counts > 0].sum().double()
            loops_run[i] += looped.exit_loops[counts > 0].sum().double()
            if progress:
                progress()
        n_bytes += counts.sum()
        n_tokens += (counts > 0).sum()
    runtime.all_reduce_sum(nats, loops_run, n_bytes, n_tokens)
    if n_bytes == 0:
        raise ValueError("evaluate_exit: the batches hold no target tokens with a byte count > 0")
    bits = nats / (math.log(2) * n_bytes)
    mean_loops = loops_run / n_tokens
    return [{"threshold": t, "val_bpb": b, "mean_loops": m}
            for t, b, m in zip(thresholds, bits.tolist(), mean_loops.tolist())]


# ----------------------------------------------------------------------------- WikiText-2
def evaluate_ppl(model, windows, loops_list, batch_size, progress=None):
    """{K: perplexity}: exp(mean NLL) of every target of the windows (data.wiki_windows). Under
    torchrun each rank scores every world-th window."""
    device = next(model.parameters()).device
    rank, world = runtime.rank_world()
    mine = torch.tensor(windows[rank::world], dtype=torch.long).view(-1, len(windows[0]))
    # each K's summed NLL, and the targets
    nll = torch.zeros(len(loops_list), dtype=torch.float64, device=device)
    n_targets = torch.zeros((), dtype=torch.float64, device=device)
    for w in mine.split(batch_size):
        x, y = w[:, :-1].to(device), w[:, 1:].to(device)
        # the budget sweep, as for bits per byte
        losses = [loss for loss, _ in loop_losses(model, x, y, loops_list).values()]
        nll += torch.stack([loss.sum() for loss in losses]).double()
        n_targets += y.numel()
        if progress:
            progress()
    runtime.all_reduce_sum(nll, n_targets)
    return {K: math.exp(s) for K, s in zip(loops_list, (nll / n_targets).tolist())}


# ----------------------------------------------------------------------------- CORE
# The prompts, their tokens and the span each option scores are nanochat's (flt/core.py);
# here, how the spans are scored and an item is judged.
def longest_input(model):
    """Positions the model's RoPE table covers: the longest sequence it takes. Prompts are fed
    whole, never cropped, as the authors' core_eval feeds them (their model has no max_seq_len)."""
    return ROPE_SPAN * model.config.sequence_len


def score_sequences(model, seqs, loops_list, batch_size, progress=None, exit_threshold=None):
    """{K: (mean loss of each span (N,), whether the argmax is right at every span position (N,))}
    for [(tokens, s)], each scoring its span tokens[s:]; batch_size sequences per forward, at most
    batch_size * sequence_len tokens unless one is longer (alone). exit_threshold: the KL rule's."""
    device = next(model.parameters()).device
    mean = {K: torch.zeros(len(seqs), dtype=torch.float64) for K in loops_list}
    exact = {K: torch.zeros(len(seqs), dtype=torch.bool) for K in loops_list}
    for chunk in core.length_batches(seqs, batch_size, model.config.sequence_len):
        rows = [seqs[i] for i in chunk]
        # every token is fed, as nanochat does; position p predicts y[p] = tokens[p + 1]. Right
        # padding (targets -1, ignored) never changes the causal positions before it.
        x = pad_sequence([torch.tensor(t) for t, _ in rows], batch_first=True).to(device)
        targets = [torch.tensor(t[1:] + [-1]) for t, _ in rows]
        y = pad_sequence(targets, batch_first=True, padding_value=-1).to(device)
        start = torch.tensor([s for _, s in rows], device=device)[:, None]
        end = torch.tensor([len(t) for t, _ in rows], device=device)[:, None]
        pos = torch.arange(x.shape[1], device=device)
        # nanochat's slice losses[s-1:e-1]; at s = 0 it starts at -1, the last column, and is empty
        span = (pos >= start - 1) & (pos < end - 1) & (start > 0)
        # the LM head runs on the span only
        y = torch.where(span, y, -1)
        for K, (loss, pred) in loop_losses(model, x, y, loops_list, exit_threshold).items():
            # an empty span: 0/0 = NaN
            mean[K][chunk] = ((loss * span).sum(1) / span.sum(1)).double().cpu()
            exact[K][chunk] = ((pred == y) | ~span).all(1).cpu()
        if progress:
            progress(len(chunk))
    return {K: (mean[K], exact[K]) for K in loops_list}


def item_correct(model, tokenizer, task, items, idxs, loops_list, batch_size, log=None):
    """{K: [item idx answered right, for idx in idxs]} by nanochat's decision rules; progress
    lines through log."""
    max_len = longest_input(model)
    seqs = [core.task_sequences(tokenizer, task, items, i, max_len) for i in idxs]
    flat = [s for item in seqs for s in item]
    progress = log and corpus.Progress(f"CORE {task['label']}", len(flat), "sequences", log=log)
    scores = score_sequences(model, flat, loops_list, batch_size, progress)
    correct = {}
    for K, (mean, exact) in scores.items():
        # language modeling, one sequence per item: right iff the argmax is right at every position
        if task["type"] == "language_modeling":
            correct[K] = exact.tolist()
            continue
        # multiple choice and schema: the option of the lowest mean span loss. Python's min and
        # index, as nanochat: the first of tied options, NaN compared as min() does
        it = iter(mean.tolist())
        options = [list(islice(it, len(item))) for item in seqs]
        correct[K] = [m.index(min(m)) == items[i]["gold"] for i, m in zip(idxs, options)]
    return correct


def evaluate_task(model, tokenizer, task, loops_list, batch_size, max_per_task=-1, log=None):
    """{K: accuracy} on one task. Under torchrun each rank scores every world-th item."""
    items = corpus.load_items(task, max_per_task)
    rank, world = runtime.rank_world()
    mine = range(rank, len(items), world)
    correct = item_correct(model, tokenizer, task, items, mine, loops_list, batch_size, log)
    device = next(model.parameters()).device
    counts = [sum(correct[K]) for K in loops_list]
    counts = torch.tensor(counts, dtype=torch.float64, device=device)
    runtime.all_reduce_sum(counts)
    return {K: c / len(items) for K, c in zip(loops_list, counts.tolist())}


def centered(accuracy, baseline_percent):
    """(a - r) / (1 - r): 0 at the task's random baseline r, 1 when every item is right."""
    r = baseline_percent / 100
    return (accuracy - r) / (1 - r)


def evaluate_core(model, tokenizer, tasks, loops_list, batch_size, max_per_task=-1, log=print,
                  progress=False):
    """{K: {"CORE": mean centered accuracy, "tasks": {label: {"accuracy", "centered"}}}}; a line
    per task through log, and progress lines within each task if progress."""
    results = {K: {"tasks": {}} for K in loops_list}
    for task in tasks:
        with runtime.Timer() as took:
            accuracy = evaluate_task(model, tokenizer, task, loops_list, batch_size, max_per_task,
                                     progress and log)
        for K, a in accuracy.items():
            scores = {"accuracy": a, "centered": centered(a, task["baseline"])}
            results[K]["tasks"][task["label"]] = scores
        log(f"{task['label']:<34} {task['fewshot']:>2}-shot  {report.per_K(accuracy, '.4f')}  "
            f"({took.seconds:.1f}s)")
    for r in results.values():
        r["CORE"] = statistics.mean(t["centered"] for t in r["tasks"].values())
    return results


# ----------------------------------------------------------------------------- main
def main(argv):
    """The command line: the settings, a plan for each mode, then each mode run and merged into
    eval.json, and the table of what eval.json holds. Exit status 1 when a mode could not run; the
    others still ran. Returns this run's {K: results}."""
    # the settings: the defaults above, then a config file and --key=value, checked before any
    # work (flt/eval_settings.py). They live in `settings`: this module keeps the defaults
    defaults = settings_of(globals())
    path, settings = eval_settings.read(argv, defaults, __file__)
    run_modes = eval_settings.chosen_modes(settings.modes)
    loops_list = eval_settings.loop_budgets(settings.loops)
    exits = eval_settings.exit_plan(settings, defaults, run_modes)  # {exit rule: thresholds}
    rt = runtime.setup(settings.device)
    runtime.init_group(rt)
    # the newest readable checkpoint, saying so; can it run every mode asked for?
    model, meta = load_model(path, rt.device, log=print0)
    eval_settings.check_checkpoint(settings.modes, run_modes, meta)
    eval_settings.check_gate(settings, exits, model, meta)
    # the metrics above, each run by its mode; the estimate times the budget sweep (flt/modes.py)
    metrics = Metrics(sweep=loop_losses, bpb=evaluate_bpb, exit=evaluate_exit, wiki=evaluate_ppl,
                      core=evaluate_core, byte_counts=BYTE_COUNTS)
    # what the modes share: the model, its tokenizer and numerics, this process, the metrics
    job = Job(settings, model.eval(), meta, rt, loops_list, exits, metrics)
    json_path = settings.out or os.path.join(meta["path"], "eval.json")
    # eval.md beside it: refused here, before any work, if eval.py did not write it (report.py)
    md_path = report.check_table(json_path)
    print0(f"{meta['path']} (step {meta.get('step')}): {model.config.variant}, trained at K="
           f"{model.config.loops}; evaluating K in {loops_list} on {rt.device}, world {rt.world}")

    # the plan: each mode fetches and counts its inputs, no forward yet. A mode that cannot (no
    # network) is reported, and the others still run
    planned, failed = {}, {}
    for mode in run_modes:
        try:
            planned[mode] = plan(mode, settings, defaults, job)
        except Exception as e:
            failed[mode] = e
            print0(f"plan {mode:<6} cannot run: {errors.explained(e)}", file=sys.stderr)
            continue
        print0(f"plan {mode:<6} {planned[mode].line}")
    # the time each should take, from forwards of its kind timed: their mean, and the spread
    if planned:
        expected = estimate(settings, job, planned)
        print0(report.estimates(expected, shared_cpu(rt.device)))

    # each mode run, then merged into eval.json by (K, metric), so a later failure keeps it. A
    # mode that fails is reported (a bug with its traceback), and the others still run
    record = {"checkpoint": meta["path"], "step": meta.get("step"), "settings": vars(settings),
              "time": report.now()}
    results, measured, held = {K: {} for K in loops_list}, {}, {}
    for mode in planned:
        try:
            with runtime.Timer(rt.device) as took, job.numerics:
                by_K, measured[mode] = planned[mode].run()
        except Exception as e:
            failed[mode] = e
            print0(f"eval.py: mode {mode!r} failed: {errors.explained(e)}", file=sys.stderr)
            continue
        print0(f"{mode} took {report.minutes(took.seconds)} "
               f"(estimated {report.estimated(*expected[mode])})")
        for K, r in by_K.items():
            results[K].update(r)
        # on rank 0; another eval.py of this checkpoint merges in turn
        if rt.rank == 0:
            with corpus.locked(json_path):
                doc = report.write_results(json_path, record, results, measured,
                                           runtime.atomic_write)
            held = doc["results"]

    # the table of what the file holds now: this run's entries and those of earlier runs
    if measured:
        print0(f"\n{json_path} now holds:\n{report.summary(held)}written to {json_path} and "
               f"{md_path}")
    # all eval.json holds, to the run's W&B (flt/tracking.py)
    if settings.wandb and rt.rank == 0 and measured:
        tracking.log_results(os.path.dirname(meta["path"]), json_path, meta.get("step"))
    # rank 0 was writing
    runtime.finish(rt)
    if failed:
        closing = report.failures(failed, len(run_modes), json_path, measured, OFFLINE)
        print0(closing, file=sys.stderr)
        raise SystemExit(1)
    return results


if __name__ == "__main__":
    # a user's mistake: one line, exit status 1 (flt/errors.py)
    with errors.user_errors("eval.py"):
        main(sys.argv[1:])
