"""train.py applies the paper's training recipe (docs/recipe.md) as the recipe says, checked on what the
optimizers receive at every step, against numbers computed here from the recipe, not from optim.py:
gradient accumulation and ranks change no number, the schedules reach every group (also after a resume).
The models are in float64 (set where train.py sets their numerics), so rounding (~1e-16) is far below
any fault these tests look for; only the loss is fp32 (the head's logits are, as in training)."""
import json
import math
import os
import shutil
import textwrap

import pytest
import torch

from model import GPT, GPTConfig
from test_train import train

# train.py in-process, its model in float64; each optimizer step's inputs are recorded, as are the final parameters.
# FIXED_BATCHES: the loader hands out one fixed batch per step, cut into (micro-batch, rank) pieces of
# device_batch_size rows, so that any split of a step's total batch sees the same tokens.
RUNNER = textwrap.dedent("""
    import json, os, runpy, sys, torch
    import data, optim
    from flt import planning, runtime
    planning.peak_flops = lambda name: 1e12  # a made-up accelerator, so that the CPU logs an MFU
    sys.argv[0] = "train.py"
    store = runtime.store_embedding  # where train.py sets the model's numerics: here float64 throughout
    runtime.store_embedding = lambda model, *args: (store(model, *args), model.double())
    build_optimizers = optim.build_optimizers  # and Muon's Newton-Schulz (fp32 on CPU) too
    optim.build_optimizers = lambda *args, **kwargs: build_optimizers(*args, **kwargs | {"ns_dtype": torch.float64})
    calls = []
    for cls in (optim.AdamW, optim.Muon):
        def step(self, grad_scale=1.0, _step=cls.step):
            calls.append({"optimizer": type(self).__name__, "grad_scale": grad_scale,
                          "groups": [{k: g[k] for k in ("lr", "initial_lr", "momentum", "weight_decay") if k in g}
                                     for g in self.param_groups]})
            return _step(self, grad_scale)
        cls.step = step

    class FixedBatches:
        skipped_documents = 0
        def __init__(self, files, tok, B, T, rank, world_size, *args, **kwargs):
            self.B, self.T, self.rank, self.world_size, self.calls = B, T, rank, world_size, 0
            self.rows = int([a for a in sys.argv if a.startswith("--total_batch_size=")][-1].split("=")[1]) // T
        def __next__(self):
            grad_accum = self.rows // (self.B * self.world_size)
            step, micro = divmod(self.calls, grad_accum)
            self.calls += 1
            batch = torch.randint(0, 256, (self.rows, self.T + 1), generator=torch.Generator().manual_seed(step))  # fixed_batch
            rows = batch[(micro * self.world_size + self.rank) * self.B:][:self.B]
            return rows[:, :-1], rows[:, 1:]
        def state_dict(self):
            return {}
    real, train_files = data.DataLoader, []
    def loader(files, *args, **kwargs):  # the training loader (given prefetch), not validation's
        if "prefetch" not in kwargs:
            return real(files, *args, **kwargs)
        train_files.extend(os.path.basename(f) for f in files)
        return (FixedBatches if FIXED else real)(files, *args, **kwargs)
    data.DataLoader = loader
    g = runpy.run_path("train.py", run_name="__main__")
    with open(os.path.join(g["out_dir"], f"calls_rank{g['rank']}.json"), "w") as f:
        json.dump({"calls": calls, "train_files": train_files}, f)
    torch.save(g["model"].state_dict(), os.path.join(g["out_dir"], f"params_rank{g['rank']}.pt"))
""")
D_MODEL = 64  # TINY's depth 1


def run(tmp_path, data_dir, name, *args, nproc=1, fixed=False):
    script = tmp_path / f"recipe_runner_{fixed}.py"
    script.write_text(RUNNER.replace("FIXED", str(fixed)))
    out = tmp_path / name
    train(out, data_dir, "--sample_tokens=0", "--eval_interval=100", *args, script=str(script), nproc=nproc)
    with open(out / "log.jsonl") as f:
        steps = {r["step"]: r for r in map(json.loads, f) if "loss" in r}
    with open(out / "calls_rank0.json") as f:
        recorded = json.load(f)
    assert recorded["train_files"] == [f"shard_{i:05d}.parquet" for i in range(4)]  # shard 4 is validation's
    return steps, recorded["calls"], torch.load(out / "params_rank0.pt")


def lr_multiplier(step, num_steps, warmdown_frac=0.2):
    """The paper's schedule, written here from its words: no warm-up, constant for the first 80% of the
    steps, then linear to 0 at the end (the warm-down is round(0.2 * num_steps) steps long)."""
    warmdown = round(warmdown_frac * num_steps)
    return min(1.0, (num_steps - step) / warmdown)


def momentum(step, warmup=5):
    """Muon's momentum, linear from 0.85 at step 0 to 0.95 at step `warmup`, then 0.95."""
    return 0.85 + 0.10 * min(step / warmup, 1.0)


BASE_LR = {"AdamW": [0.2 * math.sqrt(768 / D_MODEL), 0.004 * math.sqrt(768 / D_MODEL)], "Muon": [0.02]}


def assert_schedule(calls, num_steps, first_step=0, warmdown_frac=0.2):
    """Two optimizer calls a step (AdamW, Muon), in order: every group's lr and Muon's momentum as the recipe says."""
    assert len(calls) == 2 * (num_steps - first_step)
    for i, call in enumerate(calls):
        step = first_step + i // 2
        assert call["optimizer"] == ("AdamW", "Muon")[i % 2]
        bases = BASE_LR[call["optimizer"]]
        assert len(call["groups"]) == len(bases)
        for group, base in zip(call["groups"], bases):
            assert group["initial_lr"] == pytest.approx(base, rel=1e-12)
            assert group["lr"] == pytest.approx(base * lr_multiplier(step, num_steps, warmdown_frac), rel=1e-12, abs=1e-15), step
            assert group.get("weight_decay", 0.0) == 0.0  # the paper: no weight decay
            if call["optimizer"] == "Muon":
                assert group["momentum"] == pytest.approx(momentum(step), rel=1e-12), step


@pytest.fixture(scope="module")
def accumulated(tmp_path_factory, data_dir):
    """The same 3 steps of 256 tokens as 1, 2 and 4 forwards of 256, 128 and 64 tokens, clipping at 0.3."""
    tmp = tmp_path_factory.mktemp("accum")
    args = ("--num_steps=3", "--total_batch_size=256", "--grad_clip=0.3", "--save_interval=1", "--keep_checkpoints=0",
            "--log_clipped_norms")
    runs = {n: run(tmp, data_dir, f"accum{n}", *args, f"--device_batch_size={8 // n}", fixed=True) for n in (1, 2, 4)}
    runs["2 ranks"] = run(tmp, data_dir, "ranks", *args, "--device_batch_size=2", fixed=True, nproc=2)
    runs["rank 1"] = torch.load(tmp / "ranks" / "params_rank1.pt")
    runs["dir"] = tmp
    return runs


def fixed_batch(step, rows=8, T=32):
    """The runner's batch for a step (FixedBatches): (inputs, targets), each (rows, T)."""
    batch = torch.randint(0, 256, (rows, T + 1), generator=torch.Generator().manual_seed(step))
    return batch[:, :-1], batch[:, 1:]


def test_gradient_accumulation_changes_no_number(accumulated):
    """One forward of 8 sequences, 2 of 4 or 4 of 2 (Sec. 5's batch of 2^19 tokens split to fit a device):
    the same loss, gradient norm before clipping, clip coefficient and parameters, to float64 rounding."""
    steps, calls, params = accumulated[1]
    assert all(call["grad_scale"] < 1 for call in calls)  # clipping is active at every step
    for n in (2, 4, "2 ranks"):  # two ranks of 2 sequences, 2 forwards each
        other_steps, other_calls, other_params = accumulated[n]
        for s in steps:
            # the loss is fp32: each of <= 4 micro-batch means and each sum of them rounds at 2^-24 relative
            assert other_steps[s]["loss"] == pytest.approx(steps[s]["loss"], rel=8 * 2**-24), (n, s)
            for key in ("grad_norm", "grad_lm_head", "grad_mlp_first", "grad_attn_mid"):
                assert other_steps[s][key] == pytest.approx(steps[s][key], rel=1e-9), (n, s, key)
        assert [c["grad_scale"] for c in other_calls] == pytest.approx([c["grad_scale"] for c in calls], rel=1e-9)
        for name, p in params.items():
            torch.testing.assert_close(other_params[name], p, rtol=0, atol=1e-9, msg=f"{n} forwards: {name}")
    for name, p in accumulated["2 ranks"][2].items():  # the ranks end with the same parameters, bit for bit
        assert torch.equal(accumulated["rank 1"][name], p), name
    assert os.path.exists(accumulated["dir"] / "ranks" / "step_000003" / "rank1.pt")  # each rank's own state


def test_the_logged_numbers_are_those_of_the_saved_parameters(accumulated):
    """Recomputed here from each step's checkpoint (the parameters that step started from) on its batch: the
    mean loss over the step's tokens, the L2 norm of its gradient (the number clipping acts on) and of each
    watched module's (Sec. 3, Fig. 3: the first and only block's MLP and attention, the LM head), those
    norms clipped by the total (the authors' view) and the mean norm of the stream after each loop (Fig. 2)."""
    steps = accumulated[1][0]
    for s in (1, 2):
        saved = torch.load(accumulated["dir"] / "accum1" / f"step_{s:06d}" / "model.pt", weights_only=True)
        model = GPT(GPTConfig(**saved["config"])).double()
        model.load_state_dict(saved["model"])
        streams = []  # the last block's output at each loop: the stream after the loop, before its norm
        model.transformer.h[-1].register_forward_hook(lambda module, args, out: streams.append(out.detach()))
        loss = model(*fixed_batch(s))
        loss.backward()
        record = steps[s]
        assert record["loss"] == pytest.approx(loss.item(), rel=4 * 2**-24), s  # fp32, as the run's
        total = math.sqrt(sum(p.grad.square().sum().item() for p in model.parameters()))
        assert record["grad_norm"] == pytest.approx(total, rel=1e-12), s
        modules = {"mlp_first": "transformer.h.0.mlp.", "mlp_mid": "transformer.h.0.mlp.",
                   "attn_mid": "transformer.h.0.attn.", "lm_head": "lm_head."}
        for key, prefix in modules.items():
            norm = math.sqrt(sum(p.grad.square().sum().item() for n, p in model.named_parameters()
                                 if n.startswith(prefix)))
            assert record[f"grad_{key}"] == pytest.approx(norm, rel=1e-12), (s, key)
            assert record[f"grad_{key}_clipped"] == pytest.approx(min(1.0, 0.3 / (total + 1e-6)) * norm,
                                                                  rel=1e-12), (s, key)
        resid = [x.norm(dim=-1).mean().item() for x in streams]
        assert len(resid) == 3 and record["resid_norms"] == pytest.approx(resid, rel=1e-6), s  # logged in fp32


def test_the_clip_coefficient_is_the_rule_on_the_logged_norm(accumulated):
    """clip = min(1, 0.3 / (||g|| + 1e-6)) of the rank-averaged gradient, the norm train.py logs."""
    steps, calls, _ = accumulated[1]
    for i, call in enumerate(calls):
        assert call["grad_scale"] == pytest.approx(min(1.0, 0.3 / (steps[i // 2]["grad_norm"] + 1e-6)), rel=1e-12)


def test_the_schedules_reach_every_group_also_after_a_resume(tmp_path, data_dir):
    """10 steps, warm-down over the last half, momentum warm-up over 5 steps: at every step (warm-up, constant,
    warm-down, the last) each group's lr is its base times the schedule, and Muon's momentum the warm-up's;
    a run resumed from step 5 continues both exactly (the schedules are functions of the step). K is drawn
    per step, so the MFU must count the K each step ran (and backprop through the last 2 loops only)."""
    args = ("--num_steps=10", "--warmdown_frac=0.5", "--save_interval=5", "--keep_checkpoints=0",
            "--loops_sampler=uniform", "--loops_min=1", "--loops_max=4", "--bptt_loops=2")
    steps, calls, _ = run(tmp_path, data_dir, "full", *args)
    assert_schedule(calls, 10, warmdown_frac=0.5)
    saved = sorted(n for n in os.listdir(tmp_path / "full") if n.startswith("step_"))
    assert saved == ["step_000005", "step_000010"]  # every save_interval steps and the last, not the first
    os.makedirs(tmp_path / "cut")
    shutil.copytree(tmp_path / "full" / "step_000005", tmp_path / "cut" / "step_000005")
    _, calls, _ = run(tmp_path, data_dir, "cut", *args, "--resume")
    assert_schedule(calls, 10, first_step=5, warmdown_frac=0.5)
    assert len({r["loops"] for r in steps.values()}) > 1
    for r in steps.values():
        assert r["mfu"] == pytest.approx(training_flops(r["loops"], 2) * r["tok_per_s"] / 1e12, rel=1e-12)


def training_flops(K, bptt, d=D_MODEL, T=32, V=512):
    """FLOPs per token of a training step of TINY's model (depth 1): 2 per weight per token forward and 4 more
    backward for the block in each loop that backpropagates, 2 for those that do not; attention's QK^T and
    AV, 4 * d * T per loop forward (nanochat's convention: every key counted), tripled likewise; the head
    once, 6 per weight."""
    block, G = 12 * d * d, min(K, bptt)
    per_loop = 2 * block + 4 * d * T
    return 3 * per_loop * G + per_loop * (K - G) + 6 * V * d
