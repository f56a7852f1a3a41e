"""What eval.py reports, and the run around its measurements; no torch here (plot.py runs without it).

- Table 1, in one place: eval.py writes it (eval.md and eval.json's "table", a row per evaluated K)
  and `plot.py table` lays it out over runs (a row per run, the paper's numbers below).
- eval.json and eval.md, written after every mode: each run's results merged into what the file holds
  (write_results), read back by scripts.plot and eval.py --wandb (read_results).
- eval.py's command line (parse: a bad setting is a ValueError naming it) and its plan-then-run
  (run_modes: a plan line per mode before any forward, the time estimate, each mode run and saved;
  a mode that cannot run is reported and the others still run; failures: the closing line).

    report.table({3: {"val_bpb": 0.898, ...}})           # eval.py's table
    report.markdown(["model", "K"], [["FLT", 9, *report.cells(report.values(r))]])
    ckpt, c, modes, loops, thresholds = report.parse(argv, settings_of(globals()), __file__, MODES)
    results, measured, failed = report.run_modes(plans, estimate, numerics, save, loops, print0)
"""
import json
import os
import statistics
import sys
import time
from datetime import datetime
from types import SimpleNamespace

from configurator import configure
from flt import errors, tracking


# ----------------------------------------------------------------------------- Table 1
# Table 1's downstream columns -> the CORE task label (core.yaml) whose raw accuracy they show
TASKS = {"LMB": "lambada_openai", "PIQA": "piqa", "Hella": "hellaswag", "OPQA": "openbook_qa",
         "ARC-E": "arc_easy", "ARC-C": "arc_challenge"}
# Table 1's columns: (header, metric, scale, decimals); CORE and accuracies in percent, as in the paper.
COLUMNS = [("Wiki2 ppl", "wiki_ppl", 1, 2), ("val bpb", "val_bpb", 1, 3), ("CORE", "CORE", 100, 2),
           *((header, label, 100, 2) for header, label in TASKS.items()), ("Avg", "avg", 100, 2)]
# The paper's Table 1 by (depth, variant, trained K), in eval.json's units (CORE and Avg as
# fractions); the paper does not print the per-task columns. None: training collapsed.
PAPER = {(12, "LT", 3): dict(wiki_ppl=43.12, val_bpb=0.905, CORE=0.1613, avg=0.4052),
         (12, "LT", 6): dict(wiki_ppl=51.38, val_bpb=0.947, CORE=0.1143, avg=0.3656),
         (12, "LT", 9): None,
         (12, "LT_i", 6): dict(wiki_ppl=39.58, val_bpb=0.900, CORE=0.1530, avg=0.4020),
         (12, "FLT", 3): dict(wiki_ppl=40.47, val_bpb=0.898, CORE=0.1537, avg=0.3990),
         (12, "FLT", 6): dict(wiki_ppl=39.51, val_bpb=0.892, CORE=0.1560, avg=0.4138),
         (12, "FLT", 9): dict(wiki_ppl=38.44, val_bpb=0.892, CORE=0.1616, avg=0.4172),
         (6, "LT", 9): dict(wiki_ppl=78.79, val_bpb=1.115), (6, "FLT", 9): dict(wiki_ppl=63.29, val_bpb=1.040)}


def metric(r, name):
    """One number of eval.py's results at one K: val_bpb, wiki_ppl, CORE, a task label's raw accuracy,
    or avg, the mean accuracy of Table 1's six tasks; None where it is missing."""
    if name == "avg":
        accs = [metric(r, label) for label in TASKS.values()]
        return None if None in accs else statistics.mean(accs)
    return r.get(name, r.get("tasks", {}).get(name, {}).get("accuracy"))


def values(r):
    """The numbers of COLUMNS in one K's results r (eval.json's results[K]); None where missing."""
    return [metric(r, key) for _, key, *_ in COLUMNS]


# The cells of a run whose training collapsed, as the paper's Table 1 marks LT at K=9
COLLAPSED = ["collapsed"] + [""] * (len(COLUMNS) - 1)


def cells(numbers, missing="-"):
    """Table 1's cells for the numbers of COLUMNS, scaled and rounded; `missing` for a None."""
    return [missing if v is None else f"{v * scale:.{digits}f}" for v, (_, _, scale, digits) in zip(numbers, COLUMNS)]


def markdown(first, rows):
    """A Markdown table: headers `first` + COLUMNS' headers, then the rows (lists of cells)."""
    lines = [[*first, *(header for header, *_ in COLUMNS)], *rows]
    return "".join("| " + " | ".join(map(str, row)) + " |\n" + ("|---" * len(row) + "|\n" if i == 0 else "")
                   for i, row in enumerate(lines))


def by_label(r):
    """One K's results split by the label of the choices they were computed under (eval.py's keys
    metric[label], flt/modes.py): {"": the default ones, "cache_slots=1": {"samples": ...}, ...}."""
    groups = {}
    for key, value in r.items():
        name, _, tag = key.partition("[")
        groups.setdefault(tag.removesuffix("]"), {})[name] = value
    return dict(sorted(groups.items()))


def table(results):
    """eval.py's table ({K: results at K}): a row per K and label (the default first) that has a
    number of Table 1, a blank cell where a mode did not run."""
    rows = []
    for K, r in results.items():
        for tag, group in by_label(r).items():
            numbers = values(group)
            if any(v is not None for v in numbers):
                rows.append([f"{K} [{tag}]" if tag else K, *cells(numbers, "")])
    return markdown(["K"], rows)


def summary(results):
    """What eval.py prints of an eval.json's results: the table, then a line naming the entries it
    has no column for (samples, the exit curve, val_bpb_utf8, ...) and the Ks that hold them."""
    shown = {key for _, key, *_ in COLUMNS} | {"tasks"}
    other = {}
    for K, r in results.items():
        for key in r:
            if key.partition("[")[0] not in shown:
                other.setdefault(key, []).append(str(K))
    line = "; ".join(f"{key} at K={','.join(Ks)}" for key, Ks in other.items())
    return table(results) + (f"also held: {line}\n" if line else "")


# ----------------------------------------------------------------------------- eval.json
# eval.json accumulates: each eval.py run on a checkpoint merges its results into what the file holds,
# by (K, metric), so a rerun replaces only the entries it computed again (docs/evaluation.md). Its keys:
#   results    {K: {metric: value}}, every entry the file holds (scripts.plot and eval.py --wandb read it)
#   computed   {K: {metric: run}}, the run that computed each entry: the time it started, a key of runs
#   runs       {run: {"settings", "measured"}}, each run's settings and what its modes measured
#   table      Table 1's rows of every K in results, as eval.md beside it
#   checkpoint, step: the checkpoint scored


def now():
    """A run's key in eval.json: the local time it started, to the millisecond."""
    return datetime.now().astimezone().isoformat(timespec="milliseconds")


def read_results(path):
    """An eval.json, as write_results writes it; one written before results accumulated (a single
    run's, without computed and runs) reads as that run's, keyed by the file's time. A file that is
    not an eval.json is a ValueError naming it."""
    try:
        with open(path) as f:
            doc = json.load(f)
        if not all(K.isdigit() and isinstance(r, dict) for K, r in doc["results"].items()):
            raise ValueError("results: expected {K: {metric: value}}")
        if "runs" in doc and doc["computed"].keys() != doc["results"].keys():
            raise ValueError("computed: expected the Ks of results")
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{path}: not an eval.json of eval.py ({type(e).__name__}: {e})") from None
    if "runs" not in doc:
        run = datetime.fromtimestamp(os.path.getmtime(path)).astimezone().isoformat(timespec="milliseconds")
        doc["computed"] = {K: dict.fromkeys(r, run) for K, r in doc["results"].items()}
        doc["runs"] = {run: {"settings": doc.pop("settings", {}), "measured": doc.pop("measured", {})}}
    return doc


def same_checkpoint(doc, record):
    """Whether an eval.json (doc) holds the results of record's checkpoint: the same step, and the
    same directory where both paths exist from here (a path may be relative to another directory)."""
    paths = [doc.get("checkpoint") or "", record["checkpoint"]]
    if all(map(os.path.exists, paths)) and not os.path.samefile(*paths):
        return False
    return doc.get("step") == record["step"]


def write_results(json_path, record, results, measured, write, log=print):
    """Merge one run's results ({K: {metric: value}}) into json_path and rebuild eval.md beside it from
    everything the file then holds. record: the run's {"checkpoint", "step", "settings", "time"} (its
    key, now()); measured: {mode: what it measured}. write(path, text) writes each file: eval.py's
    runtime.atomic_write, so a reader never sees half of one. A file there that is not an eval.json,
    or holds another checkpoint's results, is renamed aside, never overwritten, and log says so."""
    doc = {"checkpoint": record["checkpoint"], "step": record["step"], "results": {}, "computed": {}, "runs": {}}
    if os.path.exists(json_path):
        try:
            old, why = read_results(json_path), None
        except ValueError as e:
            old, why = None, str(e)
        if old and not same_checkpoint(old, record):
            why = (f"{json_path} holds the results of {old.get('checkpoint')} (step {old.get('step')}), not of "
                   f"{record['checkpoint']} (step {record['step']})")
        if why:
            aside = f"{json_path}.{'other' if old else 'unreadable'}.{record['time'].replace(':', '')}"
            os.rename(json_path, aside)
            log(f"eval.py: {why}; kept it as {aside}, and {json_path} starts anew", file=sys.stderr)
        else:
            doc |= {key: old[key] for key in ("results", "computed", "runs")}
    for K, r in results.items():
        doc["results"].setdefault(str(K), {}).update(r)
        doc["computed"].setdefault(str(K), {}).update(dict.fromkeys(r, record["time"]))
    doc["runs"][record["time"]] = {"settings": record["settings"], "measured": measured}
    used = {run for by_metric in doc["computed"].values() for run in by_metric.values()}
    doc["runs"] = {run: r for run, r in doc["runs"].items() if run in used}  # none replaced whole
    for key in ("results", "computed"):
        doc[key] = dict(sorted(doc[key].items(), key=lambda item: int(item[0])))
    md = table({int(K): r for K, r in doc["results"].items()})
    write(json_path, json.dumps(doc | {"table": md}, indent=1))
    write(os.path.splitext(json_path)[0] + ".md", md)
    return doc


# ----------------------------------------------------------------------------- eval.py's run
# Where a mode's inputs are, when it could not fetch them (no network): the settings that point at local files
HINTS = {"bpb": "--val_files=<parquet shards>", "exit": "--val_files=<parquet shards>",
         "wiki": "--wiki_path=<wikitext-2-v1 test parquet or wiki.test.tokens>", "core": "--bundle_dir=<unpacked eval_bundle>"}


def parse(argv, defaults, source, modes):
    """eval.py's command line over its settings (defaults, read from the script `source`): (checkpoint,
    the settings, the modes asked for in the order of `modes`, the loop budgets sorted, the exit
    thresholds). A bad value is a ValueError naming the setting and what it allows."""
    if {"--help", "-h"} & set(argv):
        configure(defaults, argv, source=source)  # prints the settings and exits
    if not argv or argv[0].startswith("--") or argv[0].endswith(".py"):
        raise ValueError("usage: python eval.py <checkpoint dir> [config.py] [--key=value ...]; --help lists the settings")
    # the run's settings live in a copy, so importing eval.py (train.py, tests) sees the defaults
    c = SimpleNamespace(**configure(dict(defaults), argv[1:]))
    run_modes = [m.strip() for m in c.modes.split(",") if m.strip()]
    if not run_modes or set(run_modes) - set(modes):
        raise ValueError(f"--modes={c.modes!r}: expected a comma-separated subset of {','.join(modes)}")
    loops_list = loop_budgets(c.loops)
    try:
        thresholds = [float(v) for v in c.exit_thresholds.split(",") if v.strip()]
    except ValueError:
        thresholds = None
    if thresholds is None or ("exit" in run_modes) != bool(thresholds) or not all(t >= 0 for t in thresholds):
        raise ValueError(f"--exit_thresholds={c.exit_thresholds!r}: the exit mode needs, and only it takes, "
                         f"comma-separated KL thresholds >= 0, e.g. 0.1,0.03,0.01")
    if c.cache_slots is not None and "sample" not in run_modes:
        raise ValueError(f"--cache_slots={c.cache_slots!r}: only the sample mode decodes with the KV cache")
    check_cache_slots(c.cache_slots, loops_list, "--cache_slots")
    draft_loops = getattr(c, "draft_loops", None)
    if draft_loops is not None:
        if "sample" not in run_modes:
            raise ValueError(f"--draft_loops={draft_loops!r}: only the sample mode decodes")
        if min(loops_list) < 2:
            raise ValueError(f"--draft_loops={draft_loops!r}: drafting needs every K of --loops to be "
                             f"2 or more (K_d < K loops draft), and --loops holds {min(loops_list)}")
        if not isinstance(draft_loops, int) or not 1 <= draft_loops < min(loops_list):
            raise ValueError(f"--draft_loops={draft_loops!r}: expected an integer from 1 to "
                             f"{min(loops_list) - 1}, below the smallest loop budget K of "
                             f"{loops_list}")
        if c.draft_len < 1 or c.cache_slots is not None:
            raise ValueError(f"--draft_len={c.draft_len!r}, --cache_slots={c.cache_slots!r}: "
                             "drafting needs draft_len >= 1 and the exact cache")
    # the inputs a mode reads, found before any model time is spent
    given = [("--val_files", f) for f in str(getattr(c, "val_files", "") or "").split(",") if f]
    given += [("--wiki_path", c.wiki_path)] if getattr(c, "wiki_path", "") else []
    for key, path in given:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{key}={path}: no such file")
    for key in ("batch_size", "bpb_tokens", "protocol_ranks", "protocol_batch", "sample_tokens",
                "task_items"):
        errors.positive(f"--{key}", getattr(c, key, 1))
    if getattr(c, "max_per_task", -1) == 0 or getattr(c, "max_per_task", -1) < -1:
        raise ValueError(f"--max_per_task={c.max_per_task!r}: expected -1 (every item) or a positive count")
    if getattr(c, "temperature", 0) < 0:
        raise ValueError(f"--temperature={c.temperature!r}: expected 0 (greedy) or a positive number")
    if draft_loops is None and getattr(c, "draft_len", 4) != defaults.get("draft_len", 4):
        raise ValueError(f"--draft_len={c.draft_len!r} does nothing without --draft_loops: remove it, or draft")
    if getattr(c, "out", ""):
        errors.output_file("--out", c.out)
    errors.directory("--data_dir", getattr(c, "data_dir", ""))
    if getattr(c, "wandb", False):
        tracking.require("--wandb=True")  # installed? found before any model time is spent
    if not os.path.isdir(argv[0]):
        raise FileNotFoundError(f"{argv[0]}: no such checkpoint directory (a run's out_dir, a step_* directory "
                                "or an exported folder)")
    return argv[0], c, [m for m in modes if m in run_modes], loops_list, thresholds


def loop_budgets(value):
    """The loop budgets K of a --loops setting such as "1,3,6,9,12": sorted, each once. Anything but
    comma-separated integers >= 1 is a ValueError naming the setting (eval.py, lm_eval_flt.py)."""
    budgets = [v.strip() for v in str(value).split(",") if v.strip()]
    if not budgets or not all(v.isdigit() and int(v) >= 1 for v in budgets):
        raise ValueError(f"--loops={value!r}: expected comma-separated integers >= 1, e.g. 1,3,6,9,12")
    return sorted(set(map(int, budgets)))


def check_cache_slots(value, budgets, setting):
    """ValueError naming `setting` unless value is None (the exact cache) or an integer from 1 to the
    smallest loop budget: decoding at K loops keeps 1 to K loop slots per layer (model.KVCache)."""
    if value is not None and not (isinstance(value, int) and 1 <= value <= min(budgets)):
        raise ValueError(f"{setting}={value!r}: expected an integer from 1 to {min(budgets)}, the smallest "
                         f"loop budget K of {budgets} (decoding at K keeps 1 to K loop slots per layer), "
                         "or None (K slots, exact)")


def per_K(values, spec):
    """{K: value} as eval.py's result lines print it: "K=1: 1.2345  K=3: 1.1234"."""
    return "  ".join(f"K={K}: {v:{spec}}" for K, v in values.items())


def seconds(work, warmup=0):
    """Seconds one call of work() takes, after `warmup` calls (the first forwards compile and allocate)."""
    for _ in range(warmup):
        work()
    t0 = time.perf_counter()
    work()
    return time.perf_counter() - t0


def minutes(s):
    return f"{s / 60:.1f} min" if s >= 60 else f"{s:.0f} s"


def run_modes(plans, estimate, numerics, save, loops, log):
    """Plan, then run. plans: {mode: plan()}, each plan() returning (its plan line, forwards, run) after
    fetching and counting its inputs, no forward yet; a plan that raises is reported and its mode left
    out. Then the estimate line (estimate(planned) -> {mode: seconds}), then each run() in `numerics`,
    returning ({K: results at K}, what was measured), and save(results, measured) after each mode. A
    mode that fails is reported and the others still run (a bug with its traceback: errors.explained).
    Returns (results, measured, failed)."""
    planned, failed = {}, {}
    for mode, plan in plans.items():
        try:
            planned[mode] = plan()
            log(f"plan {mode:<6} {planned[mode][0]}")
        except Exception as e:
            failed[mode] = e
            log(f"plan {mode:<6} cannot run: {errors.explained(e)}", file=sys.stderr)
    if planned:
        expected = estimate(planned)
        log("estimate (from the first forwards): " + ", ".join(f"{m} ~{minutes(s)}" for m, s in expected.items()) +
            f"; in all ~{minutes(sum(expected.values()))}")
    results, measured = {K: {} for K in loops}, {}
    for mode, (_, _, run) in planned.items():
        start = time.perf_counter()
        try:
            with numerics:
                by_K, measured[mode] = run()
        except Exception as e:
            failed[mode] = e
            log(f"eval.py: mode {mode!r} failed: {errors.explained(e)}", file=sys.stderr)
            continue
        # the estimate beside what it estimated
        log(f"{mode} took {minutes(time.perf_counter() - start)} (estimated ~{minutes(expected[mode])})")
        for K, r in by_K.items():
            results[K].update(r)
        save(results, measured)
    return results, measured, failed


def failures(failed, n_modes, json_path, measured):
    """The closing line of a run whose modes did not all run: which, what was saved, how to go offline."""
    return (f"eval.py: {len(failed)} of {n_modes} modes could not run: {', '.join(failed)} (why: above). "
            f"Saved in {json_path}: {list(measured) or 'nothing'}. Inputs are downloaded unless given; without "
            "network point at local files: " + ", ".join(HINTS[m] for m in failed if m in HINTS))
