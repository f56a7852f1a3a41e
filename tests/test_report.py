"""Tests for report.py: Table 1's cells and layout from eval.json-style results, what eval.py prints
of them, eval.json and eval.md (how runs merge into them: tests/test_eval_merge.py), eval.py's
closing line; and that it imports without torch (plot.py runs without it). eval.py's settings and
its plan-then-run: tests/test_eval.py."""
import json
import os
import subprocess
import sys


from flt import report

# eval.json's task labels of Table 1's six columns, in the paper's column order (docs/evaluation.md)
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
    code = "import sys; sys.modules['torch'] = None; from flt import report; from scripts import plot; print('ok')"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=60)
    assert p.stdout == "ok\n", p.stderr


def test_summary_prints_the_table_only_with_a_row_and_names_what_it_has_no_column_for():
    """After a mode with no Table 1 column (samples), no empty header: only the line naming them."""
    samples = {1: {"samples": ["a"]}, 2: {"samples": ["b"], "samples[cache_slots=1]": ["c"]}}
    assert report.summary(samples) == "samples at K=1,2; samples[cache_slots=1] at K=2\n"
    assert report.summary({}) == ""
    both = {1: {"val_bpb": 1.25, "val_bpb_utf8": 1.5}}
    assert report.summary(both) == report.table(both) + "also held: val_bpb_utf8 at K=1\n"


def test_the_closing_line_names_the_failed_modes_and_only_the_hints_that_apply():
    measured = {"bpb": {}, "sample": {}}
    offline = {"wiki": "--wiki_path=<file>", "core": "--bundle_dir=<dir>"}
    closing = report.failures({"wiki": None, "core": None}, 4, "x/eval.json", measured, offline)
    assert closing == ("eval.py: 2 of 4 modes could not run: wiki, core (why: above). Saved in x/eval.json: "
                       "['bpb', 'sample']. Inputs are downloaded unless given; without network point at "
                       "local files: --wiki_path=<file>, --bundle_dir=<dir>")
    # a mode that fetches nothing: no download hint, no dangling colon
    assert report.failures({"tasks": None}, 1, "x/eval.json", {}, offline) == (
        "eval.py: 1 of 1 modes could not run: tasks (why: above). Saved in x/eval.json: nothing.")


def test_write_results_writes_eval_json_and_eval_md_beside_it():
    """A first run: its results by K, the run that computed each entry (its start time), that run's
    settings and what it measured, and eval.md's table, the same as eval.json's."""
    written = {}
    results = {1: {"val_bpb": 1.25}, 3: {}}
    record = {"checkpoint": "run/step_000010", "step": 10, "settings": {"modes": "bpb"}, "time": "T1"}
    report.write_results("run/step_000010/eval.json", record, results, {"bpb": {"tokens": 7}},
                         write=written.__setitem__)
    md = "| K | Wiki2 ppl | val bpb | CORE | LMB | PIQA | Hella | OPQA | ARC-E | ARC-C | Avg |\n" + \
         "|---|---|---|---|---|---|---|---|---|---|---|\n| 1 |  | 1.250 |" + "  |" * 8 + "\n"
    # K = 3 holds no number of Table 1: no row
    assert written["run/step_000010/eval.md"] == md
    assert json.loads(written["run/step_000010/eval.json"]) == {
        "checkpoint": "run/step_000010", "step": 10, "results": {"1": {"val_bpb": 1.25}, "3": {}},
        "computed": {"1": {"val_bpb": "T1"}, "3": {}},
        "runs": {"T1": {"settings": {"modes": "bpb"}, "measured": {"bpb": {"tokens": 7}}}}, "table": md,
        "previous_table": None}
