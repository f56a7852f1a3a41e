"""
Evaluate one looped checkpoint at several loop budgets K: a row of the paper's Table 1 per K.

    python eval.py out/base_flt_k9 --modes=bpb,wiki,core,sample --loops=1,3,6,9,12
    python eval.py out/base_flt_k9 --modes=bpb,exit --loops=1,2,4,6,8 --exit_thresholds=0.3,0.1,0.03,0.01
    torchrun --nproc_per_node=8 eval.py out/base_flt_k9/step_004000 --max_per_task=500

The argument is a run's out_dir (its newest step_*), a step directory or an exported Hugging Face folder.
Results merge into <step dir>/eval.json (setting `out`) by (K, metric), a rerun replacing what it
computes again; eval.md beside it tables them all. Modes are planned, then run with progress lines;
one that cannot run (offline) leaves the others running and the exit status 1 (docs/evaluation.md).

Budget sweep (the paper's Fig. 6): every loop's output h(t) is a valid prediction point, so ONE forward at
max(loops) yields each requested K's logits as head(h(K)); every metric goes through `loop_losses`.

Protocols: each follows the authors' scripts (FuRuF-11/FullyLoopedTransformer), so a number here
is the one their code gives for the same weights. What is scored never depends on this machine:
batch_size and the number of processes change the speed, not the tokens.
- val bpb (scripts/base_budget.py + nanochat/loss_eval.py, as eval.sh ran them: 4 GPUs, device
  batch 4): the validation shard streamed as their loader streams it (data.DataLoader) by
  protocol_ranks simulated ranks, each cut into chunks of protocol_batch * seq_len + 1 tokens;
  each rank scores bpb_tokens // (ranks * batch * seq_len) chunks. Never more than one pass: a
  rank whose row groups end sooner is scored to the end of them (their loader would start over).
  bpb = sum of target losses (nats) / (ln 2 * sum of the targets' bytes), 0-byte targets out of
  both sums. Bytes are counted twice: the authors' len(decode([id]).encode()) (val_bpb, the number
  to compare with the paper) and the true UTF-8 bytes (val_bpb_utf8).
- exit (depth per token, beyond the paper): val bpb on the bpb mode's tokens with the KL exit rule
  at most max(loops) loops, and the mean loops per scored token, per threshold; stored under
  K = max(loops) as "exit". One forward per threshold: where a token exits changes later ones.
- WikiText-2 perplexity (scripts/wiki_ppl.py and their wiki loader): wikitext-2-v1 TEST, BOS before
  every row (empty ones too), one stream in chunks of protocol_batch * seq_len + 1 tokens at a stride
  of protocol_batch * seq_len, the rest dropped: every token after the first is a target once.
- CORE (DCLM; nanochat/core_eval.py): example by example. Each core.yaml task with its first
  num_fewshot and continuation_delimiter (default " "); items shuffled with random.Random(1337),
  then cut to the first max_per_task if > 0. Item idx's shots: random.Random(1234 + idx) draws
  num_fewshot of the other items of that cut list, each rendered with its gold answer + "\n\n".
  Prompts, each tokenized alone after BOS, and the scored span tokens[s:]:
    multiple_choice    shots + query + delim + choice, per choice; s = the longest common prefix
                       of ALL choices' sequences (words the choices share are not scored)
    schema             shots + context + delim + continuation, per context; s = len - the longest
                       common suffix of all sequences (it may reach back into the contexts)
    language_modeling  with = shots + context.strip() + delim + continuation; s = len(without),
                       without = (shots + context.strip() + delim).strip(), which must be a token
                       prefix of with (else ValueError; nanochat asserts). A "\n" delim is scored.
  Long prompts are fed whole, never cropped: the authors' model has no max_seq_len, so their
  core_eval does not crop, and its RoPE table covers 10 x sequence_len (longer is a ValueError
  naming the task and item). Position p predicts token p + 1: the span's losses are nanochat's
  slice losses[s-1:len-1]. MC/schema: the option of lowest mean span loss by Python's min (ties:
  the first; an empty span's NaN as min() takes it). LM: correct iff the argmax is right at every
  span position. Centered accuracy (acc - r) / (1 - r), r = random baseline / 100; CORE = mean.
- Table 1 downstream columns, raw accuracy by core.yaml label: LMB = lambada_openai (0-shot),
  PIQA = piqa, Hella = hellaswag (10-shot, not hellaswag_zeroshot), OPQA = openbook_qa (0-shot),
  ARC-E = arc_easy, ARC-C = arc_challenge (10-shot); Avg = their mean.
"""
import functools
import math
import os
import random
import statistics
import sys
import time
from itertools import islice
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

import data
from configurator import settings_of
from data import protocol_chunks, rows, wiki_windows  # the authors' loaders: which tokens are scored
from flt import corpus, errors, report, runtime, tracking
from flt.checkpoint import load_model
from flt.corpus import load_bundle, load_items, load_rows  # the evaluation inputs, read and checked
from flt.runtime import print0
from model import ROPE_SPAN

# ----------------------------------------------------------------------------- settings
modes = "bpb,wiki,core,sample"  # any of bpb, wiki, core, sample, exit
loops = "1,3,6,9,12"            # loop budgets K, all scored from one forward at the largest
device = ""                     # cuda | cuda:N | cpu | mps; empty = cuda if there is one, else cpu
batch_size = 8                  # sequences per forward here: speed only, never which tokens are scored
bpb_tokens = 40 * 2**19         # validation tokens for bpb: the authors' eval.sh count
protocol_ranks = 4              # the authors' eval.sh ran 4 GPUs at device batch 4: these two fix which
protocol_batch = 4              # tokens bpb and WikiText score (chunks of batch * seq_len + 1 per rank)
val_files = ""                  # comma-separated parquet shards; empty = the checkpoint's validation shard
data_dir = ""                   # empty = the checkpoint's data_dir; downloads land here
wiki_path = ""                  # wikitext-2-v1 test: parquet (text column) or wiki.test.tokens; empty = wiki_url
wiki_url = ("https://huggingface.co/datasets/Salesforce/wikitext/resolve/main/"
            "wikitext-2-v1/test-00000-of-00001.parquet")
bundle_dir = ""                 # DCLM eval bundle directory; empty = data_dir/eval_bundle
bundle_url = "https://karpathy-public.s3.us-west-2.amazonaws.com/eval_bundle.zip"
max_per_task = -1               # CORE items per task after the seeded shuffle; <= 0 = all (as nanochat)
sample_tokens = 48              # sample mode: tokens generated per prompt and K
temperature = 0.0               # sample mode: 0 = greedy
wandb = False                   # also log the results to the run's W&B run (train.py's wandb_project)
seed = 42                       # sample mode: sampling seed when temperature > 0
cache_slots = None              # sample mode: KV cache loop slots per layer, 1..K; None = K (exact)
out = ""                        # JSON path; empty = <step dir>/eval.json (eval.md beside it)
dtype = ""                      # bf16 | fp32; empty = the dtype the checkpoint was trained with
exit_thresholds = ""            # exit mode: comma-separated KL thresholds (nats) of the exit rule

MODES = ("bpb", "wiki", "core", "sample", "exit")
SAMPLE_PROMPTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time,")
BYTE_COUNTS = ("authors", "utf8")  # val_bpb (compared with the paper), val_bpb_utf8


# ----------------------------------------------------------------------------- the budget sweep
def token_losses(logits, targets):
    """Cross-entropy of each target (any shape; logits have a vocab dimension more); 0 for targets of -1."""
    loss = F.cross_entropy(logits.flatten(0, -2), targets.flatten(), ignore_index=-1, reduction="none")
    return loss.view_as(targets)


@torch.no_grad()
def loop_losses(model, idx, targets, loops_list, exit_threshold=None):
    """{K: (per-token loss (B, T), argmax (B, T))} from ONE forward at max K, in the model's precision
    context (runtime.precision). The LM head runs on scored targets only (targets of -1: loss 0, argmax
    -1): a CORE prompt's span is a few of its tokens. exit_threshold: the KL exit rule (model.ExitRule),
    whose h(K) at budget K is that forward's too, since the rule at loop t reads only loops <= t."""
    hs = model.loop_states(idx, max(loops_list), exit_threshold=exit_threshold).states
    scored, result = targets >= 0, {}
    for K in loops_list:  # the head, one K at a time: (scored targets, vocab) logits are the big tensor
        logits = model.head(hs[K - 1][scored])
        loss, pred = torch.zeros(targets.shape, device=targets.device), torch.full_like(targets, -1)
        loss[scored], pred[scored] = token_losses(logits, targets[scored]), logits.argmax(dim=-1)
        result[K] = (loss, pred)
    return result


def sweep(model, loops_list):
    """loss_sums' per-token values of the budget sweep: each K's token losses, from one forward."""
    return lambda x, y: [loss for loss, _ in loop_losses(model, x, y, loops_list).values()]


def loss_sums(model, batches, per_token, width, weights, progress=None):
    """For each of `weights` (functions of the targets y), over all batches and ranks: the sums of the `width`
    (B, T) values per_token(x, y) returns (e.g. sweep's) over the targets of weight > 0, then the weights' sum."""
    sums = torch.zeros(len(weights), width + 1, dtype=torch.float64, device=next(model.parameters()).device)
    for x, y in batches:
        x, y = x.to(sums.device), y.to(sums.device)
        values = per_token(x, y)
        for i, w in enumerate(weight(y) for weight in weights):
            sums[i] += torch.stack([v[w > 0].sum() for v in values] + [w.sum()]).double()
        if progress:
            progress()
    runtime.all_reduce_sum(sums)
    return sums.tolist()


def byte_counts(token_bytes, y):
    """Bytes of each target (B, T) by the table token_bytes; 0 for ignored (-1) targets."""
    return torch.where(y >= 0, token_bytes.to(y.device)[y.clamp(min=0)], 0)


def evaluate_bpb(model, batches, tables, loops_list, progress=None):
    """({count: {K: bits per byte}}, targets scored) over (x, y) batches, for each byte table of `tables`
    ({name: (vocab,) bytes of each id}); all-reduced: under torchrun each rank passes its own share."""
    weights = [lambda y, t=t: byte_counts(t, y) for t in tables.values()] + [lambda y: (y >= 0).long()]
    *per_count, (*_, n_tokens) = loss_sums(model, batches, sweep(model, loops_list), len(loops_list), weights,
                                           progress)
    if any(s[-1] == 0 for s in per_count):
        raise ValueError("evaluate_bpb: the batches hold no target tokens with a byte count > 0")
    return {name: {K: nats / (math.log(2) * s[-1]) for K, nats in zip(loops_list, s)}
            for name, s in zip(tables, per_count)}, int(n_tokens)


@torch.no_grad()
def evaluate_exit(model, batches, token_bytes, loops, thresholds, progress=None):
    """[{threshold, val_bpb, mean_loops}]: bpb as evaluate_bpb's, and the mean loops per scored
    token, with the KL exit rule at each threshold and at most `loops` loops."""
    def per_token(x, y):  # each threshold's token losses and loops run, one forward each
        values = []
        for threshold in thresholds:
            logits, looped = model(x, loops=loops, exit_threshold=threshold, return_loops=True)
            values += [token_losses(logits, y), looped.exit_loops]
            if progress:
                progress()
        return values
    weights = [lambda y: byte_counts(token_bytes, y), lambda y: (byte_counts(token_bytes, y) > 0).long()]
    (*sums, n_bytes), (*_, n_tokens) = loss_sums(model, batches, per_token, 2 * len(thresholds), weights)
    if n_bytes == 0:
        raise ValueError("evaluate_exit: the batches hold no target tokens with a byte count > 0")
    return [{"threshold": t, "val_bpb": nats / (math.log(2) * n_bytes), "mean_loops": used / n_tokens}
            for t, nats, used in zip(thresholds, sums[::2], sums[1::2])]


# ----------------------------------------------------------------------------- WikiText-2
def evaluate_ppl(model, windows, loops_list, batch_size, progress=None):
    """{K: perplexity}: exp(mean NLL) of every target of the windows (wiki_windows)."""
    rank, world = runtime.rank_world()
    mine = torch.tensor(windows[rank::world], dtype=torch.long).view(-1, len(windows[0]))
    batches = ((w[:, :-1], w[:, 1:]) for w in mine.split(batch_size))
    [sums] = loss_sums(model, batches, sweep(model, loops_list), len(loops_list), [torch.ones_like], progress)
    return {K: math.exp(s / sums[-1]) for K, s in zip(loops_list, sums)}


# ----------------------------------------------------------------------------- CORE
def fewshot_indices(idx, n_items, k):
    """k distinct item indices != idx, drawn with random.Random(1234 + idx). Same draw as
    rng.sample([i for i in range(n_items) if i != idx], k), without building that list."""
    picks = random.Random(1234 + idx).sample(range(n_items - 1), k)
    return [j + (j >= idx) for j in picks]


def render(task, item, examples):
    """nanochat's prompts: one per option for MC and schema; [without, with] the continuation for LM."""
    d, kind = task["delimiter"], task["type"]
    if kind == "multiple_choice":
        shots = "".join(f"{ex['query']}{d}{ex['choices'][ex['gold']]}\n\n" for ex in examples)
        return [f"{shots}{item['query']}{d}{choice}" for choice in item["choices"]]
    if kind == "schema":
        shots = "".join(f"{ex['context_options'][ex['gold']]}{d}{ex['continuation']}\n\n" for ex in examples)
        return [f"{shots}{context}{d}{item['continuation']}" for context in item["context_options"]]
    # language_modeling: contexts are stripped (some carry trailing whitespace), and so is `without`
    shots = "".join(f"{str(ex['context']).strip()}{d}{ex['continuation']}\n\n" for ex in examples)
    prompt = f"{shots}{str(item['context']).strip()}{d}"
    return [prompt.strip(), f"{prompt}{item['continuation']}"]


def task_sequences(tokenizer, task, items, idx, max_len):
    """Item idx as [(tokens, s)], one per option: the span tokens[s:] is scored. Longer than max_len
    tokens (the model's longest input, longest_input) is a ValueError naming the task and item."""
    examples = [items[j] for j in fewshot_indices(idx, len(items), task["fewshot"])]
    seqs = [[tokenizer.bos_id] + ids for ids in tokenizer.encode_batch(render(task, items[idx], examples))]
    # os.path.commonprefix compares any sequences element-wise, token lists included
    if task["type"] == "multiple_choice":
        starts = [len(os.path.commonprefix(seqs))] * len(seqs)
    elif task["type"] == "schema":
        suffix = len(os.path.commonprefix([s[::-1] for s in seqs]))
        starts = [len(s) - suffix for s in seqs]
    else:
        without, seqs = seqs[0], seqs[1:]
        if len(without) >= len(seqs[0]) or seqs[0][:len(without)] != without:
            raise ValueError(f"task {task['label']!r} item {idx}: the prompt without the continuation is not a "
                             "token prefix of the prompt with it (nanochat's evaluator asserts this)")
        starts = [len(without)]
    for s in seqs:  # fed whole, as the authors' core_eval does: their model has no max_seq_len
        if len(s) > max_len:
            raise ValueError(f"task {task['label']!r} item {idx}: a prompt of {len(s)} tokens is longer than the "
                             f"{max_len} positions of the model's RoPE table ({ROPE_SPAN} x sequence_len)")
    return list(zip(seqs, starts))


def longest_input(model):
    """Positions the model's RoPE table covers: the longest sequence it takes."""
    return ROPE_SPAN * model.config.sequence_len


def score_sequences(model, seqs, loops_list, batch_size, progress=None, exit_threshold=None):
    """{K: (mean loss of each span (N,), whether the argmax is right at every span position (N,))} for
    [(tokens, s)], sorted by length, batch_size sequences per forward but never more than batch_size *
    sequence_len tokens. exit_threshold: scored with the KL exit rule (loop_losses)."""
    device = next(model.parameters()).device
    mean = {K: torch.zeros(len(seqs), dtype=torch.float64) for K in loops_list}
    exact = {K: torch.zeros(len(seqs), dtype=torch.bool) for K in loops_list}
    chunks, budget = [[]], batch_size * model.config.sequence_len
    for i in sorted(range(len(seqs)), key=lambda i: len(seqs[i][0])):  # each the longest of its chunk
        current = chunks[-1]
        if current and (len(current) == batch_size or (len(current) + 1) * len(seqs[i][0]) > budget):
            chunks.append([])
        chunks[-1].append(i)
    for chunk in chunks if seqs else ():
        rows = [seqs[i] for i in chunk]
        # every token is fed, as nanochat does; position p predicts y[p] = tokens[p + 1]. Right
        # padding (targets -1, ignored) never changes the causal positions before it.
        x = pad_sequence([torch.tensor(t) for t, _ in rows], batch_first=True).to(device)
        y = pad_sequence([torch.tensor(t[1:] + [-1]) for t, _ in rows], batch_first=True, padding_value=-1).to(device)
        start = torch.tensor([s for _, s in rows], device=device)[:, None]
        end = torch.tensor([len(t) for t, _ in rows], device=device)[:, None]
        pos = torch.arange(x.shape[1], device=device)
        # nanochat's slice losses[s-1:e-1]; at s = 0 it starts at -1, the last column, and is empty
        span = (pos >= start - 1) & (pos < end - 1) & (start > 0)
        y = torch.where(span, y, -1)  # the LM head runs on the span only
        for K, (loss, pred) in loop_losses(model, x, y, loops_list, exit_threshold).items():
            mean[K][chunk] = ((loss * span).sum(1) / span.sum(1)).double().cpu()  # an empty span: 0/0 = NaN
            exact[K][chunk] = ((pred == y) | ~span).all(1).cpu()
        if progress:
            progress(len(chunk))
    return {K: (mean[K], exact[K]) for K in loops_list}


def item_correct(model, tokenizer, task, items, idxs, loops_list, batch_size, log=None):
    """{K: [item idx answered right, for idx in idxs]} by nanochat's decision rules; progress via log."""
    seqs = [task_sequences(tokenizer, task, items, i, longest_input(model)) for i in idxs]
    flat = [s for item in seqs for s in item]
    progress = log and corpus.Progress(f"CORE {task['label']}", len(flat), "sequences", log=log)
    scores = score_sequences(model, flat, loops_list, batch_size, progress)
    correct = {}
    for K, (mean, exact) in scores.items():
        if task["type"] == "language_modeling":  # one sequence per item
            correct[K] = exact.tolist()
            continue
        it = iter(mean.tolist())
        options = [list(islice(it, len(item))) for item in seqs]
        # Python's min and index, as nanochat: the first of tied options, NaN compared as min() does
        correct[K] = [m.index(min(m)) == items[i]["gold"] for i, m in zip(idxs, options)]
    return correct


def evaluate_task(model, tokenizer, task, loops_list, batch_size, max_per_task=-1, log=None):
    """{K: accuracy} on one task. Under torchrun each rank scores every world-th item."""
    items = load_items(task, max_per_task)
    rank, world = runtime.rank_world()
    correct = item_correct(model, tokenizer, task, items, range(rank, len(items), world), loops_list, batch_size,
                           log)
    counts = torch.tensor([sum(correct[K]) for K in loops_list], dtype=torch.float64,
                          device=next(model.parameters()).device)
    runtime.all_reduce_sum(counts)
    return {K: c / len(items) for K, c in zip(loops_list, counts.tolist())}


def centered(accuracy, baseline_percent):
    """(a - r) / (1 - r): 0 at the task's random baseline r, 1 when every item is right."""
    r = baseline_percent / 100
    return (accuracy - r) / (1 - r)


def evaluate_core(model, tokenizer, tasks, loops_list, batch_size, max_per_task=-1, log=print, progress=False):
    """{K: {"CORE": mean centered accuracy, "tasks": {label: {"accuracy", "centered"}}}}; a line per
    task through log, and progress lines within each task if progress."""
    results = {K: {"tasks": {}} for K in loops_list}
    for task in tasks:
        t0 = time.time()
        accuracy = evaluate_task(model, tokenizer, task, loops_list, batch_size, max_per_task, progress and log)
        for K, a in accuracy.items():
            results[K]["tasks"][task["label"]] = {"accuracy": a, "centered": centered(a, task["baseline"])}
        log(f"{task['label']:<34} {task['fewshot']:>2}-shot  {report.per_K(accuracy, '.4f')}  ({time.time() - t0:.1f}s)")
    for r in results.values():
        r["CORE"] = statistics.mean(t["centered"] for t in r["tasks"].values())
    return results


# ----------------------------------------------------------------------------- the modes
# Each mode plans (its inputs fetched and counted, no forward yet) and returns (its plan line, the
# forwards this process will run, run); run() returns ({K: {key: value}}, what was measured).
def progress_of(ctx, label, total, unit="forwards"):
    return corpus.Progress(label, total, unit, log=print0) if ctx.rank == 0 else None


def validation(c, ctx):
    """The bpb and exit modes' batches, built once: this process's share of the authors' chunks."""
    if ctx.val is None:
        files = c.val_files.split(",") if c.val_files else [
            runtime.rank0_first(ctx.rt, lambda: corpus.val_shard(ctx.settings, ctx.data_dir))]
        chunks, n_chunks = protocol_chunks(files, ctx.tokenizer, ctx.seq_len, c.bpb_tokens, c.protocol_ranks,
                                           c.protocol_batch, ctx.rank, ctx.world)
        counts = torch.tensor([sum(int((y >= 0).sum()) for _, y in chunks), len(chunks)], device=ctx.dev)
        runtime.all_reduce_sum(counts)
        (targets, n), requested = counts.tolist(), n_chunks * c.protocol_batch * ctx.seq_len
        layout = f"as the authors' {c.protocol_ranks} ranks x batch {c.protocol_batch} cut it"
        what = (f"{targets:,} tokens of {files[-1]} ({layout})" if targets == requested else
                f"{targets:,} tokens of {files[-1]}: fewer than bpb_tokens={c.bpb_tokens:,}, so every one of "
                f"them once ({layout}; their loader would have wrapped around and scored tokens again)")
        ctx.val = SimpleNamespace(batches=rows(chunks, c.batch_size), what=what, measured=dict(
            tokens=targets, requested=requested, files=files, ranks=c.protocol_ranks, batch=c.protocol_batch),
            forwards=f"{-(-n * c.protocol_batch // c.batch_size):,} forwards of {c.batch_size} x {ctx.seq_len}")
        ctx.tables = {count: ctx.tokenizer.token_bytes(count).to(ctx.dev) for count in BYTE_COUNTS}
    return ctx.val


def bpb_mode(c, ctx):
    val = validation(c, ctx)

    def run():
        bpb, _ = evaluate_bpb(ctx.model, val.batches, ctx.tables, ctx.loops,
                              progress_of(ctx, "val bpb", len(val.batches)))
        print0(f"val bpb: {report.per_K(bpb['authors'], '.4f')}  (true UTF-8 bytes: "
               + "  ".join(f"{v:.4f}" for v in bpb["utf8"].values()) + ")")
        return {K: {"val_bpb": bpb["authors"][K], "val_bpb_utf8": bpb["utf8"][K]} for K in ctx.loops}, val.measured
    return f"{val.what}; {val.forwards} at K={ctx.loops[-1]}", len(val.batches), run


def exit_mode(c, ctx):
    val, K_max = validation(c, ctx), ctx.loops[-1]
    n = len(ctx.thresholds) * len(val.batches)

    def run():
        curve = evaluate_exit(ctx.model, val.batches, ctx.tables["authors"], K_max, ctx.thresholds,
                              progress_of(ctx, "exit", n))
        print0(f"exit rule, K <= {K_max}: " + "  ".join(
            f"{r['threshold']:g}: {r['val_bpb']:.4f} bpb at {r['mean_loops']:.2f} loops" for r in curve))
        return {K_max: {"exit": curve}}, val.measured
    return (f"the bpb mode's tokens, K <= {K_max}, thresholds {ctx.thresholds}: {len(ctx.thresholds)} x "
            f"{val.forwards}", n, run)


def wiki_mode(c, ctx):
    path = c.wiki_path or runtime.rank0_first(ctx.rt, lambda: corpus.fetch_wikitext(c.wiki_url, ctx.data_dir))
    windows = wiki_windows(ctx.tokenizer, load_rows(path), ctx.seq_len, c.protocol_batch)
    n, tokens = -(-len(windows[ctx.rank::ctx.world]) // c.batch_size), len(windows) * ctx.seq_len

    def run():
        ppl = evaluate_ppl(ctx.model, windows, ctx.loops, c.batch_size, progress_of(ctx, "wikitext-2", n))
        print0(f"wikitext-2 test ppl: {report.per_K(ppl, '.2f')}")
        return {K: {"wiki_ppl": v} for K, v in ppl.items()}, {"tokens": tokens}
    return (f"{tokens:,} tokens of {path} ({len(windows):,} rows of {ctx.seq_len}); "
            f"{-(-len(windows) // c.batch_size):,} forwards of {c.batch_size} x {ctx.seq_len} at K={ctx.loops[-1]}",
            n, run)


def core_mode(c, ctx):
    bundle = runtime.rank0_first(ctx.rt, lambda: corpus.fetch_bundle(
        c.bundle_dir or os.path.join(ctx.data_dir, "eval_bundle"), c.bundle_url))
    tasks = load_bundle(bundle)
    items = [it for task in tasks for it in load_items(task, c.max_per_task)]
    n_seqs = sum(len(it["choices"] if "choices" in it else it.get("context_options", [0])) for it in items)
    n = -(-n_seqs // (c.batch_size * ctx.world))

    def run():
        core = evaluate_core(ctx.model, ctx.tokenizer, tasks, ctx.loops, c.batch_size, c.max_per_task,
                             log=print0, progress=True)
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
                                  temperature=c.temperature, seed=c.seed, cache_slots=c.cache_slots)
            texts.setdefault(K, []).append(text)
            progress()
        print0("\n".join(runtime.framed(f"sample at K={K}", x) for K in texts for x in texts[K]))
        return {K: {"samples": t} for K, t in texts.items()}, {}
    return (f"{len(SAMPLE_PROMPTS)} prompts x {c.sample_tokens} tokens at each K in {ctx.loops}, cached decoding",
            sum(K * c.sample_tokens for K, _ in prompts) / ctx.loops[-1], run)


PLANS = {"bpb": bpb_mode, "wiki": wiki_mode, "core": core_mode, "sample": sample_mode, "exit": exit_mode}


@torch.no_grad()
def estimate(c, ctx, planned):
    """Seconds each planned mode should take: its forwards times one timed forward at max(loops) on a
    batch_size x sequence_len batch (after a warm-up), or a decoding step's (4 tokens) for samples."""
    K_max, x = ctx.loops[-1], torch.zeros(c.batch_size, ctx.seq_len, dtype=torch.long, device=ctx.dev)
    with ctx.numerics:
        forward = report.seconds(lambda: loop_losses(ctx.model, x, x, [K_max]), warmup=1)
        step = report.seconds(lambda: list(ctx.model.generate(x[:1, :1], 4, loops=K_max))) / 4 if (
            "sample" in planned and ctx.rank == 0) else 0.0
    return {mode: n * (step if mode == "sample" else forward) for mode, (_, n, _) in planned.items()}


# ----------------------------------------------------------------------------- main
def main(argv):
    ckpt, c, run_modes, loops_list, thresholds = report.parse(argv, settings_of(globals()), __file__, MODES)
    rt = runtime.setup(c.device)
    runtime.dtype_bytes(c.dtype or "fp32")  # checked before the checkpoint loads; "" = the run's
    runtime.init_group(rt)
    model, meta = load_model(ckpt, rt.device, log=print0)  # the newest readable checkpoint, saying so
    settings = meta.get("settings", {})
    ctx = SimpleNamespace(model=model.eval(), settings=settings, rt=rt, rank=rt.rank, world=rt.world, dev=rt.device,
                          val=None, loops=loops_list, thresholds=thresholds, seq_len=model.config.sequence_len,
                          data_dir=c.data_dir or settings.get("data_dir", corpus.DEFAULT_DATA_DIR),
                          # the numerics the run trained with (bf16 embedding and autocast, or fp32)
                          numerics=runtime.precision(model, rt.device_type, c.dtype or settings.get("dtype", "fp32")),
                          tokenizer=data.load_tokenizer(os.path.join(meta["path"], "tokenizer.json"),  # with the
                                                        bos=settings.get("bos_token", data.BOS)))   # weights
    json_path, step = c.out or os.path.join(meta["path"], "eval.json"), meta.get("step")
    print0(f"{meta['path']} (step {step}): {model.config.variant}, trained at K="
           f"{model.config.loops}; evaluating K in {loops_list} on {rt.device}, world {rt.world}")
    record = {"checkpoint": meta["path"], "step": step, "settings": vars(c), "time": report.now()}

    def save(results, measured):  # after each mode, on rank 0: merged into eval.json, atomically
        if rt.rank == 0:
            with corpus.locked(json_path):  # another eval.py of this checkpoint merges in turn
                report.write_results(json_path, record, results, measured, runtime.atomic_write)
    plans = {mode: functools.partial(PLANS[mode], c, ctx) for mode in run_modes}
    results, measured, failed = report.run_modes(plans, functools.partial(estimate, c, ctx), ctx.numerics, save,
                                                 loops_list, print0)
    print0("\n" + report.table(results) + (f"written to {json_path}" if measured else "nothing computed"))
    if c.wandb and rt.rank == 0 and measured:  # all eval.json holds, to the run's W&B (tracking.py)
        tracking.log_results(os.path.dirname(meta["path"]), json_path, step)
    runtime.finish(rt)  # rank 0 was writing
    if failed:
        print0(report.failures(failed, len(run_modes), json_path, measured), file=sys.stderr)
        raise SystemExit(1)
    return results


if __name__ == "__main__":
    with errors.user_errors("eval.py"):  # a user's mistake: one line, exit status 1 (flt/errors.py)
        main(sys.argv[1:])
