"""What a user's own experiment may run into, end to end on CPU: a config file with a mistake in it
(one line naming the file and its line, no traceback), a flag written before a config file (it
still wins), and Ctrl-C during training (the step finishes, a checkpoint is saved, exit 130; a
second Ctrl-C quits at once, leaving no half-written checkpoint), on one process and under torchrun.
"""
import os
import signal
import textwrap

import pytest

import forkserver
from configurator import configure
from flt import checkpoint, cluster
from test_cluster import read_log, torchrun_cmd, wait_for
from test_train import ROOT, TINY, python, runner


# ----------------------------------------------------------------------------- config files

@pytest.mark.parametrize("text, error", [
    ("loops = 6\ndepth = (\n", "2: SyntaxError: '(' was never closed"),
    ("loops = 6\ndepth = x + 1\n", "2: NameError: name 'x' is not defined"),
    # the line of the config file, not of the function it calls
    ("def shards():\n    return 1 / 0\n\nnum_shards = shards()\n", "2: ZeroDivisionError: division by zero"),
    ("return 3\n", "1: SyntaxError: 'return' outside function"),
])
def test_a_mistake_in_a_config_file_is_one_line_naming_its_file_and_line(tmp_path, text, error):
    mine = tmp_path / "mine.py"
    mine.write_text(text)
    p = python("train.py", str(mine), f"--out_root={tmp_path / 'out'}", "--data_dir=none")
    assert p.returncode == 1 and p.stdout == ""
    assert p.stderr == f"train.py: ValueError: {mine}:{error}\n"
    assert os.listdir(tmp_path) == ["mine.py"]  # no run directory, no data


def test_a_flag_wins_over_the_config_files_wherever_it_stands(tmp_path):
    first, second = tmp_path / "first.py", tmp_path / "second.py"
    first.write_text("loops = 6\ndepth = 4\nseed = 1\n")
    second.write_text("depth = 6\n")
    ns = dict(loops=3, depth=2, seed=0)
    # the files first, in their order (the second's depth), then the flags (the loops)
    assert configure(dict(ns), ["--loops=4", str(first), str(second)]) == dict(loops=4, depth=6, seed=1)
    assert configure(dict(ns), [str(second), "--loops=4", str(first)]) == dict(loops=4, depth=4, seed=1)
    # train.py: the run directory is named by the flag's K
    p = python("train.py", "--loops=4", str(first), "--dry_run", f"--out_root={tmp_path / 'out'}")
    assert p.returncode == 0, p.stderr
    assert f"run plan for {tmp_path / 'out'}/d4_flt_k4 (nothing downloaded or trained)" in p.stdout


# ----------------------------------------------------------------------------- Ctrl-C

# Each step is slowed, so the test can press Ctrl-C mid-run.
SLOW = textwrap.dedent("""
    import time, data
    nxt = data.DataLoader.__next__
    def slow(self):
        time.sleep(0.15)
        return nxt(self)
    data.DataLoader.__next__ = slow
""")
# and a second Ctrl-C comes while the checkpoint is written
CTRL_C_IN_THE_SAVE = SLOW + textwrap.dedent("""
    import os, signal
    from flt import checkpoint
    write = checkpoint._save
    def interrupted_write(obj, path):
        os.kill(os.getpid(), signal.SIGINT)
        write(obj, path)
    checkpoint._save = interrupted_write
""")
ARGS = ["--num_steps=30", "--save_interval=1000", "--eval_interval=100", "--sample_tokens=0"]


def ctrl_c(tmp_path, data_dir, patch, nproc=1):
    """A training run (runner with patch; nproc ranks under torchrun) given Ctrl-C, as a terminal
    gives it to the program it runs, once it has logged three steps: (exit status, stderr, out)."""
    out, env = tmp_path / "run", dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    script = runner(tmp_path, patch)
    # `python script`, or torchrun and its ranks, forked from processes that have imported torch
    # (tests/forkserver.py)
    cmd = torchrun_cmd(script, nproc) if nproc > 1 else [script]
    args = [f"--out_dir={out}", f"--data_dir={data_dir}", f"--total_batch_size={128 * nproc}", *ARGS]
    p = forkserver.start(cmd + TINY + args, ROOT, env, fork_ranks=nproc > 1)
    log = out / "log.jsonl"
    # three steps logged, or the run ended already (its output then says why)
    wait_for(lambda: p.poll() is not None or log.exists() and sum(
        '"loss"' in line for line in log.read_text().splitlines()) >= 3, what="three training steps")
    assert p.poll() is None, p.wait()
    os.kill(p.pid, signal.SIGINT)
    done = p.wait(timeout=120)
    return done.returncode, done.stderr, out


def test_ctrl_c_finishes_the_step_saves_and_exits_130(tmp_path, data_dir):
    code, stderr, out = ctrl_c(tmp_path, data_dir, SLOW)
    records = read_log(out)
    trained = [r["step"] for r in records if "loss" in r]
    saved = str(out / checkpoint.step_name(trained[-1] + 1))
    assert code == cluster.INTERRUPTED == 130
    # one line at once, one at the end, no traceback
    assert stderr == (f"{cluster.SAVING}\ninterrupted (SIGINT): saved {saved}; exit 130: continue with "
                      "--resume=auto\n")
    assert records[-1] == {"step": trained[-1] + 1, "interrupted": "SIGINT", "checkpoint": saved}
    assert trained[-1] + 1 < 30 and checkpoint.load_newest(str(out), rank_files=True)[0] == saved


def test_a_second_ctrl_c_quits_at_once_leaving_no_half_written_checkpoint(tmp_path, data_dir):
    code, stderr, out = ctrl_c(tmp_path, data_dir, CTRL_C_IN_THE_SAVE)
    assert code == 130 and stderr == f"{cluster.SAVING}\n{cluster.QUITTING}\n"
    # the save was cut short: its files are in tmp_step_N, which is no checkpoint
    assert list(out.glob("tmp_step_*")) and checkpoint.list_checkpoints(str(out)) == []
    assert not [r for r in read_log(out) if "interrupted" in r]


def test_ctrl_c_under_torchrun_saves_the_same_step_on_every_rank(tmp_path, data_dir):
    # torchrun's agent forwards the terminal's SIGINT to each rank (they run in sessions of their
    # own); the ranks agree through the step's all-reduce, as for a preemption
    code, stderr, out = ctrl_c(tmp_path, data_dir, SLOW, nproc=2)
    records = read_log(out)
    trained = [r["step"] for r in records if "loss" in r]
    saved = str(out / checkpoint.step_name(trained[-1] + 1))
    assert records[-1] == {"step": trained[-1] + 1, "interrupted": "SIGINT", "checkpoint": saved}
    assert stderr.count(cluster.SAVING) == 1  # once a node
    assert f"interrupted (SIGINT): saved {saved}; exit 130: continue with --resume=auto" in stderr
    step_dir, meta = checkpoint.load_newest(str(out), rank_files=True)
    assert step_dir == saved and meta["world_size"] == 2
    assert sorted(os.listdir(step_dir)) == ["model.pt", "rank0.pt", "rank1.pt", "tokenizer.json"]
