"""Tests for planning.py: the memory estimate and the accelerators' peak FLOP/s."""
import json

import pytest
import torch

from model import GPT, GPTConfig, config_for_depth
from planning import estimate_memory, peak_flops
from runtime import precision


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
    assert estimate == pytest.approx(peak, rel=0.15)


def test_estimate_memory_states_and_scale():
    with torch.device("meta"):
        model = GPT(config_for_depth(12, vocab_size=151644))  # base: d 768, V 151680
    emb, blocks = 151680 * 768, 12 * 12 * 768**2
    m = estimate_memory(model, 8, "bf16", loops=12, world_size=8)
    assert m["parameters"] == m["gradients"] == 2 * emb + 4 * (emb + blocks)  # wte in bf16
    # AdamW: 2 slots (wte's in bf16) over 8 ranks; Muon: rank 0 owns matrices 0, 8, 16, ...
    per_layer = [768**2] * 4 + [4 * 768**2] * 2  # c_q c_k c_v c_proj, c_fc c_proj
    muon = 4 * sum((per_layer * 12)[::8])
    assert m["optimizer"] == 2 * emb // 8 * 2 + 2 * emb // 8 * 4 + muon
    assert sum(v for k, v in m.items() if k != "total") == m["total"]
    gib = {(c, k): estimate_memory(model, 8, loops=12, compiled=c, checkpoint_loops=k)["total"] / 2**30
           for c in (False, True) for k in (False, True)}
    # the scale: eager ~77 GiB and compiled ~50 GiB by a CPU-based estimate
    assert 50 < gib[False, False] < 80 and 25 < gib[True, False] < 50
    assert gib[False, True] < 0.4 * gib[False, False] and gib[True, True] < gib[True, False]


def test_peak_flops_by_name():
    assert peak_flops("NVIDIA H100 NVL") == 835e12 and peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops("NVIDIA A100-SXM4-80GB") == 312e12 and peak_flops("NVIDIA A10") == 125e12
    assert peak_flops("cpu") is None
