"""Tests for report.py: Table 1's cells and layout, from eval.json-style results, and that it
imports without torch (plot.py runs without it)."""
import os
import subprocess
import sys

import report

# eval.json's task labels of Table 1's six columns, in the paper's column order (eval.py's docstring)
LABELS = ["lambada_openai", "piqa", "hellaswag", "openbook_qa", "arc_easy", "arc_challenge"]


def test_table_layout_and_missing_columns():
    """A row per K; CORE and accuracies in percent; a blank where a mode did not run; Avg only
    with all six tasks."""
    results = {3: {"wiki_ppl": 40.4712, "val_bpb": 0.89812, "CORE": 0.1537,
                   "tasks": {label: {"accuracy": a} for label, a in zip(LABELS, [0.4, 0.6, 0.3, 0.2, 0.5, 0.25])}},
               9: {"val_bpb": 0.892, "tasks": {"piqa": {"accuracy": 0.7}}}}
    assert report.table(results) == (
        "| K | Wiki2 ppl | val bpb | CORE | LMB | PIQA | Hella | OPQA | ARC-E | ARC-C | Avg |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|\n"
        "| 3 | 40.47 | 0.898 | 15.37 | 40.00 | 60.00 | 30.00 | 20.00 | 50.00 | 25.00 | 37.50 |\n"
        "| 9 |  | 0.892 |  |  | 70.00 |  |  |  |  |  |\n")


def test_metric_reads_results_and_task_accuracies():
    r = {"val_bpb": 1.5, "CORE": 0.2, "tasks": {label: {"accuracy": 0.1 * i, "centered": -1.0}
                                                for i, label in enumerate(LABELS + ["copa"])}}
    assert report.metric(r, "val_bpb") == 1.5 and report.metric(r, "copa") == 0.1 * 6
    assert report.metric(r, "avg") == sum(0.1 * i for i in range(6)) / 6  # the six of Table 1, not copa
    assert report.metric(r, "wiki_ppl") is None and report.metric({}, "avg") is None
    assert report.values(r) == [None, 1.5, 0.2, *(0.1 * i for i in range(6)), report.metric(r, "avg")]
    assert report.cells([None, 1.5, 0.2]) == ["-", "1.500", "20.00"]  # cut to the numbers given


def test_imports_without_torch():
    code = "import sys; sys.modules['torch'] = None; import report, plot; print('ok')"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=60)
    assert p.stdout == "ok\n", p.stderr
