"""bench.py at tiny sizes on CPU: its cheapest modes run, and what they print is consistent (each
ratio is the quotient of the two times beside it; memory_step prints one JSON record). The
timings themselves are the machine's, not checked."""
import json
import os
import re

import pytest

from conftest import run_module
from test_train import python

TINY = ["--depth=1", "--sequence_len=32", "--batch_size=2", "--loops=2"]
RATIO = re.compile(r"(.+?) +([\d.]+) ms / +([\d.]+) ms = +([\d.]+)  \(target (.+)\)")


def bench(*args):
    # the hf mode generates after a 16-token prompt: it reads no sequence_len
    tiny = [a for a in TINY if "--mode=hf" not in args or not a.startswith("--sequence_len")]
    p = python("-m", "scripts.bench", *tiny, *args)
    assert p.returncode == 0, p.stderr
    return p.stdout.splitlines()


def test_ratios_print_each_quotient_of_the_two_times():
    lines = bench("--repeats=1", "--gen_tokens=16")
    assert lines[0] == "device cpu, depth 1, T=32, B=2, median of 1"
    rows = [RATIO.fullmatch(line) for line in lines[1:5]]
    assert all(rows), lines
    assert [(m.group(1), m.group(5)) for m in rows] == [
        ("fwd+bwd FLT / LT, loops 2", "0.95-1.05"), ("fwd+bwd loops 6 / loops 3 (FLT)", "<= 2.1"),
        ("loops [1, 3, 6, 9, 12]: one all-loops pass / five passes", "<= 0.45"),
        ("generate 16 tokens, loops 2: cached / recompute", "<= 0.2")]
    for m in rows:
        a, b, r = (float(m.group(i)) for i in (2, 3, 4))
        # the times are rounded to 0.05 ms and the ratio to 0.005
        assert r == pytest.approx(a / b, abs=0.005 + 0.05 * (a + b) / b**2), m.group(0)
    faster = float(re.fullmatch(r"cached generation is ([\d.]+)x faster than recomputing the full forward per token",
                                lines[5]).group(1))
    assert faster == pytest.approx(1 / float(rows[-1].group(4)), abs=0.05 + 0.005 / float(rows[-1].group(4)) ** 2)
    assert len(lines) == 6


def test_memory_step_prints_one_json_record():
    lines = bench("--mode=memory_step", "--compile_mode=eager", "--vocab_size=512")
    record = json.loads(lines[-1])
    assert record.keys() == {"peak", "warmup", "step"}
    assert isinstance(record["peak"], int) and record["peak"] >= 0 and record["step"] > 0


def test_lmeval_prints_the_quotient_of_a_sweep_and_five_passes(embedded):
    pytest.importorskip("lm_eval")
    data_dir = os.path.dirname(os.path.dirname(embedded[0]))  # the session's embedded corpus
    *_, head, row1, row2 = bench("--mode=lmeval", "--repeats=1", f"--data_dir={data_dir}")  # after the tokenizer's
    assert head == "device cpu, depth 1, T=32, B=2, 32 requests, median of 1"
    rows = [RATIO.fullmatch(row) for row in (row1, row2)]
    assert all(rows) and [(m.group(1), m.group(5)) for m in rows] == [
        ("lm-eval loops [1, 3, 6, 9, 12]: one sweep / five passes", "<= 0.45"),
        ("lm-eval loops [1, 3, 6, 9, 12]: one sweep / one pass at K=12", "<= 1.25")]
    for m in rows:
        a, b, r = (float(m.group(i)) for i in (2, 3, 4))
        assert r == pytest.approx(a / b, abs=0.005 + 0.05 * (a + b) / b**2), m.group(0)


def test_hf_prints_the_quotient_of_transformers_generate_and_the_projects(monkeypatch, embedded):
    pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the folder is local: never a hub lookup
    data_dir = os.path.dirname(os.path.dirname(embedded[0]))  # the session's embedded corpus
    *_, head, row, overhead = bench("--mode=hf", "--repeats=1", "--gen_tokens=8", f"--data_dir={data_dir}")
    assert head == "device cpu, depth 1, B=2, loops 2, 8 tokens after 16, median of 1"
    m = RATIO.fullmatch(row)
    assert m and (m.group(1), m.group(5)) == ("generate 8 tokens: transformers / project", "<= 1.25")
    a, b, r = (float(m.group(i)) for i in (2, 3, 4))
    assert r == pytest.approx(a / b, abs=0.005 + 0.05 * (a + b) / b**2), row
    assert overhead == f"the transformers wrapper's generate takes {m.group(4)}x the time of the project's"


def test_the_decoding_modes_check_runs_plot_and_baseline_before_measuring(tmp_path):
    """--run (each of a list), --plot's directory and --baseline's commit: one line each, before
    a model is loaded (nothing is measured, nothing written)."""
    from test_eval import save_checkpoint
    save_checkpoint(tmp_path)
    good = str(tmp_path / "run")
    before = sorted(os.listdir(tmp_path))
    cases = {(f"--run={good},{tmp_path / 'nope'}",): f"--run: {tmp_path / 'nope'}: no such run",
             (f"--run={tmp_path}",): "no checkpoint in",
             (f"--run={good}", "--baseline=nosuchcommit"): "--baseline=nosuchcommit: no such git commit",
             (f"--run={good}", f"--plot={tmp_path / 'no' / 'x.png'}"): "--plot=.*: expected a file in an existing directory"}
    for mode in ("cache", "speculative"):
        for argv, message in cases.items():
            code, out, err = run_module("scripts.bench", f"--mode={mode}", *argv)
            assert code == 1 and len(err.splitlines()) == 1 and re.search(message, err), (mode, err)
            assert out == ""
    assert sorted(os.listdir(tmp_path)) == before


def test_the_decoding_modes_replace_only_a_plot_they_wrote(tmp_path):
    """--plot goes through scripts.plot's check of its outputs (plot.out_file): an existing file it did
    not write, or the .png that savefig writes for a --plot without extension, is refused in one line
    before anything is measured, and stays as it was; a figure of its own passes the check (the next
    one, --baseline's, stops the run)."""
    pytest.importorskip("matplotlib")
    from scripts import plot
    from test_eval import save_checkpoint
    save_checkpoint(tmp_path)
    good = str(tmp_path / "run")
    (tmp_path / "fig.png").write_bytes(b"\x89PNG\r\n\x1a\n a user's own figure")
    plot.save(plot.pyplot().figure(), str(tmp_path / "own.png"))
    before = {name: (tmp_path / name).read_bytes() for name in ("fig.png", "own.png")}
    cases = {"fig.png": f"--plot={tmp_path / 'fig.png'}: exists, and python -m scripts.plot did not write it",
             "fig": f"--plot={tmp_path / 'fig.png'}: exists, and python -m scripts.plot did not write it",
             "own.png": "--baseline=nosuchcommit: no such git commit",
             "own": "--baseline=nosuchcommit: no such git commit"}
    for mode in ("cache", "speculative"):
        for name, message in cases.items():
            code, out, err = run_module("scripts.bench", f"--mode={mode}", f"--run={good}",
                                        f"--plot={tmp_path / name}", "--baseline=nosuchcommit")
            assert code == 1 and len(err.splitlines()) == 1 and message in err, (mode, name, err)
            assert out == ""
    assert {name: (tmp_path / name).read_bytes() for name in before} == before
    assert "fig" not in os.listdir(tmp_path) and "own" not in os.listdir(tmp_path)
