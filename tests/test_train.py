"""train.py end to end on CPU, tiny shapes: the wiring of its settings checks, learning, exact
resume, 2-process torchrun (gloo), and the NaN guard. Each run is a real subprocess (the settings
checks themselves: tests/test_planning.py)."""
import json
import math
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
    return {r["step"]: r["loss"] for r in records if "loss" in r and not r.get("diverged")}, records


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


@pytest.mark.parametrize("arg, error", [
    ("--compile=maybe", "ValueError: compile='maybe': expected 'auto' or 'on' or 'off'"),
    ("--kv_rank=64", "ValueError: kv_rank=64 does nothing unless attn='mla': remove it, or set what it needs")])
def test_bad_or_inert_setting_stops_train_py_before_any_work(tmp_path, arg, error):
    p = train(tmp_path / "o", tmp_path / "data", arg, check=False)
    assert p.returncode == 1 and p.stderr.rstrip().endswith(error), p.stderr[-1500:]
    assert p.stdout == "" and os.listdir(tmp_path) == []  # no corpus, no run directory

# ----------------------------------------------------------------------------- training


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
    assert sorted(os.listdir(out)) == ["log.jsonl", "run.lock", "settings.json", "step_000020", "step_000030"]
    assert "sample:" in p.stdout
    assert "final_val_bpb" in records[-1]
    # the authors' diagnostic view: rank 0's own gradient (here the only one) after clipping by its norm
    for r in records[:-1]:
        coef = min(1.0, 1.0 / (r["grad_norm"] + 1e-6))
        for key in ("mlp_first", "lm_head", "mlp_mid", "attn_mid"):
            assert r[f"grad_{key}_clipped"] == pytest.approx(coef * r[f"grad_{key}"], rel=1e-4), key
    assert any(r["grad_norm"] > 1.05 for r in records[:-1])  # clipping did change some of them
    saved = torch.load(out / "step_000030" / "model.pt", weights_only=True)
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
    a = torch.load(full / "step_000008" / "model.pt", weights_only=True)["model"]
    b = torch.load(cut / "step_000008" / "model.pt", weights_only=True)["model"]
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
    torch.save(g["model"].state_dict(), os.path.join(g["out_dir"], f"params_rank{{g['rank']}}.pt"))
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
            if targets is not None and self.training:  # train.py's forward: (loss, Loops)
                calls[0] += 1
                if calls[0] == 7:  # the 7th training forward = step 6
                    out = (out[0] * float("nan"), out[1])
            return out
        model.GPT.forward = poisoned
    """)
    script = tmp_path / "runner.py"
    script.write_text(RUNNER.format(patch=patch))
    out = tmp_path / "nan"
    p = train(out, data_dir, "--num_steps=10", "--save_interval=5", script=str(script), check=False)
    assert p.returncode == 1
    assert "step 6: loss nan" in p.stderr and "parameters were not updated" in p.stderr
    assert sorted(d for d in os.listdir(out) if d.startswith("step_")) == ["step_000005"]
    by_step, _ = losses(out)
    assert max(by_step) == 5


# ----------------------------------------------------------------------------- reliability (issue 13)

def checkpoints(out):
    return sorted(d for d in os.listdir(out) if d.startswith("step_"))


def finished_run(tmp_path, data_dir, steps=6, *args):
    out = tmp_path / "run"
    train(out, data_dir, f"--num_steps={steps}", "--save_interval=3", "--sample_tokens=0", *args)
    return out


def test_resume_with_fewer_steps_stops_and_touches_nothing(tmp_path, data_dir):
    out = finished_run(tmp_path, data_dir)
    before = {d: os.path.getmtime(out / d / "model.pt") for d in checkpoints(out)}
    p = train(out, data_dir, "--num_steps=4", "--resume", check=False)
    assert p.returncode != 0 and "step 6 and num_steps=4" in p.stderr
    p = train(out, data_dir, "--num_steps=6", "--resume", check=False)
    assert p.returncode == 0 and "nothing to do" in p.stdout
    assert {d: os.path.getmtime(out / d / "model.pt") for d in checkpoints(out)} == before


def test_nonfinite_gradient_stops_before_the_update_and_saves_nothing(tmp_path, data_dir):
    # The loss stays finite; one gradient turns NaN at step 4 (the 5th training backward).
    patch = textwrap.dedent("""
        import model
        init, calls = model.GPT.init_weights, [0]
        def poison(grad):
            calls[0] += 1
            return grad * float("nan") if calls[0] == 5 else grad
        def init_weights(self):
            init(self)
            self.transformer.h[0].mlp.c_fc.weight.register_hook(poison)
        model.GPT.init_weights = init_weights
    """)
    script = tmp_path / "runner.py"
    script.write_text(RUNNER.format(patch=patch))
    out = tmp_path / "nan"
    p = train(out, data_dir, "--num_steps=10", "--save_interval=3", script=str(script), check=False)
    assert p.returncode == 1
    assert "step 4: loss" in p.stderr and "gradient norm nan" in p.stderr
    assert "parameters were not updated" in p.stderr and "step_000003" in p.stderr
    assert checkpoints(out) == ["step_000003"]
    saved = torch.load(out / "step_000003" / "model.pt", weights_only=True)["model"]
    assert all(torch.isfinite(v).all() for v in saved.values())
    _, records = losses(out)
    assert records[-1]["diverged"] is True and records[-1]["step"] == 4


def test_a_dead_model_stops_with_a_nonzero_exit(tmp_path, data_dir):
    """--matrix_lr=1e6 overflows the residual stream while the loss stays finite (a uniform guess)."""
    out = tmp_path / "dead"
    p = train(out, data_dir, "--num_steps=40", "--matrix_lr=1e6", "--sample_tokens=0", check=False)
    assert p.returncode == 1 and "residual norm inf" in p.stderr, p.stdout[-2000:]
    _, records = losses(out)
    assert records[-1]["diverged"] is True and records[-1]["step"] < 10


def test_loss_far_above_its_minimum_for_a_window_stops_the_run(tmp_path, data_dir):
    patch = textwrap.dedent("""
        import model
        forward = model.GPT.forward
        def worse(self, idx, targets=None, **kw):
            out = forward(self, idx, targets, **kw)
            worse.calls += targets is not None and self.training
            # train.py's forward returns (loss, Loops)
            return (out[0] + 5.0 * (worse.calls > 6), out[1]) if targets is not None and self.training else out
        worse.calls = 0
        model.GPT.forward = worse
    """)
    script = tmp_path / "runner.py"
    script.write_text(RUNNER.format(patch=patch))
    out = tmp_path / "div"
    p = train(out, data_dir, "--num_steps=30", "--divergence_window=4", "--divergence_nats=1.0",
              script=str(script), check=False)
    assert p.returncode == 3 and "diverged" in p.stderr and "divergence_window=4" in p.stderr
    _, records = losses(out)
    # From step 6 the loss is 5 nats up; the EMA (0.9) rises by 0.5, 0.95, 1.36 nats: above the minimum
    # + 1 nat from step 8 on, the 4th such step is 11 (+-1: the loss itself still moves a little).
    assert records[-1]["diverged"] is True and 10 <= records[-1]["step"] <= 12


def test_checkpoints_hold_no_code(tmp_path, data_dir):
    """A crafted model.pt whose unpickling would run a command: refused, nothing runs."""
    out = finished_run(tmp_path, data_dir)
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))
    newest = out / checkpoints(out)[-1]
    torch.save({"model": Evil(), "config": {}}, newest / "model.pt")
    p = train(out, data_dir, "--num_steps=9", "--resume", check=False)
    assert not marker.exists()
    # the crafted checkpoint is named and skipped; the run resumes from the older one
    assert f"skipping {newest}" in p.stdout and "step_000003" in p.stdout
    assert p.returncode == 0, p.stderr
    assert os.path.isdir(str(newest) + ".unreadable")
    p = subprocess.run([sys.executable, "eval.py", str(newest) + ".unreadable", "--modes=bpb"], cwd=ROOT,
                       capture_output=True, text=True)
    assert p.returncode != 0 and not marker.exists()


def test_truncated_checkpoint_falls_back_to_the_newest_readable(tmp_path, data_dir):
    out = finished_run(tmp_path, data_dir)
    newest = out / "step_000006" / "model.pt"
    newest.write_bytes(newest.read_bytes()[:1000])
    os.makedirs(out / "step_zzz")  # not a checkpoint, whatever it holds
    shutil.copy(out / "step_000003" / "model.pt", out / "step_zzz" / "model.pt")
    p = train(out, data_dir, "--num_steps=7", "--resume")
    assert f"skipping {out / 'step_000006'}: {newest}" in p.stdout
    assert "resuming from" in p.stdout and "step_000003 (step 3)" in p.stdout
    assert checkpoints(out) == ["step_000003", "step_000006.unreadable", "step_000007", "step_zzz"]


def test_keep_checkpoints(tmp_path, data_dir):
    out = finished_run(tmp_path, data_dir, 6, "--keep_checkpoints=0")  # 0 keeps every one
    assert checkpoints(out) == ["step_000003", "step_000006"]
    out = tmp_path / "one"
    train(out, data_dir, "--num_steps=6", "--save_interval=3", "--keep_checkpoints=1", "--sample_tokens=0")
    assert checkpoints(out) == ["step_000006"]  # the newest is never the one deleted


def test_fresh_run_refuses_an_out_dir_holding_another_run(tmp_path, data_dir):
    out = finished_run(tmp_path, data_dir)
    log_before = (out / "log.jsonl").read_text()
    p = train(out, data_dir, "--num_steps=6", check=False)
    assert p.returncode != 0 and "--resume" in p.stderr and "--out_dir" in p.stderr
    assert (out / "log.jsonl").read_text() == log_before and checkpoints(out) == ["step_000003", "step_000006"]
    train(out, data_dir, "--num_steps=2", "--save_interval=2", "--overwrite", "--sample_tokens=0")
    assert checkpoints(out) == ["step_000002"]
    by_step, _ = losses(out)
    assert sorted(by_step) == [0, 1]  # the old run's log is gone, not interleaved


def test_two_runs_on_one_out_dir_are_refused(tmp_path, data_dir):
    import checkpoint
    out = tmp_path / "busy"
    os.makedirs(out)
    held = checkpoint.lock_out_dir(str(out))
    try:
        p = train(out, data_dir, "--num_steps=2", check=False)
    finally:
        held.close()
    assert p.returncode != 0 and "is in use by pid" in p.stderr and "step " not in p.stdout


def test_unwritable_out_dir_is_found_before_training(tmp_path, data_dir):
    blocker = tmp_path / "file"
    blocker.write_text("")
    p = train(blocker / "out", data_dir, check=False)
    assert p.returncode != 0 and "is not writable" in p.stderr and "step " not in p.stdout


def test_hung_rank_ends_the_job_after_dist_timeout(tmp_path, data_dir):
    patch = textwrap.dedent("""
        import os, time, data
        if os.environ.get("RANK") == "1":
            nxt = data.DataLoader.__next__
            def hang(self):
                time.sleep(120)
                return nxt(self)
            data.DataLoader.__next__ = hang
    """)
    script = tmp_path / "runner.py"
    script.write_text(RUNNER.format(patch=patch))
    p = train(tmp_path / "hang", data_dir, "--num_steps=4", "--total_batch_size=256", "--dist_timeout=5",
              script=str(script), nproc=2, check=False)
    assert p.returncode != 0
    assert "timed out" in (p.stdout + p.stderr).lower() or "timeout" in (p.stdout + p.stderr).lower()


def test_core_during_training_equals_eval_on_the_same_weights(tmp_path, data_dir):
    from test_eval import make_bundle  # the handmade DCLM-style bundle of the eval tests
    bundle = make_bundle(tmp_path / "bundle")
    out = tmp_path / "core"
    train(out, data_dir, "--num_steps=6", "--save_interval=6", "--core_interval=3", f"--bundle_dir={bundle}",
          "--core_max_per_task=4", "--sample_tokens=0")
    _, records = losses(out)
    core = {r["step"]: r["core"] for r in records if "core" in r}
    assert sorted(core) == [0, 3, 6]
    p = subprocess.run([sys.executable, "eval.py", str(out), "--modes=core", "--loops=3", "--max_per_task=4",
                        "--batch_size=4", f"--bundle_dir={bundle}", "--device=cpu"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    saved = json.loads((out / "step_000006" / "eval.json").read_text())
    assert saved["results"]["3"]["CORE"] == pytest.approx(core[6], abs=1e-12)


def test_compiled_bf16_two_ranks_with_loop_checkpointing(tmp_path, data_dir):
    """The GPU recipe's code paths on CPU: regional torch.compile, bf16 autocast with a bf16
    embedding and bf16 Newton-Schulz, per-loop checkpointing, 2 gloo ranks."""
    script = tmp_path / "runner.py"
    script.write_text(RUNNER.format(patch=""))
    out = tmp_path / "gpu_paths"
    train(out, data_dir, "--num_steps=4", "--total_batch_size=256", "--compile=on", "--dtype=bf16",
          "--checkpoint_loops", "--sample_tokens=0", script=str(script), nproc=2)
    p0, p1 = (torch.load(out / f"params_rank{r}.pt") for r in (0, 1))
    assert p0["transformer.wte.weight"].dtype == torch.bfloat16
    assert all(torch.equal(p0[k], p1[k]) for k in p0)
    by_step, records = losses(out)
    assert sorted(by_step) == [0, 1, 2, 3] and all(math.isfinite(v) for v in by_step.values())
    saved = torch.load(out / "step_000004" / "model.pt", weights_only=True)
    assert saved["settings"]["dtype"] == "bf16"


def test_dry_run_plans_the_paper_run_without_touching_anything(tmp_path):
    cmd = [sys.executable, "train.py", "config/flt_base.py", "--dry_run", f"--data_dir={tmp_path / 'data'}",
           f"--out_root={tmp_path / 'out'}", "--gpu=H100"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert os.listdir(tmp_path) == []  # nothing downloaded, no run directory
    # independent arithmetic: base = depth 12, d 768, Qwen3's 151,669 ids padded to 151,680, K = 9
    d, L, V, K, T = 768, 12, 151680, 9, 1024
    n_all = 2 * V * d + 12 * L * d * d
    steps = 20 * n_all // 2**19
    flops = 6 * (12 * L * d * d * K + V * d) + 12 * d * T * L * K
    out = p.stdout
    assert f"{n_all:,} all, {n_all - V * d:,} without the token embedding" in out
    assert f"{steps:,} steps x 524,288 tokens" in out and steps == 12127
    assert f"the other count: {20 * (n_all - V * d) // 2**19:,} steps" in out
    assert f"{flops:.3e} per token" in out and 6.2e9 < flops < 6.4e9
    assert f"{flops * steps * 2**19:.3e} in all" in out and 3.9e19 < flops * steps * 2**19 < 4.1e19
    assert "FineWeb-Edu training shards" in out and "GPUs (estimate, GiB)" in out and "8 x H100" in out


def test_eval_computes_the_function_training_computed(tmp_path, data_dir):
    """A bf16 run's final validation bpb, recomputed by eval.py on the same tokens and batches:
    equal only if eval runs the checkpoint in the training numerics (bf16 embedding, autocast)."""
    out = tmp_path / "bf16"
    train(out, data_dir, "--num_steps=3", "--save_interval=3", "--dtype=bf16", "--final_eval_tokens=1024",
          "--sample_tokens=0")
    _, records = losses(out)
    val = os.path.join(data_dir, "embedded", "shard_00004.parquet")
    for dtype, same in (("", True), ("fp32", False)):
        # the in-training layout (1 rank, device batch 4) instead of eval.sh's 4 x 4: the same tokens
        p = subprocess.run([sys.executable, "eval.py", str(out), "--modes=bpb", "--loops=3", "--batch_size=4",
                            "--bpb_tokens=1024", f"--val_files={val}", "--device=cpu", f"--dtype={dtype}",
                            "--protocol_ranks=1", "--protocol_batch=4",
                            f"--out={tmp_path / (dtype or 'trained')}.json"],
                           cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr
        bpb = json.loads((tmp_path / f"{dtype or 'trained'}.json").read_text())["results"]["3"]["val_bpb"]
        assert (bpb == records[-1]["final_val_bpb"]) is same, (dtype, bpb, records[-1]["final_val_bpb"])


def test_a_sampled_loop_count_names_its_run_directory():
    p = subprocess.run([sys.executable, "train.py", "--loops_sampler=uniform", "--loops_max=5", "--dry_run"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "run plan for out/d3_flt_k3_uniform " in p.stdout, p.stderr
