"""scripts/gpu_check.py, the one command that checks and measures the recipe on a GPU, run here in
its CPU mode (--tiny): the same parts and code paths at a tiny size, so the command cannot rot."""
import json
import os
import re
import shutil

from conftest import run_module
from test_train import python

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_tiny_gpu_check_runs_every_part_and_reports_what_it_measured(tmp_path, data_dir):
    out = tmp_path / "check.json"
    p = python("-m", "scripts.gpu_check", "--tiny", "--device=cpu", "--compile=off",
               f"--data_dir={data_dir}", f"--authors_dir={tmp_path / 'none'}", f"--out={out}")
    assert p.returncode == 0, p.stderr[-2000:]
    results = json.loads(out.read_text())
    assert [part for part in results if part != "meta"] == ["quickstart", "base", "decode", "numerics"]
    assert not [part for part, r in results.items() if "error" in r], results
    q = results["quickstart"]
    # the quick start ran train.py in bf16 beside an fp32 CPU run of the same steps
    assert q["exit"] == 0 and q["reference_exit"] == 0 and q["graphs"] == 0
    # one host read per optimizer step: the step's one sync (train.py's .tolist())
    assert q["reads_per_step"] == 1
    # bf16 against fp32: the relative rounding of bf16 (2**-8), far below a different function
    assert abs(q["final_val_bpb"] / q["reference_bpb"] - 1) < 2**-6, q
    assert list(q["first_losses"]) == ["0", "1", "2"]
    base = results["base"]
    assert [row["loops"] for row in base["rows"]] == [3, 1]
    # the FLOP count has the loops: the blocks run K times, the head (6 x 512 x 64) once
    k3, k1 = (row["flops_per_token"] for row in base["rows"])
    assert k3 - k1 == 2 * (k1 - 6 * 512 * 64)
    assert all(row["planned_gib"] > 0 and row["tok_per_s"] > 0 for row in base["rows"])
    assert base["top_kernels"] and base["authors"].startswith("skipped")
    # greedy decoding with the KV cache gives the tokens of recomputing the whole forward
    assert [row["same_tokens"] for row in results["decode"]["rows"]] == [1.0, 1.0]
    n = results["numerics"]
    assert n["first_steps_compared"] == 3 and n["first_losses_max_diff"] < 2**-6 * 7
    assert n["logits_mean_diff"] < 0.05 * n["logits_std"] and n["argmax_same"] > 0.9
    for row in ("quick start: exit, final val bpb", "decode K=3 B=1", "first 3 losses vs fp32 CPU"):
        assert row in p.stdout
    # the reference rounded as the measured bpb; no log line of the profiler's own; the file named
    assert re.search(r"quick start: exit, final val bpb +0, \d\.\d{4} +[+-]\d\.\d\d% vs \d\.\d{4}\n", p.stdout)
    assert "profiler_st" not in p.stdout + p.stderr and "USDT" not in p.stdout + p.stderr
    assert re.fullmatch(rf"written to {re.escape(str(out))}; the parts' runs and files are in .*gpu_check\w+",
                        p.stdout.splitlines()[-1])


def test_gpu_check_writes_its_json_beside_its_runs_not_into_the_repository(data_dir):
    """Without --out, gpu_check.json goes to the work folder it names (a new temporary one). The part run:
    numerics, which compiles nothing (decode compiles its static step unless --compile=off)."""
    p = python("-m", "scripts.gpu_check", "--tiny", "--device=cpu", "--parts=numerics", f"--data_dir={data_dir}")
    assert p.returncode == 0, p.stderr[-2000:]
    written = re.fullmatch(r"written to (.*); the parts' runs and files are in (.*)", p.stdout.splitlines()[-1])
    path, work = written.groups()
    assert path == os.path.join(work, "gpu_check.json") and not path.startswith(ROOT)
    assert list(json.load(open(path))) == ["meta", "numerics"]
    shutil.rmtree(work)
    assert not os.path.exists(os.path.join(ROOT, "gpu_check.json"))


def test_gpu_check_refuses_in_one_line_without_a_gpu_or_with_a_bad_setting(tmp_path):
    cases = {(): "--device=cuda: the full check needs a CUDA GPU",
             ("--tiny", "--parts=quickstart,nope"): "'nope' is not one of",
             ("--tiny", "--compile=auto"): "--compile=auto: expected on or off",
             ("--tiny", "--steps=0"): "--steps=0",
             ("--tiny", f"--out={tmp_path}/missing/x.json"): "expected a file in an existing directory"}
    for argv, message in cases.items():
        code, out, err = run_module("scripts.gpu_check", *(("--device=cpu",) if argv else ()), *argv)
        assert code == 1 and len(err.splitlines()) == 1 and message in err, (argv, err)
    assert not (tmp_path / "missing").exists()
