"""checkpoint.py: what counts as a checkpoint, in which order, what is refused."""
import os

import pytest
import torch

import checkpoint
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
