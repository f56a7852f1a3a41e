"""Tests for planning.py: the memory estimate against measured training steps, the accelerators'
peak FLOP/s against the vendors' published figures, and train.py's settings: checks, run directory,
horizon, batch split, shards, what a resume may change."""
import json
import os
import re

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from flt import planning
from flt import runtime
from conftest import config_for_depth
from model import VARIANTS, GPT, GPTConfig
from optim import build_optimizers, reduce_gradients
from flt.planning import PEAK_FLOPS, estimate_memory, peak_flops
from flt.runtime import precision, resolve_dtype
from test_configs import grad_accum, model_config, train_defaults
from test_train import python


def measured_peak(model, idx, loops, tmp_path):
    """Peak bytes allocated during one CPU bf16 training step, from the profiler's allocator
    trace. The gradients exist beforehand (accumulated in place), so the peak is activations."""
    autocast = precision(model.train(), "cpu", "bf16")
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        with autocast:
            loss = model(idx, idx, loops=loops)
        loss.backward()
    prof.export_chrome_trace(str(tmp_path / "trace.json"))
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    return max(e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]")


@pytest.mark.parametrize("n_embd, n_layer, vocab, loops, ckpt", [
    (64, 2, 4096, 2, False), (128, 2, 128, 4, False), (128, 2, 4096, 4, True), (128, 3, 1024, 6, True)])
def test_estimate_memory_matches_measured_activations(n_embd, n_layer, vocab, loops, ckpt, tmp_path):
    torch.manual_seed(0)
    cfg = GPTConfig(sequence_len=64, vocab_size=vocab, n_layer=n_layer, n_embd=n_embd, n_head=2, n_kv_head=2,
                    checkpoint_loops=ckpt)
    model = GPT(cfg)
    model.init_weights()
    peak = measured_peak(model, torch.randint(0, vocab, (2, 64)), loops, tmp_path)
    estimate = estimate_memory(model, 2, "bf16", loops=loops, device_type="cpu")["activations"]
    # The count leaves out what is small next to (batch x sequence x width) tensors: index and target
    # tensors, the loss, scalars, the RoPE slices, SDPA's per-row statistics. At these shapes they
    # were 0.1-3.4% of the measured peak (the estimate below it each time), hence 5%.
    assert estimate == pytest.approx(peak, rel=0.05)


def measured_states(model, world_size):
    """Bytes of the parameters, gradients and optimizer state that rank 0 of `world_size` holds after
    one bf16 training step with train.py's optimizers (build_optimizers, distributed as under
    torchrun). The ranks are simulated in this process by torch's fake process group: collectives move
    nothing, so the values are garbage, but every buffer rank 0 keeps is allocated."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        autocast = precision(model.train(), "cpu", "bf16")
        optimizers = build_optimizers(model, distributed=True)
        idx = torch.randint(0, model.config.vocab_size, (2, model.config.sequence_len))
        with autocast:
            loss = model(idx, idx, loops=2)
        loss.backward()
        reduce_gradients(optimizers)
        for opt in optimizers:
            opt.step()
    finally:
        dist.destroy_process_group()
    state = [t for opt in optimizers for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
    return {"parameters": sum(p.nbytes for p in model.parameters()),
            "gradients": sum(p.grad.nbytes for p in model.parameters()),
            "optimizer": sum(t.nbytes for t in state)}


@pytest.mark.parametrize("n_layer, world_size", [(2, 1), (3, 3), (12, 8)])
def test_estimate_memory_matches_measured_states(n_layer, world_size):
    # 12 layers on 8 ranks: rank 0 owns 6 of the 48 attention matrices and 2 of each MLP's 12, not
    # every 8th matrix in parameter order (which would give it 18 d^2 instead of 22 d^2 of momentum)
    torch.manual_seed(0)
    model = GPT(GPTConfig(sequence_len=16, vocab_size=100, n_layer=n_layer, n_embd=64, n_head=2, n_kv_head=2))
    model.init_weights()
    m = estimate_memory(model, 2, "bf16", loops=2, world_size=world_size, device_type="cpu")
    assert {k: m[k] for k in ("parameters", "gradients", "optimizer")} == measured_states(model, world_size)


def test_estimate_memory_states_and_scale():
    with torch.device("meta"):
        model = GPT(config_for_depth(12, vocab_size=151644))  # base: d 768, V 151680
    emb, blocks = 151680 * 768, 12 * 12 * 768**2
    m = estimate_memory(model, 8, "bf16", loops=12, world_size=8)
    assert m["parameters"] == m["gradients"] == 2 * emb + 4 * (emb + blocks)  # wte in bf16
    # AdamW: 2 slots (wte's in bf16) over 8 ranks; Muon (fp32): rank 0 owns the first of every 8
    # matrices of a shape: 6 of the 48 d x d (c_q c_k c_v c_proj), 2 of the 12 c_fc, 2 of the 12 c_proj
    muon = 4 * (6 * 768**2 + 2 * 4 * 768**2 + 2 * 4 * 768**2)
    assert m["optimizer"] == 2 * emb // 8 * 2 + 2 * emb // 8 * 4 + muon
    assert sum(v for k, v in m.items() if k != "total") == m["total"]
    gib = {(c, k): estimate_memory(model, 8, loops=12, compiled=c, checkpoint_loops=k)["total"] / 2**30
           for c in (False, True) for k in (False, True)}
    # the scale of a base model at K=12: eager ~77 GiB and compiled ~50 GiB by a CPU-based estimate
    assert 50 < gib[False, False] < 80 and 25 < gib[True, False] < 50
    assert gib[False, True] < 0.4 * gib[False, False] and gib[True, True] < gib[True, False]


# Peak GiB of a training step (bf16, Muon + AdamW, B=16) of config/flt_base.py's model, measured on
# an NVIDIA H200 (torch 2.11, CUDA 13) by `python -m scripts.gpu_check --batch_size=16`, docs/testing.md
H200_PEAK_GIB = {(9, True): 69.28, (1, True): 22.66, (9, False): 111.34, (1, False): 48.04}


@pytest.mark.parametrize("loops,compiled", sorted(H200_PEAK_GIB))
def test_estimate_memory_matches_the_h200_measurements(loops, compiled):
    with torch.device("meta"):
        model = GPT(config_for_depth(12, vocab_size=151644, sequence_len=1024))
    planned = estimate_memory(model, 16, "bf16", compiled=compiled, loops=loops)["total"] / 2**30
    # within 5%: the allocator's rounding and workspace are not modelled
    assert planned == pytest.approx(H200_PEAK_GIB[loops, compiled], rel=0.05)


def test_peak_flops_by_name():
    # Dense bf16 tensor-core peaks as published (the "with sparsity" figures are twice these):
    published = {
        "NVIDIA H100 80GB HBM3": 989.4e12,    # H100 SXM5: NVIDIA H100 whitepaper (989.4 / 1978.9 sparse)
        "NVIDIA H100 PCIe": 756.5e12,         # H100 whitepaper, PCIe column (756.5 / 1513)
        "NVIDIA H100 NVL": 835.5e12,          # H100 NVL datasheet: 1,671 TFLOPS with sparsity
        "NVIDIA H200": 989.4e12,              # H200 datasheet: 1,979 TFLOPS with sparsity
        "NVIDIA A100-SXM4-80GB": 312e12,      # A100 datasheet: 312 / 624 sparse, SXM and PCIe alike
        "NVIDIA A100 80GB PCIe": 312e12,
        "NVIDIA A10": 125e12,                 # A10 datasheet: 125 / 250 sparse
        "NVIDIA L40S": 362.05e12,             # L40S datasheet: 362.05 / 733 sparse
        "NVIDIA GeForce RTX 4090": 165.2e12,  # Ada Lovelace whitepaper, FP32 accumulate: 165.2 / 330.4
    }
    for name, flops in published.items():
        assert peak_flops(name) == pytest.approx(flops, rel=1e-3), name
        assert peak_flops(name.lower()) == peak_flops(name)
    assert peak_flops("cpu") is None and peak_flops("Apple M2") is None
    # The first name contained in the device's wins, so a name that contains another must come first
    # ("H100 NVL" before "H100", "A100" before "A10"), else the longer one is never reached.
    keys = [key.lower() for key, _ in PEAK_FLOPS]
    assert not [(a, b) for i, a in enumerate(keys) for b in keys[i + 1:] if a in b]


# ---------------------------------------------------------------------------- train.py's settings
# The functions train.py runs on its settings before any data, model or process group exists,
# called here directly on train.py's defaults (the CLI wiring: a few runs in test_train.py).

DEFAULTS = train_defaults()


def before_data(**changes):
    """What train.py does with its settings before it touches data, on one CPU process: the settings
    checks, the run directory, the device, the precision, the batch split, the model's shape."""
    s = DEFAULTS | changes
    planning.check_settings(s, DEFAULTS)
    out_dir = planning.out_dir_of(s)
    runtime.setup(s["device"])
    resolve_dtype(s["dtype"], "cpu")
    grad_accum(s, 1)
    model_config(s, s["bpe_vocab_size"])
    return out_dir


def test_the_defaults_and_every_allowed_choice_pass():
    assert before_data() == os.path.join("out", "d3_flt_k3")
    for changes in (dict(compile="on"), dict(dataset="fineweb", num_shards=3), dict(dtype="bf16"),
                    dict(horizon_params="non_embedding", num_steps=-1), dict(attn="mla", kv_rank=64),
                    dict(loops_sampler="uniform", loops_min=2, loops_max=5), dict(bptt_loops=2),
                    dict(loops_sampler="lognormal_poisson", loops=2, loops_max=9), dict(keep_checkpoints=0),
                    dict(depth=4, n_kv_head=1), dict(watch_layer=2), dict(divergence_window=5, divergence_nats=0.5),
                    dict(save_interval_minutes=0.5), dict(resume="auto"), dict(variant="LT_i", bptt_loops=2),
                    dict(variant="LT", loops_sampler="uniform", loops_min=1, loops_max=2, bptt_loops=2)):
        before_data(**changes)
    assert [resolve_dtype("auto", t) for t in ("cuda", "cpu", "mps")] == ["bf16", "fp32", "fp32"]


@pytest.mark.parametrize("changes, match", [
    (dict(device="cuda"), "device='cuda', but this torch"),
    (dict(eval_interval=0), "eval_interval=0: expected a positive integer"),
    (dict(save_interval=-3), "save_interval=-3: expected a positive integer"),
    (dict(device_batch_size=0), "device_batch_size=0: expected a positive integer"),
    (dict(n_kv_head=0), "n_kv_head=0: expected -1 (automatic) or a positive integer"),
    (dict(depth=4, n_kv_head=3), "n_kv_head=3 is invalid: must divide n_head=2"),  # n_head = ceil(256 / 128)
    (dict(num_steps=0), "num_steps=0: expected -1"),
    (dict(depth=5), "depth=5, aspect_ratio=64: d_model = aspect_ratio * depth = 320 does not split into heads of "
                    "one even dimension <= 128 (train.py's shape); e.g. depth=4 or 6 at aspect_ratio=64"),
    (dict(keep_checkpoints=-1), "keep_checkpoints=-1: expected >= 1, or 0 to keep every checkpoint"),
    (dict(keep_every=-1), "keep_every=-1: expected an integer >= 0"),
    (dict(horizon_params="some"), "horizon_params='some': expected 'all' or 'non_embedding'"),
    (dict(compile="maybe"), "compile='maybe': expected 'auto' or 'on' or 'off'"),
    (dict(dtype="fp16"), "dtype='fp16': expected 'bf16' or 'fp32' (or 'auto'"),
    (dict(variant="XL"), "variant='XL': expected " + " or ".join(map(repr, VARIANTS))),
    (dict(total_batch_size=100), "total_batch_size=100 is not a multiple of device_batch_size * sequence_len * "
                                 "world_size = 2048"),
    (dict(watch_layer=3), "watch_layer=3: expected a layer index below depth=3"),
    (dict(divergence_nats=0.0), "divergence_nats=0.0: expected a positive number of nats"),
    # nan passed `<= 0`; 1e38 overflowed fp32 inside AdamW's first step, a traceback
    (dict(matrix_lr=float("nan")), "matrix_lr=nan: expected a positive learning rate, at most 1e+06"),
    (dict(embedding_lr=1e38), "embedding_lr=1e+38: expected a positive learning rate, at most 1e+06"),
    (dict(grad_clip=float("nan")), "grad_clip=nan: expected a positive gradient norm"),
    (dict(save_interval_minutes=-1.0), "save_interval_minutes=-1.0: expected minutes >= 0 (0 = off)"),
    (dict(loops_sampler="poisson"), "loops_sampler='poisson': expected 'fixed' or 'uniform' or"),
    (dict(loops_sampler="uniform", loops_min=4, loops_max=2), "loops_max=2: expected an integer >= loops_min=4"),
    (dict(loops_sampler="lognormal_poisson", loops=1), "loops=1: expected an integer >= 2"),
    (dict(loops=0), "loops=0: expected a positive integer"),
    # LT reads the token embedding in loop 1 only: a truncated loop 1 leaves it without a gradient
    (dict(variant="LT", bptt_loops=2), "bptt_loops=2: expected -1 with variant='LT' while K can exceed it: its "
                                       "loops after the first restart without the token embedding"),
    (dict(variant="LT", loops_sampler="uniform", loops_min=1, loops_max=5, bptt_loops=4), "bptt_loops=4: expected -1"),
    (dict(variant="LT", loops_sampler="lognormal_poisson", loops=2, bptt_loops=4), "bptt_loops=4: expected -1"),
])
def test_bad_values_fail_before_data_naming_the_setting(changes, match):
    if changes.get("device") == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match=re.escape(match)):
        before_data(**changes)


@pytest.mark.parametrize("changes, match", [
    (dict(kv_rank=64), "kv_rank=64 does nothing unless attn='mla'"),
    (dict(num_shards=3), "num_shards=3 does nothing unless dataset='fineweb'"),
    (dict(horizon_params="non_embedding", num_steps=5), "horizon_params='non_embedding' does nothing unless "
                                                        "num_steps=-1"),
    (dict(tokenizer="t.json", bpe_vocab_size=512), "bpe_vocab_size=512 does nothing unless tokenizer='bpe'"),
    (dict(divergence_nats=2.0), "divergence_nats=2.0 does nothing unless divergence_window > 0"),
    (dict(loops=1, loss_all_loops=True), "loss_all_loops=True does nothing with loops=1"),
    (dict(loops=1, variant="LT"), "variant='LT' does nothing with loops=1 (one loop is the plain transformer)"),
    (dict(core_max_per_task=4), "core_max_per_task=4 does nothing unless core_interval > 0"),
    (dict(bundle_dir="b"), "bundle_dir='b' does nothing unless core_interval > 0"),
    (dict(out_dir="x", out_root="runs"), "out_root='runs' does nothing when out_dir is given"),
    (dict(gpu="H100"), "gpu='H100' does nothing unless dry_run=True"),
    (dict(keep_checkpoints=0, keep_every=100), "keep_every=100 does nothing with keep_checkpoints=0 (every one is "
                                               "kept)"),
    (dict(dataset="s3", loader_prefetch=4, sample_tokens=0), "loader_prefetch=4 does nothing with a task dataset "
                                                             "(its items are made, not read)"),
    (dict(loops_min=2), "loops_min=2 does nothing unless loops_sampler='uniform'"),
    (dict(loops_max=6), "loops_max=6 does nothing with loops_sampler='fixed'"),
    (dict(bptt_loops=3), "bptt_loops=3 does nothing with loops_sampler='fixed' unless below loops"),
])
def test_a_setting_that_would_do_nothing_is_refused(changes, match):
    with pytest.raises(ValueError, match=re.escape(match) + ": remove it \\(or a config file's value: --"):
        planning.check_settings(DEFAULTS | changes, DEFAULTS)


@pytest.mark.parametrize("changes, path", [
    ({}, "out/d3_flt_k3"), (dict(depth=6), "out/small_flt_k3"), (dict(depth=12, variant="LT_ai", loops=9),
                                                                  "out/base_lt_ai_k9"),
    (dict(depth=1, variant="LT_i", loops=2, n_kv_head=1, window_pattern="SL"), "out/d1_lt_i_k2_gqa1_swa_SL"),
    (dict(attn="mla", loops_sampler="lognormal_poisson"), "out/d3_flt_k3_mla_lognormal_poisson"),
    (dict(out_root="runs/x"), "runs/x/d3_flt_k3"),
])
def test_out_dir_is_named_by_what_makes_the_run_different(changes, path):
    assert planning.out_dir_of(DEFAULTS | changes) == path
    assert planning.out_dir_of(DEFAULTS | changes | {"out_dir": "mine"}) == "mine"


def dry_run(*args):
    """The lines of `python train.py <args> --dry_run`: train.py's own arithmetic, nothing trained."""
    p = python("train.py", *args, "--dry_run", timeout=120)  # forked from a process that imported torch
    assert p.returncode == 0, p.stderr
    return p.stdout.splitlines()


def test_horizon_is_20_tokens_per_parameter():
    # depth 2: d = 128, L = 2; vocabulary 1000 padded to 1024; untied embedding and LM head, 12 d^2 a block
    d, L, V = 128, 2, 1024
    n_all, n_non_embedding = 2 * V * d + 12 * L * d * d, V * d + 12 * L * d * d
    lines = dry_run("--depth=2", "--bpe_vocab_size=1000", "--num_steps=-1", "--total_batch_size=4096")
    assert lines[2] == f"  parameters  {n_all:,} all, {n_non_embedding:,} without the token embedding"
    assert 20 * n_all // 4096 == 3200 and 20 * n_non_embedding // 4096 == 2560
    assert lines[3].startswith("  horizon     3,200 steps x 4,096 tokens") and "the other count: 2,560 steps" in lines[3]
    lines = dry_run("--depth=2", "--bpe_vocab_size=1000", "--num_steps=-1", "--horizon_params=non_embedding",
                    "--total_batch_size=4096")
    assert lines[3].startswith("  horizon     2,560 steps x 4,096 tokens") and "the other count: 3,200 steps" in lines[3]
    lines = dry_run("--depth=2", "--num_steps=-1", "--horizon_params=non_embedding", f"--total_batch_size={2**30}")
    assert lines[3].startswith("  horizon     1 steps x")  # at least a step
    assert dry_run("--depth=2")[3].startswith("  horizon     250 steps x")  # num_steps, when given


def test_the_shape_follows_from_depth():
    """The paper's backbone from one integer: d_model = 64 * depth, heads of at most 128 dimensions (n_head =
    ceil(d_model / 128)), kv heads = heads unless n_kv_head is given (GQA)."""
    assert "depth 3 (d_model 192, 2 heads, 2 kv)" in dry_run("--depth=3")[1]  # 1.5 heads of 128: 2
    assert "depth 12 (d_model 768, 6 heads, 2 kv)" in dry_run("--depth=12", "--n_kv_head=2")[1]


def test_a_depth_is_refused_by_name_exactly_where_the_model_could_not_be_built():
    """heads_of (the settings check) against GPTConfig itself, at train.py's ceil(d_model / 128) heads:
    odd depths at aspect_ratio 64 split only where depth + 1 divides 128 (1, 3, 7, 15, 31, 63)."""
    for aspect_ratio in (32, 48, 64, 96, 128):
        for depth in range(1, 70):
            n_embd = aspect_ratio * depth
            n_head = -(-n_embd // 128)
            try:
                GPTConfig(n_layer=depth, n_head=n_head, n_kv_head=n_head, n_embd=n_embd)
                built = True
            except ValueError:
                built = False
            assert (planning.heads_of(aspect_ratio, depth) is not None) == built, (aspect_ratio, depth)
    odd = [d for d in range(1, 70, 2) if planning.heads_of(64, d)]
    assert odd == [1, 3, 7, 15, 31, 63]


def test_grad_accum_splits_the_batch_over_ranks_and_forwards():
    s = DEFAULTS | dict(total_batch_size=2**19, device_batch_size=8, sequence_len=1024)
    assert [grad_accum(s, w) for w in (1, 2, 8, 64)] == [64, 32, 8, 1]
    with pytest.raises(ValueError, match=r"total_batch_size=524288 is not a multiple .* = 1048576"):
        planning.check_grad_accum(2**19, 8 * 1024 * 128)


def test_training_shards_cover_the_horizon(capsys):
    s = DEFAULTS | dict(dataset="fineweb", num_shards=-1)
    # ceil(tokens x 1.1 margin / 55M tokens a shard): 6e9 -> 120 shards; 50M -> exactly 1
    assert planning.training_shards(s, 6e9) == 120 and planning.training_shards(s, 50e6) == 1
    assert planning.training_shards(s | {"num_shards": 249}, 6e9) == 249
    assert capsys.readouterr().out == ""
    assert planning.training_shards(s | {"num_shards": 3}, 6e9) == 3
    assert "will see its data more than once (num_shards=3)" in capsys.readouterr().out


def test_resume_may_change_only_the_resumable_settings():
    saved = DEFAULTS | {"out_dir": "out/d3_flt_k3"}
    now = saved | dict(resume=True, eval_interval=7, num_steps=500, brand_new_setting=1)
    # in the saved order, train.py's: the optimizers' settings, evaluation's, the run directory's
    assert planning.resume_changes(saved, now, "ckpt") == ["num_steps", "eval_interval", "resume"]
    assert planning.resume_changes(saved, saved, "ckpt") == []
    with pytest.raises(ValueError) as e:
        planning.resume_changes(saved, now | dict(loops=5, matrix_lr=0.1), "out/x/step_000004")
    assert str(e.value) == (f"--resume: settings ['loops', 'matrix_lr'] differ from the checkpoint "
                            f"out/x/step_000004; only {sorted(planning.RESUMABLE)} may change")
    assert planning.RESUMABLE < set(DEFAULTS)  # every name in it is a setting


@pytest.mark.parametrize("saved, now, refused", [
    (dict(keep_checkpoints=0), dict(keep_checkpoints=2), True),  # a resume that forgot --keep_checkpoints=0
    (dict(keep_checkpoints=5), dict(keep_checkpoints=2), True),
    (dict(keep_checkpoints=2, keep_every=100), dict(keep_checkpoints=2, keep_every=0), True),
    (dict(keep_checkpoints=2), dict(keep_checkpoints=5), False),  # keeping more deletes nothing
    (dict(keep_checkpoints=2), dict(keep_checkpoints=0), False),
    (dict(keep_checkpoints=2), dict(keep_checkpoints=2, keep_every=50), False),
])
def test_a_resume_never_prunes_what_the_run_chose_to_keep(saved, now, refused):
    saved, now = DEFAULTS | saved, DEFAULTS | now | {"resume": True}
    if not refused:
        assert "resume" in planning.resume_changes(saved, now, "ckpt")
        return
    with pytest.raises(ValueError, match=rf"^--resume: keep_checkpoints={now['keep_checkpoints']}, keep_every="
                                         rf"{now['keep_every']} would delete checkpoints the run kept \(it had "
                                         rf"keep_checkpoints={saved['keep_checkpoints']}, keep_every="):
        planning.resume_changes(saved, now, "ckpt")


def test_plan_names_what_it_cannot_count():
    with pytest.raises(ValueError, match="tokenizer='gpt2' is not a local file"):
        planning.planned_vocab(DEFAULTS | dict(tokenizer="gpt2"))
    s = DEFAULTS | dict(out_dir="o", gpu="TPU v9", dry_run=True)
    with torch.device("meta"):
        model = GPT(model_config(s, planning.planned_vocab(s)))
    text = planning.plan(s, model, {"all": 1, "non_embedding": 1}, {"all": 20, "non_embedding": 20}, 250)
    assert "unknown accelerator 'TPU v9'" in text and "the embedded corpus" in text
