"""train.py end to end on CPU, tiny shapes: settings errors, learning, exact resume,
2-process torchrun (gloo), and the NaN guard. Each run is a real subprocess."""
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from configurator import configure

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--device=cpu", "--depth=1", "--sequence_len=32", "--device_batch_size=4",
        "--total_batch_size=128", "--bpe_vocab_size=512", "--eval_interval=5", "--eval_tokens=256",
        "--sample_tokens=8", "--momentum_warmup_steps=5"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("data"))


def train(out_dir, data_dir, *args, script="train.py", nproc=1, check=True):
    cmd = [sys.executable, script] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", script]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    p = subprocess.run(cmd + TINY + [f"--out_dir={out_dir}", f"--data_dir={data_dir}", *args],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    if check and p.returncode != 0:
        raise AssertionError(f"train.py failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return p


def losses(out_dir):
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return {r["step"]: r["loss"] for r in records if "loss" in r}, records


# ----------------------------------------------------------------------------- settings

def test_configurator_applies_files_and_flags(tmp_path):
    cfg = tmp_path / "c.py"
    cfg.write_text("import math\ndepth = 2 * 3\nlr = 1\n")
    ns = dict(depth=4, lr=0.5, name="x", flag=False, extra=None)
    out = configure(ns, [str(cfg), "--name=a,b", "--flag", "--extra=7", "--lr=2e-3"])
    assert out == dict(depth=6, lr=2e-3, name="a,b", flag=True, extra=7)
    assert type(out["lr"]) is float  # an int in a file for a float setting becomes a float


@pytest.mark.parametrize("argv, match", [
    (["--nope=1"], "'nope'"),                # unknown key
    (["--depth=abc"], "'depth' expects int"),
    (["--depth=1.5"], "'depth' expects int"),
    (["--flag=maybe"], "'flag' expects a bool"),
    (["--depth"], "--depth=value"),          # a bare flag for a non-bool
    (["config.txt"], "config file"),
])
def test_configurator_errors_name_the_key(argv, match):
    with pytest.raises(ValueError, match=match):
        configure(dict(depth=4, flag=False), argv)


def test_configurator_file_errors(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("depth = 'deep'\n")
    with pytest.raises(ValueError, match="'depth' expects int"):
        configure(dict(depth=4), [str(bad)])
    bad.write_text("dpeth = 3\n")
    with pytest.raises(ValueError, match="unknown setting 'dpeth'"):
        configure(dict(depth=4), [str(bad)])
    with pytest.raises(FileNotFoundError):
        configure(dict(depth=4), [str(tmp_path / "missing.py")])


def test_train_rejects_bad_settings(tmp_path, data_dir):
    p = train(tmp_path / "o", data_dir, "--variant=XL", check=False)
    assert p.returncode != 0 and "variant" in p.stderr
    p = train(tmp_path / "o", data_dir, "--total_batch_size=100", check=False)
    assert p.returncode != 0 and "total_batch_size=100" in p.stderr
    p = train(tmp_path / "o", data_dir, "--compile=maybe", check=False)
    assert p.returncode != 0 and "compile='maybe'" in p.stderr


# ----------------------------------------------------------------------------- training

def test_short_run_learns_logs_and_saves(tmp_path, data_dir):
    out = tmp_path / "run"
    p = train(out, data_dir, "--num_steps=30", "--save_interval=10")
    by_step, records = losses(out)
    assert sorted(by_step) == list(range(30))
    first, last = sum(by_step[s] for s in range(3)) / 3, sum(by_step[s] for s in range(27, 30)) / 3
    assert last < first - 0.5, (first, last)
    bpb = [r["val_bpb"] for r in records if "val_bpb" in r]
    assert len(bpb) == 7 and bpb[-1] < bpb[0]  # steps 0, 5, ..., 30
    r = records[1]
    assert len(r["resid_norms"]) == 3 and all(x > 0 for x in r["resid_norms"])
    for key in ("grad_norm", "grad_mlp_first", "grad_lm_head", "grad_mlp_mid", "grad_attn_mid", "lrm", "tok_per_s"):
        assert r[key] > 0, key
    assert sorted(os.listdir(out)) == ["log.jsonl", "step_000020", "step_000030"]  # keep_checkpoints=2
    assert "sample:" in p.stdout
    saved = torch.load(out / "step_000030" / "model.pt", weights_only=False)
    assert saved["step"] == 30 and saved["config"]["loops"] == 3


def test_resume_reproduces_the_uninterrupted_run(tmp_path, data_dir):
    full, cut = tmp_path / "full", tmp_path / "cut"
    train(full, data_dir, "--num_steps=8", "--save_interval=4", "--variant=LT_i")
    # A run killed after step 4's checkpoint: only that checkpoint is left. Resume it.
    os.makedirs(cut)
    shutil.copytree(full / "step_000004", cut / "step_000004")
    train(cut, data_dir, "--num_steps=8", "--save_interval=4", "--variant=LT_i", "--resume")
    want, _ = losses(full)
    got, _ = losses(cut)
    assert sorted(got) == [4, 5, 6, 7]
    assert [got[s] for s in got] == [want[s] for s in got]  # exact, not approximate
    a = torch.load(full / "step_000008" / "model.pt", weights_only=False)["model"]
    b = torch.load(cut / "step_000008" / "model.pt", weights_only=False)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_resume_refuses_changed_model_settings(tmp_path, data_dir):
    out = tmp_path / "run"
    train(out, data_dir, "--num_steps=2")
    p = train(out, data_dir, "--num_steps=4", "--resume", "--loops=5", check=False)
    assert p.returncode != 0 and "loops" in p.stderr


# A wrapper that runs train.py in-process, so the test can look inside afterwards.
RUNNER = textwrap.dedent("""
    import os, runpy, sys, torch
    sys.argv[0] = "train.py"
    {patch}
    g = runpy.run_path("train.py", run_name="__main__")
    torch.save(g["raw_model"].state_dict(), os.path.join(g["out_dir"], f"params_rank{{g['rank']}}.pt"))
""")


def test_torchrun_two_ranks_stay_identical(tmp_path, data_dir):
    script = tmp_path / "runner.py"
    script.write_text(RUNNER.format(patch=""))
    out = tmp_path / "ddp"
    train(out, data_dir, "--num_steps=12", "--total_batch_size=512", "--eval_interval=6",
          script=str(script), nproc=2)
    p0, p1 = (torch.load(out / f"params_rank{r}.pt") for r in (0, 1))
    assert all(torch.equal(p0[k], p1[k]) for k in p0)
    by_step, _ = losses(out)
    assert by_step[11] < by_step[0] - 0.3
    assert os.path.exists(out / "step_000012" / "rank1.pt")


def test_nan_loss_stops_and_keeps_the_last_checkpoint(tmp_path, data_dir):
    patch = textwrap.dedent("""
        import model
        forward, calls = model.GPT.forward, [0]
        def poisoned(self, idx, targets=None, **kw):
            out = forward(self, idx, targets, **kw)
            if targets is not None and self.training:
                calls[0] += 1
                if calls[0] == 7:  # the 7th training forward = step 6
                    out = out * float("nan")
            return out
        model.GPT.forward = poisoned
    """)
    script = tmp_path / "runner.py"
    script.write_text(RUNNER.format(patch=patch))
    out = tmp_path / "nan"
    p = train(out, data_dir, "--num_steps=10", "--save_interval=5", script=str(script), check=False)
    assert p.returncode == 1
    assert "step 6: loss is nan" in p.stdout + p.stderr
    assert sorted(d for d in os.listdir(out) if d.startswith("step_")) == ["step_000005"]
    by_step, _ = losses(out)
    assert max(by_step) == 5
