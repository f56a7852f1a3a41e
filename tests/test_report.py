"""Tests for report.py: Table 1's cells and layout from eval.json-style results, eval.json and
eval.md (how runs merge into them: tests/test_eval_merge.py), eval.py's command line and its
plan-then-run, with stand-in modes; and that it imports without torch (plot.py runs without it)."""
import json
import os
import re
import subprocess
import sys

import pytest

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


# ----------------------------------------------------------------------------- eval.py's run
DEFAULTS = dict(modes="bpb", loops="1", exit_thresholds="", batch_size=8, bpb_tokens=10, protocol_ranks=4,
                protocol_batch=4, cache_slots=None)
MODES = ("bpb", "wiki", "core", "sample", "exit")


def test_parse_orders_modes_and_loops_and_names_bad_settings(tmp_path):
    run = str(tmp_path)
    ckpt, c, modes, loops, thresholds = report.parse(
        [run, "--modes=exit, bpb,exit", "--loops=6,1,6,3", "--exit_thresholds=0.1,0"], DEFAULTS, "eval.py", MODES)
    assert (ckpt, modes, loops, thresholds, c.batch_size) == (run, ["bpb", "exit"], [1, 3, 6], [0.1, 0.0], 8)
    assert DEFAULTS["modes"] == "bpb"  # the defaults are not changed
    bad = {"--modes=bpb,ppl": "--modes='bpb,ppl': expected a comma-separated subset of bpb,wiki,core,sample,exit",
           "--loops=1,0": "--loops='1,0': expected comma-separated integers >= 1",
           "--exit_thresholds=0.1": "--exit_thresholds='0.1': the exit mode needs, and only it takes",
           "--batch_size=0": "--batch_size=0: expected a positive integer"}
    for arg, message in bad.items():
        with pytest.raises(ValueError, match=re.escape(message)):
            report.parse([run, arg], DEFAULTS, "eval.py", MODES)
    with pytest.raises(ValueError, match="usage: python eval.py <checkpoint dir>"):
        report.parse(["--loops=3"], DEFAULTS, "eval.py", MODES)
    # the settings first, then the checkpoint: a missing one is named before any model loads
    with pytest.raises(FileNotFoundError, match=re.escape(f"{run}/nope: no such checkpoint directory")):
        report.parse([f"{run}/nope"], DEFAULTS, "eval.py", MODES)


def test_cache_slots_are_for_the_sample_mode_and_at_most_the_smallest_K(tmp_path):
    """Sampling at each K of --loops decodes with cache_slots loop slots per layer (model.KVCache): 1 to K."""
    assert report.parse([str(tmp_path), "--modes=sample", "--loops=6,2", "--cache_slots=2"], DEFAULTS, "eval.py",
                        MODES)[1].cache_slots == 2
    bad = {("--modes=sample", "--loops=6,2", "--cache_slots=3"): "--cache_slots=3: expected an integer from 1 "
           "to 2, the smallest loop budget K of [2, 6]",
           ("--modes=sample", "--cache_slots=0"): "--cache_slots=0: expected an integer from 1 to 1",
           ("--modes=bpb", "--cache_slots=1"): "--cache_slots=1: only the sample mode decodes with the KV cache"}
    for args, message in bad.items():
        with pytest.raises(ValueError, match=re.escape(message)):
            report.parse([str(tmp_path), *args], DEFAULTS, "eval.py", MODES)


class Numerics:
    """A context manager that counts how often it was entered."""
    entered = 0

    def __enter__(self):
        Numerics.entered += 1

    def __exit__(self, *exc):
        return False


def test_run_modes_plans_first_runs_the_rest_and_saves_after_each_mode():
    """A mode whose plan raises and one whose run raises are reported; the others run in the
    numerics, each result merged by K and saved after its mode; the estimate sees only the planned."""
    lines, saved, calls, Numerics.entered = [], [], [], 0

    def plan(name, fail_plan=False, fail_run=False):
        def planned():
            calls.append(f"plan {name}")
            if fail_plan:
                raise ConnectionError(f"{name}: no network")

            def run():
                calls.append(f"run {name}")
                if fail_run:
                    raise RuntimeError(f"{name} broke")
                return {1: {name: 1.0}, 3: {name: 3.0}}, {"tokens": len(name)}
            return f"{name} inputs", 2, run
        return planned
    plans = {"bpb": plan("bpb"), "wiki": plan("wiki", fail_plan=True), "core": plan("core", fail_run=True),
             "sample": plan("sample")}
    results, measured, failed = report.run_modes(
        plans, lambda planned: {m: 30.0 * n for m, (_, n, _) in planned.items()}, Numerics(),
        lambda results, measured: saved.append((json.dumps(results), dict(measured))), [1, 3, 6],
        lambda line, **kw: lines.append(line))
    assert calls == ["plan bpb", "plan wiki", "plan core", "plan sample", "run bpb", "run core", "run sample"]
    assert lines[:5] == ["plan bpb    bpb inputs", "plan wiki   cannot run: wiki: no network",
                         "plan core   core inputs", "plan sample sample inputs",
                         "estimate (from the first forwards): bpb ~1.0 min, core ~1.0 min, sample ~1.0 min; "
                         "in all ~3.0 min"]
    # each mode's time beside its estimate
    assert lines[5] == "bpb took 0 s (estimated ~1.0 min)" and lines[7].startswith("sample took 0 s (")
    # a bug keeps its traceback (flt/errors.py); the other modes still run
    assert lines[6].startswith("eval.py: mode 'core' failed: core broke\nTraceback (most recent call last):\n")
    assert lines[6].endswith("RuntimeError: core broke") and Numerics.entered == 3
    assert results == {1: {"bpb": 1.0, "sample": 1.0}, 3: {"bpb": 3.0, "sample": 3.0}, 6: {}}
    assert measured == {"bpb": {"tokens": 3}, "sample": {"tokens": 6}} and list(failed) == ["wiki", "core"]
    assert [m for _, m in saved] == [{"bpb": {"tokens": 3}}, measured]  # after bpb, after sample
    assert json.loads(saved[0][0]) == {"1": {"bpb": 1.0}, "3": {"bpb": 3.0}, "6": {}}
    closing = report.failures(failed, 4, "x/eval.json", measured)
    assert closing.startswith("eval.py: 2 of 4 modes could not run: wiki, core (why: above). "
                              "Saved in x/eval.json: ['bpb', 'sample'].")
    assert closing.endswith("local files: --wiki_path=<wikitext-2-v1 test parquet or wiki.test.tokens>, "
                            "--bundle_dir=<unpacked eval_bundle>")


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
        "runs": {"T1": {"settings": {"modes": "bpb"}, "measured": {"bpb": {"tokens": 7}}}}, "table": md}
