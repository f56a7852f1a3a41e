"""The loop cache (flt/decoding.py: KVCache's cache_slots): m loop slots per layer, 1 <= m <= K,
loop t reading and writing slot t mod m (Huginn's shared cache, Geiping et al. 2025). m = K is the
exact cache of K*L entries and the default. For m < K, cached decoding is checked against
`slot_reference`: an independent float64 rewrite of decoding that keeps every token's keys/values of
every loop in a plain list, no KVCache, and lets each forward see an earlier token as the slot rule
says (the last loop to write its slot). The backbone and variants are the paper's (Sec. 4); the exit
rule is Huginn's KL rule (flt/decoding.py: ExitRule)."""
import math
import re

import pytest
import torch

from test_model import (ATTENTION, ATTENTION_EXTRA, REFERENCE_RULES, VARIANTS,
                        greedy_by_full_forward, make_model, random_tokens, ref_rope, ref_windows)
from test_padded_generate import left_padded, prompts
from flt.decoding import LoopSpan, cached_loops
from model import KVCache

TIGHT = dict(atol=1e-10, rtol=0)  # float64 model and reference: only the order of operations differs


def model64(variant, attention, **overrides):
    """The test model in float64, its RoPE tables too (model.rotary_tables computes them in float32)."""
    model = make_model(variant, attention, **overrides).double()
    hd = model.config.n_embd // model.config.n_head
    inv_freq = 1.0 / (10000 ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    angles = torch.outer(torch.arange(model.cos.size(0), dtype=torch.float64), inv_freq)
    model.cos, model.sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    return model


def norm64(x):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + torch.finfo(x.dtype).eps)


def last_writer(s, K, m):
    """The last of loops 0..K-1 whose slot is s: what a finished forward leaves in slot s."""
    return max(t for t in range(K) if t % m == s)


def rule_settled(rule, threshold, h, h_prev, logp, logp_prev, same, W):
    """The exit rules of flt/decoding.py's EXIT_RULES written again from their definitions, for one
    loop: (settled (B, n) or None, the scores compared or None, argmax's new count)."""
    score = None
    if rule == "kl" and logp_prev is not None:
        score = (logp_prev.exp() * (logp_prev - logp)).sum(-1)
    if rule == "entropy":
        score = -(logp.exp() * logp).sum(-1)
    if rule == "latent" and h_prev is not None:
        score = torch.linalg.vector_norm(h - h_prev, dim=-1) / torch.linalg.vector_norm(h, dim=-1)
    if rule == "gate":  # Ouro's gate: an MLP on [h(t), h(t) - h(t-1)], h(0) = 0
        features = torch.cat([h, h - (0 if h_prev is None else h_prev)], -1)
        hidden = torch.nn.functional.gelu(features @ W["exit_gate.fc.weight"].T + W["exit_gate.fc.bias"])
        score = torch.sigmoid(hidden @ W["exit_gate.out.weight"][0] + W["exit_gate.out.bias"][0])
    if rule == "argmax" and logp_prev is not None:
        unchanged = logp.argmax(-1) == logp_prev.argmax(-1)
        same = torch.where(unchanged, same + 1, torch.zeros_like(same))
        return same >= threshold, same, same
    return (None if score is None else score < threshold), score, same


def slot_reference(model, idx, prefill, K, m, threshold=None, rule="kl"):
    """h(K) (B, T, d) of decoding idx: its first `prefill` tokens in one forward, then one token per
    forward. A forward's tokens see each other at the same loop; at loop t they see an earlier forward's
    token j through j's keys/values of loop last_writer(t mod m). threshold: the exit rule `rule`; a token
    that exited keeps its h and its keys/values of the exit loop. Returns (h(K), the scores compared,
    each position's loops (B, T))."""
    cfg, W = model.config, {k: v.detach().double() for k, v in model.state_dict().items()}
    H, Hkv, hd = cfg.n_head, cfg.n_kv_head, cfg.n_embd // cfg.n_head
    past = []  # past[j][t][layer] = (k, v) of token j at loop t, each (B, Hkv, hd)
    # the variant's rule as tests/test_model.py: REFERENCE_RULES reads Sec. 4 (KeyError if missing)
    ref_restart, ref_injection = REFERENCE_RULES[cfg.variant]
    outs, kls, exit_loops = [], [], []
    for p, q in [(0, prefill)] + [(n, n + 1) for n in range(prefill, idx.size(1))]:
        B, n = idx.size(0), q - p
        e = W["transformer.wte.weight"][idx[:, p:q]]
        pos = torch.arange(p, q)
        own = []  # own[t][layer] = (k, v) of this forward's tokens, each (B, n, Hkv, hd)
        hs, done, logp = [], torch.zeros(B, n, dtype=torch.bool), None
        same, loops_run = torch.zeros(B, n, dtype=torch.long), torch.full((B, n), K)
        for t in range(K):
            h_prev = hs[-1] if hs else None
            if t == 0:
                x = norm64(e)
            else:
                x = ref_restart(e, h_prev, norm64)
            own.append([])
            for layer, window in enumerate(ref_windows(cfg)):
                a = f"transformer.h.{layer}.attn."
                inject = ref_injection(layer) if t > 0 else None
                if inject == "res":
                    x = norm64(x + h_prev)
                kv_in = norm64(x)
                q_in = h_prev if inject == "attn" else kv_in
                qv = (q_in @ W[a + "c_q.weight"].T).view(B, n, H, hd)
                if cfg.attn == "mla":
                    c = norm64(kv_in @ W[a + "c_kv_down.weight"].T)
                    k, v = c @ W[a + "c_k_up.weight"].T, c @ W[a + "c_v_up.weight"].T
                else:
                    k, v = kv_in @ W[a + "c_k.weight"].T, kv_in @ W[a + "c_v.weight"].T
                qv, k = norm64(ref_rope(qv, p)), norm64(ref_rope(k.view(B, n, Hkv, hd), p))
                v = v.view(B, n, Hkv, hd)
                if t > 0:  # an exited token keeps its previous (so its exit) loop's keys/values
                    k_prev, v_prev = own[t - 1][layer]
                    k = torch.where(done[:, :, None, None], k_prev, k)
                    v = torch.where(done[:, :, None, None], v_prev, v)
                own[t].append((k, v))
                seen = [past[j][last_writer(t % m, K, m)][layer] for j in range(p)]  # the slot rule
                keys = torch.cat([kj[:, None] for kj, _ in seen] + [k], 1)  # (B, q, Hkv, hd)
                values = torch.cat([vj[:, None] for _, vj in seen] + [v], 1)
                keys, values = (z.repeat_interleave(H // Hkv, dim=2) for z in (keys, values))
                scores = torch.einsum("bihd,bjhd->bhij", qv, keys) / math.sqrt(hd)
                i, j = pos[:, None], torch.arange(q)[None, :]
                visible = (j <= i) & (i - j < window) if window else j <= i
                att = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
                y = torch.einsum("bhij,bjhd->bihd", att, values).reshape(B, n, -1)
                x = x + y @ W[a + "c_proj.weight"].T
                mlp = f"transformer.h.{layer}.mlp."
                x = x + torch.relu(norm64(x) @ W[mlp + "c_fc.weight"].T).pow(2) @ W[mlp + "c_proj.weight"].T
            h = norm64(x)
            if threshold is not None:
                logits = 15 * torch.tanh((h @ W["lm_head.weight"].T)[..., :cfg.vocab_size] / 15)
                new_logp = torch.log_softmax(logits, dim=-1)
                settled, score, same = rule_settled(rule, threshold, h, h_prev, new_logp, logp, same, W)
                if score is not None:
                    kls.append(score[~done].double())
                if t > 0:
                    h = torch.where(done[..., None], hs[-1], h)
                if settled is not None:
                    loops_run[settled & ~done] = t + 1
                    done = done | settled
                logp = new_logp
            hs.append(h)
        past += [[[(k[:, i], v[:, i]) for k, v in own[t]] for t in range(K)] for i in range(n)]
        outs.append(hs[-1])
        exit_loops.append(loops_run)
    return torch.cat(outs, 1), torch.cat(kls) if kls else None, torch.cat(exit_loops, 1)


def cached_states(model, idx, prefill, K, m, threshold=None, rule="kl"):
    """(h(K) (B, T, d), the cache, each position's loops or None) of model.py's cached decoding with m
    slots (teacher-forced, as slot_reference), under the exit rule `rule` if threshold is given."""
    cache = model.new_kv_cache(idx.size(0), K, cache_slots=m)
    span = LoopSpan(K)
    calls = [idx[:, :prefill]] + [idx[:, n:n + 1] for n in range(prefill, idx.size(1))]
    with torch.no_grad():
        outs = [cached_loops(model, tokens, span, cache, threshold, rule) for tokens in calls]
    exits = None if threshold is None else torch.cat([loops for _, loops in outs], 1)
    return torch.cat([hs[-1] for hs, _ in outs], 1), cache, exits


@pytest.mark.parametrize("attention", sorted(ATTENTION | ATTENTION_EXTRA))
@pytest.mark.parametrize("variant", VARIANTS)
def test_decodings_loop_computes_the_plain_loop(variant, attention):
    """Two loops over the same loop_start and blocks: model.py's (GPT.loop_states, training's) and
    decoding's (flt/decoding.py: cached_loops). In float64 they give the same h(t) and logits at every
    loop, for a prompt in one call and for a prefill then one token a call through the exact cache."""
    model, idx, K = model64(variant, attention), random_tokens(2, 13, seed=6), 3
    with torch.no_grad():
        plain = model.loop_states(idx, K).states
        whole, _ = cached_loops(model, idx, LoopSpan(K))
        cache = model.new_kv_cache(2, K)
        calls = [cached_loops(model, idx[:, :5], LoopSpan(K), cache)[0]]
        calls += [cached_loops(model, idx[:, n:n + 1], LoopSpan(K), cache)[0] for n in range(5, 13)]
        stepped = [torch.cat(states, 1) for states in zip(*calls)]
        for got in (whole, stepped):
            assert len(got) == K
            for h, want in zip(got, plain):
                torch.testing.assert_close(h, want, **TIGHT)
                torch.testing.assert_close(model.lm_head(h), model.lm_head(want), **TIGHT)


def cache_bytes(cache):
    return sum(z.numel() * z.element_size() for kv in cache.kv.values() for z in kv)


@pytest.mark.parametrize("attention, window_pattern", [("gqa", "SL"), ("mla_gqa_window", "SSL")])
@pytest.mark.parametrize("variant", VARIANTS)
def test_fewer_slots_decode_as_the_from_scratch_reference(variant, attention, window_pattern):
    """m = 1, 2 of K = 3; GQA with sliding windows (layers S L L), and MLA with GQA (S S L)."""
    model = model64(variant, attention, window_pattern=window_pattern)
    idx = random_tokens(2, 11, seed=1)  # decoding past the window (8)
    for m in (1, 2):
        got, cache, _ = cached_states(model, idx, 4, 3, m)
        torch.testing.assert_close(got, slot_reference(model, idx, 4, 3, m)[0], **TIGHT)
        assert sorted(cache.kv) == [(s, layer) for s in range(m) for layer in range(3)]


@pytest.mark.parametrize("variant", ["LT", "FLT"])
def test_slot_rule_at_four_loops(variant):
    """K = 4: with m = 3, slot 0 ends with loop 3's keys, slots 1 and 2 with loops 1's and 2's."""
    model, idx = model64(variant, "gqa"), random_tokens(1, 9, seed=2)
    references = {m: slot_reference(model, idx, 3, 4, m)[0] for m in (1, 2, 3, 4)}
    for m, want in references.items():
        torch.testing.assert_close(cached_states(model, idx, 3, 4, m)[0], want, **TIGHT)
    for m in (1, 2, 3):  # sharing is not free: each m < K decodes another function
        assert (references[m][:, 3:] - references[4][:, 3:]).abs().max() > 1e-3


@pytest.mark.parametrize("variant, attention, threshold", [("FLT", "window", 0.015), ("LT", "gqa", 0.1)])
def test_exited_positions_keep_their_exit_loop_in_the_slots(variant, attention, threshold):
    """The exit rule with m < K = 4: a token that exits keeps its exit loop's keys/values in every slot a
    later loop would have written. Each threshold exits about half the positions it checks and is at
    least 1e-4 from every KL value compared (asserted), so no rounding decides an exit."""
    model, idx = model64(variant, attention), random_tokens(2, 12, seed=3)
    for m in (1, 2):
        want, kls, _ = slot_reference(model, idx, 5, 4, m, threshold)
        assert (kls - threshold).abs().min() > 1e-4 and (kls < threshold).any() and (kls > threshold).any()
        torch.testing.assert_close(cached_states(model, idx, 5, 4, m, threshold)[0], want, **TIGHT)


def test_exact_slots_are_the_default_cache_bit_for_bit():
    """cache_slots = K is the default (None): the same tokens, greedy and sampled, the same cache tensors,
    with and without the exit rule and left padding; greedy equals a full forward per token."""
    model, rows = make_model("FLT", "window"), prompts(seed=7)
    ids, mask = left_padded(rows)
    with torch.no_grad():
        for kw in ({}, dict(attention_mask=mask, exit_threshold=2e-3)):
            for sampling in (dict(temperature=0), dict(temperature=1.0, top_k=20, seed=5)):
                runs = [torch.cat(list(model.generate(ids, 10, loops=3, **kw, **sampling, **slots)), 1)
                        for slots in ({}, dict(cache_slots=3))]
                assert torch.equal(*runs), (kw, sampling)
            caches = [model.new_kv_cache(3, 3, mask if "attention_mask" in kw else None, m) for m in (None, 3)]
            for cache in caches:
                model(ids, loops=3, kv_cache=cache, exit_threshold=kw.get("exit_threshold"))
                model(ids[:, -1:], loops=3, kv_cache=cache, exit_threshold=kw.get("exit_threshold"))
            assert caches[0].kv.keys() == caches[1].kv.keys() == {(t, i) for t in range(3) for i in range(3)}
            assert all(torch.equal(a, b) for key in caches[0].kv for a, b in zip(caches[0].kv[key],
                                                                                  caches[1].kv[key]))
        greedy = torch.cat(list(model.generate(ids[2:], 10, temperature=0, loops=3, cache_slots=3)), 1)
        assert torch.equal(greedy, greedy_by_full_forward(model, ids[2:], 10, loops=3))


def test_one_loop_has_one_slot_and_it_is_exact():
    model, idx = model64("FLT", "window"), random_tokens(2, 12, seed=4)
    torch.testing.assert_close(cached_states(model, idx, 4, 1, 1)[0], model.loop_states(idx, 1).states[-1],
                               **TIGHT)
    with pytest.raises(ValueError, match=r"cache_slots=2: expected an integer 1 to loops=1"):
        model.new_kv_cache(2, 1, cache_slots=2)


@pytest.mark.parametrize("variant", VARIANTS)
def test_prefill_equals_the_full_forward_for_every_m(variant):
    """Within one forward each loop writes its slot before it attends: the prompt's own states are exact."""
    model, idx = model64(variant, "window"), random_tokens(2, 14, seed=5)
    with torch.no_grad():
        full = model.loop_states(idx, 4).states
        for m in (1, 2, 3, 4):
            cache = model.new_kv_cache(2, 4, cache_slots=m)
            torch.testing.assert_close(cached_loops(model, idx, LoopSpan(4), cache)[0], full, **TIGHT)
            cache.pos = 0  # the same prompt again, for the logits (fp32: model.head)
            torch.testing.assert_close(model(idx, loops=4, kv_cache=cache), model.head(full[-1]), **TIGHT)


@pytest.mark.parametrize("attention", ["full", "gqa", "mla"])
def test_allocated_bytes_are_m_over_K_of_exact(attention):
    model, idx = make_model("FLT", attention), random_tokens(2, 6)
    sizes = {}
    with torch.no_grad():
        for m in (1, 2, 3, 6):
            cache = model.new_kv_cache(2, 6, cache_slots=m)
            assert cache_bytes(cache) == 0  # nothing before the first forward
            model(idx, loops=6, kv_cache=cache, exit_threshold=1e9)  # all exit at loop 2: fill writes the rest
            model(idx[:, :1], loops=6, kv_cache=cache)
            sizes[m] = cache_bytes(cache)
    H_kv, D = model.config.n_kv_head, model.config.n_embd // model.config.n_head
    assert sizes[6] == 6 * 3 * 2 * (2 * H_kv * model.config.sequence_len * D) * 4  # K*L (k, v), fp32
    assert all(sizes[m] * 6 == m * sizes[6] for m in sizes)


def test_padded_batch_with_fewer_slots_gives_each_prompt_its_own_tokens():
    model, rows = make_model("LT_i", "gqa"), prompts(seed=9)
    ids, mask = left_padded(rows)
    with torch.no_grad():
        for kw in ({}, dict(exit_threshold=2e-3)):
            got = torch.cat(list(model.generate(ids, 10, temperature=0, loops=3, attention_mask=mask,
                                                cache_slots=1, **kw)), 1)
            for row, p in enumerate(rows):
                alone = model.generate(p[None], 10, temperature=0, loops=3, cache_slots=1, **kw)
                assert torch.equal(got[row], torch.cat(list(alone), 1)[0]), (row, kw)


@pytest.mark.parametrize("value", [0, 4, -1, 1.5, "2"])
def test_slots_outside_one_to_K_are_refused_by_name(value):
    model, idx = make_model("FLT", "full"), random_tokens(1, 3)
    message = re.escape(f"cache_slots={value!r}: expected an integer 1 to loops=3")
    with pytest.raises(ValueError, match=message):
        next(model.generate(idx, 2, loops=3, cache_slots=value))
    with pytest.raises(ValueError, match=message):
        KVCache(1, 3, model.config, cache_slots=value)
