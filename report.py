"""The paper's Table 1 from eval.py's results, in one place: eval.py writes it (eval.md, eval.json's
"table", a row per evaluated K) and `plot.py table` lays it out over runs (a row per run, the paper's
row below). No torch here: plot.py runs without it.

    report.table({3: {"val_bpb": 0.898, ...}})           # eval.py's table
    report.markdown(["model", "K"], [["FLT", 9, *report.cells(report.values(r))]])
"""
import statistics

# Table 1's downstream columns -> the CORE task label (core.yaml) whose raw accuracy they show
TASKS = {"LMB": "lambada_openai", "PIQA": "piqa", "Hella": "hellaswag", "OPQA": "openbook_qa",
         "ARC-E": "arc_easy", "ARC-C": "arc_challenge"}
# Table 1's columns: (header, metric, scale, decimals); CORE and accuracies in percent, as in the paper.
COLUMNS = [("Wiki2 ppl", "wiki_ppl", 1, 2), ("val bpb", "val_bpb", 1, 3), ("CORE", "CORE", 100, 2),
           *((header, label, 100, 2) for header, label in TASKS.items()), ("Avg", "avg", 100, 2)]
# The paper's Table 1 (SPEC 9) by (depth, variant, trained K), in eval.json's units (CORE and Avg as
# fractions); the per-task columns are not in SPEC 9. None: training collapsed.
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


def cells(numbers, missing="-"):
    """Table 1's cells for the numbers of COLUMNS, scaled and rounded; `missing` for a None."""
    return [missing if v is None else f"{v * scale:.{digits}f}" for v, (_, _, scale, digits) in zip(numbers, COLUMNS)]


def markdown(first, rows):
    """A Markdown table: headers `first` + COLUMNS' headers, then the rows (lists of cells)."""
    lines = [[*first, *(header for header, *_ in COLUMNS)], *rows]
    return "".join("| " + " | ".join(map(str, row)) + " |\n" + ("|---" * len(row) + "|\n" if i == 0 else "")
                   for i, row in enumerate(lines))


def table(results):
    """eval.py's table ({K: results at K}): a row per K, a blank cell where a mode did not run."""
    return markdown(["K"], [[K, *cells(values(r), "")] for K, r in results.items()])
