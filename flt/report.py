"""What eval.py reports, formatted; no torch here (plot.py runs without it).

- Table 1, in one place: eval.py writes it (eval.md and eval.json's "table", a row per evaluated K)
  and `plot.py table` lays it out over runs (a row per run, the paper's numbers below).
- eval.json and eval.md, written after every mode: each run's results merged into what the file holds
  (write_results; merge, which scripts.lm_eval_flt's lm_eval.json shares), read back by scripts.plot
  and eval.py --wandb (read_results). An eval.md that is not eval.py's own is never replaced
  (check_table).
- depth per token: the exit rules' curves (exit_curves) against fixed K, the fewest loops per token
  within 0.1% and 1% of the best fixed-K bpb (exit_savings, exit_table), which eval.py prints and
  `plot.py exit-table` lays out over runs.
- eval.py's lines: a number per K (per_K), a duration (minutes), a time estimate (estimated,
  estimates), the closing line of a run whose modes did not all run (failures).

    report.table({3: {"val_bpb": 0.898, ...}})           # eval.py's table
    report.markdown(["model", "K"], [["FLT", 9, *report.cells(report.values(r))]])
    report.write_results(json_path, record, results, measured, runtime.atomic_write)
"""
import json
import os
import statistics
import sys
from datetime import datetime


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


def grid(headers, rows):
    """A Markdown table: the headers, then the rows (lists of cells)."""
    return "".join("| " + " | ".join(map(str, row)) + " |\n" + ("|---" * len(row) + "|\n" if i == 0 else "")
                   for i, row in enumerate([headers, *rows]))


def markdown(first, rows):
    """A Markdown table: headers `first` + COLUMNS' headers, then the rows (lists of cells)."""
    return grid([*first, *(header for header, *_ in COLUMNS)], rows)


def by_label(r):
    """One K's results split by the label of the choices they were computed under (eval.py's keys
    metric[label], flt/modes.py): {"": the default ones, "cache_slots=1": {"samples": ...}, ...}."""
    groups = {}
    for key, value in r.items():
        name, _, tag = key.partition("[")
        groups.setdefault(tag.removesuffix("]"), {})[name] = value
    return dict(sorted(groups.items()))


def table_rows(results):
    """The rows of eval.py's table ({K: results at K}): one per K and label (the default first) that
    has a number of Table 1, a blank cell where a mode did not run."""
    rows = []
    for K, r in results.items():
        for tag, group in by_label(r).items():
            numbers = values(group)
            if any(v is not None for v in numbers):
                rows.append([f"{K} [{tag}]" if tag else K, *cells(numbers, "")])
    return rows


def table(results):
    """eval.py's table ({K: results at K}), as eval.md holds it: table_rows under Table 1's header."""
    return markdown(["K"], table_rows(results))


def summary(results, loops=None):
    """What eval.py prints of an eval.json's results: the table (none without a row), then a line
    naming the entries it has no column for (samples, the exit curve, val_bpb_utf8, ...) and the Ks
    that hold them, then for each label with exit curves the exit table against fixed K at `loops`
    (exit_table; None: every K the file holds, from this call or an earlier one)."""
    shown = {key for _, key, *_ in COLUMNS} | {"tasks"}
    other = {}
    for K, r in results.items():
        for key in r:
            if key.partition("[")[0] not in shown:
                other.setdefault(key, []).append(str(K))
    line = "; ".join(f"{key} at K={','.join(Ks)}" for key, Ks in other.items())
    rows = table_rows(results)
    tags = sorted({tag for r in results.values() for tag, group in by_label(r).items()
                   if exit_curves(group)})
    exits = "".join(exit_table(results, loops, tag) for tag in tags)
    if not rows:
        return (f"{line}\n" if line else "") + exits
    return markdown(["K"], rows) + (f"also held: {line}\n" if line else "") + exits


# ----------------------------------------------------------------------------- depth per token
# An exit rule's point is as good as fixed K when its bpb is within these shares of the best
# fixed-K bpb
TOLERANCES = (0.001, 0.01)


def exit_curves(r):
    """{rule: [{threshold, val_bpb, mean_loops}]} of one K's results (an eval.json results[K], one
    label's: by_label): kl's curve is held under "exit", the other rules' under "exit_rules"."""
    curves = {"kl": r["exit"]} if r.get("exit") else {}
    return curves | r.get("exit_rules", {})


def exit_savings(fixed, curves, tolerances=TOLERANCES):
    """{"fixed K": [...], rule: [...]}: for each tolerance, the fewest loops per token whose bpb is
    within it of the best of `fixed` ({K: val_bpb}, every token K loops): the least such K, and
    each rule's least mean loops over its curve (curves: exit_curves); None where none is."""
    best = min(fixed.values())
    limits = [best * (1 + tol) for tol in tolerances]
    rows = {"fixed K": [min((K for K, b in fixed.items() if b <= limit), default=None)
                        for limit in limits]}
    for rule, curve in curves.items():
        rows[rule] = [min((p["mean_loops"] for p in curve if p["val_bpb"] <= limit), default=None)
                      for limit in limits]
    return rows


# The exit table's columns: a rule's (or fixed K's) name, the best fixed-K bpb, and per tolerance
# the fewest loops per token within it
EXIT_HEADER = ["loops per token", "best fixed-K bpb",
               *(f"within {tol * 100:g}%" for tol in TOLERANCES)]


def exit_rows(results, loops=None, label=""):
    """The exit table's rows (EXIT_HEADER) of {K: results at K}: for each K holding exit curves
    (those kept apart under `label` where one is given), exit_savings against the bpb mode's
    fixed-K val_bpb at `loops` (None: every K that has one); where there is none, a row per rule
    that says so. [] without exit curves."""
    groups = {int(K): by_label(r).get(label, {}) for K, r in results.items()}
    fixed = {K: g["val_bpb"] for K, g in groups.items()
             if "val_bpb" in g and (loops is None or K in loops)}
    rows = []
    for K, group in groups.items():
        curves = exit_curves(group)
        if curves and not fixed:
            at = f" at K in {list(loops)}" if loops else ""
            missing = f"none{at}: run eval.py --modes=bpb"
            rows += [[f"{rule}, K <= {K}", missing, *("-" for _ in TOLERANCES)] for rule in curves]
        if not curves or not fixed:
            continue
        K_best = min(fixed, key=fixed.get)
        best = f"{fixed[K_best]:.4f} (K={K_best})"
        for rule, fewest in exit_savings(fixed, curves).items():
            name = rule if rule == "fixed K" else f"{rule}, K <= {K}"
            # fixed K's are loop counts, the rules' mean loops
            cells = ["-" if v is None else f"{v:.2f}" if isinstance(v, float) else v
                     for v in fewest]
            rows.append([name, best, *cells])
    return rows


def exit_table(results, loops=None, label=""):
    """Markdown: exit_rows under EXIT_HEADER, the label named in its first column."""
    first = f"{EXIT_HEADER[0]} [{label}]" if label else EXIT_HEADER[0]
    return grid([first, *EXIT_HEADER[1:]], exit_rows(results, loops, label))


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


def check_table(json_path):
    """The Markdown table beside json_path (eval.json -> eval.md), which write_results rewrites
    from what json_path holds. Rule: it is eval.py's own, and may be rewritten, when it holds
    exactly the "table" of the eval.json of eval.py beside it, as eval.py writes the two together
    (or its "previous_table": a run stopped between the two writes), or, beside an eval.json that
    cannot be read (set aside with it, write_results), when it is a table of eval.py's and nothing
    else. Anything else there (a user's notes, a table edited by hand, a file with no eval.json
    beside it) is a FileExistsError naming it, found before any work. Returns its path."""
    md_path = os.path.splitext(json_path)[0] + ".md"
    if not os.path.exists(md_path):
        return md_path
    with open(md_path, errors="replace") as f:
        md = f.read()
    try:
        doc = read_results(json_path)
        ours = md in (doc.get("table"), doc.get("previous_table"))
    except ValueError:
        ours = md.startswith(table({})) and all(line.startswith("|") for line in md.splitlines())
    except OSError:  # no eval.json there
        ours = False
    if not ours:
        raise FileExistsError(f"{md_path}: not the table eval.py wrote beside {json_path}, and eval.py "
                              "would replace it: move the file, or give --out another name")
    return md_path


# The curves merged point by point, by (rule, threshold), not replaced whole: a later run's
# thresholds join the earlier ones. exit: the kl rule's [{threshold, ...}]; exit_rules and
# task_exit: {rule: the rule's points}
CURVES = ("exit", "exit_rules", "task_exit")


def merge_points(old, new):
    """new's points merged into old's, by threshold (lists of {threshold, ...}) or by rule and then
    threshold ({rule: points}): a point at a threshold new has replaces old's in place, new's other
    points follow, and old's other points stay."""
    if isinstance(new, dict):
        return old | {rule: merge_points(old.get(rule, []), points) for rule, points in new.items()}
    fresh = {p["threshold"]: p for p in new}
    kept = [fresh.pop(p["threshold"], p) for p in old]
    return kept + list(fresh.values())


def merge(old, record, results, measured):
    """One run's results ({K: {key: value}}) merged into old (read_results' doc; None: a new file) by
    (K, key): a rerun replaces only the entries it computed again; a curve of CURVES, only its
    points it computed again (merge_points). record: the run's {"checkpoint",
    "step", "settings", "time"} (its key, now()); measured: what it measured. A run none of whose
    entries is left is dropped; a key a user added to old's top level (notes) stays. Returns the new
    doc (without its table)."""
    doc = {"checkpoint": record["checkpoint"], "step": record["step"], "results": {}, "computed": {}, "runs": {}}
    if old:
        doc |= {key: old[key] for key in ("results", "computed", "runs")}
        doc |= {key: value for key, value in old.items() if key not in doc}
    for K, r in results.items():
        held = doc["results"].setdefault(str(K), {})
        for key, value in r.items():
            curve = key.partition("[")[0] in CURVES and key in held
            held[key] = merge_points(held[key], value) if curve else value
        doc["computed"].setdefault(str(K), {}).update(dict.fromkeys(r, record["time"]))
    doc["runs"][record["time"]] = {"settings": record["settings"], "measured": measured}
    used = {run for by_metric in doc["computed"].values() for run in by_metric.values()}
    doc["runs"] = {run: r for run, r in doc["runs"].items() if run in used}  # none replaced whole
    for key in ("results", "computed"):
        doc[key] = dict(sorted(doc[key].items(), key=lambda item: int(item[0])))
    return doc


def write_results(json_path, record, results, measured, write, log=print):
    """Merge one run's results ({K: {metric: value}}) into json_path (merge) and rebuild eval.md beside it
    from everything the file then holds. record: the run's {"checkpoint", "step", "settings", "time"};
    measured: {mode: what it measured}. write(path, text) writes each file: eval.py's
    runtime.atomic_write, so a reader never sees half of one. A file there that is not an eval.json,
    or holds another checkpoint's results, is renamed aside (an unreadable one with its eval.md), never
    overwritten, and log says so; an eval.md that is not eval.py's is a FileExistsError before
    anything is written (check_table)."""
    md_path = check_table(json_path)
    old = None
    if os.path.exists(json_path):
        try:
            old, why = read_results(json_path), None
        except ValueError as e:
            why = str(e)
        if old and not same_checkpoint(old, record):
            why = (f"{json_path} holds the results of {old.get('checkpoint')} (step {old.get('step')}), not of "
                   f"{record['checkpoint']} (step {record['step']})")
        if why:
            aside = f"{json_path}.{'other' if old else 'unreadable'}.{record['time'].replace(':', '')}"
            os.rename(json_path, aside)
            kept = f"kept it as {aside}"
            # the table beside an unreadable file may be the only readable copy of its numbers
            if not old and os.path.exists(md_path):
                os.rename(md_path, md_path + aside[len(json_path):])
                kept += f" (its table as {md_path + aside[len(json_path):]})"
            log(f"eval.py: {why}; {kept}, and {json_path} starts anew", file=sys.stderr)
            old = None
    doc = merge(old, record, results, measured)
    md = table({int(K): r for K, r in doc["results"].items()})
    # eval.md holds the table before this run's until it is rewritten: still eval.py's own should the
    # run stop between the two writes (check_table)
    doc |= {"previous_table": old.get("table") if old else None}
    write(json_path, json.dumps(doc | {"table": md}, indent=1))
    write(md_path, md)
    return doc


# ----------------------------------------------------------------------------- eval.py's lines
def per_K(values, spec):
    """{K: value} as eval.py's result lines print it: "K=1: 1.2345  K=3: 1.1234"."""
    return "  ".join(f"K={K}: {v:{spec}}" for K, v in values.items())


def minutes(s):
    return f"{s / 60:.1f} min" if s >= 60 else f"{s:.0f} s"


def estimated(low, mid, high):
    """A time estimate (seconds, flt/modes.py: Span) as eval.py prints it: "~2.0 min (1.1 min to
    10.8 min)", the mean's and, where they differ, the fastest call's to the slowest's."""
    spread = f" ({minutes(low)} to {minutes(high)})" if minutes(low) != minutes(high) else ""
    return f"~{minutes(mid)}{spread}"


def estimates(spans, shared=None):
    """eval.py's estimate line: each mode's time ({mode: (low, mid, high)}, estimated), then all;
    shared: (load, cores) of a CPU loaded past its cores (flt/modes.py: shared_cpu), said."""
    total = [sum(values) for values in zip(*spans.values())]
    line = ("estimate (from timed forwards: at their mean, and at the fastest to the slowest): "
            + ", ".join(f"{m} {estimated(*s)}" for m, s in spans.items())
            + f"; in all {estimated(*total)}")
    if shared:
        line += (f"; this CPU is shared (load {shared[0]:.1f} on {shared[1]} cores), so the time "
                 "may be several times more or less")
    return line


def failures(failed, n_modes, json_path, measured, offline):
    """The closing line of a run whose modes did not all run: which, what was saved and, for the
    modes that fetch their inputs (offline: {mode: the setting that points at a local copy}), how
    to run without network."""
    hints = [offline[m] for m in failed if m in offline]
    return (f"eval.py: {len(failed)} of {n_modes} modes could not run: {', '.join(failed)} (why: "
            f"above). Saved in {json_path}: {list(measured) or 'nothing'}."
            + (" Inputs are downloaded unless given; without network point at local files: "
               + ", ".join(hints) if hints else ""))
