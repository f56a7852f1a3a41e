"""Support for train.py: run planning and settings checks, kept out of the tutorial's way.

What a run will cost before it starts (the memory estimate, accelerators' peak FLOP/s, the
--dry_run plan), and train.py's settings checks (values, settings that would do nothing, what a
resumed run may change, the run directory's name, the horizon).
"""
import math
from collections import Counter

from runtime import dtype_bytes

# ---------------------------------------------------------------------------- memory and accelerators

def estimate_memory(model, batch_size, dtype="bf16", compiled=False, checkpoint_loops=None, loops=None,
                    world_size=1, device_type="cuda"):
    """Peak training bytes per GPU of `model` (a GPT, on the meta device will do): {parameters,
    gradients, optimizer, activations, total}. Optimizer state: AdamW's two slots (in the parameter's
    dtype) for wte and lm_head, sharded over world_size; Muon's fp32 momentum for the block matrices,
    each owned by one rank: rank 0 owns the first of every world_size matrices of one shape (Muon's
    blocks). Activations, per token, d = n_embd, kv = n_kv_head * head_dim, b = 2 (bf16 autocast)
    or 4 bytes, s = bytes of the residual stream (norm's output: bf16 on CPU, fp32 under CUDA's
    autocast), V = padded vocabulary:
      eager, per layer and loop: the stream twice (2s d), the normed inputs of the four
        linears (shared when s = b: 2b d, else one bf16 copy each: 4b d), q and k after
        RoPE (fp32: the cos/sin tables are, 4(d + kv)), SDPA's q, k, v and output
        (b(2d + 2kv)), ReLU and its square (8b d); per loop also h(t) and the stream (s d)
      compiled (compile_regions; inductor recomputes pointwise ops): 2s d + b(2d + 2kv) + 4b d
      checkpoint_loops: per loop only what crosses loops (2s d), plus one loop recomputed
      logits: eager keeps tanh and log-softmax outputs (8V) and peaks with two fp32
        gradients (8V) in backward; compiled keeps the bf16 logits (bV) and peaks at +4V.
    Checked against CPU measurements (bf16 autocast, eager) in tests/test_planning.py. The
    compiled counts are the partitioner's expected choice, not calibrated: CPU inductor
    (bench.py --mode=memory, regional) kept ~1.3-1.5x more."""
    c, K = model.config, model.loop_count(loops)
    ckpt = c.checkpoint_loops if checkpoint_loops is None else checkpoint_loops
    b = dtype_bytes(dtype)
    s = 2 if (b == 2 and device_type == "cpu") else 4
    d, kv, L, V = c.n_embd, c.n_kv_head * (c.n_embd // c.n_head), c.n_layer, c.padded_vocab
    if compiled:
        layer, head, head_peak = 2 * s * d + b * (2 * d + 2 * kv) + 4 * b * d, b * V, 4 * V
    else:
        layer = 2 * s * d + (2 if s == b else 4) * b * d + 4 * (d + kv) + b * (2 * d + 2 * kv) + 8 * b * d
        head, head_peak = 8 * V, 8 * V
    N, loop = batch_size * c.sequence_len, L * layer + s * d
    held = N * (K * (2 * s * d if ckpt else loop) + 2 * s * d + head)  # + e and norm(e)
    wte, lm_head = model.transformer.wte.weight, model.lm_head.weight
    # autocast's bf16 copies of the weights, saved for backward (the blocks' only while a loop is live)
    blocks = 2 * sum(p.numel() for p in model.transformer.h.parameters()) if b == 2 else 0
    held += 2 * lm_head.numel() if b == 2 else 0
    peak = max(N * head_peak, N * loop + blocks) if ckpt else N * head_peak + blocks

    def size(p, n):  # bytes of n elements of p: wte is stored in bf16 under bf16 (precision)
        return n * (2 if p is wte and b == 2 else 4)
    nbytes = {"parameters": sum(size(p, p.numel()) for p in model.parameters())}
    nbytes["gradients"] = nbytes["parameters"]
    shapes = Counter(tuple(p.shape) for p in model.transformer.h.parameters())
    nbytes["optimizer"] = (sum(2 * size(p, -(-p.numel() // world_size)) for p in (wte, lm_head))
                           + sum(4 * math.prod(shape) * -(-n // world_size) for shape, n in shapes.items()))
    nbytes["activations"] = held + peak
    nbytes["total"] = sum(nbytes.values())
    return nbytes


# Dense (no sparsity) bf16 tensor-core peak FLOP/s, for MFU and the run planner (train.py --dry_run):
# NVIDIA's datasheets halve their "with sparsity" figures, the H100 and Ada whitepapers give both. H200 is
# the H100 SXM's GH100 with more memory. A name that contains another comes before it ("A100", "A10").
PEAK_FLOPS = (("H200", 989.4e12), ("H100 PCIe", 756.5e12), ("H100 NVL", 835.5e12), ("H100", 989.4e12),
              ("A100", 312e12), ("L40S", 362.05e12), ("4090", 165.2e12), ("A10", 125e12))


def peak_flops(name):
    """Peak FLOP/s of an accelerator by (part of) its name, e.g. torch.cuda.get_device_name(), or
    None if unknown (a CPU). More specific names come first: "H100 NVL" before "H100"."""
    return next((flops for key, flops in PEAK_FLOPS if key.lower() in name.lower()), None)


# ---------------------------------------------------------------------------- train.py's settings
