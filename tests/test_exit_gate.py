"""Ouro's learned exit gate trained after the fact (flt/exit_gate.py, arXiv 2510.25741's second
stage): its targets against a hand computation, its training on a frozen model's own loss curves
(the model untouched), the command on train.py's tiny run writing exit_gate.pt beside the
checkpoint, load_model attaching it for exit_rule="gate", pruning leaving it, and bad input as one
line."""
import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from conftest import run_module
from test_model import make_model, random_tokens
from flt import checkpoint
from flt.decoding import ExitGate
from flt.exit_gate import exit_targets, frozen_pass, train_gate
from test_eval import one_thread  # noqa: F401 (autouse: tiny shapes on one thread)


def quiet(*args, **kwargs):
    pass


def by_hand(losses, margin):
    """c_t written from its definition, one position and loop at a time (the module docstring)."""
    K, B, T = losses.shape
    c = torch.zeros(K - 1, B, T, dtype=torch.float64)
    for t in range(K - 1):
        for b in range(B):
            for i in range(T):
                best_later = min(losses[s, b, i].item() for s in range(t + 1, K))
                c[t, b, i] = float(losses[t, b, i].item() - best_later > margin)
    return c


def test_targets_say_whether_a_later_loop_still_lowers_the_loss_by_more_than_the_margin():
    # (K=4, B=1, T=3) losses l_1 .. l_4; margin 0.25, exact in binary: a gap of exactly 0.25 is
    # no gain
    losses = torch.tensor([[[2.0, 1.0, 1.0]],
                           [[1.5, 1.25, 1.0]],
                           [[1.75, 0.5, 1.0]],
                           [[1.25, 0.75, 1.0]]], dtype=torch.float64)
    # position 0: l_1 - min(1.5, 1.75, 1.25) = 0.75; l_2 - min(1.75, 1.25) = 0.25 (not more);
    # l_3 - 1.25 = 0.5. Position 1: 1.0 - 0.5; 1.25 - 0.5; 0.5 - 0.75 < 0. Position 2: flat.
    expected = torch.tensor([[[1.0, 1.0, 0.0]],
                             [[0.0, 1.0, 0.0]],
                             [[1.0, 0.0, 0.0]]], dtype=torch.float64)
    assert torch.equal(exit_targets(losses, 0.25), expected)
    assert torch.equal(by_hand(losses, 0.25), expected)
    g = torch.Generator().manual_seed(0)
    losses = torch.rand(5, 2, 7, generator=g, dtype=torch.float64)
    assert torch.equal(exit_targets(losses, 0.1), by_hand(losses, 0.1))


def test_the_frozen_pass_scores_each_loop_as_the_models_own_loss():
    """frozen_pass's targets come from the per-position losses of model(x, all_loops=True)'s
    logits, and the positions whose target is -1 are not scored."""
    model = make_model("FLT", loops=3)
    x = random_tokens(2, 16)
    y = torch.roll(x, -1, dims=1)
    y[:, -3:] = -1
    states, targets, scored = frozen_pass(model, x, y, 3, 0.01)
    with torch.no_grad():
        logits = model(x, loops=3, all_loops=True)
    losses = torch.stack([F.cross_entropy(lg.flatten(0, 1).double(), y.flatten(), ignore_index=-1,
                                          reduction="none").view(y.shape) for lg in logits])
    assert states.shape == (2, 2, 16, model.config.n_embd)
    assert torch.equal(scored, y != -1)
    # a target that rounding could decide is left out of the comparison
    later = torch.stack([losses[t + 1:].min(0).values for t in range(2)])
    clear = ((losses[:-1] - later - 0.01).abs() > 1e-4) & scored
    assert clear.sum() > 0.9 * 2 * scored.sum()
    assert torch.equal(targets[clear], by_hand(losses, 0.01).float()[clear])


def toy_batches(n, B=4, T=32):
    """(x, y) of 8 token ids, y labelling each position itself (a task's layout, flt/tasks.py): each
    loop's loss is then a function of the context alone, which the gate sees through h."""
    batches = []
    for i in range(n):
        x = random_tokens(B, T, seed=i) % 8
        batches.append((x, x.clone()))
    return batches


def test_training_lowers_the_gates_held_out_loss_and_leaves_the_model_frozen():
    model = make_model("FLT", loops=3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    batches = toy_batches(5)
    gate, record = train_gate(model, batches[:-1], batches[-1], loops=3, steps=100, margin=0.01,
                              hidden=16, lr=3e-3, log=quiet)
    assert record["loss_after"] < record["loss_before"]
    assert 0 < record["positives"] < 1
    assert record["tokens"] == 4 * 4 * 32 and record["steps"] == 100 and record["loops"] == 3
    # the run's weights: the same bits, no gradient kept, none trainable
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None and not p.requires_grad for p in model.parameters())
    assert isinstance(gate, ExitGate) and gate.margin.item() == pytest.approx(0.01)


@pytest.fixture
def gated_run(tiny_run, tmp_path):
    """A copy of train.py's tiny run (conftest.py), the gate trained on it by the command."""
    run = str(tmp_path / "run")
    shutil.copytree(tiny_run, run, ignore=shutil.ignore_patterns("run.lock"))
    status, stdout, stderr = run_module("flt.exit_gate", run, "--tokens=256", "--steps=30",
                                        "--batch_size=4", "--hidden=16", "--device=cpu")
    assert status == 0, stdout + stderr
    return run, stdout


def test_the_command_writes_the_gate_beside_the_checkpoint_and_load_model_attaches_it(gated_run):
    run, stdout = gated_run
    step_dir = checkpoint.list_checkpoints(run)[-1][1]
    path = os.path.join(step_dir, "exit_gate.pt")
    assert stdout.splitlines()[-1].startswith("exit gate: BCE ")
    assert stdout.splitlines()[-1].endswith(f"wrote {path}")
    saved = checkpoint.load_file(path)
    assert saved["config"]["hidden"] == 16 and saved["config"]["margin"] == pytest.approx(0.01)
    assert saved["trained"]["tokens"] == 256 and saved["trained"]["steps"] == 30
    assert saved["trained"]["loops"] == 3
    model, meta = checkpoint.load_model(run, log=quiet)
    assert meta["path"] == step_dir
    assert all(torch.equal(model.exit_gate.state_dict()[k], v) for k, v in saved["gate"].items())
    model.eval()
    idx = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(idx, exit_threshold=0.5, exit_rule="gate")
        # threshold 0: no probability is below it, so no position exits: the full K loops
        assert torch.allclose(model(idx, exit_threshold=0.0, exit_rule="gate"), model(idx),
                              atol=1e-5, rtol=0)
    assert logits.shape == (2, 12, model.config.vocab_size) and torch.isfinite(logits).all()
    # run again: refused in one line, the gate untouched; with --force, replaced and said so;
    # nothing else in the directory
    before = open(path, "rb").read()
    again = ["flt.exit_gate", run, "--tokens=128", "--steps=5", "--batch_size=4", "--device=cpu"]
    status, stdout, stderr = run_module(*again)
    assert (status, stdout) == (1, "") and stderr == (
        f"flt.exit_gate: FileExistsError: {path}: an earlier exit gate, which eval.json's gate "
        "results (if any) were measured with; --force replaces it\n")
    assert open(path, "rb").read() == before
    status, stdout, _ = run_module(*again, "--force")
    assert status == 0 and f"replacing {path}, an earlier exit gate" in stdout
    assert checkpoint.load_file(path)["config"]["hidden"] == 64
    assert sorted(os.listdir(step_dir)) == ["exit_gate.pt", "model.pt", "rank0.pt",
                                            "tokenizer.json"]
    # pruning deletes the checkpoint's own files only: the gate is not one of them
    checkpoint.remove_checkpoint(step_dir, log=quiet)
    assert os.listdir(step_dir) == ["exit_gate.pt"]


def test_an_unreadable_gate_file_is_one_error_naming_it(tiny_run, tmp_path):
    run = str(tmp_path / "run")
    shutil.copytree(tiny_run, run, ignore=shutil.ignore_patterns("run.lock"))
    step_dir = checkpoint.list_checkpoints(run)[-1][1]
    path = os.path.join(step_dir, "exit_gate.pt")
    with open(path, "wb") as f:
        f.write(b"not a gate")
    with pytest.raises(ValueError, match=f"{path}: not a readable checkpoint file"):
        checkpoint.load_model(run, log=quiet)
    torch.save({"gate": {}, "config": {"n_embd": 7, "hidden": 4, "margin": 0.01}}, path)
    with pytest.raises(ValueError, match=f"{path}: not an exit gate of this model"):
        checkpoint.load_model(run, log=quiet)


@pytest.mark.parametrize("argv, message", [
    (["no/such/run"], "FileNotFoundError: run 'no/such/run': no such directory"),
    (["RUN", "--margin=0"], "ValueError: --margin=0.0: expected a number > 0"),
    (["RUN", "--tokens=0"], "ValueError: --tokens=0: expected a positive integer"),
    (["RUN", "--loops=1"], "ValueError: --loops=1: expected an integer >= 2"),
    (["RUN", "--steps=x"], "ValueError: argument --steps: invalid int value: 'x'"),
])
def test_bad_input_is_one_line_and_a_non_zero_exit(tiny_run, argv, message):
    argv = [tiny_run if a == "RUN" else a for a in argv]
    status, stdout, stderr = run_module("flt.exit_gate", *argv)
    assert status == 1 and stdout == ""
    assert len(stderr.splitlines()) == 1 and stderr.startswith(f"flt.exit_gate: {message}")
