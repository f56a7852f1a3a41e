"""Tests for model.py: the looped backbone, its loop variants and its KV cache (flt/decoding.py).

The central check is `reference_forward`: an independent plain-torch (float64) rewrite
of the paper's backbone and variants (Sec. 4) -- its own RMSNorm, RoPE, explicit-softmax attention with a mask,
and the per-variant restart / injection rules (REFERENCE_RULES) -- run on the model's own
weights. Most other tests compare the model against itself (cache vs. full forward,
checkpointing vs. not, one pass vs. separate passes).

After `init_weights()` every output projection is zero, so each block is the identity
and many equalities would hold trivially; `randomize_` therefore redraws *every* weight
before any equality test, and `test_variants_differ_beyond_first_loop` makes sure the
variants really are different functions once K > 1.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from conftest import config_for_depth
from model import INJECTIONS, ROPE_SPAN, VARIANTS, GPT, GPTConfig, KVCache, apply_rotary, injection
from flt.runtime import precision

SEQ_LEN = 32  # sliding window w = SEQ_LEN // 4 = 8, shorter than the sequences below
VOCAB = 100  # padded to 128
ATTENTION = {
    "full": dict(n_head=2, n_kv_head=2),
    "gqa": dict(n_head=4, n_kv_head=2),
    "mla": dict(n_head=2, n_kv_head=2, attn="mla", kv_rank=16),
    "window": dict(n_head=2, n_kv_head=2, window_pattern="SL"),  # S L L over 3 layers
}
# Extra attention shapes for the reference comparison only.
ATTENTION_EXTRA = {
    "window_S": dict(n_head=2, n_kv_head=2, window_pattern="S"),  # S S L: last forced to L
    "mla_gqa_window": dict(n_head=4, n_kv_head=2, attn="mla", kv_rank=16, window_pattern="SSL"),
}
TOL = dict(atol=2e-5, rtol=1e-5)  # fp32 model vs. float64 reference


def make_config(variant="FLT", attention="full", **overrides):
    kw = dict(sequence_len=SEQ_LEN, vocab_size=VOCAB, n_layer=3, n_embd=64, loops=1, variant=variant)
    kw.update({**ATTENTION, **ATTENTION_EXTRA}[attention])
    kw.update(overrides)
    return GPTConfig(**kw)


@torch.no_grad()
def randomize_(model, seed=0):
    """Redraw every weight so that no block is the identity (init zeroes c_proj)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        fan_in = p.shape[-1]
        if "wte" in name:
            std = 1.0
        elif "c_proj" in name:
            std = 0.5 / math.sqrt(fan_in)
        else:
            std = 1.0 / math.sqrt(fan_in)
        p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32) * std)
    return model


def make_model(variant="FLT", attention="full", seed=0, **overrides):
    torch.manual_seed(seed)
    model = GPT(make_config(variant, attention, **overrides))
    model.init_weights()
    randomize_(model, seed)
    return model.eval()


def random_tokens(B, T, seed=0):
    g = torch.Generator().manual_seed(seed + 1000)
    return torch.randint(0, VOCAB, (B, T), generator=g)


def padded(v):
    return -(-v // 64) * 64


# ----------------------------------------------------------------------------------
# Independent reference (float64), written from the paper (backbone and Sec. 4's variants)


def ref_norm(x):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + torch.finfo(torch.float32).eps)


def ref_rope(x, pos0=0):
    """x: (B, T, H, hd); half-split rotation, base 10000, nanochat's direction:
    y1 = x1 cos + x2 sin, y2 = -x1 sin + x2 cos. Angles from the formula for any T, so inputs
    longer than sequence_len get their own table, not the model's buffer."""
    T, hd = x.shape[1], x.shape[3]
    inv_freq = 1.0 / (10000 ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    angle = torch.arange(pos0, pos0 + T, dtype=torch.float64)[:, None] * inv_freq[None, :]
    cos, sin = angle.cos()[None, :, None, :], angle.sin()[None, :, None, :]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    return torch.cat([x1 * cos + x2 * sin, -x1 * sin + x2 * cos], dim=-1)


def test_rope_direction_hand_computed():
    # head_dim 4: frequencies 10000^(-0/4) = 1 and 10000^(-2/4) = 0.01, so at position 1 the
    # pairs (x1[0], x2[0]) = (1, 3) and (x1[1], x2[1]) = (2, 4) turn by 1 and 0.01 radians in
    # nanochat's direction: y1 = x1 cos + x2 sin, y2 = -x1 sin + x2 cos.
    model = GPT(make_config(n_embd=8, n_head=2, n_kv_head=2))
    x = torch.tensor([1.0, 2.0, 3.0, 4.0]).view(1, 1, 1, 4)
    expect = torch.tensor([1 * 0.5403023 + 3 * 0.8414710,     # 3.0647153
                           2 * 0.9999500 + 4 * 0.0099998,     # 2.0398993
                           -1 * 0.8414710 + 3 * 0.5403023,    # 0.7794359
                           -2 * 0.0099998 + 4 * 0.9999500])   # 3.9798003
    torch.testing.assert_close(apply_rotary(x, model.cos[1:2], model.sin[1:2]).flatten(), expect)
    torch.testing.assert_close(apply_rotary(x, model.cos[:1], model.sin[:1]), x)  # position 0


def ref_windows(cfg):
    pattern = (cfg.window_pattern * cfg.n_layer)[: cfg.n_layer]
    pattern = pattern[:-1] + "L"
    return [cfg.sequence_len // 4 if c == "S" else None for c in pattern]


# The references' own reading of Sec. 4, written apart from model.py's restart and injection: per
# variant, where loop t >= 2 starts (from e, h(t-1) and the reference's norm) and how layer i sees
# h(t-1) (a name of model.py: INJECTIONS). Indexed, never .get(): a variant of model.VARIANTS
# missing here fails with a KeyError (and test_reference_rules_cover_every_variant), not a default.
REFERENCE_RULES = {
    "LT": (lambda e, h, norm: h, lambda i: None),
    "LT_i": (lambda e, h, norm: norm(e + h), lambda i: None),
    "LT_ai": (lambda e, h, norm: norm(e), lambda i: "attn" if i == 0 else None),
    "FLT_res": (lambda e, h, norm: norm(e), lambda i: "res"),
    "FLT": (lambda e, h, norm: norm(e), lambda i: "attn"),
}


def reference_forward(model, cfg, idx, loops):
    """Returns (per-loop logits, per-loop h(t), per-loop pre-norm streams), float64."""
    W = {k: v.detach().double() for k, v in model.state_dict().items()}
    B, T = idx.shape
    d, H, Hkv = cfg.n_embd, cfg.n_head, cfg.n_kv_head
    hd = d // H
    windows = ref_windows(cfg)
    i_pos = torch.arange(T)[:, None]
    j_pos = torch.arange(T)[None, :]

    def attn(layer, q_in, kv_in):
        p = f"transformer.h.{layer}.attn."
        q = (q_in @ W[p + "c_q.weight"].T).view(B, T, H, hd)
        if cfg.attn == "mla":
            c = ref_norm(kv_in @ W[p + "c_kv_down.weight"].T)
            k, v = c @ W[p + "c_k_up.weight"].T, c @ W[p + "c_v_up.weight"].T
        else:
            k, v = kv_in @ W[p + "c_k.weight"].T, kv_in @ W[p + "c_v.weight"].T
        k, v = k.view(B, T, Hkv, hd), v.view(B, T, Hkv, hd)
        q, k = ref_norm(ref_rope(q)), ref_norm(ref_rope(k))
        k = k.repeat_interleave(H // Hkv, dim=2)
        v = v.repeat_interleave(H // Hkv, dim=2)
        scores = torch.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(hd)
        visible = j_pos <= i_pos
        if windows[layer] is not None:
            visible = visible & (i_pos - j_pos < windows[layer])
        scores = scores.masked_fill(~visible, float("-inf"))
        att = torch.softmax(scores, dim=-1)
        y = torch.einsum("bhij,bjhd->bihd", att, v).reshape(B, T, H * hd)
        return y @ W[p + "c_proj.weight"].T

    def mlp(layer, u):
        p = f"transformer.h.{layer}.mlp."
        return torch.relu(u @ W[p + "c_fc.weight"].T).pow(2) @ W[p + "c_proj.weight"].T

    def block(layer, x, h_prev=None, inject=None):
        # "res": the stream becomes norm(x + h(t-1)) first (FLT_res)
        if inject == "res":
            x = ref_norm(x + h_prev)
        # "attn", Attention Injection: queries from the previous loop's output
        q_in = ref_norm(h_prev) if inject == "attn" else ref_norm(x)
        x = x + attn(layer, q_in, ref_norm(x))
        return x + mlp(layer, ref_norm(x))

    ref_restart, ref_injection = REFERENCE_RULES[cfg.variant]
    e = W["transformer.wte.weight"][idx]
    hs, streams = [], []
    for t in range(1, loops + 1):
        if t == 1:
            x = ref_norm(e)
        else:
            h_prev = hs[-1]
            x = ref_restart(e, h_prev, ref_norm)
        for layer in range(cfg.n_layer):
            if t == 1:
                x = block(layer, x)
            else:
                x = block(layer, x, h_prev, ref_injection(layer))
        streams.append(x)
        hs.append(ref_norm(x))
    logits = [15 * torch.tanh((h @ W["lm_head.weight"].T) / 15)[..., : cfg.vocab_size] for h in hs]
    return logits, hs, streams


# ----------------------------------------------------------------------------------
# 1. Parameter count


def expected_params(cfg):
    d, L, V = cfg.n_embd, cfg.n_layer, padded(cfg.vocab_size)
    hd = d // cfg.n_head
    kv = cfg.n_kv_head * hd
    if cfg.attn == "mla":
        attn = d * d + cfg.kv_rank * d + 2 * kv * cfg.kv_rank + d * d
    else:
        attn = d * d + 2 * kv * d + d * d
    return 2 * V * d + L * (attn + 8 * d * d)


@pytest.mark.parametrize("attention", ["full", "gqa", "mla"])
def test_param_count(attention):
    counts, keys = set(), set()
    for variant in VARIANTS:
        for loops in (1, 3, 6):
            model = GPT(make_config(variant, attention, loops=loops))
            n = sum(p.numel() for p in model.parameters())
            assert model.num_params() == n
            counts.add(n)
            keys.add(tuple(sorted(model.state_dict().keys())))
    assert counts == {expected_params(make_config("FLT", attention))}
    assert len(keys) == 1, "state_dict keys differ between variants"
    if attention == "full":  # the formula N = 2*V*d + 12*L*d^2 (MHA, padded V = 128)
        assert counts == {2 * 128 * 64 + 12 * 3 * 64**2}


def test_param_shapes_and_padded_vocab():
    model = GPT(make_config("FLT", "gqa"))
    shapes = {k: tuple(v.shape) for k, v in model.named_parameters()}
    d, hd = 64, 16
    assert shapes["transformer.wte.weight"] == (128, d)
    assert shapes["lm_head.weight"] == (128, d)
    assert shapes["transformer.h.0.attn.c_q.weight"] == (4 * hd, d)
    assert shapes["transformer.h.0.attn.c_k.weight"] == (2 * hd, d)
    assert shapes["transformer.h.0.attn.c_v.weight"] == (2 * hd, d)
    assert shapes["transformer.h.0.attn.c_proj.weight"] == (d, 4 * hd)
    assert shapes["transformer.h.2.mlp.c_fc.weight"] == (4 * d, d)
    assert shapes["transformer.h.2.mlp.c_proj.weight"] == (d, 4 * d)
    assert all(len(s) == 2 for s in shapes.values()), "no biases or norm parameters"
    # a vocabulary that is already a multiple of 64 is not padded further
    assert GPT(make_config(vocab_size=128)).transformer.wte.weight.shape[0] == 128


@pytest.mark.parametrize("depth,n_head,millions", [(6, 3, 127), (12, 6, 318)])
def test_paper_sizes(depth, n_head, millions):
    cfg = config_for_depth(depth, vocab_size=151644)
    assert (cfg.n_embd, cfg.n_head, cfg.n_kv_head, cfg.n_layer) == (64 * depth, n_head, n_head, depth)
    with torch.device("meta"):  # no memory for 300M parameters needed
        n = GPT(cfg).num_params()
    assert n == 2 * 151680 * cfg.n_embd + 12 * depth * cfg.n_embd**2
    assert round(n / 1e6) == millions


# ----------------------------------------------------------------------------------
# 2. K = 1 is the plain transformer for every variant; K > 1 is not


@pytest.mark.parametrize("attention", list(ATTENTION))
def test_variants_identical_at_one_loop(attention):
    idx = random_tokens(2, 24)
    state = make_model("FLT", attention).state_dict()
    outs = []
    for variant in VARIANTS:
        model = GPT(make_config(variant, attention)).eval()
        model.load_state_dict(state)
        with torch.no_grad():
            outs.append(model(idx, loops=1))
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], atol=1e-6, rtol=0)


@pytest.mark.parametrize("attention", ["full", "mla"])
@pytest.mark.parametrize("loops", [2, 3])
def test_variants_differ_beyond_first_loop(attention, loops):
    idx = random_tokens(2, 24)
    state = make_model("FLT", attention).state_dict()
    outs = {}
    for variant in VARIANTS:
        model = GPT(make_config(variant, attention)).eval()
        model.load_state_dict(state)
        with torch.no_grad():
            outs[variant] = model(idx, loops=loops)
    for a in VARIANTS:
        for b in VARIANTS:
            if a < b:
                assert (outs[a] - outs[b]).abs().max() > 1e-3, f"{a} and {b} agree at loops={loops}"


# ----------------------------------------------------------------------------------
# 3. Every variant matches the independent reference


def test_reference_rules_cover_every_variant():
    """A variant added to model.VARIANTS needs its row in REFERENCE_RULES (the third place)."""
    missing = set(VARIANTS) - REFERENCE_RULES.keys()
    assert not missing, f"add {sorted(missing)} to tests/test_model.py: REFERENCE_RULES"
    assert REFERENCE_RULES.keys() <= set(VARIANTS)


@pytest.mark.parametrize("variant", VARIANTS)
def test_injection_names_a_kind_the_block_reads(variant):
    """model.py: injection returns only names of INJECTIONS (Block.forward reads no others), the
    ones the reference's rule gives, at every layer of a deep model."""
    ref_injection = REFERENCE_RULES[variant][1]
    for layer in range(12):
        kind = injection(variant, layer)
        assert kind in INJECTIONS, f"injection({variant!r}, {layer}) = {kind!r}"
        assert kind == ref_injection(layer), (variant, layer)


def test_every_injection_kind_is_its_own_branch():
    """Block.forward reads each name of INJECTIONS as a different layer: a name without its own
    branch would be the plain layer."""
    model = make_model("FLT")
    block = model.transformer.h[0]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 8, 64, generator=g)
    h_prev = ref_norm(torch.randn(2, 8, 64, generator=g))
    rope = (model.cos[:8], model.sin[:8])
    with torch.no_grad():
        outs = {kind: block(x, rope, h_prev, kind) for kind in INJECTIONS}
    for a in INJECTIONS:
        for b in INJECTIONS:
            if a != b:
                assert (outs[a] - outs[b]).abs().max() > 1e-3, f"injections {a!r} and {b!r} agree"


@pytest.mark.parametrize("attention", list(ATTENTION) + list(ATTENTION_EXTRA))
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("loops", [1, 2, 3])
def test_matches_reference(variant, attention, loops):
    model = make_model(variant, attention)
    idx = random_tokens(2, 24)  # T = 24 > window 8
    with torch.no_grad():
        logits = model(idx, loops=loops)
    ref_logits, _, _ = reference_forward(model, model.config, idx, loops)
    assert logits.dtype == torch.float32 and logits.shape == (2, 24, VOCAB)
    torch.testing.assert_close(logits, ref_logits[-1].float(), **TOL)


@pytest.mark.parametrize("variant", VARIANTS)
def test_loop_states_and_head_match_reference(variant):
    model = make_model(variant, "gqa")
    idx = random_tokens(2, 20)
    with torch.no_grad():
        states = model.loop_states(idx, loops=3).states
        logits = model(idx, loops=3)
        head = model.head(states[-1])
    _, ref_hs, _ = reference_forward(model, model.config, idx, 3)
    assert len(states) == 3
    for h, ref_h in zip(states, ref_hs):
        assert h.shape == (2, 20, 64)
        torch.testing.assert_close(h.float(), ref_h.float(), **TOL)
    torch.testing.assert_close(head, logits)


def test_config_loops_is_the_default_loop_count():
    model = make_model("FLT", "full", loops=3)
    idx = random_tokens(1, 16)
    with torch.no_grad():
        torch.testing.assert_close(model(idx), model(idx, loops=3))
        assert (model(idx) - model(idx, loops=2)).abs().max() > 1e-3


# ----------------------------------------------------------------------------------
# 4. Causality


@pytest.mark.parametrize("attention", list(ATTENTION))
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("loops", [1, 3])
def test_causality(variant, attention, loops):
    model = make_model(variant, attention)
    a = random_tokens(2, 24)
    i = 13
    b = a.clone()
    b[:, i + 1 :] = (b[:, i + 1 :] + 1 + torch.randint(0, VOCAB - 1, b[:, i + 1 :].shape)) % VOCAB
    with torch.no_grad():
        la, lb = model(a, loops=loops), model(b, loops=loops)
    torch.testing.assert_close(la[:, : i + 1], lb[:, : i + 1], atol=1e-6, rtol=0)
    assert (la[:, i + 1 :] - lb[:, i + 1 :]).abs().max() > 1e-3  # the check can fail


# ----------------------------------------------------------------------------------
# 5. Cached decoding equals the full forward; generate


@pytest.mark.parametrize("attention", list(ATTENTION))
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("loops", [1, 3])
def test_kv_cache_matches_full_forward(variant, attention, loops):
    model = make_model(variant, attention)
    B, T, prefix = 2, 22, 5  # decode well past the sliding window (8)
    idx = random_tokens(B, T)
    kv = KVCache(B, loops, model.config)
    with torch.no_grad():
        full = model(idx, loops=loops)
        pre = model(idx[:, :prefix], loops=loops, kv_cache=kv)
        torch.testing.assert_close(pre, full[:, :prefix], atol=1e-4, rtol=0)
        assert kv.pos == prefix
        for n in range(prefix, T):
            step = model(idx[:, n : n + 1], loops=loops, kv_cache=kv)
            assert step.shape == (B, 1, VOCAB)
            # full forward over the sequence so far (not only the final one)
            expect = model(idx[:, : n + 1], loops=loops)[:, -1:]
            torch.testing.assert_close(step, expect, atol=1e-4, rtol=0)
        assert kv.pos == T


# ----------------------------------------------------------------------------------
# 5b. Inputs longer than sequence_len: the RoPE table covers ROPE_SPAN x sequence_len (the
# authors' gpt.py), so CORE's few-shot prompts are fed whole; the KV cache stays at sequence_len.
LONG = 5 * SEQ_LEN // 2  # 80 tokens: 2.5 x sequence_len, 10 sliding windows


def test_rope_table_is_ten_sequence_lens_and_not_saved():
    model = make_model("FLT", "gqa")
    hd = 64 // 4
    inv_freq = 1.0 / (10000 ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    angle = torch.arange(10 * SEQ_LEN, dtype=torch.float64)[:, None] * inv_freq  # fp32 table: ~1e-5 off
    assert ROPE_SPAN == 10 and model.cos.shape == model.sin.shape == (10 * SEQ_LEN, 1, hd // 2)
    torch.testing.assert_close(model.cos[:, 0].double(), angle.cos(), atol=3e-5, rtol=0)
    torch.testing.assert_close(model.sin[:, 0].double(), angle.sin(), atol=3e-5, rtol=0)
    # checkpoints hold the parameters only, so they load whatever the table's length
    state = model.state_dict()
    assert list(state) == [name for name, _ in model.named_parameters()]
    other = GPT(make_config("FLT", "gqa")).eval()
    assert not other.load_state_dict(state).missing_keys
    idx = random_tokens(1, LONG)
    with torch.no_grad():
        torch.testing.assert_close(other(idx, loops=2), model(idx, loops=2), atol=0, rtol=0)


@pytest.mark.parametrize("variant, attention", [("FLT", "window"), ("LT_i", "gqa"), ("FLT_res", "mla"),
                                                ("LT_ai", "mla_gqa_window"), ("LT", "full")])
def test_long_input_matches_reference(variant, attention):
    model, idx = make_model(variant, attention), random_tokens(2, LONG)
    with torch.no_grad():
        logits = model(idx, loops=3)
        first = model(idx[:, :SEQ_LEN], loops=3)
    assert logits.shape == (2, LONG, VOCAB)
    torch.testing.assert_close(logits, reference_forward(model, model.config, idx, 3)[0][-1].float(), **TOL)
    torch.testing.assert_close(logits[:, :SEQ_LEN], first, atol=1e-6, rtol=0)


def test_long_input_exit_rule_and_checkpointing():
    model, idx = make_model("FLT", "window"), random_tokens(2, LONG)
    with torch.no_grad():  # the exit rule's own KV cache is as long as the input
        full = model(idx, loops=3)
        gated, looped = model(idx, loops=3, exit_threshold=0.0, return_loops=True)
        torch.testing.assert_close(gated, full, atol=1e-5, rtol=0)
        assert (looped.exit_loops == 3).all()
        exit_at_2, looped = model(idx, loops=3, exit_threshold=1e9, return_loops=True)  # all exit at loop 2
        assert (looped.exit_loops == 2).all()
        assert model(idx, loops=3, return_loops=True)[1].exit_loops is None  # no exit rule, no count
        torch.testing.assert_close(exit_at_2, model(idx, loops=2), atol=1e-5, rtol=0)
    grads = []
    for ckpt in (False, True):
        m = make_model("FLT_res", "gqa", checkpoint_loops=ckpt, window_pattern="SL").train()
        m(idx, idx, loops=2).backward()
        grads.append({n: p.grad for n, p in m.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], msg=lambda msg: f"{name}: {msg}")


def test_input_longer_than_rope_table_raises():
    model = make_model("FLT", "window")
    too_long = random_tokens(1, 10 * SEQ_LEN + 1)
    with torch.no_grad():
        model(too_long[:, :-1])  # exactly the table's length is fine
        for kw in ({}, dict(exit_threshold=0.1)):
            with pytest.raises(ValueError, match=r"input of 321 tokens exceeds the RoPE table's 320 positions "
                                                 r"\(10 x sequence_len=32\)"):
                model(too_long, loops=2, **kw)


def test_kv_cache_past_sequence_len_raises():
    model, idx = make_model("FLT", "full"), random_tokens(1, SEQ_LEN + 1)
    kv = model.new_kv_cache(1, 2)
    with torch.no_grad():
        model(idx[:, :SEQ_LEN - 1], loops=2, kv_cache=kv)
        model(idx[:, SEQ_LEN - 1:SEQ_LEN], loops=2, kv_cache=kv)  # fills the cache exactly
        with pytest.raises(ValueError, match=r"input of 33 tokens exceeds the KV cache's capacity of 32 tokens "
                                             r"\(sequence_len=32\)"):
            model(idx[:, SEQ_LEN:], loops=2, kv_cache=kv)
        assert kv.pos == SEQ_LEN
        with pytest.raises(ValueError, match="KV cache's capacity of 32"):  # a prefill longer than the cache
            model(idx, loops=2, kv_cache=model.new_kv_cache(1, 2))
        with pytest.raises(ValueError, match=r"prompt \(30\) \+ max_new_tokens \(3\) exceeds sequence_len=32"):
            next(model.generate(idx[:, :30], 3, loops=2))


def test_gqa_with_a_mask_repeats_kv_heads(monkeypatch):
    # enable_gqa together with a mask falls back to SDPA's math kernel, so masked attention gets
    # K/V repeated to n_head heads; unmasked (is_causal) attention keeps the grouped heads.
    sdpa, calls = F.scaled_dot_product_attention, []

    def spy(q, k, v, attn_mask=None, is_causal=False, enable_gqa=False):
        calls.append((attn_mask is not None, k.size(1), v.size(1), enable_gqa))
        return sdpa(q, k, v, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=enable_gqa)

    model = make_model("FLT", "gqa", window_pattern="SL")  # n_head 4, n_kv_head 2
    idx = random_tokens(2, 20)
    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    with torch.no_grad():
        logits = model(idx, loops=2)
    assert set(calls) == {(True, 4, 4, False), (False, 2, 2, True)}
    torch.testing.assert_close(logits, reference_forward(model, model.config, idx, 2)[0][-1].float(), **TOL)


@pytest.mark.parametrize("variant", ["LT", "FLT"])
def test_new_kv_cache_and_chunked_prefill(variant):
    """A second multi-token chunk on top of a filled cache is also exact."""
    model = make_model(variant, "window")
    idx = random_tokens(2, 24)
    kv = model.new_kv_cache(2, 3)
    with torch.no_grad():
        full = model(idx, loops=3)
        a = model(idx[:, :10], loops=3, kv_cache=kv)
        b = model(idx[:, 10:24], loops=3, kv_cache=kv)
    torch.testing.assert_close(torch.cat([a, b], 1), full, atol=1e-4, rtol=0)


def greedy_by_full_forward(model, idx, steps, loops):
    out = []
    with torch.no_grad():
        for _ in range(steps):
            nxt = model(idx, loops=loops)[:, -1].argmax(-1, keepdim=True)
            out.append(nxt)
            idx = torch.cat([idx, nxt], dim=1)
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("variant,attention", [("LT", "full"), ("FLT", "window"), ("FLT_res", "mla")])
def test_generate_greedy_matches_full_forward(variant, attention):
    model = make_model(variant, attention)
    idx = random_tokens(2, 6)
    expect = greedy_by_full_forward(model, idx, 16, loops=3)
    with torch.no_grad():
        toks = list(model.generate(idx, 16, temperature=0.0, loops=3))
        top1 = list(model.generate(idx, 16, temperature=1.0, top_k=1, seed=3, loops=3))
    assert all(t.shape == (2, 1) and t.dtype == torch.long for t in toks)
    assert torch.equal(torch.cat(toks, 1), expect)
    assert torch.equal(torch.cat(top1, 1), expect)  # top_k=1 is greedy too


def test_generate_seed_is_reproducible():
    model = make_model("FLT", "full")
    idx = random_tokens(2, 4)

    def sample(seed, top_k=None):
        with torch.no_grad():
            return torch.cat(list(model.generate(idx, 20, temperature=1.0, top_k=top_k, seed=seed, loops=2)), 1)

    a, b, c = sample(7), sample(7), sample(8)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert a.min() >= 0 and a.max() < VOCAB  # padded ids are never sampled
    torch.testing.assert_close(sample(5, top_k=10), sample(5, top_k=10), atol=0, rtol=0)


def test_sampling_is_the_softmax_of_the_top_k_logits_over_the_temperature():
    """The first sampled token, for many seeds: a draw, with a generator seeded alike, from softmax(z / T)
    over the k largest logits z of a full forward (the rest get probability 0), written out here."""
    model = make_model("FLT", "full").double()
    idx = random_tokens(1, 6)
    with torch.no_grad():
        z = model(idx, loops=2)[0, -1]
    kept = z >= z.topk(5).values[-1]
    probs = torch.where(kept, (z / 0.7).exp(), torch.zeros_like(z))
    probs = probs / probs.sum()
    for seed in range(20):
        want = torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(seed))
        got = next(model.generate(idx, 1, temperature=0.7, top_k=5, seed=seed, loops=2))
        assert got.item() == want.item(), seed


# ----------------------------------------------------------------------------------
# 6. One pass at K gives every K' <= K; per-loop losses; residual norms


@pytest.mark.parametrize("variant", VARIANTS)
def test_all_loops_one_pass(variant):
    model = make_model(variant, "gqa")
    idx = random_tokens(2, 20)
    targets = random_tokens(2, 20, seed=5)
    targets[0, :4] = -1
    K = 4
    with torch.no_grad():
        all_logits = model(idx, loops=K, all_loops=True)
        all_losses, looped = model(idx, targets, loops=K, all_loops=True, return_loops=True)
        norms = looped.resid_norms
        assert len(looped.states) == K and looped.exit_loops is None
        torch.testing.assert_close(model.loop_states(idx, loops=K).resid_norms, norms, atol=0, rtol=0)
        assert isinstance(all_logits, (list, tuple)) and len(all_logits) == K
        assert all_losses.shape == (K,)
        for k in range(1, K + 1):
            torch.testing.assert_close(all_logits[k - 1], model(idx, loops=k), atol=1e-6, rtol=0)
            torch.testing.assert_close(all_losses[k - 1], model(idx, targets, loops=k), atol=1e-6, rtol=0)
    ref_logits, _, ref_streams = reference_forward(model, model.config, idx, K)
    for k in range(K):  # loss = mean CE over non-ignored targets, padded vocab excluded
        ref_loss = F.cross_entropy(ref_logits[k].flatten(0, 1), targets.flatten(), ignore_index=-1)
        torch.testing.assert_close(all_losses[k], ref_loss.float(), **TOL)
    ref_norms = torch.stack([s.norm(dim=-1).mean() for s in ref_streams])
    assert norms.shape == (K,) and not norms.requires_grad
    torch.testing.assert_close(norms, ref_norms.float(), atol=1e-4, rtol=1e-5)
    assert not hasattr(model, "resid_norms") and not hasattr(model, "exit_loops")  # returned, not left behind


def test_loss_all_loops_is_mean_over_loops():
    idx, targets = random_tokens(2, 16), random_tokens(2, 16, seed=9)
    model = make_model("FLT", "full", loss_all_loops=True)
    with torch.no_grad():
        per_loop = model(idx, targets, loops=3, all_loops=True)
        torch.testing.assert_close(model(idx, targets, loops=3), per_loop.mean())
        plain = GPT(make_config("FLT", "full")).eval()
        plain.load_state_dict(model.state_dict())
        torch.testing.assert_close(plain(idx, targets, loops=3), per_loop[-1])
    assert (per_loop.mean() - per_loop[-1]).abs() > 1e-4


# ----------------------------------------------------------------------------------
# 7. Per-loop activation checkpointing changes nothing


@pytest.mark.parametrize("variant", VARIANTS)
def test_checkpoint_loops_same_loss_and_grads(variant):
    idx, targets = random_tokens(2, 16), random_tokens(2, 16, seed=3)
    results = []
    for ckpt in (False, True):
        model = make_model(variant, "full", checkpoint_loops=ckpt).train()
        loss = model(idx, targets, loops=3)
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (loss_a, grads_a), (loss_b, grads_b) = results
    torch.testing.assert_close(loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys()
    assert grads_a["transformer.h.0.attn.c_q.weight"].abs().max() > 0
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], msg=lambda m: f"{name}: {m}")


# ----------------------------------------------------------------------------------
# 7b. Precision: train and eval take it from one helper


def test_precision_helper_gives_training_and_eval_the_same_function():
    model, idx = make_model("FLT", "gqa", loops=3), random_tokens(2, 20)
    with torch.no_grad(), precision(model, "cpu", "fp32"):
        fp32 = model(idx)
    assert model.transformer.wte.weight.dtype == torch.float32
    ctx = precision(model, "cpu", "bf16")
    assert model.transformer.wte.weight.dtype == torch.bfloat16  # the recipe: embedding stored in bf16
    with ctx:  # training usage: train mode, autograd on, forward()
        train_logits = model.train()(idx)
    with torch.no_grad(), ctx:  # eval.py's usage: eval mode, loop_states + head
        eval_logits = model.eval().head(model.loop_states(idx).states[-1])
    torch.testing.assert_close(train_logits, eval_logits, atol=0, rtol=0)
    diff = (train_logits - fp32).abs()
    assert 0 < diff.max() < 0.1 and diff.mean() < 0.02  # logits span about +-4
    with pytest.raises(ValueError, match="dtype='fp16'"):
        precision(model, "cpu", "fp16")


# ----------------------------------------------------------------------------------
# 7c. Regional compilation


def compiled_frames():
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("variant, attention, kinds", [("FLT", "window", 4), ("FLT_res", "gqa", 2),
                                                       ("LT_ai", "mla", 2), ("LT", "window", 2)])
def test_compile_regions_graph_count_is_bounded(variant, attention, kinds):
    # One graph per kind of layer (injection x window) and one for the loss, whatever K; a KV
    # cache runs eagerly. backend "eager" traces with dynamo, as inductor would, without codegen.
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    eager, model = make_model(variant, attention), make_model(variant, attention)
    model.compile_regions(backend="eager", dynamic=False)
    idx, targets = random_tokens(2, 16), random_tokens(2, 16, seed=4)
    with torch.no_grad():
        for K in range(1, 7):
            torch.testing.assert_close(model(idx, loops=K), eager(idx, loops=K), atol=0, rtol=0)
            torch.testing.assert_close(model(idx, targets, loops=K), eager(idx, targets, loops=K))
        kv = model.new_kv_cache(2, 3)
        model(idx[:, :5], loops=3, kv_cache=kv)
        torch.testing.assert_close(model(idx[:, 5:6], loops=3, kv_cache=kv), eager(idx[:, :6], loops=3)[:, 5:],
                                   atol=1e-4, rtol=0)
    assert compiled_frames() == kinds + 1
    torch._dynamo.reset()


def test_compile_regions_with_checkpointing_same_grads():
    # aot_eager: AOTAutograd's joint graph inside checkpointed loops, the combination whose memory
    # saving a whole-model compile loses.
    idx, targets = random_tokens(2, 16), random_tokens(2, 16, seed=3)
    grads = []
    for compiled in (False, True):
        model = make_model("FLT", "window", checkpoint_loops=True).train()
        if compiled:
            model.compile_regions(backend="aot_eager", dynamic=False)
        model(idx, targets, loops=3).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], msg=lambda m: f"{name}: {m}")
    torch._dynamo.reset()


# ----------------------------------------------------------------------------------
# 8. Invalid settings


@pytest.mark.parametrize(
    "overrides,field",
    [
        (dict(variant="LT_x"), "variant"),
        (dict(attn="flash"), "attn"),
        (dict(n_head=4, n_kv_head=3), "n_kv_head"),
        (dict(n_head=2, n_kv_head=4), "n_kv_head"),
        (dict(window_pattern="LX"), "window_pattern"),
        (dict(window_pattern=""), "window_pattern"),
        (dict(loops=0), "loops"),
    ],
)
def test_invalid_config_raises(overrides, field):
    with pytest.raises(ValueError, match=field):
        GPT(make_config(**overrides))


def test_invalid_forward_arguments_raise():
    model = make_model("FLT", "full")
    with torch.no_grad():
        with pytest.raises(ValueError, match="loops"):
            model(random_tokens(1, 8), loops=0)
        with pytest.raises(ValueError, match="loops"):
            model(random_tokens(1, 8), loops=-2)


# ----------------------------------------------------------------------------------
# 9. Initialisation (the paper's backbone)


@pytest.mark.parametrize("attention", ["full", "mla"])
def test_init_weights(attention):
    torch.manual_seed(0)
    d, R = 128, 32
    extra = dict(attn="mla", kv_rank=R) if attention == "mla" else {}
    model = GPT(make_config(n_embd=d, n_head=2, n_kv_head=2, vocab_size=256, **extra))
    randomize_(model, 1)  # init_weights must overwrite everything
    model.init_weights()
    P = dict(model.named_parameters())
    assert abs(P["transformer.wte.weight"].std().item() - 1.0) < 0.03  # 32768 samples
    assert abs(P["lm_head.weight"].std().item() - 0.001) < 0.00003

    def check_uniform(w, s):
        assert w.abs().max() <= s
        assert w.abs().max() > 0.97 * s
        assert abs(w.std().item() - s / math.sqrt(3)) < 0.05 * s / math.sqrt(3)

    s = math.sqrt(3 / d)
    for i in range(3):
        a, m = f"transformer.h.{i}.attn.", f"transformer.h.{i}.mlp."
        names = ["c_q", "c_kv_down"] if attention == "mla" else ["c_q", "c_k", "c_v"]
        for n in names:
            check_uniform(P[a + n + ".weight"], s)
        check_uniform(P[m + "c_fc.weight"], s)
        if attention == "mla":
            check_uniform(P[a + "c_k_up.weight"], math.sqrt(3 / R))
            check_uniform(P[a + "c_v_up.weight"], math.sqrt(3 / R))
        assert torch.all(P[a + "c_proj.weight"] == 0)
        assert torch.all(P[m + "c_proj.weight"] == 0)


# ----------------------------------------------------------------------------------
# 10. FLOPs count the loops


@pytest.mark.parametrize("attention", ["full", "window"])
def test_estimate_flops_counts_loops(attention):
    cfg = make_config("FLT", attention)
    model = GPT(cfg)
    V, d = padded(VOCAB), cfg.n_embd
    f = {k: model.estimate_flops(loops=k) for k in (1, 2, 3, 6)}
    slope = f[2] - f[1]
    for k in (3, 6):  # f(K) = a + b*K
        assert f[k] == pytest.approx(f[1] + (k - 1) * slope, rel=1e-9)
    intercept = f[1] - slope
    assert intercept == pytest.approx(6 * V * d, rel=1e-9)  # the LM head, once; wte is a lookup
    block_params = model.num_params() - 2 * V * d
    assert slope >= 6 * block_params  # matmuls of every block, once per loop ...
    assert slope <= 6 * block_params + 12 * cfg.n_layer * d * cfg.sequence_len  # ... plus attention
    assert model.estimate_flops() == model.estimate_flops(loops=cfg.loops)
    # the loss on every loop's output runs the head K times
    all_loops = GPT(make_config("FLT", attention, loss_all_loops=True))
    for k in (1, 3, 6):
        assert all_loops.estimate_flops(loops=k) == pytest.approx(f[k] + 6 * V * d * (k - 1), rel=1e-9)


def test_kv_cache_rejects_a_different_loop_count():
    # Decoding one step at fewer loops would leave the later loops' cache entries unwritten.
    model, idx = make_model("FLT", "full"), random_tokens(1, 12)
    kv = model.new_kv_cache(1, 3)
    with torch.no_grad():
        model(idx[:, :6], loops=3, kv_cache=kv)
        with pytest.raises(ValueError, match="loops"):
            model(idx[:, 6:7], loops=1, kv_cache=kv)


@pytest.mark.parametrize("variant, attention, ckpt", [("FLT", "full", True), ("LT_ai", "mla", False),
                                                      ("FLT_res", "window", False)])
def test_training_forward_traces_without_graph_breaks(variant, attention, ckpt):
    # torch.compile on CUDA should see one graph per training step; dynamo's tracing is the
    # same on CPU, so a graph break introduced in model.py shows up here.
    model = make_model(variant, attention, checkpoint_loops=ckpt).train()
    idx = random_tokens(2, 16)
    for kw in ({}, dict(bptt_loops=2, return_loops=True)):  # the second: train.py's call
        explained = torch._dynamo.explain(model)(idx, idx, loops=3, **kw)
        torch._dynamo.reset()
        assert explained.graph_break_count == 0, (kw, explained.break_reasons)

