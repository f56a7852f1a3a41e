"""scripts/torchrun_check.py, the headline command's check, in its CPU mode: torchrun with 2 gloo
ranks trains config/flt_base.py's recipe at a tiny size, a copy of its first checkpoint resumes
with --resume=auto, eval.py scores the result, and scripts/zero_check.py runs optim.py's
collectives (both pairs of names) against the single process. What it reports must hold: the
resumed run repeats the uninterrupted run's losses, eval.py's bpb is the training log's final one
(the same function on the same tokens), and the sharded step is the single process's."""
import json
import os
import subprocess
import sys

import forkserver
from conftest import run_module

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def forked(cmd, cwd, stdout, stderr):
    """subprocess.run as torchrun_check calls it (`python ...`, its output and errors into one open
    file), the process forked from one that has imported torch (tests/forkserver.py): eval.py, and
    torchrun with the ranks it starts."""
    assert cmd[0] == sys.executable and stderr == subprocess.STDOUT, (cmd, stderr)
    done = forkserver.run(cmd[1:], cwd, dict(os.environ, OMP_NUM_THREADS="1"), stderr_to_stdout=True,
                          fork_ranks=cmd[1:3] == ["-m", "torch.distributed.run"])
    stdout.write(done.stdout)
    return done


def test_the_headline_commands_cpu_mode_resumes_evaluates_and_shards_exactly(tmp_path, data_dir, monkeypatch):
    out = tmp_path / "check"
    # `python -m scripts.torchrun_check ...`, run in this process; its steps' processes forked
    monkeypatch.setattr(subprocess, "run", forked)
    status, stdout, stderr = run_module("scripts.torchrun_check", "--tiny", "--device=cpu", "--steps=2",
                                        f"--data_dir={data_dir}", f"--out_dir={out}")
    monkeypatch.undo()
    assert status == 0, stdout[-2000:] + stderr[-2000:]
    result = json.loads((out / "torchrun_check.json").read_text())
    assert result["meta"]["tiny"] and result["train"]["exit"] == 0
    # two optimizer steps, a checkpoint after the first: the resumed run repeats step 1
    assert sorted(result["train"]["losses"]) == ["0", "1"]
    assert result["resume"]["steps_compared"] == [1]
    assert result["resume"]["max_abs_loss_diff"] == 0
    assert result["eval"]["val_bpb"] == result["eval"]["train_final_val_bpb"]
    zero = result["zero"]
    assert zero["world_size"] == 2 and zero["backend"] == "gloo"
    assert set(zero["paths"]) == {"this torch", "older names"}
    for path in zero["paths"].values():
        # one step: a reduce-scatter and an all-gather for each AdamW parameter (2) and Muon block
        # (one layer: 4 attention matrices in 2 blocks of 2 ranks, MLP's two shapes 1 each)
        assert path["max_abs_param_diff"] == 0 and path["collectives"] == 2 * (2 + 4), path
    assert f"written to {out / 'torchrun_check.json'}" in stdout
