"""eval.py's exit rules side by side (--exit_rules, --argmax_counts): each rule's bpb and loops per
token in the exit mode, eval.json's "exit" (kl, as before) and "exit_rules" merged point by point,
the table of the fewest loops per token within 0.1% and 1% of the best fixed K (flt/report.py), and
the tasks mode's accuracy and loops per answer by difficulty under each rule (flt/tasks.py: exit_accuracy)."""
import json
import re

import pytest
import torch

import data
import eval as ev
from configurator import settings_of
from flt import checkpoint, eval_settings, report, tasks
from test_eval import save_checkpoint
from test_tasks import tiny_model

DEFAULTS = settings_of(vars(ev))


def read(*argv):
    return eval_settings.read([".", *argv], dict(DEFAULTS), "eval.py")[1]


# bpb_tokens off its default: eval.json keeps the results apart, under this label
LABEL = "bpb_tokens=256"


def exit_run(tmp_path, out, *argv):
    """eval.py on save_checkpoint's run (K up to 4, 256 validation tokens): eval.json's results
    under LABEL, {K: {metric: value}}."""
    ev.main([str(tmp_path / "run"), "--device=cpu", "--loops=1,2,4", "--batch_size=4",
             "--bpb_tokens=256", f"--val_files={tmp_path / 'val.parquet'}", f"--out={out}", *argv])
    results = json.loads(out.read_text())["results"]
    return {K: g for K, r in results.items() if (g := report.by_label(r).get(LABEL))}


def protocol_batches(tmp_path, tok):
    chunks, _ = data.protocol_chunks([str(tmp_path / "val.parquet")], tok, 64, 256, 1, 4)
    return chunks


def test_the_default_rule_writes_what_it_wrote_before_and_every_rule_its_curve(tmp_path, capsys):
    """Without --exit_rules, and with --exit_rules=kl, eval.json holds the kl curve under "exit"
    alone, evaluate_exit's numbers; each other rule's curve is evaluate_exit's under its rule, in
    "exit_rules"; a later call merges its (rule, threshold) points and drops none."""
    model, tok, _ = save_checkpoint(tmp_path)
    default = exit_run(tmp_path, tmp_path / "a.json", "--modes=exit", "--exit_thresholds=0.1,0.01")
    kl = exit_run(tmp_path, tmp_path / "b.json", "--modes=exit", "--exit_thresholds=0.1,0.01",
                  "--exit_rules=kl")
    # the files' results alike, byte for byte
    a, b = (json.loads((tmp_path / name).read_text()) for name in ("a.json", "b.json"))
    assert json.dumps(a["results"]) == json.dumps(b["results"])
    chunks = protocol_batches(tmp_path, tok)
    expected = ev.evaluate_exit(model, chunks, tok.token_bytes(), 4, [0.1, 0.01])
    assert default == kl == {"4": {"exit": expected}}
    assert "exit rule kl, K <= 4: 0.1: " in capsys.readouterr().out

    out = tmp_path / "c.json"
    both = exit_run(tmp_path, out, "--modes=bpb,exit", "--exit_thresholds=0.1",
                    "--exit_rules=kl,entropy,latent,argmax", "--argmax_counts=1,2")
    printed = capsys.readouterr().out
    assert both["4"]["exit"] == ev.evaluate_exit(model, chunks, tok.token_bytes(), 4, [0.1])
    assert list(both["4"]["exit_rules"]) == ["entropy", "latent", "argmax"]
    for rule, thresholds in (("entropy", [0.1]), ("latent", [0.1]), ("argmax", [1, 2])):
        curve = ev.evaluate_exit(model, chunks, tok.token_bytes(), 4, thresholds, rule)
        assert both["4"]["exit_rules"][rule] == curve
    # the table, against the bpb mode's fixed K
    fixed = {K: both[str(K)]["val_bpb"] for K in (1, 2, 4)}
    curves = report.exit_curves(both["4"])
    assert set(curves) == {"kl", "entropy", "latent", "argmax"}
    held = {K: {f"{key}[{LABEL}]": v for key, v in r.items()} for K, r in both.items()}
    assert report.exit_table(held, [1, 2, 4], LABEL) in printed
    assert report.exit_rows(held, [1, 2, 4], LABEL)[0][0] == "fixed K"
    assert report.exit_savings(fixed, curves)["fixed K"][1] is not None

    # a later call: entropy at another threshold joins; nothing earlier is dropped
    later = exit_run(tmp_path, out, "--modes=exit", "--exit_thresholds=0.1,0.5",
                     "--exit_rules=entropy")["4"]
    assert [p["threshold"] for p in later["exit_rules"]["entropy"]] == [0.1, 0.5]
    assert later["exit_rules"]["entropy"][1] == ev.evaluate_exit(
        model, chunks, tok.token_bytes(), 4, [0.5], "entropy")[0]
    assert later["exit_rules"]["latent"] == both["4"]["exit_rules"]["latent"]
    assert later["exit_rules"]["argmax"] == both["4"]["exit_rules"]["argmax"]
    assert later["exit"] == both["4"]["exit"] and later["val_bpb"] == both["4"]["val_bpb"]


def test_merge_keeps_every_rule_and_threshold():
    """report.merge: a curve of CURVES merges by (rule, threshold), a point computed again
    replaced in place, the others kept; any other key is replaced whole, as before."""
    def point(t, b):
        return {"threshold": t, "val_bpb": b, "mean_loops": 1.0}
    old = report.merge(None, {"checkpoint": "c", "step": 1, "settings": {}, "time": "t1"},
                       {3: {"exit": [point(0.1, 1.0), point(0.01, 0.9)],
                            "exit_rules": {"argmax": [point(1, 1.2)]}, "val_bpb": 1.0}}, {})
    new = report.merge(old, {"checkpoint": "c", "step": 1, "settings": {}, "time": "t2"},
                       {3: {"exit": [point(0.01, 0.8), point(0.001, 0.7)],
                            "exit_rules": {"entropy": [point(0.5, 1.1)]}, "val_bpb": 0.5}}, {})
    r = new["results"]["3"]
    assert r["exit"] == [point(0.1, 1.0), point(0.01, 0.8), point(0.001, 0.7)]
    assert r["exit_rules"] == {"argmax": [point(1, 1.2)], "entropy": [point(0.5, 1.1)]}
    assert r["val_bpb"] == 0.5


def test_the_exit_table_finds_the_fewest_loops_within_each_tolerance():
    """exit_savings by hand: the best fixed K is 1.000 at K=8; within 0.1% (<= 1.001) and 1%
    (<= 1.01), fixed K needs K=6 and K=4, kl 5.5 and 3.0 loops, argmax none and 4.5."""
    fixed = {2: 1.10, 4: 1.009, 6: 1.0008, 8: 1.000}
    curves = {"kl": [{"threshold": 0.1, "val_bpb": 1.02, "mean_loops": 2.0},
                     {"threshold": 0.03, "val_bpb": 1.005, "mean_loops": 3.0},
                     {"threshold": 0.01, "val_bpb": 1.001, "mean_loops": 5.5},
                     {"threshold": 0.0, "val_bpb": 1.000, "mean_loops": 8.0}],
              "argmax": [{"threshold": 1, "val_bpb": 1.05, "mean_loops": 2.5},
                         {"threshold": 2, "val_bpb": 1.0099, "mean_loops": 4.5}]}
    rows = report.exit_savings(fixed, curves)
    assert rows == {"fixed K": [6, 4], "kl": [5.5, 3.0], "argmax": [None, 4.5]}
    results = {K: {"val_bpb": b} for K, b in fixed.items()}
    results[8] |= {"exit": curves["kl"], "exit_rules": {"argmax": curves["argmax"]}}
    assert report.exit_table(results) == (
        "| loops per token | best fixed-K bpb | within 0.1% | within 1% |\n|---|---|---|---|\n"
        "| fixed K | 1.0000 (K=8) | 6 | 4 |\n| kl, K <= 8 | 1.0000 (K=8) | 5.50 | 3.00 |\n"
        "| argmax, K <= 8 | 1.0000 (K=8) | - | 4.50 |\n")
    # no fixed-K bpb at the loops asked: the table says so
    assert "none at K in [3]: run eval.py --modes=bpb" in report.exit_table(results, [3])


@pytest.mark.parametrize("args, message", [
    (["--exit_rules=cosine", "--exit_thresholds=0.1"],
     "--exit_rules='cosine': expected comma-separated exit rules of kl,entropy,latent,argmax,gate"),
    (["--exit_rules=argmax", "--argmax_counts=0"], "--argmax_counts='0': expected comma-separated "
                                                   "integers >= 1"),
    (["--exit_thresholds=0.1", "--argmax_counts=2"], "--argmax_counts='2' does nothing without the "
                                                     "argmax rule"),
    (["--exit_rules=kl,argmax"], "--exit_thresholds='': the exit mode needs"),
    (["--exit_rules=argmax", "--exit_thresholds=0.1"], "--exit_thresholds='0.1' does nothing with "
                                                       "--exit_rules='argmax'"),
])
def test_bad_exit_settings_name_the_setting(args, message):
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        read("--modes=exit", *args)


def test_exit_plan_gives_each_rule_its_thresholds():
    settings = read("--modes=exit", "--exit_rules=argmax,kl", "--exit_thresholds=0.1,0.01")
    assert eval_settings.exit_plan(settings, DEFAULTS, ["exit"]) == {"kl": [0.1, 0.01],
                                                                      "argmax": [1, 2, 3]}
    # the tasks mode scores them only when one is given
    assert eval_settings.exit_plan(read("--modes=tasks"), DEFAULTS, ["tasks"]) == {}
    assert eval_settings.exit_plan(read("--modes=tasks", "--exit_rules=argmax"), DEFAULTS,
                                   ["tasks"]) == {"argmax": [1, 2, 3]}


def test_the_gate_rule_without_a_gate_is_one_line(tmp_path):
    save_checkpoint(tmp_path)
    gateless = r"^--exit_rules='kl,gate': .* has no exit gate .*; train one with `python -m flt"
    with pytest.raises(ValueError, match=gateless + r"\.exit_gate RUN`$"):
        exit_run(tmp_path, tmp_path / "g.json", "--modes=exit", "--exit_thresholds=0.5",
                 "--exit_rules=kl,gate")


def hand_count(model, batches, levels, K, rule, threshold):
    """(accuracy, mean loops, by difficulty each) of the answers, one position at a time."""
    right, loops, count = ({d: 0 for d in levels} for _ in range(3))
    for x, y, d in batches:
        with torch.no_grad():
            logits, looped = model(x, loops=K, exit_threshold=threshold, exit_rule=rule,
                                   return_loops=True)
        for b, t in zip(*torch.nonzero(y >= 0, as_tuple=True)):
            level = int(d[b, t])
            count[level] += 1
            right[level] += int(logits[b, t].argmax() == y[b, t])
            loops[level] += int(looped.exit_loops[b, t])
    n = sum(count.values())
    return (sum(right.values()) / n, sum(loops.values()) / n,
            {str(v): right[v] / count[v] for v in levels},
            {str(v): loops[v] / count[v] for v in levels})


def test_the_tasks_mode_reports_accuracy_and_loops_per_answer_by_difficulty(tmp_path):
    """eval.py --modes=tasks with --exit_rules: task_exit at K_max, {rule: [{threshold, acc,
    mean_loops, acc_by_difficulty, loops_by_difficulty}]}, each point a hand count's, merged by
    (rule, threshold) with a later call."""
    task = tasks.Task("chains", 2, 20)
    model = tiny_model(task, loops=3).float()
    settings = {"dataset": "chains", "task_difficulty": 2, "sequence_len": 20,
                "bos_token": data.BOS}
    step = checkpoint.save(str(tmp_path / "run"), 4, model, {"world_size": 1}, settings=settings,
                           files={"tokenizer.json": tasks.tokenizer(task).save})
    out = tmp_path / "t.json"

    def run(*argv):
        ev.main([step, "--device=cpu", "--modes=tasks", "--loops=1,3", "--task_items=24",
                 "--batch_size=6", "--dtype=fp32", f"--out={out}", *argv])
        return json.loads(out.read_text())["results"]["3"]["task_exit[task_items=24]"]

    saved = run("--exit_rules=kl,argmax", "--exit_thresholds=0.01", "--argmax_counts=1")
    assert list(saved) == ["kl", "argmax"]
    batches = task.batches(24 * task.item_len, 6)
    for rule, threshold in (("kl", 0.01), ("argmax", 1)):
        (point,) = saved[rule]
        acc, mean_loops, acc_by, loops_by = hand_count(model, batches, task.levels, 3, rule,
                                                       threshold)
        assert point["threshold"] == threshold
        assert point["acc"] == pytest.approx(acc, abs=1e-12)
        assert point["mean_loops"] == pytest.approx(mean_loops, abs=1e-12)
        assert point["acc_by_difficulty"] == pytest.approx(acc_by, abs=1e-12)
        assert point["loops_by_difficulty"] == pytest.approx(loops_by, abs=1e-12)
    later = run("--exit_rules=argmax", "--argmax_counts=2")
    assert later["kl"] == saved["kl"]
    assert [p["threshold"] for p in later["argmax"]] == [1, 2]
