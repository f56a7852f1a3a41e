"""plot.py: every subcommand on small synthetic runs (train.py-style log.jsonl and settings.json,
eval.py-style eval.json), checked against what was drawn or printed. The readers, the EMA and the
table need no matplotlib; the figures are drawn only where it is installed (requirements/plot.txt)."""
import json
import math
import os
import re

import pytest

from scripts import plot
from flt import report


def write_log(path, losses, resumed_from=None, extra=None):
    """A train.py-style log.jsonl: a training record per step with val_bpb every 2 steps, then the
    final evaluation-only record; resumed_from=s appends a resumed run's records from step s; extra:
    more records (e.g. {"step": 2, "core": 0.1}) merged into the steps they name."""
    def record(step, loss):
        r = dict(step=step, loss=loss, lrm=1.0, grad_norm=1.0, grad_mlp_first=0.1 * (step + 1), grad_lm_head=0.2 + step,
                 grad_mlp_mid=0.3 + step, grad_attn_mid=0.4 + step, resid_norms=[10.0 + step, 3.0, 2.0 + step],
                 grad_mlp_first_clipped=0.01 * step, grad_lm_head_clipped=0.02 * step, grad_mlp_mid_clipped=0.03 * step,
                 grad_attn_mid_clipped=0.04 * step,
                 tok_per_s=1e3, dt=0.1, mfu=None)
        return r | ({"val_bpb": 2.0} if step % 2 == 0 else {})
    lines = [record(s, x) for s, x in enumerate(losses)] + [{"step": len(losses), "val_bpb": 1.5}]
    if resumed_from is not None:
        lines += [record(s, -1.0) for s in range(resumed_from, len(losses))] + [{"step": len(losses), "val_bpb": 1.4}]
    for r in extra or []:
        lines = [line | r if line["step"] == r["step"] else line for line in lines]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return path


def write_run(root, name, losses, variant="FLT", loops=3, depth=12, **kwargs):
    """A run directory with train.py's settings.json and log.jsonl."""
    run = root / name
    write_log(run / "log.jsonl", losses, **kwargs)
    (run / "settings.json").write_text(json.dumps(dict(variant=variant, loops=loops, depth=depth, attn="full",
                                                       n_kv_head=None, window_pattern="L", out_dir=str(run))))
    return run


def write_eval(path, ks, acc=lambda K: 0.5, bpb=lambda K: 1.0):
    """eval.py's JSON at path with results at every K in ks; the six tasks have accuracies acc(K) + 0.01 * i."""
    results = {str(K): {"val_bpb": bpb(K), "wiki_ppl": 2 ** bpb(K), "CORE": 0.1 * K,
                        "tasks": {label: {"accuracy": acc(K) + 0.01 * i, "centered": 0.0}
                                  for i, label in enumerate(report.TASKS.values())}} for K in ks}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"checkpoint": str(path.parent), "step": 10, "settings": {}, "results": results,
                                "table": ""}))
    return path


def lines_of(ax):
    """{legend label: (xs, ys)} of the lines drawn in ax (the stop markers have no label)."""
    return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata()))
            for line in ax.get_lines() if not line.get_label().startswith("_")}


def assert_png(path):
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG") and len(data) > 10_000


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


def test_read_eval_finds_the_newest_step(tmp_path):
    write_eval(tmp_path / "run" / "step_000005" / "eval.json", [1, 3], acc=lambda K: 0.1)
    newest = write_eval(tmp_path / "run" / "step_000010" / "eval.json", [12, 1, 3], acc=lambda K: 0.4)
    (tmp_path / "run" / "step_000020").mkdir()  # a checkpoint not evaluated yet
    for path in (tmp_path / "run", newest.parent, newest):  # a run, a step directory, the file
        results = plot.read_eval(str(path))
        assert list(results) == [1, 3, 12]  # by K
        assert report.metric(results[3], "piqa") == pytest.approx(0.41)  # a task's raw accuracy
        assert report.metric(results[3], "avg") == pytest.approx(0.4 + 0.01 * (0 + 1 + 2 + 3 + 4 + 5) / 6)
    with pytest.raises(FileNotFoundError, match="step_000020.*eval.py"):
        plot.read_eval(str(tmp_path / "run" / "step_000020"))


def test_labels_come_from_settings_json(tmp_path):
    run = write_run(tmp_path, "some_dir", [1.0], variant="LT_i", loops=9)
    assert plot.default_label(str(run / "log.jsonl")) == "LT_i K=9"
    settings = dict(variant="FLT", loops=12, n_kv_head=2, attn="mla", window_pattern="SSSL")
    assert plot.model_name(settings) == "FLT GQA(2) MLA SWA(SSSL)"
    assert plot.model_name(dict(variant="LT", loops=3, n_kv_head=-1, attn="full", window_pattern="L")) == "LT"
    write_log(tmp_path / "bare" / "log.jsonl", [1.0])
    assert plot.default_label(str(tmp_path / "bare" / "step_000010")) == "bare"  # no settings.json


def test_diag(tmp_path):
    pytest.importorskip("matplotlib")
    lt = write_run(tmp_path, "lt", [9.0, 8.5, 8.4, 8.4], variant="LT", loops=12)
    flt = write_run(tmp_path, "flt", [9.0, 7.0, 6.0, 5.0], loops=12, resumed_from=3)
    fig = plot.main(["diag", str(lt / "log.jsonl"), str(flt), "--labels", "LT", "FLT", "-o", str(tmp_path / "d.png")])
    resid, loss, grad = (lines_of(ax) for ax in fig.axes)
    assert resid["LT"] == ([0, 1, 2, 3], [10.0, 11.0, 12.0, 13.0])  # resid_norms[0]: the first loop
    assert loss["FLT"][1] == pytest.approx(plot.ema([9.0, 7.0, 6.0, -1.0]))  # resumed step 3 wins
    s = [0.1 * 9.0, 0.9 * 0.1 * 9.0 + 0.1 * 8.5]  # the EMA by hand, then debiased
    assert loss["LT"][1][:2] == pytest.approx([s[0] / 0.1, s[1] / (1 - 0.9**2)])
    assert grad["LT"] == ([0, 1, 2, 3], pytest.approx([0.1, 0.2, 0.3, 0.4]))
    assert fig.axes[2].get_yscale() == "log"
    assert_png(tmp_path / "d.png")


def test_loss_marks_a_run_that_stopped_early(tmp_path):
    pytest.importorskip("matplotlib")
    ok = write_run(tmp_path, "flt", [5.0, 4.0, 3.0, 2.0], loops=12)
    stopped = write_run(tmp_path, "lt", [5.0, 6.0], variant="LT", loops=12,
                        extra=[{"step": 2, "loss": math.nan, "diverged": True}])
    fig = plot.main(["loss", str(ok), str(stopped), "-o", str(tmp_path / "loss.png")])
    ax = fig.axes[0]
    assert lines_of(ax) == {"FLT K=12": ([0, 1, 2, 3], pytest.approx(plot.ema([5.0, 4.0, 3.0, 2.0]))),
                            "LT K=12 (stopped at 1)": ([0, 1], pytest.approx(plot.ema([5.0, 6.0])))}
    markers = [line for line in ax.get_lines() if line.get_marker() == "x"]
    assert [list(m.get_xydata()[0]) for m in markers] == [[1, pytest.approx(plot.ema([5.0, 6.0])[-1])]]
    assert_png(tmp_path / "loss.png")


def test_val_draws_each_runs_val_bpb_against_its_steps(tmp_path):
    """val: a line a run through its log's records that have a finite val_bpb (a diverged run's NaN
    left out, the line ending in an x); --out's rules as every figure's: a rerun replaces its own
    figure, another file is refused unless --force."""
    pytest.importorskip("matplotlib")
    flt = write_run(tmp_path, "flt", [5.0, 4.0, 3.0, 2.0], loops=12, extra=[{"step": 2, "val_bpb": 1.8}])
    lt = write_run(tmp_path, "lt", [5.0, 6.0], variant="LT", loops=12,
                   extra=[{"step": 2, "val_bpb": math.nan, "diverged": True}])
    out = tmp_path / "val.png"
    for _ in range(2):  # the second replaces the script's own figure
        fig = plot.main(["val", str(flt), str(lt / "log.jsonl"), "-o", str(out)])
    ax = fig.axes[0]
    assert lines_of(ax) == {"FLT K=12": ([0, 2, 4], [2.0, 1.8, 1.5]), "LT K=12 (stopped at 0)": ([0], [2.0])}
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("step", "val bpb")
    assert_png(out)
    other = tmp_path / "notes.png"
    other.write_bytes(b"a user's own figure")
    with pytest.raises(FileExistsError, match="notes.png: exists, and python -m scripts.plot did not write it"):
        plot.main(["val", str(flt), "-o", str(other)])
    plot.main(["val", str(flt), "-o", str(other), "--force"])
    assert_png(other)



def test_an_out_without_extension_is_the_png_savefig_writes(tmp_path, capsys):
    """-o myfig: matplotlib's savefig writes myfig.png, so that is the file checked (a user's
    myfig.png is refused in one line and stays as it was), written and named in the "wrote" line;
    -o fig. is fig.png too, and a rerun replaces the script's own figure."""
    pytest.importorskip("matplotlib")
    run = write_run(tmp_path, "flt", [5.0, 4.0, 3.0])
    mine = tmp_path / "myfig.png"
    mine.write_bytes(b"\x89PNG\r\n\x1a\n a user's own figure")
    with pytest.raises(FileExistsError, match=re.escape(f"--out={mine}: exists, and python -m scripts.plot did "
                                                        "not write it: choose another --out")):
        plot.main(["loss", str(run), "-o", str(tmp_path / "myfig")])
    assert mine.read_bytes() == b"\x89PNG\r\n\x1a\n a user's own figure"
    assert sorted(os.listdir(tmp_path)) == ["flt", "myfig.png"]
    capsys.readouterr()
    for name in ("fig", "fig."):
        plot.main(["loss", str(run), "-o", str(tmp_path / name)])
        assert capsys.readouterr().out == f"wrote {tmp_path / 'fig.png'}\n"
    assert_png(tmp_path / "fig.png")
    assert sorted(os.listdir(tmp_path)) == ["fig.png", "flt", "myfig.png"]


def test_figures_and_tables_are_written_whole_or_not_at_all(tmp_path, monkeypatch):
    """--out is written under a temporary name in its folder, then renamed over it: until the rename
    the old file is whole, and a write that fails (a full disk) leaves it as it was and no
    temporary file behind."""
    matplotlib = pytest.importorskip("matplotlib")
    run = write_run(tmp_path, "flt", [5.0, 4.0, 3.0])
    write_eval(run / "step_000010" / "eval.json", [3])
    outs = {"loss": tmp_path / "loss.png", "table": tmp_path / "t.md"}
    for command, out in outs.items():
        plot.main([command, str(run), "-o", str(out)])
    old = {str(out): out.read_bytes() for out in outs.values()}
    renamed, replace = {}, os.replace

    def rename(src, dst):
        # the old file still whole at dst, the new one beside it
        assert os.path.dirname(src) == os.path.dirname(dst) and open(dst, "rb").read() == old[dst]
        renamed[dst] = open(src, "rb").read()
        replace(src, dst)
    monkeypatch.setattr(os, "replace", rename)
    for command, out in outs.items():
        plot.main([command, str(run), "-o", str(out)])
    assert renamed == {str(out): out.read_bytes() for out in outs.values()}
    monkeypatch.setattr(os, "replace", replace)
    before = {name: (tmp_path / name).read_bytes() for name in ("loss.png", "t.md")}

    def full_disk(fig, fname, **kwargs):
        with open(fname, "wb") as f:
            f.write(b"half a figure")
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", full_disk)
    with pytest.raises(OSError, match="No space left on device"):
        plot.main(["loss", str(run), "-o", str(outs["loss"])])
    assert sorted(os.listdir(tmp_path)) == ["flt", "loss.png", "t.md"]
    assert {name: (tmp_path / name).read_bytes() for name in before} == before

def test_runs_lists_every_run_below_the_folders_from_its_files(tmp_path, monkeypatch, capsys):
    """runs: a Markdown row per run (a folder with settings.json or log.jsonl) at any depth below the
    folders, each once, by path: variant, K, dataset, the last step logged, the last val bpb and the
    final one, or where the log says the run diverged; "-" where a file or a record is missing. A
    running log's half-written last line is left out. No matplotlib; --out as table's."""
    monkeypatch.setattr(plot, "pyplot", lambda: pytest.fail("runs needs no matplotlib"))
    out, more = tmp_path / "out", tmp_path / "more"
    # steps 0-2, val bpb 2.0 at 0 and 2, then the final record (step 3): val bpb 1.5, final 1.25
    done = write_run(out / "sweep", "flt_k6", [3.0, 2.0, 1.0], loops=6, extra=[{"step": 3, "final_val_bpb": 1.25}])
    settings = json.loads((done / "settings.json").read_text())
    (done / "settings.json").write_text(json.dumps(settings | {"dataset": "fineweb"}))
    # no settings.json; diverged at step 1, train.py's line for it replacing the step's record
    log = [{"step": 0, "loss": 5.0, "val_bpb": 2.5}, {"step": 1, "loss": 9.0}, {"step": 1, "diverged": True}]
    (out / "lt_k9").mkdir()
    (out / "lt_k9" / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in log))
    # just started: its settings.json, no log yet
    (out / "new").mkdir()
    (out / "new" / "settings.json").write_text(json.dumps({"variant": "LT_i", "loops": 3, "dataset": "embedded"}))
    # running: the last line of its log half written
    running = write_run(more, "running", [4.0, 3.5], loops=3)
    with open(running / "log.jsonl", "a") as f:
        f.write('{"step": 3, "lo')
    (out / "checkpoints_only" / "step_000010").mkdir(parents=True)  # no run
    md = plot.main(["runs", str(out), str(more), str(out / "sweep")])
    assert capsys.readouterr().out == md
    assert md == ("| run | variant | K | dataset | last step | val bpb | final val bpb |\n"
                  "|---|---|---|---|---|---|---|\n"
                  f"| {running} | FLT | 3 | - | 2 | 1.5000 | - |\n"
                  f"| {out / 'lt_k9'} | - | - | - | 1 | 2.5000 | diverged at step 1 |\n"
                  f"| {out / 'new'} | LT_i | 3 | embedded | - | - | - |\n"
                  f"| {done} | FLT | 6 | fineweb | 3 | 1.5000 | 1.2500 |\n")
    # --out: written, replaced on a rerun, another file refused
    for _ in range(2):
        assert plot.main(["runs", str(out), "-o", str(tmp_path / "runs.md")]) == (tmp_path / "runs.md").read_text()
    (tmp_path / "notes.md").write_text("| my notes |\n")
    with pytest.raises(FileExistsError, match="notes.md: exists, and python -m scripts.plot did not write it"):
        plot.main(["runs", str(out), "-o", str(tmp_path / "notes.md")])
    # none below a folder: the header alone, and a line saying so
    assert plot.main(["runs", str(out / "checkpoints_only")]) == md[:md.index(f"| {running}")]
    assert "runs: no run below" in capsys.readouterr().err


def test_sweep(tmp_path):
    pytest.importorskip("matplotlib")
    runs = []
    for trained in (9, 3):  # given out of order: lines come in training-K order
        run = write_run(tmp_path, f"flt_k{trained}", [1.0], loops=trained)
        write_eval(run / "step_000010" / "eval.json", [1, 3, 6, 9, 12], acc=lambda K, t=trained: 0.3 + 0.001 * K * t,
                   bpb=lambda K, t=trained: 1.0 / (K + t))
        runs.append(str(run))
    fig = plot.main(["sweep", *runs, "-o", str(tmp_path / "sweep.png")])
    ax = fig.axes[0]
    assert [line.get_label() for line in ax.get_lines()] == ["FLT K=3", "FLT K=9"]
    xs, ys = lines_of(ax)["FLT K=9"]
    assert xs == [1, 3, 6, 9, 12]
    assert ys == pytest.approx([0.3 + 0.009 * K + 0.025 for K in xs])  # + the mean of 0.00..0.05
    assert list(ax.get_xticks()) == [1, 3, 6, 9, 12]
    fig = plot.main(["sweep", *runs, "--metric", "val_bpb", "--labels", "a", "b", "-o", str(tmp_path / "bpb.png")])
    assert lines_of(fig.axes[0])["b"] == ([1, 3, 6, 9, 12], pytest.approx([1 / (K + 3) for K in (1, 3, 6, 9, 12)]))
    assert_png(tmp_path / "sweep.png")
    with pytest.raises(ValueError, match="'hellaswag_zeroshot'.*CORE.*piqa"):
        plot.main(["sweep", *runs, "--metric", "hellaswag_zeroshot"])


def test_depth_draws_task_accuracy_against_K_and_difficulty(tmp_path):
    pytest.importorskip("matplotlib")
    runs = []
    for name, depth, loops in (("looped", 2, 4), ("deep", 8, 1)):
        run = write_run(tmp_path, name, [1.0], loops=loops, depth=depth)
        results = {str(K): {"task_acc": 0.1 * K * depth,
                            "task_acc_by_difficulty": {str(d): 1 / (d + K) for d in (1, 2, 3)}}
                   for K in (1, 2, 4, 8)}
        (run / "step_000010").mkdir()
        (run / "step_000010" / "eval.json").write_text(json.dumps({"results": results}))
        runs.append(str(run))
    fig = plot.main(["depth", *runs])
    by_k, looped, deep = fig.axes
    assert lines_of(by_k)["FLT K=4, 2 blocks"] == ([1, 2, 4, 8], pytest.approx([0.2, 0.4, 0.8, 1.6]))
    # by difficulty: a panel per run, a line at every K evaluated
    assert set(lines_of(looped)) == {f"FLT K=4, 2 blocks at K={K}" for K in (1, 2, 4, 8)}
    assert set(lines_of(deep)) == {f"FLT K=1, 8 blocks at K={K}" for K in (1, 2, 4, 8)}
    assert lines_of(looped)["FLT K=4, 2 blocks at K=8"] == ([1, 2, 3],
                                                            pytest.approx([1 / 9, 1 / 10, 1 / 11]))
    # equal points stay visible: every K its own marker, larger the smaller K is
    drawn = looped.get_lines()
    assert len({line.get_marker() for line in drawn}) == 4
    assert [line.get_markersize() for line in drawn] == sorted(
        (line.get_markersize() for line in drawn), reverse=True)
    fig = plot.main(["depth", *runs, "--loops", "2", "-o", str(tmp_path / "two.png")])
    assert {label.rpartition(" at ")[2] for label in lines_of(fig.axes[1])} == {"K=2"}
    # panels in rows of at most four: four runs and the K panel are a row of four and one below
    fig = plot.main(["depth", *runs, *runs, "-o", str(tmp_path / "five.png")])
    rows = [round(ax.get_position().y0, 3) for ax in fig.axes]
    assert len(rows) == 5 and len(set(rows[:4])) == 1 and rows[4] < rows[0]
    # without -o: beside the runs (the folder they share), not where the command ran
    assert_png(tmp_path / "depth.png")
    write_eval(tmp_path / "text" / "step_000010" / "eval.json", [1, 3])
    with pytest.raises(ValueError, match="no task accuracy.*--modes=tasks"):
        plot.main(["depth", str(tmp_path / "text")])


def test_resid_skips_loops_a_run_does_not_have(tmp_path):
    pytest.importorskip("matplotlib")
    k3 = write_run(tmp_path, "k3", [1.0, 1.0], loops=3)  # resid_norms has 3 loops
    log = tmp_path / "k4" / "log.jsonl"
    log.parent.mkdir()
    log.write_text("".join(json.dumps({"step": s, "loss": 1.0, "resid_norms": [1.0, 2.0, 3.0, 4.0 + s]}) + "\n"
                           for s in range(2)))
    fig = plot.main(["resid", str(k3), str(log), "--loops", "3", "4", "-o", str(tmp_path / "resid.png")])
    assert [ax.get_title() for ax in fig.axes] == ["residual-state norm, loop 3", "residual-state norm, loop 4"]
    assert lines_of(fig.axes[0]) == {"FLT K=3": ([0, 1], [2.0, 3.0]), "k4": ([0, 1], [3.0, 3.0])}
    assert lines_of(fig.axes[1]) == {"k4": ([0, 1], [4.0, 5.0])}
    assert_png(tmp_path / "resid.png")
    with pytest.raises(ValueError, match="loop 9: none of the runs"):
        plot.main(["resid", str(k3), "--loops", "9", "-o", str(tmp_path / "r.png")])


def test_grads(tmp_path):
    pytest.importorskip("matplotlib")
    run = write_run(tmp_path, "flt", [1.0, 1.0, 1.0], loops=6)
    fig = plot.main(["grads", str(run), "-o", str(tmp_path / "grads.png")])
    drawn = [lines_of(ax)["FLT K=6"] for ax in fig.axes]
    assert drawn == [([0, 1, 2], pytest.approx([0.2 + s for s in range(3)])),  # LM head
                     ([0, 1, 2], pytest.approx([0.3 + s for s in range(3)])),  # 5th-layer FFN
                     ([0, 1, 2], pytest.approx([0.4 + s for s in range(3)]))]  # 5th-layer attention
    assert_png(tmp_path / "grads.png")
    # --clipped: the authors' view (rank 0's own gradient after clipping), the *_clipped keys
    fig = plot.main(["grads", str(run), "--clipped", "-o", str(tmp_path / "clipped.png")])
    assert [lines_of(ax)["FLT K=6"][1] for ax in fig.axes] == [pytest.approx([k * s for s in range(3)])
                                                                for k in (0.02, 0.03, 0.04)]
    assert "after clipping" in fig.axes[0].get_title()
    fig = plot.main(["diag", str(run), "--clipped", "-o", str(tmp_path / "diag.png")])
    assert lines_of(fig.axes[2])["FLT K=6"][1] == pytest.approx([0.0, 0.01, 0.02])


def test_core(tmp_path):
    pytest.importorskip("matplotlib")
    run = write_run(tmp_path, "flt", [1.0] * 5, loops=6, extra=[{"step": 2, "core": 0.11}, {"step": 5, "core": 0.15}])
    fig = plot.main(["core", str(run), "-o", str(tmp_path / "core.png")])
    assert lines_of(fig.axes[0]) == {"FLT K=6": ([2, 5], [0.11, 0.15])}  # step 5: the final record
    assert_png(tmp_path / "core.png")


def table_rows(md):
    """{(model, K): cells} of a Markdown table from plot.table."""
    lines = [[c.strip() for c in line.strip("|").split("|")] for line in md.splitlines()]
    assert lines[0][:4] == ["model", "depth", "K", "Wiki2 ppl"] and lines[0][-1] == "Avg"
    return {(row[0], row[2]): row[3:] for row in lines[2:]}


def test_table(tmp_path, capsys):
    flt = write_run(tmp_path, "flt", [1.0], loops=9)
    write_eval(flt / "step_000010" / "eval.json", [1, 9], acc=lambda K: 0.4, bpb=lambda K: 0.875)
    lt = write_run(tmp_path, "lt", [1.0], variant="LT", loops=9, extra=[{"step": 1, "diverged": True}])
    bare = write_eval(tmp_path / "bare" / "step_000010" / "eval.json", [3], acc=lambda K: 0.5, bpb=lambda K: math.inf)
    out = tmp_path / "t.md"
    md = plot.main(["table", str(flt), str(lt), str(bare.parent), "-o", str(out)])
    assert out.read_text() == md and capsys.readouterr().out == md
    rows = table_rows(md)
    avg = 100 * (0.4 + 0.025)
    assert rows[("FLT", "9")] == [f"{2 ** 0.875:.2f}", "0.875", "90.00", "40.00", "41.00", "42.00", "43.00", "44.00",
                                  "45.00", f"{avg:.2f}"]  # at the trained K only
    assert rows[("LT", "9")] == ["collapsed"] + [""] * 9  # diverged: no eval.json needed
    assert rows[("bare", "3")] == ["collapsed"] + [""] * 9  # an infinite value: collapsed
    never = write_run(tmp_path, "never", [1.0], loops=3)
    write_eval(never / "step_000010" / "eval.json", [1])  # evaluated, but not at its trained K=3
    assert table_rows(plot.main(["table", str(never)]))[("FLT", "3")] == ["-"] * 10  # never measured
    assert len(rows) == 3
    rows = table_rows(plot.main(["table", str(flt), "--paper", "--labels", "ours"]))
    assert list(rows) == [("ours", "9"), ("paper", "9")]  # the paper's row below the run it reports


# The paper's Table 1 as printed: model | K | Wiki2 ppl | val bpb | CORE | Avg of 6 (base size,
# depth 12), then the small size (depth 6) at K=9, which reports ppl and bpb only.
TABLE1 = """
| LT  | 3 | 43.12 | 0.905 | 16.13 | 40.52 |
| LT  | 6 | 51.38 | 0.947 | 11.43 | 36.56 |
| LT  | 9 | collapsed | | | |
| LT_i | 6 | 39.58 | 0.900 | 15.30 | 40.20 |
| FLT | 3 | 40.47 | 0.898 | 15.37 | 39.90 |
| FLT | 6 | 39.51 | 0.892 | 15.60 | 41.38 |
| FLT | 9 | 38.44 | 0.892 | 16.16 | 41.72 |
"""
TABLE1_SMALL = {"LT": ("78.79", "1.115"), "FLT": ("63.29", "1.040")}


def test_table_paper_rows_are_spec_9(tmp_path):
    """--paper puts the paper's numbers under every run of a configuration Table 1 reports, in its
    columns (the six tasks are not in the paper's Table 1: "-"), and "collapsed" where training collapsed."""
    expected = {}
    for line in TABLE1.strip().splitlines():
        variant, K, *numbers = [c.strip() for c in line.strip("|").split("|")]
        ppl, bpb, core, avg = numbers
        expected[(12, variant, K)] = [ppl, bpb, core, *["-"] * 6, avg] if ppl != "collapsed" else [ppl] + [""] * 9
    for variant, (ppl, bpb) in TABLE1_SMALL.items():
        expected[(6, variant, "9")] = [ppl, bpb, *["-"] * 8]
    runs = []
    for depth, variant, K in expected:
        run = write_run(tmp_path, f"{variant}_d{depth}_k{K}", [1.0], variant=variant, loops=int(K), depth=depth)
        write_eval(run / "step_000010" / "eval.json", [int(K)])
        runs.append(str(run))
    runs.append(str(write_run(tmp_path, "flt_k12", [1.0], loops=12)))  # not in Table 1: no paper row
    write_eval(tmp_path / "flt_k12" / "step_000010" / "eval.json", [12])
    md = plot.main(["table", *runs, "--paper"])
    lines = [[c.strip() for c in line.strip("|").split("|")] for line in md.splitlines()]
    paper = {(int(row[1]), ours[0], row[2]): row[3:] for ours, row in zip(lines[2:], lines[3:]) if row[0] == "paper"}
    assert paper == expected


def test_labels_must_match_inputs(tmp_path):
    log = write_log(tmp_path / "run" / "log.jsonl", [1.0])
    with pytest.raises(ValueError, match="--labels: 2 given for 1 runs"):  # before matplotlib is needed
        plot.main(["diag", str(log), "--labels", "a", "b"])


def test_exit_draws_each_rule_and_exit_table_prints_the_fewest_loops(tmp_path, capsys):
    """exit: fixed K dashed, then each exit rule's curve in the run's colour, a style per rule;
    exit-table: report.exit_rows per run under the run's name, a rerun replacing its own file."""
    pytest.importorskip("matplotlib")
    run = tmp_path / "run"
    run.mkdir()
    (run / "settings.json").write_text(json.dumps({"variant": "FLT", "loops": 4}))
    kl = [{"threshold": 0.1, "val_bpb": 1.05, "mean_loops": 2.0},
          {"threshold": 0.0, "val_bpb": 1.0, "mean_loops": 4.0}]
    argmax = [{"threshold": 2, "val_bpb": 1.005, "mean_loops": 3.0},
              {"threshold": 1, "val_bpb": 1.2, "mean_loops": 1.5}]
    results = {"2": {"val_bpb": 1.1}, "4": {"val_bpb": 1.0, "exit": kl,
                                           "exit_rules": {"argmax": argmax}}}
    (run / "step_000010").mkdir()
    (run / "step_000010" / "eval.json").write_text(json.dumps({"results": results}))
    fig = plot.main(["exit", str(run), "-o", str(tmp_path / "exit.png")])
    lines = fig.axes[0].get_lines()
    assert [line.get_label() for line in lines] == [
        "FLT K=4: K loops for every token", "FLT K=4: kl exit rule (mean loops per token)",
        "FLT K=4: argmax exit rule (mean loops per token)"]
    assert [line.get_linestyle() for line in lines] == ["--", "-", "-"]
    assert [line.get_marker() for line in lines] == ["o", "s", "D"]
    assert len({line.get_color() for line in lines}) == 1
    # argmax's points in the order of their loops
    assert list(lines[2].get_xdata()) == [1.5, 3.0] and list(lines[2].get_ydata()) == [1.2, 1.005]
    out = tmp_path / "exit.md"
    md = plot.main(["exit-table", str(run), "-o", str(out)])
    assert md == report.grid(["run", *report.EXIT_HEADER],
                             [["FLT K=4", *row] for row in report.exit_rows(read_results(run))])
    assert "| FLT K=4 | argmax, K <= 4 | 1.0000 (K=4) | - | 3.00 |" in md
    assert plot.main(["exit-table", str(run), "-o", str(out)]) == md == out.read_text()
    # a rule under two caps K_max: two curves, named by their cap, the lower cap lighter
    results["2"]["exit"] = [{"threshold": 0.1, "val_bpb": 1.1, "mean_loops": 1.5}]
    (run / "step_000010" / "eval.json").write_text(json.dumps({"results": results}))
    lines = plot.main(["exit", str(run), "-o", str(tmp_path / "exit.png")]).axes[0].get_lines()
    assert [(line.get_label(), line.get_alpha()) for line in lines[1:]] == [
        ("FLT K=4: kl exit rule, K <= 2 (mean loops per token)", 0.5),
        ("FLT K=4: kl exit rule, K <= 4 (mean loops per token)", 1.0),
        ("FLT K=4: argmax exit rule, K <= 4 (mean loops per token)", 1.0)]
    assert list(lines[1].get_xdata()) == [1.5] and list(lines[2].get_xdata()) == [2.0, 4.0]


def read_results(run):
    return {int(K): r for K, r in json.loads((run / "step_000010" / "eval.json").read_text())[
        "results"].items()}


def test_task_exit_draws_loops_per_answer_against_difficulty(tmp_path):
    pytest.importorskip("matplotlib")
    run = tmp_path / "run"
    (run / "step_000010").mkdir(parents=True)
    point = {"threshold": 0.1, "acc": 0.5, "mean_loops": 2.0, "acc_by_difficulty": {"1": 1.0, "2": 0.0},
             "loops_by_difficulty": {"1": 1.5, "2": 2.5}}
    results = {"4": {"task_exit": {"kl": [point], "argmax": [point | {"threshold": 2}]}}}
    (run / "step_000010" / "eval.json").write_text(json.dumps({"results": results}))
    fig = plot.main(["task-exit", str(run), "--labels", "r", "-o", str(tmp_path / "t.png")])
    # a panel per rule, in EXIT_RULES' order, a line per threshold
    assert [ax.get_title() for ax in fig.axes] == ["r: kl, K <= 4", "r: argmax, K <= 4"]
    assert lines_of(fig.axes[0]) == {"0.1: accuracy 0.500, 2.00 loops": ([1, 2], [1.5, 2.5])}
    assert lines_of(fig.axes[1]) == {"2: accuracy 0.500, 2.00 loops": ([1, 2], [1.5, 2.5])}
    (run / "step_000010" / "eval.json").write_text(json.dumps({"results": {"4": {"val_bpb": 1.0}}}))
    with pytest.raises(ValueError, match="no task_exit in its eval.json; run eval.py --modes=tasks"):
        plot.main(["task-exit", str(run), "-o", str(tmp_path / "t.png")])
