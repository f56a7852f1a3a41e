"""
Evaluate one looped checkpoint at several loop budgets K: a row of the paper's Table 1 per K.

    python eval.py out/flt_base --modes=bpb,wiki,core,sample --loops=1,3,6,9,12
    python eval.py out/flt_base --modes=bpb,exit --loops=1,2,4,6,8 --exit_thresholds=0.3,0.1,0.03,0.01
    torchrun --nproc_per_node=8 eval.py out/flt_base/step_004000 --max_per_task=500

The argument is a run's out_dir (its newest step_* is used) or a step directory, read with the
tokenizer.json saved beside the weights. Results go to <step dir>/eval.json (setting `out`), a
markdown table to eval.md beside it.

Budget sweep (SPEC 3): every loop's output h(t) is a valid prediction point, so ONE forward at
max(loops) yields each requested K's logits as head(h(K)); every metric goes through `loop_losses`,
which does exactly that.

Protocols
- val bpb (SPEC 8; nanochat's evaluate_bpb): bpb_tokens tokens (default 40 * 2**19, the authors'
  count) of the training data's last (validation) shard, in (batch_size, seq_len) windows from
  data.DataLoader. bpb = sum of target losses (nats) / (ln 2 * sum of the targets' UTF-8 bytes);
  0-byte targets (special tokens, e.g. BOS) are left out of both sums.
- exit (depth per token, beyond the paper): val bpb on the bpb mode's tokens with the KL exit rule
  (model.GPT.loop_states' exit_threshold) at most max(loops) loops, and the mean number of loops
  per scored token, for each of exit_thresholds; stored under K = max(loops) as "exit": [{threshold,
  val_bpb, mean_loops}]. One forward per threshold: where a token exits changes what later ones read.
- WikiText-2 perplexity (the authors' protocol): the wikitext-2-v1 TEST split (the tokenized,
  non-raw variant with <unk>). Every row, empty ones included, becomes BOS + its tokens; all rows
  are concatenated into one stream, cut into contiguous non-overlapping windows of seq_len + 1
  tokens, the remainder dropped. A window's last seq_len tokens are targets; ppl = exp(mean NLL).
- CORE (DCLM): nanochat's core_eval, example by example. Each core.yaml task with its first
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
  Over sequence_len tokens, a sequence keeps its last sequence_len, all fed (s shifts; below 0
  is a ValueError, as nanochat's assert). Position p predicts token p + 1, so the span's losses
  are nanochat's slice losses[s-1:len-1]. MC/schema: the option of lowest mean span loss by
  Python's min (ties: the first; an empty span's NaN as min() takes it). LM: correct iff the
  argmax is right at every span position. Accuracy over the (cut) items; centered accuracy
  (acc - r) / (1 - r), r = random baseline / 100; CORE = their mean.
- Table 1 downstream columns, raw accuracy by core.yaml label: LMB = lambada_openai (0-shot),
  PIQA = piqa, Hella = hellaswag (10-shot, not hellaswag_zeroshot), OPQA = openbook_qa (0-shot),
  ARC-E = arc_easy, ARC-C = arc_challenge (10-shot); Avg = their mean. A label missing from the
  bundle leaves its column, and Avg, empty.

eval.json is rewritten (atomically) after every mode, so a mode that fails (e.g. no network for a
download) keeps the ones before it; the run then exits non-zero.
"""
import csv
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
import zipfile
from itertools import islice
from types import SimpleNamespace

import pyarrow.parquet as pq
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence
import yaml

import data
from configurator import configure, settings_of
from checkpoint import load_model
from model import precision

# ----------------------------------------------------------------------------- settings
modes = "bpb,wiki,core,sample"  # any of bpb, wiki, core, sample, exit
loops = "1,3,6,9,12"            # loop budgets K, all scored from one forward at the largest
device = ""                     # cuda | cpu | mps; empty = autodetect
batch_size = 8                  # sequences per forward
bpb_tokens = 40 * 2**19         # validation tokens for bpb: the authors' count
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
seed = 42                       # sample mode: sampling seed when temperature > 0
out = ""                        # JSON path; empty = <step dir>/eval.json (eval.md beside it)
dtype = ""                      # bf16 | fp32; empty = the dtype the checkpoint was trained with
exit_thresholds = ""            # exit mode: comma-separated KL thresholds (nats) of the exit rule

MODES = ("bpb", "wiki", "core", "sample", "exit")
TASK_TYPES = ("multiple_choice", "schema", "language_modeling")
TABLE_TASKS = {"LMB": "lambada_openai", "PIQA": "piqa", "Hella": "hellaswag", "OPQA": "openbook_qa",
               "ARC-E": "arc_easy", "ARC-C": "arc_challenge"}
SAMPLE_PROMPTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time,")


def rank_world():
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_reduce_sum(t):
    if rank_world()[1] > 1:
        dist.all_reduce(t)


# ----------------------------------------------------------------------------- the budget sweep
@torch.no_grad()
def loop_losses(model, idx, targets, loops_list):
    """{K: (per-token loss (B, T), argmax (B, T))} from ONE forward at max K; targets of -1 get loss 0.
    Run it in the model's precision context (model.precision), as main() and train.py do."""
    hs = model.loop_states(idx, max(loops_list))
    result = {}
    for K in loops_list:  # the head, one K at a time: (B, T, vocab) logits are the big tensor
        logits = model.head(hs[K - 1])
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-1, reduction="none")
        result[K] = (loss.view_as(targets), logits.argmax(dim=-1))
    return result


def loss_sums(model, batches, loops_list, weight):
    """Per-K sums of token losses over the targets with weight(y) > 0, and the sum of weight(y),
    over all batches and all ranks."""
    sums = torch.zeros(len(loops_list) + 1, dtype=torch.float64, device=next(model.parameters()).device)
    for x, y in batches:
        w = weight(y)
        losses = loop_losses(model, x, y, loops_list)
        sums += torch.stack([losses[K][0][w > 0].sum() for K in loops_list] + [w.sum()]).double()
    all_reduce_sum(sums)
    return sums[:-1].tolist(), sums[-1].item()


def byte_counts(token_bytes, y):
    """UTF-8 bytes of each target (B, T); 0 for special tokens and ignored (-1) targets."""
    return torch.where(y >= 0, token_bytes[y.clamp(min=0)], 0)


def evaluate_bpb(model, batches, token_bytes, loops_list):
    """{K: bits per byte} over a finite iterable of (x, y) batches; token_bytes (vocab,) is the
    UTF-8 byte count of each id (0 for special tokens), on the batches' device. Sums are
    all-reduced, so under torchrun each rank passes its own share of the batches."""
    nats, n_bytes = loss_sums(model, batches, loops_list, lambda y: byte_counts(token_bytes, y))
    if n_bytes == 0:
        raise ValueError("evaluate_bpb: the batches hold no target tokens with a byte count > 0")
    return {K: n / (math.log(2) * n_bytes) for K, n in zip(loops_list, nats)}


@torch.no_grad()
def evaluate_exit(model, batches, token_bytes, loops, thresholds):
    """[{threshold, val_bpb, mean_loops}]: bpb as evaluate_bpb's, and the mean loops per scored
    token, with the KL exit rule at each threshold and at most `loops` loops."""
    device = next(model.parameters()).device
    sums = torch.zeros(2 * len(thresholds) + 2, dtype=torch.float64, device=device)
    for x, y in batches:
        n_bytes = byte_counts(token_bytes, y)
        scored = n_bytes > 0
        for i, threshold in enumerate(thresholds):
            logits = model(x, loops=loops, exit_threshold=threshold)
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-1, reduction="none")
            sums[2 * i:2 * i + 2] += torch.stack([loss.view_as(y)[scored].sum(),
                                                  model.exit_loops[scored].sum()]).double()
        sums[-2:] += torch.stack([n_bytes.sum(), scored.sum()]).double()
    all_reduce_sum(sums)
    (n_bytes, n_tokens), s = sums[-2:].tolist(), sums[:-2].view(-1, 2).tolist()
    if n_bytes == 0:
        raise ValueError("evaluate_exit: the batches hold no target tokens with a byte count > 0")
    return [{"threshold": t, "val_bpb": nats / (math.log(2) * n_bytes), "mean_loops": used / n_tokens}
            for t, (nats, used) in zip(thresholds, s)]


# ----------------------------------------------------------------------------- WikiText-2
def load_rows(path):
    """WikiText rows: a parquet file's `text` column, or the lines of wiki.test.tokens with blank
    lines as "" (how the Hugging Face parquet was built from that file)."""
    if path.endswith(".parquet"):
        names = pq.read_schema(path).names
        if "text" not in names:
            raise ValueError(f"{path}: no 'text' column (columns: {names})")
        return pq.read_table(path, columns=["text"]).column("text").to_pylist()
    with open(path, encoding="utf-8") as f:
        return [line if line.strip() else "" for line in f]


def wiki_windows(tokenizer, rows, n):
    """BOS + tokens of every row, concatenated, cut into non-overlapping windows of n tokens; the
    remainder is dropped (the authors' protocol)."""
    ids = [t for row in tokenizer.encode_batch(rows) for t in [tokenizer.bos_id] + row]
    if len(ids) < n:
        raise ValueError(f"WikiText: {len(ids)} tokens, fewer than one window of sequence_len + 1 = {n}")
    return [ids[i:i + n] for i in range(0, len(ids) - n + 1, n)]


def evaluate_ppl(model, tokenizer, rows, loops_list, batch_size):
    """{K: perplexity} of WikiText rows by the window protocol of the module docstring."""
    rank, world = rank_world()
    mine = wiki_windows(tokenizer, rows, model.config.sequence_len + 1)[rank::world]
    device = next(model.parameters()).device
    batches = ((w[:, :-1], w[:, 1:]) for w in (torch.tensor(mine[i:i + batch_size], device=device)
                                               for i in range(0, len(mine), batch_size)))
    nats, n_tokens = loss_sums(model, batches, loops_list, lambda y: torch.ones_like(y))
    return {K: math.exp(s / n_tokens) for K, s in zip(loops_list, nats)}


# ----------------------------------------------------------------------------- CORE
def load_bundle(bundle_dir):
    """The tasks of core.yaml, each {label, type, fewshot, delimiter, path, baseline (percent)}.
    Every file and task type is checked here, before any model time is spent."""
    yaml_path, meta_path = (os.path.join(bundle_dir, f) for f in ("core.yaml", "eval_meta_data.csv"))
    with open(yaml_path) as f:
        entries = (yaml.safe_load(f) or {}).get("icl_tasks")
    if not entries:
        raise ValueError(f"{yaml_path}: expected a non-empty 'icl_tasks' list")
    with open(meta_path, newline="") as f:
        rows = csv.DictReader(f)
        if not {"Eval Task", "Random baseline"} <= set(rows.fieldnames or ()):
            raise ValueError(f"{meta_path}: expected columns 'Eval Task' and 'Random baseline'")
        baselines = {row["Eval Task"]: float(row["Random baseline"]) for row in rows}
    tasks = []
    for entry in entries:
        missing = {"label", "dataset_uri", "num_fewshot", "icl_task_type"} - set(entry)
        if missing:
            raise ValueError(f"{yaml_path}: task entry {entry} lacks {sorted(missing)}")
        label = entry["label"]
        if entry["icl_task_type"] not in TASK_TYPES:
            raise ValueError(f"{yaml_path}: task {label!r} has icl_task_type {entry['icl_task_type']!r}; "
                             f"expected one of {TASK_TYPES}")
        path = os.path.join(bundle_dir, "eval_data", entry["dataset_uri"])
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{yaml_path}: task {label!r}: missing data file {path}")
        if label not in baselines:
            raise ValueError(f"{meta_path}: no 'Random baseline' row for task {label!r}")
        tasks.append(dict(label=label, type=entry["icl_task_type"], fewshot=entry["num_fewshot"][0],
                          delimiter=entry.get("continuation_delimiter", " "), path=path,
                          baseline=baselines[label]))
    return tasks


def load_items(task, max_per_task):
    """The task's items, shuffled with seed 1337, then cut to max_per_task if > 0 (nanochat)."""
    with open(task["path"], encoding="utf-8") as f:
        items = [json.loads(line) for line in f if line.strip()]
    random.Random(1337).shuffle(items)
    if max_per_task > 0:
        items = items[:max_per_task]
    if task["fewshot"] >= len(items):
        raise ValueError(f"task {task['label']!r}: {task['fewshot']}-shot needs more than {len(items)} items "
                         f"(max_per_task={max_per_task})")
    return items


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
    """Item idx as [(tokens, s)], one per option: the span tokens[s:] is scored."""
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
    cropped = []
    for s, start in zip(seqs, starts):
        crop = max(0, len(s) - max_len)  # nanochat keeps the last max_len tokens
        if start < crop:
            raise ValueError(f"task {task['label']!r} item {idx}: the scored span ({len(s) - start} tokens) is "
                             f"longer than sequence_len={max_len}")
        cropped.append((s[crop:], start - crop))
    return cropped


def score_sequences(model, seqs, loops_list, batch_size):
    """{K: (mean loss of each span (N,), whether the argmax is right at every span position (N,))}
    for [(tokens, s)], batch_size sequences per forward, sorted by length to limit padding."""
    device = next(model.parameters()).device
    mean = {K: torch.zeros(len(seqs), dtype=torch.float64) for K in loops_list}
    exact = {K: torch.zeros(len(seqs), dtype=torch.bool) for K in loops_list}
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i][0]))
    for b in range(0, len(order), batch_size):
        chunk = order[b:b + batch_size]
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
        for K, (loss, pred) in loop_losses(model, x, y, loops_list).items():
            mean[K][chunk] = ((loss * span).sum(1) / span.sum(1)).double().cpu()  # an empty span: 0/0 = NaN
            exact[K][chunk] = ((pred == y) | ~span).all(1).cpu()
    return {K: (mean[K], exact[K]) for K in loops_list}


def item_correct(model, tokenizer, task, items, idxs, loops_list, batch_size):
    """{K: [whether item idx is answered right, for idx in idxs]} by nanochat's decision rules."""
    seqs = [task_sequences(tokenizer, task, items, i, model.config.sequence_len) for i in idxs]
    scores = score_sequences(model, [s for item in seqs for s in item], loops_list, batch_size)
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


def evaluate_task(model, tokenizer, task, loops_list, batch_size, max_per_task=-1):
    """{K: accuracy} on one task. Under torchrun each rank scores every world-th item."""
    items = load_items(task, max_per_task)
    rank, world = rank_world()
    correct = item_correct(model, tokenizer, task, items, range(rank, len(items), world), loops_list, batch_size)
    counts = torch.tensor([sum(correct[K]) for K in loops_list], dtype=torch.float64,
                          device=next(model.parameters()).device)
    all_reduce_sum(counts)
    return {K: c / len(items) for K, c in zip(loops_list, counts.tolist())}


def centered(accuracy, baseline_percent):
    r = baseline_percent / 100
    return (accuracy - r) / (1 - r)


def evaluate_core(model, tokenizer, tasks, loops_list, batch_size, max_per_task=-1, log=print):
    """{K: {"CORE": mean centered accuracy, "tasks": {label: {"accuracy", "centered"}}}}."""
    results = {K: {"tasks": {}} for K in loops_list}
    for task in tasks:
        t0 = time.time()
        accuracy = evaluate_task(model, tokenizer, task, loops_list, batch_size, max_per_task)
        for K, a in accuracy.items():
            results[K]["tasks"][task["label"]] = {"accuracy": a, "centered": centered(a, task["baseline"])}
        log(f"{task['label']:<34} {task['fewshot']:>2}-shot  " + "  ".join(
            f"K={K}: {a:.4f}" for K, a in accuracy.items()) + f"  ({time.time() - t0:.1f}s)")
    for r in results.values():
        r["CORE"] = statistics.mean(t["centered"] for t in r["tasks"].values())
    return results


def fetch_bundle(bundle_dir, url):
    """bundle_dir if it exists, else the zip at url (a top-level eval_bundle/) unpacked there.
    The unpacked directory is renamed into place, so a half-extracted bundle is never seen."""
    if os.path.isdir(bundle_dir):
        return bundle_dir
    zip_path = data.download(url, os.path.abspath(bundle_dir) + ".zip")  # creates bundle_dir's parent
    with tempfile.TemporaryDirectory(dir=os.path.dirname(zip_path)) as tmp:
        with zipfile.ZipFile(zip_path) as z:
            z.extractall(tmp)
        inner = os.path.join(tmp, "eval_bundle")
        if not os.path.isdir(inner):
            raise ValueError(f"{zip_path}: expected a top-level eval_bundle/ directory")
        os.replace(inner, bundle_dir)
    os.remove(zip_path)
    return bundle_dir


# ----------------------------------------------------------------------------- samples and the table
def sample(model, tokenizer, loops_list, max_new_tokens, temperature=0.0, seed=None):
    """{K: [prompt + continuation for each of SAMPLE_PROMPTS]}."""
    device = next(model.parameters()).device
    texts = {K: [] for K in loops_list}
    for K in loops_list:
        for prompt in SAMPLE_PROMPTS:
            ids = [tokenizer.bos_id] + tokenizer.encode(prompt)
            n = min(max_new_tokens, model.config.sequence_len - len(ids))
            new = [t.item() for t in model.generate(torch.tensor([ids], device=device), n,
                                                     temperature, seed=seed, loops=K)]
            texts[K].append(tokenizer.decode(ids[1:] + new))  # decoded whole: no split characters
    return texts


def table(results):
    """Markdown in the layout of the paper's Table 1; CORE and accuracies in percent."""
    cols = ["K", "Wiki2 ppl", "val bpb", "CORE", *TABLE_TASKS, "Avg"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]

    def fmt(value, digits, scale=1):
        return "" if value is None else f"{value * scale:.{digits}f}"
    for K, r in results.items():
        accs = [r.get("tasks", {}).get(label, {}).get("accuracy") for label in TABLE_TASKS.values()]
        avg = None if None in accs else statistics.mean(accs)
        cells = [str(K), fmt(r.get("wiki_ppl"), 2), fmt(r.get("val_bpb"), 3), fmt(r.get("CORE"), 2, 100),
                 *(fmt(a, 2, 100) for a in accs), fmt(avg, 2, 100)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- main
def write_results(json_path, record, md):
    """eval.json (record + the table) and eval.md beside it, each replaced atomically."""
    for path, text in ((json_path, json.dumps(record | {"table": md}, indent=1)),
                       (os.path.splitext(json_path)[0] + ".md", md)):
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)


def val_shard(settings, data_dir):
    """The validation shard the checkpoint's training run held out (train.py's layout)."""
    if settings.get("dataset", "embedded") == "embedded":
        return data.embedded_corpus(data_dir)[-1]
    name = data.SHARD_NAME.format(data.VAL_SHARD)
    return data.download(f"{data.DEFAULT_BASE_URL}/{name}", os.path.join(data_dir, name))


def main(argv):
    if not argv or argv[0].startswith("--") or argv[0].endswith(".py"):
        raise ValueError("usage: python eval.py <checkpoint dir> [config.py] [--key=value ...]")
    ckpt, argv = argv[0], argv[1:]
    # the run's settings live in a copy, so importing this module (train.py, tests) sees the defaults
    c = SimpleNamespace(**configure(settings_of(globals()), argv))
    run_modes = [m.strip() for m in c.modes.split(",") if m.strip()]
    if not run_modes or set(run_modes) - set(MODES):
        raise ValueError(f"--modes={c.modes!r}: expected a comma-separated subset of {','.join(MODES)}")
    loops_list = [v.strip() for v in c.loops.split(",") if v.strip()]
    if not loops_list or not all(v.isdigit() and int(v) >= 1 for v in loops_list):
        raise ValueError(f"--loops={c.loops!r}: expected comma-separated integers >= 1, e.g. 1,3,6,9,12")
    loops_list = sorted(set(int(v) for v in loops_list))
    try:
        thresholds = [float(v) for v in c.exit_thresholds.split(",") if v.strip()]
    except ValueError:
        thresholds = None
    if thresholds is None or ("exit" in run_modes) != bool(thresholds) or not all(t >= 0 for t in thresholds):
        raise ValueError(f"--exit_thresholds={c.exit_thresholds!r}: the exit mode needs, and only it takes, "
                         f"comma-separated KL thresholds >= 0, e.g. 0.1,0.03,0.01")
    dev = c.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if dev == "cuda":
        dev = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
        torch.cuda.set_device(dev)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("nccl" if dev.startswith("cuda") else "gloo")
    rank, world = rank_world()

    def print0(*args, **kwargs):
        if rank == 0:
            print(*args, **kwargs, flush=True)

    model, meta = load_model(ckpt, dev, log=print0)  # the newest readable checkpoint, saying so
    model.eval()
    settings = meta.get("settings", {})
    # the numerics the run trained with (bf16 embedding and autocast, or fp32): the same function
    numerics = precision(model, dev.split(":")[0], c.dtype or settings.get("dtype", "fp32"))
    tokenizer = data.load_tokenizer(os.path.join(meta["path"], "tokenizer.json"),  # saved with the weights
                                    bos=settings.get("bos_token", data.BOS))        # and its document token
    data_dir = c.data_dir or settings.get("data_dir", data.DEFAULT_DATA_DIR)
    seq_len = model.config.sequence_len
    json_path = c.out or os.path.join(meta["path"], "eval.json")
    print0(f"{meta['path']} (step {meta.get('step')}): {model.config.variant}, trained at K="
           f"{model.config.loops}; evaluating K in {loops_list} on {dev}, world {world}")

    def fetched(fetch):
        """Rank 0 downloads first; the other ranks then find the file in place."""
        path = fetch() if rank == 0 else None
        if world > 1:
            dist.barrier()
        return path or fetch()

    def run(mode):
        """{K: {key: value}} of one mode."""
        if mode in ("bpb", "exit"):  # the same validation tokens for both
            files = c.val_files.split(",") if c.val_files else [fetched(lambda: val_shard(settings, data_dir))]
            steps = max(1, c.bpb_tokens // (c.batch_size * seq_len * world))
            batches = islice(data.DataLoader(files, tokenizer, c.batch_size, seq_len, rank, world, dev), steps)
            what = f"{steps * c.batch_size * seq_len * world:,} tokens of {files[-1]}"
            if mode == "exit":
                curve = evaluate_exit(model, batches, tokenizer.token_bytes().to(dev), loops_list[-1], thresholds)
                print0(f"exit rule, K <= {loops_list[-1]} ({what}): " + "  ".join(
                    f"{r['threshold']:g}: {r['val_bpb']:.4f} bpb at {r['mean_loops']:.2f} loops" for r in curve))
                return {loops_list[-1]: {"exit": curve}}
            bpb = evaluate_bpb(model, batches, tokenizer.token_bytes().to(dev), loops_list)
            print0(f"val bpb ({what}): " + "  ".join(f"K={K}: {v:.4f}" for K, v in bpb.items()))
            return {K: {"val_bpb": v} for K, v in bpb.items()}
        if mode == "wiki":
            path = c.wiki_path or fetched(lambda: data.download(
                c.wiki_url, os.path.join(data_dir, "wikitext", "wikitext-2-v1-test.parquet")))
            ppl = evaluate_ppl(model, tokenizer, load_rows(path), loops_list, c.batch_size)
            print0("wikitext-2 test ppl: " + "  ".join(f"K={K}: {v:.2f}" for K, v in ppl.items()))
            return {K: {"wiki_ppl": v} for K, v in ppl.items()}
        if mode == "core":
            bundle = fetched(lambda: fetch_bundle(c.bundle_dir or os.path.join(data_dir, "eval_bundle"),
                                                  c.bundle_url))
            core = evaluate_core(model, tokenizer, load_bundle(bundle), loops_list, c.batch_size,
                                 c.max_per_task, log=print0)
            print0("CORE: " + "  ".join(f"K={K}: {r['CORE']:.4f}" for K, r in core.items()))
            return core
        if rank > 0:  # sample: rank 0 alone
            return {}
        texts = sample(model, tokenizer, loops_list, c.sample_tokens, c.temperature, c.seed)
        for K, t in texts.items():
            print0(f"--- K={K}\n" + "\n".join(repr(s) for s in t))
        return {K: {"samples": t} for K, t in texts.items()}

    results, done = {K: {} for K in loops_list}, []
    for mode in (m for m in MODES if m in run_modes):
        try:
            with numerics:
                for K, r in run(mode).items():
                    results[K].update(r)
        except Exception as e:
            print0(f"eval.py: mode {mode!r} failed ({e}); saved in {json_path}: {done or 'nothing'}. Inputs are "
                   "downloaded unless given: without network, point at local files with --val_files=<parquet "
                   "shards> (bpb), --wiki_path=<wikitext-2-v1 test parquet or wiki.test.tokens> (wiki), "
                   "--bundle_dir=<unpacked eval_bundle> (core).", file=sys.stderr)
            raise
        done.append(mode)
        if rank == 0:
            write_results(json_path, {"checkpoint": meta["path"], "step": meta.get("step"), "settings": vars(c),
                                      "results": {str(K): r for K, r in results.items()}}, table(results))
    print0("\n" + table(results) + f"written to {json_path}")
    if world > 1:
        dist.barrier()  # rank 0 was writing; no rank tears the group down under another
        dist.destroy_process_group()
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
