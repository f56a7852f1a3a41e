"""
EleutherAI's lm-evaluation-harness (lm-eval 0.4.13) on a looped checkpoint, at several loop budgets K.

    pip install -r requirements/lmeval.txt
    python -m scripts.lm_eval_flt --run out/base_flt_k9 --tasks hellaswag,arc_easy --loops 1,3,6,9,12 --batch_size 32
    python -m scripts.lm_eval_flt --run out/d3_flt_k3 --tasks my_task --include_path my_tasks/ --limit 100

--run is a run's out_dir (its newest readable step_*) or a step directory, read with the
tokenizer.json saved beside the weights and run in the dtype it trained with, as eval.py does. The
harness runs once per K, largest first; the command merges every K's harness results into one JSON
file (--output_path; default <step dir>/lm_eval.json) by (K, task), as eval.py merges into eval.json,
so a run of other tasks keeps the earlier ones, and prints the table of all it holds (a row per task
and metric, a column per K). A file there that is not this script's is refused before any work.

One pass for every K (eval.py's budget sweep): each loop's output h(K) is a prediction point, so a
loglikelihood request scored at max(loops) has its score at every smaller K in the same forward
(eval.loop_losses). The adapter scores every K at the first (largest-K) run and keeps the scores per
request; the runs at smaller K find theirs there. loglikelihood_rolling is scored the same way.
Generation cannot be shared: each K decodes its own tokens, so generate_until runs once per K.

From Python (one LoopedLM across the runs, so that they share its scores):
    lm, meta = lm_eval_flt.load("out/d3_flt_k3", loops=[1, 3])
    for K in (3, 1):
        results = lm_eval.simple_evaluate(model=lm.at(K), tasks=["hellaswag"])
"""
import difflib
import hashlib
import json
import os
import sys
from array import array
from collections import defaultdict
from contextlib import nullcontext

import torch
from lm_eval import simple_evaluate
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.tasks import TaskManager
from lm_eval.utils import get_rolling_token_windows, handle_non_serializable, make_disjoint_window

from flt import corpus
import data
import eval as evaluation
from flt import errors, report
from flt import runtime
from flt.checkpoint import load_model
from flt.decoding import check_cache_slots
from flt.eval_settings import loop_budgets


class LoopedLM(TemplateLM):
    """The harness's language model over one looped GPT at K = self.K loops (at(K) sets it), with the
    KL exit rule if exit_threshold is given. Every text starts after the document token BOS, as the
    model saw each document in training. The context is the model's sequence_len: a longer input
    loses its oldest tokens (the harness's convention for its own models; eval.py's CORE instead
    feeds prompts whole, as the authors' evaluator did).

    loglikelihood and loglikelihood_rolling are scored at every K of `loops` in one forward at
    max(loops) (eval.score_sequences) and kept in self.scores, so a later run at a smaller K costs no
    forward. generate_until decodes at self.K only: a continuation at one K says nothing of another's; its
    KV cache keeps cache_slots loop slots per layer (flt/decoding.py's KVCache; None = K, the exact cache)."""

    def __init__(self, model, tokenizer, loops, numerics=nullcontext(), exit_threshold=None, batch_size=32,
                 log=print, cache_slots=None):
        super().__init__()
        if not loops or not all(isinstance(K, int) and K >= 1 for K in loops):
            raise ValueError(f"loops={loops!r}: expected a list of integers >= 1")
        if exit_threshold is not None and not exit_threshold >= 0:
            raise ValueError(f"exit_threshold={exit_threshold!r}: expected a KL threshold >= 0 (nats), or None")
        if not (isinstance(batch_size, int) and batch_size >= 1):
            raise ValueError(f"batch_size={batch_size!r}: expected a positive integer")
        self.model, self.tok, self.numerics, self.log = model.eval(), tokenizer, numerics, log
        self.loops, self.K = sorted(set(loops)), max(loops)
        # the cache serves generation at every K of loops: at most the smallest
        check_cache_slots(cache_slots, self.loops)
        self.cache_slots = cache_slots
        self.exit_threshold, self.batch_size = exit_threshold, batch_size
        self.max_length = model.config.sequence_len
        self.scores = {}  # a scored sequence's fingerprint -> {K: (log-likelihood, is_greedy)}, every K of loops

    def at(self, K):
        """This model at K loops, one of `loops` (the budgets every pass scores); returns self."""
        if K not in self.loops:
            raise ValueError(f"K={K}: not one of loops={self.loops}, the budgets each pass scores")
        self.K = K
        return self

    def get_model_info(self):
        """Recorded by simple_evaluate in its results' config."""
        return {"K": self.K, "loops": self.loops, "exit_threshold": self.exit_threshold,
                "cache_slots": self.cache_slots, "sequence_len": self.max_length}

    # ------------------------------------------------------------------ scoring
    @property
    def eot_token_id(self):
        return self.tok.bos_id  # the harness's prefix for an empty context and the first rolling window

    def tok_encode(self, string, add_special_tokens=None, **kwargs):
        """string's tokens after BOS; without it when add_special_tokens is False (the harness's
        continuation of an empty context, which it puts after prefix_token_id itself)."""
        ids = self.tok.encode(string)
        return ids if add_special_tokens is False else [self.tok.bos_id] + ids

    def _loglikelihood_tokens(self, requests, disable_tqdm=False):
        """[(log-likelihood of the continuation, whether greedy decoding gives it)] at self.K for the
        harness's tokenized requests ((context, continuation), context tokens, continuation tokens)."""
        return [scores[self.K] for scores in self._scored([(ctx + cont, len(cont)) for _, ctx, cont in requests])]

    def loglikelihood_rolling(self, requests, disable_tqdm=False):
        """The log-likelihood of each whole text at self.K: the harness's rolling windows of
        sequence_len predictions (the first after BOS), disjoint, each window's log-likelihoods summed."""
        windows = [[(ctx + pred, len(pred)) for ctx, pred in map(make_disjoint_window, get_rolling_token_windows(
            self.tok_encode(text, add_special_tokens=False), self.tok.bos_id, self.max_length, context_len=1))]
            for (text,) in (r.args for r in requests)]
        scores = iter(self._scored([w for doc in windows for w in doc]))
        return [sum(next(scores)[self.K][0] for _ in doc) for doc in windows]

    def _scored(self, sequences):
        """{K: (log-likelihood, is_greedy)} of each (tokens, n): the last n tokens given the ones before,
        from self.scores, scoring at every K of loops in one forward those not there yet. Inputs longer
        than sequence_len + 1 tokens keep their last sequence_len + 1 (the last one is never an input
        to a prediction that is scored)."""
        keys, todo = [], {}
        for tokens, n in sequences:
            tokens = tokens[-(self.max_length + 1):]
            if n >= len(tokens):
                raise ValueError(f"a continuation of {n} tokens: at most {self.max_length} (sequence_len) are "
                                 "scored, each after at least one token of context")
            # kept by a 16-byte fingerprint: a benchmark's scores stay in memory, not its tokens
            keys.append(hashlib.blake2b(array("q", [n, *tokens]).tobytes(), digest_size=16).digest())
            if keys[-1] not in self.scores:
                todo[keys[-1]] = (tokens, len(tokens) - n)
        if todo:
            known = len(keys) - len(todo)
            self.log(f"K={self.K}: scoring {len(todo):,} sequences at every K in {self.loops}, in forwards at "
                     f"K={self.loops[-1]}" + (f" ({known:,} already scored)" if known else ""))
            progress = corpus.Progress(f"scoring at K={self.loops[-1]}", len(todo), "sequences", log=self.log)
            with self.numerics:
                scored = evaluation.score_sequences(self.model, list(todo.values()), self.loops, self.batch_size,
                                                    progress, self.exit_threshold)
            for i, (key, (tokens, s)) in enumerate(todo.items()):  # mean span loss -> summed log-likelihood
                self.scores[key] = {K: (-mean[i].item() * (len(tokens) - s), bool(exact[i]))
                                    for K, (mean, exact) in scored.items()}
        else:
            self.log(f"K={self.K}: {len(keys):,} sequences, every one scored by an earlier pass")
        return [self.scores[key] for key in keys]

    # ------------------------------------------------------------------ generation
    def generate_until(self, requests, disable_tqdm=False):
        """Greedy continuations at self.K by model.generate's KV cache, each context cut on the left so
        that it and max_gen_toks fit in sequence_len, stopped at the first `until` string, a document
        token (BOS: a new document would begin) or max_gen_toks tokens, and cut before the stop string.
        Requests with the same max_gen_toks share a batch, longest context first, each left-padded to the
        longest with an attention mask (model.generate: a padded context computes what it computes alone).
        Not shared across K: each K decodes its own tokens."""
        bos_text = self.tok.decode([self.tok.bos_id])
        jobs = []
        for context, gen_kwargs in (r.args for r in requests):
            kwargs = normalize_gen_kwargs(gen_kwargs)
            until, max_new = handle_stop_sequences(kwargs.pop("until", None), bos_text), kwargs.pop("max_gen_toks")
            if kwargs.pop("do_sample") or kwargs.pop("temperature", 0.0) != 0 or kwargs:
                raise ValueError(f"generation_kwargs {gen_kwargs}: this model decodes greedily only, taking until "
                                 "and max_gen_toks (do_sample false, temperature 0)")
            if not 1 <= max_new < self.max_length:
                raise ValueError(f"max_gen_toks={max_new}: expected 1 to {self.max_length - 1}, leaving room for "
                                 f"a context in sequence_len={self.max_length} (--gen_kwargs max_gen_toks=N sets it)")
            jobs.append((self.tok_encode(context)[max_new - self.max_length:], max_new, [u for u in until if u]))
        by_budget = defaultdict(list)  # a batch's longest context and max_gen_toks fit in sequence_len
        for i in sorted(range(len(jobs)), key=lambda i: -len(jobs[i][0])):
            by_budget[jobs[i][1]].append(i)
        texts = [None] * len(jobs)
        progress = corpus.Progress(f"generate_until at K={self.K}", len(jobs), "requests", log=self.log)
        for group in by_budget.values():
            for batch in (group[i:i + self.batch_size] for i in range(0, len(group), self.batch_size)):
                for i, text in zip(batch, self._greedy([jobs[i] for i in batch])):
                    texts[i] = text
                progress(len(batch))
        return texts

    def _greedy(self, jobs):
        """Each job's (context ids, max new tokens, stop strings) continued greedily, in one batch of contexts
        left-padded (with BOS, masked) to the longest; decoding ends once every row has stopped."""
        new, stopped = [[] for _ in jobs], [False] * len(jobs)
        width, device = max(len(ids) for ids, _, _ in jobs), next(self.model.parameters()).device
        context = torch.tensor([[self.tok.bos_id] * (width - len(ids)) + ids for ids, _, _ in jobs], device=device)
        mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids, _, _ in jobs], device=device)
        with self.numerics:
            for tokens in self.model.generate(context, max(n for _, n, _ in jobs), temperature=0, loops=self.K,
                                              exit_threshold=self.exit_threshold, attention_mask=mask,
                                              cache_slots=self.cache_slots):
                for row, (token, (_, n, until)) in enumerate(zip(tokens[:, 0].tolist(), jobs)):
                    if not stopped[row]:
                        new[row].append(token)
                        stopped[row] = len(new[row]) == n or any(u in self.tok.decode(new[row]) for u in until)
                if all(stopped):
                    break
        return [postprocess_generated_text(self.tok.decode(ids), until, None)
                for ids, (_, _, until) in zip(new, jobs)]


def load(run, loops, device="", dtype="", exit_threshold=None, batch_size=32, log=print, cache_slots=None):
    """(LoopedLM, the checkpoint's meta) for the newest readable checkpoint at `run` (a run's out_dir or a
    step directory) and the tokenizer saved with it, on `device` ("" = cuda if there is one), in `dtype`
    ("" = the run's), as eval.py loads it. cache_slots: generate_until's KV cache (LoopedLM)."""
    rt = runtime.setup(device)
    if rt.world > 1:
        raise ValueError(f"WORLD_SIZE={rt.world}: lm_eval_flt runs in one process; run it without torchrun")
    model, meta = load_model(run, rt.device, log=log)
    settings = meta.get("settings", {})
    lm = LoopedLM(model, data.load_tokenizer(os.path.join(meta["path"], "tokenizer.json"),
                                             bos=settings.get("bos_token", data.BOS)),
                  loops, runtime.precision(model, rt.device_type, dtype or settings.get("dtype", "fp32")),
                  exit_threshold, batch_size, log, cache_slots)
    return lm, meta


# ----------------------------------------------------------------------------- the command
def task_names(tasks, task_manager):
    """The comma-separated --tasks as a list, each a task, group or tag the harness knows."""
    names = [t.strip() for t in tasks.split(",") if t.strip()]
    if not names:
        raise ValueError(f"--tasks={tasks!r}: expected comma-separated task names, e.g. hellaswag,arc_easy")
    for name in names:
        if name not in task_manager.all_tasks:
            close = difflib.get_close_matches(name, task_manager.all_tasks, n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise ValueError(f"--tasks: unknown task {name!r}{hint}; `lm-eval ls tasks` lists them, --include_path "
                             "adds a directory of task YAMLs")
    return names


def generation_tasks(names, task_manager):
    """The tasks of `names` that may generate text (output_type generate_until), the only ones that read
    --cache_slots and --gen_kwargs. A group, a tag or a task whose YAML does not name its output type
    counts as one: it may (generate_until is the harness's default type)."""
    entries = [task_manager.task_index.get(name) for name in names]
    return [name for name, entry in zip(names, entries)
            if (getattr(entry, "cfg", None) or {}).get("output_type", "generate_until") == "generate_until"]


def table(results):
    """A Markdown table of lm_eval.json's results ({K: {task: {"results": the harness's metrics, ...}}}):
    a row per task and metric, a column per K, a blank cell where the task did not run at that K."""
    rows = {}
    for K, by_task in results.items():
        for task, entry in by_task.items():
            for key, value in entry["results"].items():
                metric, _, kind = key.partition(",")
                if kind and "_stderr" not in metric and isinstance(value, (int, float)):
                    name = metric if kind == "none" else f"{metric} ({kind})"
                    rows.setdefault((task, name), {})[K] = f"{value:.4f}"
    head = ["task", "metric", *(f"K={K}" for K in results)]
    lines = [head, ["---"] * len(head)] + [[task, name, *(v.get(K, "") for K in results)]
                                          for (task, name), v in rows.items()]
    return "".join("| " + " | ".join(line) + " |\n" for line in lines)


# ----------------------------------------------------------------------------- lm_eval.json
# lm_eval.json accumulates as eval.json does (flt/report.py: merge), by (K, task): results[K][task]
# holds the task's entry of each section of the harness's results (results, configs, n-samples, ...);
# runs[time] a run's settings and, per K, the seconds it took and the harness's other sections.
def by_task(r):
    """simple_evaluate's results r as ({task: {section: r[section][task]}}, the other sections): a
    section is by task when it has an entry for a task of r["results"]."""
    tasks = r["results"].keys()
    keyed = [section for section, v in r.items() if isinstance(v, dict) and v.keys() & tasks]
    entries = {task: {section: r[section][task] for section in keyed if task in r[section]} for task in tasks}
    return entries, {section: v for section, v in r.items() if section not in keyed}


def read_own(path, record):
    """What the lm_eval.json at path holds (report.read_results), None if there is none yet. A file
    that is not this script's (another tool's, unreadable, an older lm_eval_flt's single run), or
    holds another checkpoint's results, is a FileExistsError naming it: never replaced."""
    if not os.path.exists(path):
        return None
    try:
        doc = report.read_results(path)
        ours = all(isinstance(e, dict) and "results" in e for r in doc["results"].values() for e in r.values())
    except ValueError:
        ours = False
    if not ours:
        raise FileExistsError(f"{path}: not an lm_eval.json of scripts.lm_eval_flt, and it would be replaced: "
                              "move the file, or give --output_path another file")
    if not report.same_checkpoint(doc, record):
        raise FileExistsError(f"{path}: holds the results of {doc.get('checkpoint')} (step {doc.get('step')}), "
                              f"not of {record['checkpoint']}: give --output_path another file")
    return doc


def parse(argv):
    p = errors.ArgumentParser(prog="python -m scripts.lm_eval_flt", description=__doc__.split("\n\n")[0].strip())
    p.add_argument("--run", required=True, help="a run's out_dir (its newest step_*) or a step directory")
    p.add_argument("--tasks", required=True, help="comma-separated harness tasks, e.g. hellaswag,arc_easy")
    p.add_argument("--loops", default="1,3,6,9,12", help="loop budgets K, all scored in one pass at the largest")
    p.add_argument("--batch_size", type=int, default=32, help="sequences per forward: speed only")
    p.add_argument("--device", default="", help="cuda | cpu | mps; empty = cuda if there is one")
    p.add_argument("--dtype", default="", help="bf16 | fp32; empty = the dtype the run trained with")
    p.add_argument("--exit_threshold", type=float, default=None, help="KL exit rule threshold (nats); none = off")
    p.add_argument("--cache_slots", type=int, default=None,
                   help="generate_until's KV cache: loop slots per layer, 1 to the smallest K; none = K (exact)")
    p.add_argument("--limit", type=float, default=None, help="items per task (< 1: a fraction); for quick checks")
    p.add_argument("--num_fewshot", type=int, default=None, help="few-shot examples; default: each task's own")
    p.add_argument("--include_path", default=None, help="a directory of task YAMLs beside the harness's own")
    p.add_argument("--gen_kwargs", default=None, help="generation settings over the tasks', e.g. max_gen_toks=64")
    p.add_argument("--output_path", default="", help="the JSON file; empty = <step dir>/lm_eval.json")
    args = p.parse_args(argv)
    args.loops = loop_budgets(args.loops)
    check_cache_slots(args.cache_slots, args.loops, prefix="--")
    errors.positive("--batch_size", args.batch_size)
    if args.limit is not None and args.limit <= 0:
        raise ValueError(f"--limit={args.limit}: expected items per task (>= 1) or a fraction of them (< 1), > 0")
    if args.num_fewshot is not None and args.num_fewshot < 0:
        raise ValueError(f"--num_fewshot={args.num_fewshot}: expected an integer >= 0")
    if args.exit_threshold is not None and args.exit_threshold < 0:
        raise ValueError(f"--exit_threshold={args.exit_threshold}: expected a KL threshold >= 0 (nats)")
    if args.output_path:
        errors.output_file("--output_path", args.output_path)
    if args.include_path and not os.path.isdir(args.include_path):
        raise FileNotFoundError(f"--include_path={args.include_path!r}: no such directory")
    if not os.path.exists(args.run):
        raise FileNotFoundError(f"--run={args.run!r}: no such directory")
    return args


def main(argv):
    args = parse(argv)
    task_manager = TaskManager(include_path=args.include_path)
    tasks = task_names(args.tasks, task_manager)
    # generation's settings, given to tasks that only score: they would do nothing
    for key in ("cache_slots", "gen_kwargs"):
        if getattr(args, key) is not None and not generation_tasks(tasks, task_manager):
            raise ValueError(f"--{key}={getattr(args, key)!r} does nothing for --tasks={args.tasks}: only "
                             "generate_until tasks read it")
    lm, meta = load(args.run, args.loops, args.device, args.dtype, args.exit_threshold, args.batch_size,
                    cache_slots=args.cache_slots)
    path = args.output_path or os.path.join(meta["path"], "lm_eval.json")
    record = {"checkpoint": meta["path"], "step": meta.get("step"), "settings": vars(args), "time": report.now()}
    # a file there that is not this script's: refused before any work
    read_own(path, record)
    config = lm.model.config
    print(f"{meta['path']} (step {meta.get('step')}): {config.variant}, trained at K={config.loops}; tasks {tasks} "
          f"at K in {args.loops}: the harness once per K, largest first, every K's loglikelihoods in the first",
          flush=True)
    results, seconds = {}, {}
    for K in reversed(args.loops):
        with runtime.Timer() as took:
            results[K] = simple_evaluate(model=lm.at(K), tasks=tasks, task_manager=task_manager, limit=args.limit,
                                         num_fewshot=args.num_fewshot, gen_kwargs=args.gen_kwargs,
                                         batch_size=args.batch_size, log_samples=False)
        seconds[K] = took.seconds
        print(f"K={K}: done in {report.minutes(seconds[K])}", flush=True)
    # merged into what the file holds, by (K, task); another lm_eval_flt of this checkpoint merges in turn
    entries, measured = {}, {}
    for K in sorted(results):
        entries[K], rest = by_task(results[K])
        measured[K] = {"seconds": seconds[K], **rest}
    with corpus.locked(path):
        doc = report.merge(read_own(path, record), record, entries, measured)
        doc["table"] = table(doc["results"])
        runtime.atomic_write(path, json.dumps(doc, indent=1, default=handle_non_serializable))
    print("\n" + doc["table"] + f"written to {path}")
    return results


if __name__ == "__main__":
    with errors.user_errors("scripts.lm_eval_flt"):  # a bad path or setting: one line and exit status 1
        main(sys.argv[1:])
