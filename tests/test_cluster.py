"""train.py on a cluster, on CPU: preemption (a signal on one rank of a 2-rank gloo job), --resume=auto,
time-based checkpoints, two torchrun "nodes" sharing (or not) out_dir, CORE during training on two nodes
with their own data_dir, and a changed world size."""
import os
import pathlib
import re
import shutil
import signal
import socket
import textwrap
import time
import zipfile

import pytest
import torch

import forkserver
from flt import checkpoint
from flt import cluster
from test_eval import make_bundle
from test_train import ROOT, TINY, losses, runner, train


def read_log(out):
    return losses(out)[1]


def wait_for(predicate, timeout=120, what="a condition"):
    t0 = time.time()
    while not predicate():
        if time.time() - t0 > timeout:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Each rank writes its pid, and its steps are slowed, so the test can signal a rank mid-run; rank 1
# also signals itself again whenever it writes a checkpoint file (a second signal during the save).
SLOW = textwrap.dedent("""
    import os, signal, time, data
    from flt import checkpoint
    rank = os.environ.get("RANK", "0")
    open(os.path.join(os.environ["PID_DIR"], "pid" + rank), "w").write(str(os.getpid()))
    nxt, write = data.DataLoader.__next__, checkpoint._save
    def slow(self):
        time.sleep(0.15)
        return nxt(self)
    def signalled_write(obj, path):
        if rank == "1":
            os.kill(os.getpid(), signal.SIGUSR1)
        write(obj, path)
    data.DataLoader.__next__, checkpoint._save = slow, signalled_write
""")


def torchrun_cmd(script, nproc=2):
    """torchrun's argv after `python`, for forkserver.start (with fork_ranks: its ranks are forked too)."""
    return ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", script]


def test_sigterm_on_one_rank_saves_the_same_step_on_every_rank_and_exits_75(tmp_path, data_dir):
    out, args = tmp_path / "run", ["--num_steps=30", "--total_batch_size=256", "--save_interval=100",
                                  "--sample_tokens=0", "--eval_interval=100"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, PID_DIR=str(tmp_path))
    p = forkserver.start(torchrun_cmd(runner(tmp_path, SLOW)) + TINY + [f"--out_dir={out}", f"--data_dir={data_dir}",
                         *args], ROOT, env, fork_ranks=True)
    log = out / "log.jsonl"
    wait_for(lambda: log.exists() and sum("loss" in line for line in log.read_text().splitlines()) >= 3,
             what="three training steps")
    os.kill(int((tmp_path / "pid1").read_text()), signal.SIGTERM)  # rank 1 only; rank 0 never hears of it
    stderr = p.wait(timeout=120).stderr
    records = read_log(out)
    trained = [r["step"] for r in records if "loss" in r]
    last = records[-1]
    # both ranks finished the step in progress, saved the step after it, and exited 75
    assert last == {"step": trained[-1] + 1, "preempted": "another rank",
                    "checkpoint": str(out / checkpoint.step_name(trained[-1] + 1))}, records[-3:]
    # torchrun reports 75 for the first rank out, and terminates the other while it exits (75 or SIGTERM)
    codes = re.findall(r"exitcode\s+: (-?\d+)", stderr)
    assert str(cluster.PREEMPTED) in codes and set(codes) <= {str(cluster.PREEMPTED), "-15"}, stderr[-3000:]
    assert f"preempted (signal on another rank): saved {last['checkpoint']}; exit 75" in stderr
    assert trained[-1] + 1 < 30
    step_dir, meta = checkpoint.load_newest(str(out), rank_files=True)
    assert step_dir == last["checkpoint"] and meta["world_size"] == 2
    assert sorted(os.listdir(step_dir)) == ["model.pt", "rank0.pt", "rank1.pt", "tokenizer.json"]
    # the checkpoint is whole (rank 1 was signalled again during the save): the run resumes from it
    # and ends as the same run never interrupted
    train(out, data_dir, *args, "--resume=auto", script=runner(tmp_path), nproc=2)
    whole = tmp_path / "whole"
    train(whole, data_dir, *args, script=runner(tmp_path), nproc=2)
    resumed, uninterrupted = (torch.load(d / "params_rank0.pt") for d in (out, whole))
    assert all(torch.equal(resumed[k], uninterrupted[k]) for k in resumed)
    assert losses(out)[0] == losses(whole)[0]


def test_resume_auto_starts_fresh_or_continues(tmp_path, data_dir):
    out, args = tmp_path / "auto", ["--save_interval=2", "--sample_tokens=0", "--resume=auto"]
    p = train(out, data_dir, "--num_steps=6", *args)  # absent: a fresh run
    assert "resuming" not in p.stdout and sorted(losses(out)[0]) == list(range(6))
    shutil.rmtree(out / "step_000006")  # as if preempted after step 4's checkpoint
    p = train(out, data_dir, "--num_steps=6", *args)  # holds a checkpoint: continued
    assert f"resuming from {out / 'step_000004'} (step 4)" in p.stdout and sorted(losses(out)[0]) == list(range(6))
    p = train(out, data_dir, "--num_steps=6", *args)  # finished: nothing to do, exit 0, nothing touched
    assert "nothing to do" in p.stdout
    never_saved = tmp_path / "never_saved"  # a run preempted before its first checkpoint: starts over
    never_saved.mkdir()
    (never_saved / "log.jsonl").write_text('{"step": 0, "loss": 9.0}\n')
    train(never_saved, data_dir, "--num_steps=2", *args)
    assert sorted(losses(never_saved)[0]) == [0, 1]
    p = train(tmp_path / "empty", data_dir, "--num_steps=2", "--resume=True", check=False)
    assert p.returncode == 1 and "--resume: no checkpoint" in p.stderr  # True still means: continue a run


SAVES = textwrap.dedent("""
    import os
    from flt import checkpoint
    save = checkpoint.save
    def counted(out_dir, step, *args, **kwargs):
        with open(os.path.join(os.environ["PID_DIR"], "saves"), "a") as f:
            f.write(f"{step}\\n")
        return save(out_dir, step, *args, **kwargs)
    checkpoint.save = counted
""")


def test_time_based_checkpoints_never_save_a_step_twice(tmp_path, data_dir):
    env_dir = tmp_path / "pids"
    env_dir.mkdir()
    os.environ["PID_DIR"] = str(env_dir)
    try:
        # due at every step (a microsecond), beside save_interval=3: each step saved once
        train(tmp_path / "clock", data_dir, "--num_steps=7", "--save_interval=3", "--save_interval_minutes=1e-8",
              "--keep_checkpoints=0", "--sample_tokens=0", script=runner(tmp_path, SAVES))
        assert (env_dir / "saves").read_text().split() == [str(s) for s in range(1, 8)]
        (env_dir / "saves").unlink()
        train(tmp_path / "steps", data_dir, "--num_steps=7", "--save_interval=3", "--keep_checkpoints=0",
              "--sample_tokens=0", script=runner(tmp_path, SAVES))
        assert (env_dir / "saves").read_text().split() == ["3", "6", "7"]
    finally:
        del os.environ["PID_DIR"]


def two_nodes(out_dirs, data_dir, *args, script="train.py", check=True):
    """Two torchrun agents, one process each, meeting at a c10d rendezvous on 127.0.0.1, as two nodes.
    data_dir: both nodes', or a list of each node's own."""
    port, env = free_port(), dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    data_dirs = data_dir if isinstance(data_dir, list) else [data_dir] * 2
    # the agents and their ranks forked from processes that have imported torch (tests/forkserver.py)
    procs = [forkserver.start(["-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
                               f"--node_rank={node}", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}",
                               "--rdzv_id=two_nodes", script] + TINY + [f"--out_dir={out_dirs[node]}",
                              f"--data_dir={data_dirs[node]}", "--total_batch_size=256", "--sample_tokens=0", *args],
                              ROOT, env, fork_ranks=True)
             for node in (0, 1)]
    results = [(done.returncode, done.stdout, done.stderr) for done in (p.wait(timeout=300) for p in procs)]
    if check:
        for code, stdout, stderr in results:
            assert code == 0, stderr[-3000:]
    return results


@pytest.fixture(scope="module")
def two_node_run(tmp_path_factory, data_dir, http_server):
    """One run on two nodes sharing out_dir, for the two tests below: 4 steps with a checkpoint every 2,
    then continued to 6 (--resume=True); CORE every 2 steps, its eval bundle a zip on http_server. Each
    node has its own data_dir, holding the corpus and its BPE (as a node's disk would after its first
    run) but no bundle. (out_dir, the nodes' data_dirs, the bundle zipped, the server's requests)"""
    tmp = tmp_path_factory.mktemp("two_nodes")
    bundle = make_bundle(tmp / "zipped" / "eval_bundle")
    archive = tmp / "eval_bundle.zip"
    with zipfile.ZipFile(archive, "w") as z:
        for path in sorted(pathlib.Path(bundle).rglob("*")):
            z.write(path, path.relative_to(tmp / "zipped"))
    http_server.files, http_server.requests = {"/eval_bundle.zip": archive.read_bytes()}, []
    http_server.mode, http_server.drops, http_server.delay = "ok", 0, 0.0
    url = f"http://127.0.0.1:{http_server.server_address[1]}/eval_bundle.zip"
    out, data_dirs = tmp / "shared", [str(tmp / f"node{n}_data") for n in (0, 1)]
    for node_data in data_dirs:
        shutil.copytree(data_dir, node_data, ignore=shutil.ignore_patterns("*.lock"))
    script = runner(tmp, f"from flt import core; core.BUNDLE_URL = {url!r}")
    args = ["--save_interval=2", "--core_interval=2", "--core_max_per_task=4"]
    two_nodes([out, out], data_dirs, "--num_steps=4", "--resume=auto", *args, script=script)
    two_nodes([out, out], data_dirs, "--num_steps=6", "--resume=True", *args, script=script)
    return out, data_dirs, bundle, list(http_server.requests)


def test_two_nodes_train_save_and_resume(two_node_run):
    out = two_node_run[0]
    by_step, records = losses(out)
    assert sorted(by_step) == list(range(6))
    assert not [r for r in records if "saved_world_size" in r]  # 2 ranks saved it, 2 resumed it: nothing resharded
    assert checkpoint.load_newest(str(out), rank_files=True)[1]["world_size"] == 2


def test_core_during_training_on_two_nodes_with_their_own_data_dirs(two_node_run):
    # Each node fetches the eval bundle into its own data_dir (before, only rank 0 did, and the other
    # node's rank found no bundle on its disk), once: the resumed run finds it there.
    out, data_dirs, bundle, requests = two_node_run
    assert [r["core"] for r in losses(out)[1] if "core" in r] != [] and len(requests) == 2
    for node_data in data_dirs:  # each node's copy, whole
        assert files(os.path.join(node_data, "eval_bundle")) == files(bundle)


def files(root):
    """{path relative to root: bytes} of every file below root."""
    return {str(p.relative_to(root)): p.read_bytes() for p in pathlib.Path(root).rglob("*") if p.is_file()}


def test_out_dir_not_shared_by_the_nodes_is_an_error(tmp_path, data_dir):
    results = two_nodes([tmp_path / "node0", tmp_path / "node1"], data_dir, "--num_steps=2", check=False)
    message = "of 2 ranks do not see the file rank 0 wrote there: out_dir must be on a filesystem shared by all nodes"
    assert all(code != 0 and message in stderr for code, _, stderr in results), results[0][2][-2000:]
    assert not list((tmp_path / "node0").glob("step_*"))


def test_world_size_2_then_1_then_2(tmp_path, data_dir):
    out, args = tmp_path / "resized", ["--total_batch_size=256", "--save_interval=2", "--sample_tokens=0"]
    train(out, data_dir, "--num_steps=4", *args, script=runner(tmp_path), nproc=2)
    p = train(out, data_dir, "--num_steps=6", "--resume=True", *args)  # one rank: twice the accumulation
    assert "2 ranks saved" in p.stdout and "1 resume it: the optimizer state is resharded exactly" in p.stdout
    assert checkpoint.load_newest(str(out), rank_files=True)[1]["world_size"] == 1
    p = train(out, data_dir, "--num_steps=8", "--resume=True", *args, script=runner(tmp_path), nproc=2)
    by_step, records = losses(out)
    resized = [r for r in records if "saved_world_size" in r]
    assert [(r["step"], r["saved_world_size"]) for r in resized] == [(4, 2), (6, 1)]
    assert all(r["skipped_documents"] >= 0 for r in resized) and sorted(by_step) == list(range(8))
    p0, p1 = (torch.load(out / f"params_rank{r}.pt") for r in (0, 1))
    assert all(torch.equal(p0[k], p1[k]) for k in p0)  # the resharded ranks still agree
    assert all(map(lambda v: v == v, by_step.values()))


# The disk of out_dir is full once the first checkpoint is in (runtime.free_bytes: the one reading of it).
FULL_AFTER_FIRST = textwrap.dedent("""
    import glob, os
    from flt import runtime
    free = runtime.free_bytes
    def full(path):
        return 1000 if glob.glob(os.path.join(os.environ["OUT"], "step_*")) and os.environ["OUT"] in os.path.abspath(path) else free(path)
    runtime.free_bytes = full
""")


def test_a_full_disk_stops_the_run_keeping_the_last_good_checkpoint(tmp_path, data_dir, monkeypatch):
    out = tmp_path / "full"
    monkeypatch.setenv("OUT", str(out))
    p = train(out, data_dir, "--num_steps=6", "--save_interval=2", "--sample_tokens=0",
              script=runner(tmp_path, FULL_AFTER_FIRST), check=False)
    first = out / checkpoint.step_name(2)
    assert p.returncode == 1 and "step 4: checkpoint step 4: needs" in p.stderr, p.stderr[-2000:]
    assert f"in {out}, but its disk has only 0.0 MB (1,000 bytes) free" in p.stderr
    assert p.stderr.rstrip().endswith(f"Last good checkpoint: {first}")
    assert sorted(os.listdir(out)) == ["log.jsonl", "run.lock", "settings.json", "step_000002"]
    assert checkpoint.load_newest(str(out), rank_files=True)[0] == str(first)  # whole, and resumable
    assert max(r["step"] for r in losses(out)[1]) == 3  # stopped before training step 4
