"""checkpoint.py: what counts as a checkpoint, in which order, what is refused, and what a full disk
(before or while writing, on one rank of two) leaves behind: nothing new, the older ones untouched."""
import errno
import io
import json
import math
import os
import re
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flt import checkpoint
from flt import runtime
from model import GPT, GPTConfig


def tiny():
    model = GPT(GPTConfig(sequence_len=8, vocab_size=64, n_layer=1, n_head=1, n_kv_head=1, n_embd=16))
    model.init_weights()
    return model


def save(out, step, model=None, **kw):
    return checkpoint.save(str(out), step, model or tiny(), {"world_size": 1}, settings={"x": 1}, **kw)


def test_only_numbered_step_directories_count_in_numeric_order(tmp_path):
    for step in (999_999, 1_000_000, 5):
        save(tmp_path, step, keep=0)
    os.makedirs(tmp_path / "step_zzz")
    (tmp_path / "step_zzz" / "model.pt").write_bytes(b"")
    os.makedirs(tmp_path / "step_000007")  # no model.pt: not a checkpoint
    assert [s for s, _ in checkpoint.list_checkpoints(str(tmp_path))] == [5, 999_999, 1_000_000]
    assert checkpoint.load_newest(str(tmp_path))[1]["step"] == 1_000_000


def test_prune_keeps_the_newest(tmp_path):
    for step in (1, 2, 3):
        save(tmp_path, step, keep=1)
    assert [s for s, _ in checkpoint.list_checkpoints(str(tmp_path))] == [3]
    for step in (4, 5, 6, 7):
        save(tmp_path, step, keep=1, keep_every=2)
    assert [s for s, _ in checkpoint.list_checkpoints(str(tmp_path))] == [4, 6, 7]
    with pytest.raises(ValueError, match="keep_checkpoints=-1"):
        checkpoint.prune(str(tmp_path), -1)


def test_saving_the_same_step_again_replaces_it_whole(tmp_path):
    save(tmp_path, 4)
    model = tiny()
    with torch.no_grad():
        model.lm_head.weight.fill_(0.5)
    save(tmp_path, 4, model)
    _, meta = checkpoint.load_newest(str(tmp_path))
    assert torch.equal(meta["model"]["lm_head.weight"], model.lm_head.weight)
    assert sorted(os.listdir(tmp_path)) == ["step_000004"]


def test_nonfinite_parameters_are_never_saved(tmp_path):
    save(tmp_path, 1)
    model = tiny()
    with torch.no_grad():
        model.transformer.h[0].mlp.c_fc.weight[0, 0] = float("inf")
    with pytest.raises(ValueError, match="non-finite parameters.*mlp.c_fc.weight"):
        save(tmp_path, 2, model)
    assert [s for s, _ in checkpoint.list_checkpoints(str(tmp_path))] == [1]


def test_an_older_format_is_refused_not_loaded(tmp_path):
    step_dir = save(tmp_path, 1)
    meta = torch.load(os.path.join(step_dir, "model.pt"), weights_only=True)
    del meta["format"]  # as saved before the RoPE direction fix
    torch.save(meta, os.path.join(step_dir, "model.pt"))
    with pytest.raises(ValueError, match="checkpoint format 1.*RoPE"):
        checkpoint.load_model(str(tmp_path))


def test_a_pickle_that_runs_code_is_refused(tmp_path):
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))
    step_dir = save(tmp_path / "run", 1)
    torch.save({"model": Evil(), "config": {}}, os.path.join(step_dir, "model.pt"))
    with pytest.raises(ValueError, match="no readable checkpoint"):
        checkpoint.load_model(str(tmp_path / "run"), log=lambda *a: None)
    assert not marker.exists()


def test_load_model_round_trip(tmp_path):
    model = tiny()
    save(tmp_path, 3, model)
    loaded, meta = checkpoint.load_model(str(tmp_path))
    assert meta["step"] == 3 and meta["settings"] == {"x": 1} and meta["path"].endswith("step_000003")
    x = torch.randint(0, 64, (1, 8))
    assert torch.equal(loaded(x), model(x))


# ----------------------------------------------------------------------------- a full disk

def files_of(directory):
    """{relative path: bytes} of every file below directory."""
    return {os.path.relpath(os.path.join(d, f), directory): open(os.path.join(d, f), "rb").read()
            for d, _, names in os.walk(directory) for f in names}


def dir_bytes(step_dir):
    return sum(os.path.getsize(os.path.join(step_dir, f)) for f in os.listdir(step_dir))


def size_text(n):  # written out again: the messages must show both forms
    return (f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB") + f" ({n:,} bytes)"


def with_margin(n):
    return math.ceil(n * 1.05) + 16 * 2**20


def trained_rank_state(model):
    """A rank file as train.py writes it: a real optimizer's state after one step, the RNG state."""
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8))).backward()
    opt.step()
    return dict(optimizers=[opt.state_dict()], rng=torch.get_rng_state())


def test_a_full_disk_refuses_the_checkpoint_and_leaves_the_older_ones(tmp_path, monkeypatch):
    for step in (1, 2):
        save(tmp_path, step, keep=1, files={"tokenizer.json": lambda path: open(path, "w").write("x" * 5000)})
    before = files_of(tmp_path)
    # the next checkpoint needs the newest one's size (every file in it), with the margin
    needed = with_margin(dir_bytes(tmp_path / "step_000002"))
    seen = []
    monkeypatch.setattr(runtime, "free_bytes", lambda path: seen.append(path) or needed - 1)
    with pytest.raises(runtime.DiskSpaceError) as e:
        save(tmp_path, 3, keep=1)
    assert isinstance(e.value, OSError) and e.value.errno == errno.ENOSPC
    assert str(e.value) == (f"checkpoint step 3: needs {size_text(needed)} in {tmp_path}, but its disk has only "
                            f"{size_text(needed - 1)} free; nothing of step_000003 was kept and the earlier "
                            "checkpoints are untouched; free some space, lower keep_checkpoints, or choose another out_dir")
    assert seen == [str(tmp_path)] and files_of(tmp_path) == before  # not pruned, no tmp_step_000003
    assert checkpoint.load_newest(str(tmp_path))[1]["step"] == 2
    monkeypatch.setattr(runtime, "free_bytes", lambda path: needed)  # exactly enough
    save(tmp_path, 3, keep=1)
    assert [s for s, _ in checkpoint.list_checkpoints(str(tmp_path))] == [3]


def test_the_first_checkpoint_estimates_its_tensors(tmp_path, monkeypatch):
    """No checkpoint yet: model.pt's tensors plus world_size (here 1) times the rank file's, each
    counted here by hand (elements x bytes per element); the files written then fit in it (torch.save's
    zip records, ~1 kB a tensor, are SPACE_SLACK's to cover: large beside this model's tensors)."""
    model = tiny()
    rank_state = trained_rank_state(model)
    tensors = [*model.state_dict().values(), *rank_state["optimizers"][0]["state"].values(), rank_state["rng"]]
    flat = [t for x in tensors for t in (x.values() if isinstance(x, dict) else [x])]
    needed = with_margin(sum(t.numel() * t.element_size() for t in flat))
    monkeypatch.setattr(runtime, "free_bytes", lambda path: 0)
    with pytest.raises(runtime.DiskSpaceError, match=re.escape(f"needs {size_text(needed)} in {tmp_path}, but "
                                                                  f"its disk has only {size_text(0)} free")):
        checkpoint.save(str(tmp_path), 1, model, rank_state, settings={})
    assert os.listdir(tmp_path) == []
    monkeypatch.undo()
    step_dir = checkpoint.save(str(tmp_path), 1, model, rank_state, settings={})
    assert dir_bytes(step_dir) <= needed


def half_then_enospc(real_save, fail_on, free=None):
    """A torch.save whose call number fail_on writes half its bytes, then finds the disk full (and
    sets free[0], the free bytes a stand-in free_bytes reports, to 12345)."""
    calls = []

    def fake(obj, f):
        calls.append(1)
        if len(calls) != fail_on:
            return real_save(obj, f)
        buffer = io.BytesIO()
        real_save(obj, buffer)
        f.write(buffer.getvalue()[:len(buffer.getvalue()) // 2])
        if free:
            free[0] = 12345
        raise OSError(errno.ENOSPC, "No space left on device")
    return fake


@pytest.mark.parametrize("fail_on", [1, 2])  # while writing model.pt, while writing rank0.pt
def test_a_disk_that_fills_while_writing_leaves_the_older_checkpoints(tmp_path, monkeypatch, fail_on):
    for step in (1, 2):
        save(tmp_path, step, keep=1)
    before = files_of(tmp_path)
    free = [10**12]  # plenty for the check before writing; 12345 once the disk is full
    monkeypatch.setattr(runtime, "free_bytes", lambda path: free[0])
    monkeypatch.setattr(torch, "save", half_then_enospc(torch.save, fail_on, free))
    with pytest.raises(runtime.DiskSpaceError) as e:
        save(tmp_path, 3, keep=1)
    needed = with_margin(dir_bytes(tmp_path / "step_000002"))
    assert str(e.value).startswith(f"checkpoint step 3, which filled the disk while being written: needs "
                                   f"{size_text(needed)} in {tmp_path}, but its disk has only {size_text(12345)} "
                                   "free; nothing of step_000003 was kept and the earlier checkpoints are untouched")
    assert e.value.__cause__.errno == errno.ENOSPC
    assert files_of(tmp_path) == before
    assert checkpoint.load_newest(str(tmp_path))[1]["step"] == 2


def test_saving_a_step_again_that_cannot_be_renamed_keeps_the_old_copy(tmp_path, monkeypatch):
    step_dir = save(tmp_path, 4)
    before, replace = files_of(tmp_path), os.replace

    def refuse_tmp(src, dst):
        if os.path.basename(src).startswith("tmp_step_"):
            raise PermissionError(errno.EACCES, "Permission denied", src)
        replace(src, dst)
    monkeypatch.setattr(os, "replace", refuse_tmp)
    with pytest.raises(PermissionError):
        save(tmp_path, 4)
    assert files_of(tmp_path) == before and os.path.isdir(step_dir)


def _two_ranks(rank, init_file, out, results):
    """Rank `rank` of 2 (gloo): a checkpoint, then two that fail on rank 1 only (too little space
    before writing; the disk full while writing its rank file), then one that succeeds."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=30))  # a rank left waiting fails in 30 s, never hangs
    torch.manual_seed(0)
    model = tiny()

    def save_step(step):
        return checkpoint.save(out, step, model, {"rank": rank, "shard": torch.full((1000,), float(rank))},
                               settings={}, rank=rank, keep=1)
    save_step(1)
    dist.barrier()
    record = {"needed": with_margin(dir_bytes(os.path.join(out, "step_000001"))), "errors": [], "intact": []}
    before = files_of(out)
    dist.barrier()  # both have looked before the next save begins
    free_bytes, real_save = runtime.free_bytes, torch.save
    for failure in ("no space", "disk full"):
        if rank == 1 and failure == "no space":
            runtime.free_bytes = lambda path: 1000
        if rank == 1 and failure == "disk full":
            torch.save = half_then_enospc(real_save, 1)  # rank 1 writes only its rank file
        try:
            save_step(2)
            record["errors"].append(None)
        except Exception as e:
            record["errors"].append([type(e).__name__, str(e)])
        runtime.free_bytes, torch.save = free_bytes, real_save
        dist.barrier()  # rank 0 has cleaned up
        record["intact"].append(files_of(out) == before)
        dist.barrier()  # both have looked before the next save begins
    record["saved"] = os.path.basename(save_step(2))
    record["files"] = sorted(files_of(out))
    with open(os.path.join(results, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)
    dist.barrier()
    dist.destroy_process_group()


def test_one_rank_without_space_stops_every_rank_and_keeps_the_older_checkpoint(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    mp.start_processes(_two_ranks, args=(str(tmp_path / "init"), str(out), str(tmp_path)), nprocs=2,
                       start_method="forkserver")
    records = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(2)]
    assert records[0]["errors"] == records[1]["errors"]  # the same error, the same message, on both ranks
    (kind1, message1), (kind2, message2) = records[0]["errors"]
    needed = records[0]["needed"]
    assert kind1 == kind2 == "DiskSpaceError"
    assert message1 == (f"checkpoint step 2 (rank 1 of 2): needs {size_text(needed)} in {out}, but its disk has "
                        f"only {size_text(1000)} free; nothing of step_000002 was kept and the earlier checkpoints "
                        "are untouched; free some space, lower keep_checkpoints, or choose another out_dir")
    assert message2.startswith(f"checkpoint step 2 (rank 1 of 2), which filled the disk while being written: needs "
                               f"{size_text(needed)} in {out}, but its disk has only ")
    for record in records:
        assert record["intact"] == [True, True]
        assert record["saved"] == "step_000002"
        assert record["files"] == ["step_000002/model.pt", "step_000002/rank0.pt", "step_000002/rank1.pt"]
    step_dir = str(out / "step_000002")
    for r in range(2):
        [state] = checkpoint.load_rank_states(step_dir, checkpoint.read_model_file(step_dir), r, 2)
        assert state["shard"].eq(r).all()


def test_a_user_error_removes_the_run_directories_the_claim_made_while_unused(tmp_path):
    """A run that ends on a user's error before writing anything leaves no directory behind; one
    that wrote something, or a directory that existed before, is left as it is, its run.lock as it was
    before the claim (absent here)."""
    from flt import errors
    (tmp_path / "kept").mkdir()
    lock = checkpoint.claim_out_dir(str(tmp_path / "kept" / "a" / "run"), False, False)
    assert (tmp_path / "kept" / "a" / "run" / "run.lock").exists()
    errors.report("train.py", ValueError("a download refused"))
    assert os.listdir(tmp_path / "kept") == []
    lock.close()
    checkpoint.claim_out_dir(str(tmp_path / "used"), False, False)
    (tmp_path / "used" / "log.jsonl").write_text("{}\n")
    errors.report("train.py", ValueError("later"))
    assert sorted(os.listdir(tmp_path / "used")) == ["log.jsonl"]
    assert not errors.UNDO
