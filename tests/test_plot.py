"""plot.py: the log and eval readers and the EMA need no matplotlib; the two figures are drawn
only where it is installed (requirements-plot.txt)."""
import json

import pytest

import plot


def write_log(path, losses, resumed_from=None):
    """A train.py-style log.jsonl: a training record per step with val_bpb every 2 steps, then the
    final evaluation-only record; resumed_from=s appends a resumed run's records from step s."""
    def record(step, loss):
        r = dict(step=step, loss=loss, lrm=1.0, grad_norm=1.0, grad_mlp_first=0.1 * (step + 1), grad_lm_head=0.2,
                 grad_mlp_mid=0.3, grad_attn_mid=0.4, resid_norms=[1.0, 3.0, 2.0 + step], tok_per_s=1e3,
                 dt=0.1, mfu=None)
        return r | ({"val_bpb": 2.0} if step % 2 == 0 else {})
    lines = [record(s, x) for s, x in enumerate(losses)] + [{"step": len(losses), "val_bpb": 1.5}]
    if resumed_from is not None:
        lines += [record(s, -1.0) for s in range(resumed_from, len(losses))] + [{"step": len(losses), "val_bpb": 1.4}]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return path


def write_eval(path, checkpoint, bpb):
    results = {str(K): {"val_bpb": v, "wiki_ppl": 2**v, "CORE": 0.1 * K,
                        "tasks": {"piqa": {"accuracy": 0.5 + 0.01 * K, "centered": 0.0}}} for K, v in bpb.items()}
    path.write_text(json.dumps({"checkpoint": checkpoint, "step": 10, "settings": {}, "results": results, "table": ""}))
    return path


def test_ema_is_debiased():
    beta = 0.9
    s1 = 0.1 * 4.0                      # s_1 = 0.9 * 0 + 0.1 * x_1
    s2 = 0.9 * s1 + 0.1 * 2.0
    s3 = 0.9 * s2 + 0.1 * 3.0
    expected = [s1 / (1 - beta), s2 / (1 - beta**2), s3 / (1 - beta**3)]
    assert plot.ema([4.0, 2.0, 3.0]) == pytest.approx(expected)
    assert expected[0] == pytest.approx(4.0)  # debiased: the first point is the first value
    assert plot.ema([5.0] * 50) == pytest.approx([5.0] * 50)  # a constant stays constant


def test_read_log_keeps_last_occurrence(tmp_path):
    log = write_log(tmp_path / "run" / "log.jsonl", [9.0, 8.0, 7.0, 6.0], resumed_from=2)
    records = plot.read_log(str(tmp_path / "run"))  # a run directory reads its log.jsonl
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    assert [r.get("loss") for r in records] == [9.0, 8.0, -1.0, -1.0, None]  # resumed steps win
    assert records[-1] == {"step": 4, "val_bpb": 1.4}
    assert plot.read_log(str(log)) == records


def test_read_eval(tmp_path):
    path = write_eval(tmp_path / "e.json", "out/flt_base/step_000010", {12: 0.9, 1: 1.2, 3: 1.0})
    assert plot.read_eval(str(path), "val_bpb") == ("flt_base", {1: 1.2, 3: 1.0, 12: 0.9})  # sorted by K
    assert plot.read_eval(str(path), "piqa") == ("flt_base", {1: 0.51, 3: 0.53, 12: 0.62})  # a task's accuracy
    with pytest.raises(ValueError, match="'hellaswag'.*CORE.*piqa"):
        plot.read_eval(str(path), "hellaswag")


def test_diag_and_budget_figures(tmp_path):
    pytest.importorskip("matplotlib")
    lt = write_log(tmp_path / "out" / "diag_lt_k12" / "log.jsonl", [9.0, 8.5, 8.4, 8.4])
    flt = write_log(tmp_path / "out" / "diag_flt_k12" / "log.jsonl", [9.0, 7.0, 6.0, 5.0], resumed_from=3)
    plot.main(["diag", str(lt), str(flt.parent), "--max_over_loops", "-o", str(tmp_path / "diag.png")])
    evals = [write_eval(tmp_path / f"{n}.json", f"out/{n}/step_000010", {1: 1.3, 3: 1.1, 6: b})
             for n, b in (("lt_k3", 1.2), ("flt_k9", 1.0))]
    plot.main(["budget", *map(str, evals), "--metric", "wiki_ppl", "--labels", "LT", "FLT",
               "-o", str(tmp_path / "budget.png")])
    for png in ("diag.png", "budget.png"):
        data = (tmp_path / png).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 10_000


def test_labels_must_match_inputs(tmp_path):
    log = write_log(tmp_path / "run" / "log.jsonl", [1.0])
    with pytest.raises(SystemExit):  # argparse's usage error, before matplotlib is needed
        plot.main(["diag", str(log), "--labels", "a", "b"])
