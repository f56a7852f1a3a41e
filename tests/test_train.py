"""train.py end to end on CPU, tiny shapes: the wiring of its settings checks, learning, exact
resume, 2-process torchrun (gloo), and the NaN guard. Each run is a process of its own, forked from
one that has imported torch (tests/forkserver.py), and so is each rank torchrun starts (the settings
checks themselves: tests/test_planning.py)."""
import json
import math
import os
import re
import shutil
import textwrap
import time

import pyarrow.parquet as pq
import pytest
import tokenizers
import torch

import forkserver
from configurator import configure

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--device=cpu", "--depth=1", "--sequence_len=32", "--device_batch_size=4",
        "--total_batch_size=128", "--bpe_vocab_size=512", "--eval_interval=5", "--eval_tokens=256",
        "--final_eval_tokens=256", "--sample_tokens=8", "--momentum_warmup_steps=5"]


def python(*argv, timeout=300, fork_ranks=False):
    """`python argv...` in ROOT with one torch thread, as a process forked from one that has already
    imported torch (tests/forkserver.py): the same process boundary, seconds sooner. fork_ranks: argv
    is torchrun's, and its ranks are forked as well."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    return forkserver.run(argv, ROOT, env, timeout, fork_ranks=fork_ranks)


def train(out_dir, data_dir, *args, script="train.py", nproc=1, check=True, torchrun=("-m", "torch.distributed.run")):
    """train.py (or a runner script) with TINY + args; out_dir None: train.py derives it (out_root).
    nproc > 1: `python -m torch.distributed.run --standalone` (or the torchrun program given), its agent
    forked as well, and the ranks it starts, `python -u script`, each in a session of its own as torchrun
    starts them (tests/forkserver.py: fork_ranks)."""
    args = TINY + ([f"--out_dir={out_dir}"] if out_dir is not None else []) + [f"--data_dir={data_dir}", *args]
    if nproc == 1:
        p = python(script, *args)
    else:
        p = python(*torchrun, "--standalone", f"--nproc_per_node={nproc}", script, *args, fork_ranks=True)
    if check and p.returncode != 0:
        raise AssertionError(f"train.py failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return p


def losses(out_dir):
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return {r["step"]: r["loss"] for r in records if "loss" in r and not r.get("diverged")}, records


# A wrapper that runs train.py in-process, so the test can look inside afterwards.
RUNNER = textwrap.dedent("""
    import os, runpy, sys, torch
    sys.argv[0] = "train.py"
    {patch}
    g = runpy.run_path("train.py", run_name="__main__")
    torch.save(g["model"].state_dict(), os.path.join(g["out_dir"], f"params_rank{{g['rank']}}.pt"))
""")


def runner(tmp_path, patch=""):
    """The path of a RUNNER script that applies `patch` first."""
    script = tmp_path / "runner.py"
    script.write_text(RUNNER.format(patch=patch))
    return str(script)


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
    (["--resume=sometimes"], r"setting 'resume' expects a bool \(true/false\) or auto, got 'sometimes'"),
    (["--depth=abc"], "'depth' expects int"),
    (["--depth=1.5"], "'depth' expects int"),
    (["--flag=maybe"], "'flag' expects a bool"),
    (["--depth"], "--depth=value"),          # a bare flag for a non-bool
    (["config.txt"], "config file"),
])
def test_configurator_errors_name_the_key(argv, match):
    with pytest.raises(ValueError, match=match):
        configure(dict(depth=4, flag=False, resume=False, _ALSO_ACCEPTS={"resume": ("auto",)}), argv)


def test_a_bool_setting_may_take_its_words(tmp_path):
    ns = dict(resume=False, flag=False, _ALSO_ACCEPTS={"resume": ("auto",)})
    assert configure(dict(ns), ["--resume=auto"]) == dict(resume="auto", flag=False)
    assert configure(dict(ns), ["--resume"]) == dict(resume=True, flag=False)
    cfg = tmp_path / "c.py"
    cfg.write_text("resume = 'auto'\n")
    assert configure(dict(ns), [str(cfg)])["resume"] == "auto"
    with pytest.raises(ValueError, match="setting 'flag' expects a bool"):
        configure(dict(ns), ["--flag=auto"])  # the word is resume's only


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
    ("--kv_rank=64", "ValueError: kv_rank=64 does nothing unless attn='mla': remove it (or a config file's value: --kv_rank=128, its default), or set what it needs")])
def test_bad_or_inert_setting_stops_train_py_before_any_work(tmp_path, arg, error):
    p = train(tmp_path / "o", tmp_path / "data", arg, check=False)
    assert p.returncode == 1 and p.stderr.rstrip().endswith(error), p.stderr[-1500:]
    assert p.stdout == "" and os.listdir(tmp_path) == []  # no corpus, no run directory


# ----------------------------------------------------------------------------- training

# The keys of a log line (docs/lm_eval_and_tracking.md, "Logs and plots"): a training step's on CPU (mem_gib is CUDA's),
# an evaluation's, and the last step's.
STEP_KEYS = {"step", "loss", "loops", "lrm", "grad_norm", "resid_norms", "tok_per_s", "dt", "mfu"} | {
    f"grad_{m}{c}" for m in ("mlp_first", "lm_head", "mlp_mid", "attn_mid") for c in ("", "_clipped")}
VAL_KEYS = {"val_bpb", "val_bpb_utf8", "val_tokens"}


def split_targets(val_file, tokenizer_json, batch, seq_len, n_tokens):
    """Targets one rank scores in the validation split, counted without data.py: the documents as one
    stream of [BOS] + tokens, cut into chunks of batch * seq_len + 1 tokens (the last shorter, if it has
    two), each scoring all its tokens but the first; n_tokens // (batch * seq_len) chunks at most."""
    tok = tokenizers.Tokenizer.from_file(str(tokenizer_json))
    tok.encode_special_tokens = True
    texts = pq.read_table(val_file, columns=["text"]).column("text").to_pylist()
    n, size = sum(1 + len(e.ids) for e in tok.encode_batch(texts, add_special_tokens=False)), batch * seq_len + 1
    chunks = [size] * (n // size) + ([n % size] if n % size >= 2 else [])
    return sum(c - 1 for c in chunks[:n_tokens // (batch * seq_len)])


def test_short_run_learns_logs_and_saves(tmp_path):
    root, data_dir = tmp_path / "runs", str(tmp_path / "data")  # a new data_dir: the quick start's first run
    p = train(None, data_dir, f"--out_root={root}", "--num_steps=30", "--save_interval=10", f"--final_eval_tokens={2**20}",
              "--log_clipped_norms",
              script=runner(tmp_path))
    assert os.listdir(root) == ["d1_flt_k3"]  # named by train.py: depth 1, FLT, K = 3
    assert re.search(rf"embedded corpus: [\d,]+ docs, [\d,]+ bytes in 5 shards at {data_dir}/embedded", p.stdout)
    assert f"trained a 512-token BPE on 4 files -> {data_dir}/embedded" in p.stdout
    out = root / "d1_flt_k3"
    assert sorted(os.listdir(out)) == ["log.jsonl", "params_rank0.pt", "run.lock", "settings.json", "step_000020",
                                       "step_000030"]
    by_step, records = losses(out)
    assert sorted(by_step) == list(range(30))
    first, last = sum(by_step[s] for s in range(3)) / 3, sum(by_step[s] for s in range(27, 30)) / 3
    assert last < first - 0.5, (first, last)
    for r in records[:-1]:  # steps 0-29; evaluations at 0, 5, ..., 25 (eval_interval=5)
        assert r.keys() == STEP_KEYS | (VAL_KEYS if r["step"] % 5 == 0 else set()), r["step"]
    assert records[-1].keys() == {"step"} | VAL_KEYS | {f"final_{k}" for k in VAL_KEYS} and records[-1]["step"] == 30
    bpb = [r["val_bpb"] for r in records if "val_bpb" in r]
    assert len(bpb) == 7 and bpb[-1] < bpb[0]
    # validation: eval_tokens=256 is 2 chunks of 4 x 32; final_eval_tokens=2**20 is more than the split: all of it, once
    val, tokenizer = os.path.join(data_dir, "embedded", "shard_00004.parquet"), out / "step_000030" / "tokenizer.json"
    assert {r["val_tokens"] for r in records if "val_tokens" in r} == {split_targets(val, tokenizer, 4, 32, 256)} == {256}
    assert records[-1]["final_val_tokens"] == split_targets(val, tokenizer, 4, 32, 2**20) < 2**20
    steps = records[:-1]
    assert [r["lrm"] for r in steps] == [1.0] * 25 + [5 / 6, 4 / 6, 3 / 6, 2 / 6, 1 / 6]  # warm-down: last 6 steps
    for r in steps:
        assert r["loops"] == 3 and r["mfu"] is None and r["tok_per_s"] == pytest.approx(128 / r["dt"], rel=1e-9)
        assert len(r["resid_norms"]) == 3 and all(0 < x < math.inf for x in r["resid_norms"])
        # depth 1: the watched layer is block 0, whose MLP is also the first; lm_head, block 0's MLP and its
        # attention are disjoint, and the embedding's gradient is the rest of the global norm
        assert r["grad_mlp_mid"] == r["grad_mlp_first"]
        assert 0 < r["grad_lm_head"] ** 2 + r["grad_mlp_first"] ** 2 + r["grad_attn_mid"] ** 2 < r["grad_norm"] ** 2
        # the authors' diagnostic view: rank 0's own gradient (here the only one) after clipping by its norm
        coef = min(1.0, 1.0 / (r["grad_norm"] + 1e-6))
        for key in ("mlp_first", "lm_head", "mlp_mid", "attn_mid"):
            assert r[f"grad_{key}_clipped"] == pytest.approx(coef * r[f"grad_{key}"], rel=1e-4), key
    assert any(r["grad_norm"] > 1.05 for r in steps)  # clipping did change some of them
    assert "sample:" in p.stdout
    # the checkpoint holds the model as training left it, its settings as the run directory has them
    saved = torch.load(out / "step_000030" / "model.pt", weights_only=True)
    final = torch.load(out / "params_rank0.pt")
    assert saved["model"].keys() == final.keys() and all(torch.equal(saved["model"][k], final[k]) for k in final)
    assert saved["step"] == 30 and saved["config"]["loops"] == 3 and saved["config"]["n_layer"] == 1
    assert saved["settings"] == json.loads((out / "settings.json").read_text())
    assert saved["settings"]["out_dir"] == str(out)
    rank0 = torch.load(out / "step_000030" / "rank0.pt", weights_only=True)
    assert rank0.keys() == {"optimizers", "loader", "rng", "cuda_rng", "monitor"} and len(rank0["optimizers"]) == 2


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
    out = tmp_path / "nan"
    p = train(out, data_dir, "--num_steps=10", "--save_interval=5", script=runner(tmp_path, patch), check=False)
    assert p.returncode == 1
    assert "step 6: loss nan" in p.stderr and "parameters were not updated" in p.stderr
    assert sorted(d for d in os.listdir(out) if d.startswith("step_")) == ["step_000005"]
    by_step, _ = losses(out)
    assert max(by_step) == 5


# ----------------------------------------------------------------------------- reliability: nothing lost on a failure

def checkpoints(out):
    return sorted(d for d in os.listdir(out) if d.startswith("step_"))


def finished_run(tmp_path, data_dir, steps=6, *args):
    out = tmp_path / "run"
    train(out, data_dir, f"--num_steps={steps}", "--save_interval=3", "--sample_tokens=0", *args)
    return out


@pytest.fixture(scope="module")
def finished_once(tmp_path_factory, data_dir):
    """finished_run's 6 steps, trained once per module and kept aside as a template."""
    base = tmp_path_factory.mktemp("finished")
    os.rename(finished_run(base, data_dir), base / "template")
    return base


@pytest.fixture
def finished(finished_once):
    """A fresh copy of finished_run(tmp_path, data_dir) for a test to change: checkpoints at steps 3 and 6,
    at the path it was trained in, which its settings name (a resume may not move it)."""
    out = finished_once / "run"
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(finished_once / "template", out)
    return out


def test_resume_with_fewer_steps_stops_and_touches_nothing(tmp_path, data_dir, finished):
    out = finished
    before = {d: os.path.getmtime(out / d / "model.pt") for d in checkpoints(out)}
    p = train(out, data_dir, "--num_steps=4", "--resume", check=False)
    assert p.returncode != 0 and "step 6 and num_steps=4" in p.stderr
    p = train(out, data_dir, "--num_steps=6", "--resume", check=False)
    assert p.returncode == 0 and "nothing to do" in p.stdout
    assert {d: os.path.getmtime(out / d / "model.pt") for d in checkpoints(out)} == before


def test_resume_may_change_only_the_resumable_settings(tmp_path, data_dir, finished):
    out = finished  # 6 steps, checkpoints at 3 and 6, evaluations every 5 steps
    p = train(out, data_dir, "--num_steps=9", "--save_interval=3", "--sample_tokens=0", "--eval_interval=2", "--resume")
    # the changed settings in the checkpoint's order (train.py's)
    changed = "num_steps, eval_interval, resume"
    assert f"resuming from {out / 'step_000006'} (step 6); settings changed: {changed}" in p.stdout
    by_step, records = losses(out)
    resumed = records[records.index(next(r for r in records if r["step"] == 6 and "loss" in r)):]
    assert sorted(by_step) == list(range(9)) and checkpoints(out) == ["step_000006", "step_000009"]
    assert [r["step"] for r in resumed if "val_bpb" in r] == [6, 8, 9]  # every 2 steps now, and the last
    log, saved = (out / "log.jsonl").read_text(), checkpoints(out)
    p = train(out, data_dir, "--num_steps=12", "--resume", "--loops=5", "--matrix_lr=0.03", check=False)
    assert p.returncode == 1 and (f"ValueError: --resume: settings ['loops', 'matrix_lr'] differ from the checkpoint "
                                  f"{out / 'step_000009'}; only ") in p.stderr
    assert (out / "log.jsonl").read_text() == log and checkpoints(out) == saved


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
    out = tmp_path / "nan"
    p = train(out, data_dir, "--num_steps=10", "--save_interval=3", script=runner(tmp_path, patch), check=False)
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
    assert p.returncode == 1 and "residual norms' sum inf" in p.stderr, p.stdout[-2000:]
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
    out = tmp_path / "div"
    p = train(out, data_dir, "--num_steps=30", "--divergence_window=4", "--divergence_nats=1.0",
              script=runner(tmp_path, patch), check=False)
    assert p.returncode == 3 and "diverged" in p.stderr and "divergence_window=4" in p.stderr
    _, records = losses(out)
    # From step 6 the loss is 5 nats up; the EMA (0.9) rises by 0.5, 0.95, 1.36 nats: above the minimum
    # + 1 nat from step 8 on, the 4th such step is 11 (+-1: the loss itself still moves a little).
    assert records[-1]["diverged"] is True and 10 <= records[-1]["step"] <= 12


def test_checkpoints_hold_no_code(tmp_path, data_dir, finished):
    """A crafted model.pt whose unpickling would run a command: refused, nothing runs."""
    out = finished
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
    p = python("eval.py", str(newest) + ".unreadable", "--modes=bpb")
    assert p.returncode != 0 and not marker.exists()


def test_truncated_checkpoint_falls_back_to_the_newest_readable(tmp_path, data_dir, finished):
    out = finished
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


def test_fresh_run_refuses_an_out_dir_holding_another_run(tmp_path, data_dir, finished):
    out = finished
    log_before = (out / "log.jsonl").read_text()
    p = train(out, data_dir, "--num_steps=6", check=False)
    assert p.returncode != 0 and "--resume" in p.stderr and "--out_dir" in p.stderr
    assert (out / "log.jsonl").read_text() == log_before and checkpoints(out) == ["step_000003", "step_000006"]
    train(out, data_dir, "--num_steps=2", "--save_interval=2", "--overwrite", "--sample_tokens=0")
    assert checkpoints(out) == ["step_000002"]
    by_step, _ = losses(out)
    assert sorted(by_step) == [0, 1]  # the old run's log is gone, not interleaved


def test_two_runs_on_one_out_dir_are_refused(tmp_path, data_dir):
    from flt import checkpoint
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


# torchrun with a 2 s wait between a worker's SIGTERM and its SIGKILL, instead of the 30 s with which
# torch closes the workers once one has failed (its --shutdown_timeout does not reach that path).
TORCHRUN_QUICK_KILL = textwrap.dedent("""
    from torch.distributed.elastic.multiprocessing.api import PContext
    from torch.distributed.run import main
    close = PContext.close
    PContext.close = lambda self, death_sig=None, timeout=30: close(self, death_sig, min(timeout, 2))
    main()
""")


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
    quick_kill = tmp_path / "torchrun_quick_kill.py"
    quick_kill.write_text(TORCHRUN_QUICK_KILL)
    t0 = time.time()
    p = train(tmp_path / "hang", data_dir, "--num_steps=4", "--total_batch_size=256", "--dist_timeout=5",
              script=runner(tmp_path, patch), nproc=2, check=False, torchrun=[str(quick_kill)])
    # rank 0 waits 5 s (dist_timeout) for rank 1 in a collective, gives up with gloo's timeout error,
    # and torchrun ends the job: rank 1, still asleep, is killed long before its 120 s are over (its
    # SIGTERM only asks for a checkpoint after the step, cluster.py: SIGKILL follows, after torchrun's
    # wait, 2 s here: TORCHRUN_QUICK_KILL)
    assert p.returncode == 1 and time.time() - t0 < 90
    assert re.search(r"\[rank0\]: RuntimeError: .*Timed out waiting 5000ms", p.stderr), p.stderr[-3000:]
    assert re.search(r"rank\s+: 1 \(local_rank: 1\)\s+exitcode\s+: -9 .*\(SIGKILL\)", p.stderr)
    assert re.search(r"Root Cause \(first observed failure\):\s+\[0\]:.*?rank\s+: 0 \(local_rank: 0\)\s+exitcode\s+: 1 ",
                     p.stderr, re.S)
    assert "[rank1]" not in p.stderr  # rank 1 never got to raise anything


def test_core_during_training_equals_eval_on_the_same_weights(tmp_path, data_dir):
    from test_eval import make_bundle  # the handmade DCLM-style bundle of the eval tests
    bundle = make_bundle(tmp_path / "bundle")
    out = tmp_path / "core"
    train(out, data_dir, "--num_steps=6", "--save_interval=6", "--core_interval=3", f"--bundle_dir={bundle}",
          "--core_max_per_task=4", "--sample_tokens=0")
    _, records = losses(out)
    core = {r["step"]: r["core"] for r in records if "core" in r}
    assert sorted(core) == [0, 3, 6]
    p = python("eval.py", str(out), "--modes=core", "--loops=3", "--max_per_task=4", "--batch_size=4",
               f"--bundle_dir={bundle}", "--device=cpu")
    assert p.returncode == 0, p.stderr
    saved = json.loads((out / "step_000006" / "eval.json").read_text())
    # max_per_task off eval.py's default: kept under its label
    assert saved["results"]["3"]["CORE[max_per_task=4]"] == pytest.approx(core[6], abs=1e-12)


# Each rank writes the precision its Muon runs Newton-Schulz in.
NS_DTYPE = textwrap.dedent("""
    import os, optim
    init = optim.Muon.__init__
    def recording(self, *args, **kwargs):
        init(self, *args, **kwargs)
        with open(os.path.join(os.environ["NS_DTYPE_DIR"], f"rank{os.environ.get('RANK', 0)}"), "w") as f:
            f.write(str(self.ns_dtype))
    optim.Muon.__init__ = recording
""")


def test_bf16_two_ranks_with_loop_checkpointing(tmp_path, data_dir, monkeypatch):
    """The GPU recipe's numerics on CPU: bf16 autocast with a bf16 embedding and bf16 Newton-Schulz,
    per-loop checkpointing, 2 gloo ranks ending with the same parameters. torch.compile: below, in
    one process (each rank compiles its own blocks, and no collective runs in a compiled region)."""
    out = tmp_path / "gpu_paths"
    monkeypatch.setenv("NS_DTYPE_DIR", str(tmp_path))
    train(out, data_dir, "--num_steps=4", "--total_batch_size=256", "--dtype=bf16", "--variant=LT",
          "--loops=2", "--checkpoint_loops", "--sample_tokens=0", script=runner(tmp_path, NS_DTYPE), nproc=2)
    assert [(tmp_path / f"rank{r}").read_text() for r in (0, 1)] == ["torch.bfloat16"] * 2
    p0, p1 = (torch.load(out / f"params_rank{r}.pt") for r in (0, 1))
    assert p0["transformer.wte.weight"].dtype == torch.bfloat16
    assert all(torch.equal(p0[k], p1[k]) for k in p0)
    by_step, records = losses(out)
    assert sorted(by_step) == [0, 1, 2, 3] and all(math.isfinite(v) for v in by_step.values())
    saved = torch.load(out / "step_000004" / "model.pt", weights_only=True)
    assert saved["settings"]["dtype"] == "bf16"


def test_inductor_generates_and_runs_the_bf16_training_step(tmp_path, data_dir, monkeypatch):
    """train.py --compile=on as a GPU runs it, torch.compile's own backend (inductor) included: the
    blocks' and the loss's bf16 code generated, compiled and run, forward and the per-loop
    checkpointed backward, and the run trains (graph counts and recompiles: tests/test_gpu_path.py)."""
    cache = tmp_path / "inductor"
    # this run's own inductor cache, so that the kernels found there are the ones it compiled
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
    out = tmp_path / "inductor_run"
    # LT: one kind of layer in every loop, so the fewest graphs to compile (FLT's: tests/test_gpu_path.py)
    train(out, data_dir, "--num_steps=2", "--compile=on", "--dtype=bf16", "--variant=LT", "--loops=2",
          "--checkpoint_loops", "--sample_tokens=0")
    by_step, _ = losses(out)
    assert sorted(by_step) == [0, 1] and all(math.isfinite(v) for v in by_step.values())
    assert list(cache.rglob("*.so")), "inductor compiled no kernel"


def test_dry_run_plans_the_paper_run_without_touching_anything(tmp_path):
    p = python("train.py", "config/flt_base.py", "--dry_run", f"--data_dir={tmp_path / 'data'}",
               f"--out_root={tmp_path / 'out'}", "--gpu=H100", timeout=120)
    assert p.returncode == 0, p.stderr
    assert os.listdir(tmp_path) == []  # nothing downloaded, no run directory
    # Independent arithmetic. base: depth 12, d = 768, Qwen3's 151,669 ids padded to 151,680, K = 9, T = 1024.
    d, L, V, K, T, batch = 768, 12, 151680, 9, 1024, 2**19
    n_all = 2 * V * d + 12 * L * d * d  # untied embedding and LM head; per block attention 4 d^2, MLP 8 d^2
    steps = 20 * n_all // batch          # 20 tokens per parameter
    tokens = steps * batch
    # FLOPs per token: 2 per weight of a matmul (multiply, add): the L blocks' 12 L d^2 weights K times, the
    # LM head's V d once (the last loop's output); attention scores, QK^T and AV over all T keys: 2 x 2 d T
    # per layer and loop; backward twice the forward
    forward = 2 * (12 * L * d * d * K + V * d) + 2 * 2 * d * T * L * K
    flops = 3 * forward
    h100 = 989.4e12  # dense bf16, NVIDIA's H100 whitepaper (SXM5)
    hours = {mfu: flops * tokens / (8 * h100 * mfu) / 3600 for mfu in (0.30, 0.45)}
    shards = 249     # the authors' training shards 0-248 (num_shards), ~55M tokens and ~0.1 GB each
    lines = p.stdout.splitlines()
    assert lines[:6] == [
        f"run plan for {tmp_path / 'out' / 'base_flt_k9'} (nothing downloaded or trained)",
        "  model       FLT, K=9, depth 12 (d_model 768, 6 heads, 6 kv), vocab 151,669 (padded 151,680)",
        f"  parameters  {n_all:,} all, {n_all - V * d:,} without the token embedding",
        f"  horizon     {steps:,} steps x 524,288 tokens = {tokens:.3e} tokens (horizon_params='all'; "
        f"the other count: {20 * (n_all - V * d) // batch:,} steps)",
        f"  FLOPs       {flops:.3e} per token (the loops counted), {flops * tokens:.3e} in all",
        f"  data        {shards} FineWeb-Edu training shards + 1 validation, about {(shards + 1) * 0.1:.1f} GB, "
        f"~{shards * 55e6:.2e} tokens for {tokens:.2e}"]
    assert (n_all, steps, f"{flops:.2e}", f"{flops * tokens:.1e}") == (317_915_136, 12127, "6.30e+09", "4.0e+19")
    assert lines[6] == "  memory/GPU  device_batch_size=8, bf16, 8 GPUs (estimate, GiB):"
    eager, eager_ckpt, compiled, compiled_ckpt = map(float, re.fullmatch(
        r" +eager ([\d.]+), checkpoint_loops ([\d.]+); compiled ([\d.]+), checkpoint_loops ([\d.]+)", lines[7]).groups())
    assert eager_ckpt < eager and compiled_ckpt < compiled < eager
    assert lines[8:] == [f"  time        8 x H100: {hours[0.30]:.1f} h at 30% MFU, {hours[0.45]:.1f} h at 45%; "
                         f"each GPU consumes {989.4e12 * 0.4 / flops / 1e6:.2f} M tokens/s at 40%"]


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
        p = python("eval.py", str(out), "--modes=bpb", "--loops=3", "--batch_size=4", "--bpb_tokens=1024",
                   f"--val_files={val}", "--device=cpu", f"--dtype={dtype}", "--protocol_ranks=1", "--protocol_batch=4",
                   f"--out={tmp_path / (dtype or 'trained')}.json")
        assert p.returncode == 0, p.stderr
        results = json.loads((tmp_path / f"{dtype or 'trained'}.json").read_text())["results"]["3"]
        # the protocol off eval.py's default: kept under its label
        bpb = results["val_bpb[bpb_tokens=1024,protocol_ranks=1]"]
        assert (bpb == records[-1]["final_val_bpb"]) is same, (dtype, bpb, records[-1]["final_val_bpb"])


def test_a_sampled_loop_count_names_its_run_directory():
    p = python("train.py", "--loops_sampler=uniform", "--loops_max=5", "--dry_run", timeout=120)
    assert p.returncode == 0 and "run plan for out/d3_flt_k3_uniform " in p.stdout, p.stderr
