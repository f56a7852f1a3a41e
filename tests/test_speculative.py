"""Self-speculative decoding (flt/decoding.py: draft_and_verify, GPT.generate(draft_loops=...)): tokens drafted with
the first K_d loops and verified with all K give K-loop decoding's tokens (greedy) or its
distribution (sampling), with no loop computed twice and a cache that ends as a plain decode's.
The first K_d loops of a K-loop forward are a K_d-loop forward: loop t reads loops 1..t-1 only."""
import pytest
import torch

from flt import decoding
from model import Block
from test_model import ATTENTION, VARIANTS, make_model, random_tokens
from test_padded_generate import left_padded

K = 3
LENGTHS = (3, 9, 6)


def float64_model(variant, attention):
    # float64: the verification's forward over several tokens rounds as one token at a time does
    return make_model(variant, attention, loops=K).double()


def padded_prompts(seed=0):
    return left_padded([random_tokens(1, n, seed=seed + n)[0] for n in LENGTHS], pad_id=5)


def decode(model, ids, mask, n, **kwargs):
    with torch.no_grad():
        return torch.cat(list(model.generate(ids, n, temperature=0, attention_mask=mask,
                                             **kwargs)), 1)


@pytest.mark.parametrize("attention", list(ATTENTION))
@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_drafts_give_the_tokens_of_k_loop_decoding(variant, attention):
    model = float64_model(variant, attention)
    ids, mask = padded_prompts()
    exact = decode(model, ids, mask, 14)
    for draft_loops in (1, K - 1):
        for draft_len in (1, 4):
            got = decode(model, ids, mask, 14, draft_loops=draft_loops, draft_len=draft_len)
            assert torch.equal(got, exact), (draft_loops, draft_len)


def test_drafting_emits_max_new_tokens_like_plain_decoding_even_none():
    model = float64_model("FLT", "full")
    ids, mask = padded_prompts()
    for n in (0, 1, 2, 5):
        with torch.no_grad():
            plain = list(model.generate(ids, n, temperature=0, attention_mask=mask))
            drafted = list(model.generate(ids, n, temperature=0, attention_mask=mask, draft_loops=1))
        assert sum(t.size(1) for t in drafted) == sum(t.size(1) for t in plain) == n


def test_a_trained_like_model_accepts_drafts_and_rows_advance_together():
    # a model whose loops barely move (the paper's FLT): the drafts are confirmed, whole rounds
    model = float64_model("FLT", "full")
    with torch.no_grad():
        for block in model.transformer.h:
            block.mlp.c_proj.weight.mul_(0.01)
            block.attn.c_proj.weight.mul_(0.01)
    ids, mask = padded_prompts(seed=4)
    stats = {}
    with torch.no_grad():
        got = list(decoding.draft_and_verify(model, ids, 13, K, 2, 4, attention_mask=mask,
                                             stats=stats))
    assert stats["accepted"] > 0.5 * stats["drafted"]
    assert sum(t.size(1) for t in got) == 13 and all(t.size(0) == 3 for t in got)
    assert torch.equal(torch.cat(got, 1), decode(model, ids, mask, 13))


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_span_of_loops_continues_the_pass_from_its_state(variant):
    # loops 1..j, then j+1..K from h(j): the plain loop's states, with a cache of each call's own
    # (the first span's keys/values are not needed: the second's tokens are its own) or one cache
    model = float64_model(variant, "gqa")
    ids = random_tokens(2, 7)
    with torch.no_grad():
        whole = model.loop_states(ids, K).states
        for j in range(1, K):
            first, _ = decoding.cached_loops(model, ids, decoding.LoopSpan(K, stop=j))
            rest, _ = decoding.cached_loops(model, ids, decoding.LoopSpan(K, start=j, h_start=first[-1]))
            assert len(first) == j and len(rest) == K - j
            torch.testing.assert_close(first + rest, whole, rtol=0, atol=1e-12)
            cache = model.new_kv_cache(2, K)
            first, _ = decoding.cached_loops(model, ids, decoding.LoopSpan(K, stop=j), cache)
            cache.pos = 0
            rest, _ = decoding.cached_loops(model, ids, decoding.LoopSpan(K, start=j, h_start=first[-1]), cache)
            torch.testing.assert_close(first + rest, whole, rtol=0, atol=1e-12)
            assert cache.pos == ids.size(1)


def cache_after_plain_decode(model, ids, mask, tokens):
    """The exact cache after K-loop decoding of `tokens` (B, n) after the prompt: one forward."""
    cache = model.new_kv_cache(ids.size(0), K, mask)
    with torch.no_grad():
        model(ids, kv_cache=cache)
        model(tokens, kv_cache=cache)
    return cache


@pytest.mark.parametrize("variant, attention", [("FLT", "window"), ("LT", "mla"), ("LT_i", "gqa")])
def test_after_each_round_the_cache_is_a_plain_decodes(variant, attention):
    model = float64_model(variant, attention)
    ids, mask = padded_prompts(seed=2)
    stats, emitted = {}, []
    with torch.no_grad():
        for tokens in decoding.draft_and_verify(model, ids, 12, K, 1, 3, attention_mask=mask,
                                                stats=stats):
            emitted.append(tokens)
            fed = torch.cat(emitted, 1)[:, :-1]
            cache = stats["cache"]
            # the last emitted token is not fed yet; every fed position holds K-loop keys/values
            assert cache.pos == ids.size(1) + fed.size(1)
            if fed.size(1):
                want = cache_after_plain_decode(model, ids, mask, fed)
                for key, (k, v) in want.kv.items():
                    torch.testing.assert_close(cache.kv[key][0][:, :, :cache.pos],
                                               k[:, :, :cache.pos], rtol=0, atol=1e-12)
                    torch.testing.assert_close(cache.kv[key][1][:, :, :cache.pos],
                                               v[:, :, :cache.pos], rtol=0, atol=1e-12)


def test_no_loop_is_computed_twice(monkeypatch):
    model = float64_model("FLT", "full")
    ids = random_tokens(2, 5)
    calls = []
    forward = Block.forward

    def counted(self, *args, **kwargs):
        calls.append(args[0].size(1))
        return forward(self, *args, **kwargs)
    monkeypatch.setattr(Block, "forward", counted)
    stats, L, draft_loops = {}, 3, 1
    with torch.no_grad():
        rounds = [t.size(1) for t in decoding.draft_and_verify(
            model, ids, 11, K, draft_loops, 4, stats=stats)][1:]
    # the prefill: K loops over the prompt; then per round, drafts of one token through K_d
    # loops each, and one verification of all of them through the other K - K_d
    drafted = [min(4, 11 - 1 - sum(rounds[:i])) for i in range(len(rounds))]
    want = [5] * K * L
    for n in drafted:
        want += [1] * n * draft_loops * L + [n] * (K - draft_loops) * L
    assert calls == want and stats["drafted"] == sum(drafted)


def test_the_acceptance_rule_keeps_the_k_loop_distribution_exactly():
    # enumerated: a draft x from q is kept with probability a(x), else replaced by the residual r:
    # P(token = y) = q(y) a(y) + (1 - sum_x q(x) a(x)) r(y) / sum(r) must be p(y)
    g = torch.Generator().manual_seed(0)
    V = 6
    for trial in range(20):
        p = torch.rand(V, generator=g, dtype=torch.float64) ** 3
        q = torch.rand(V, generator=g, dtype=torch.float64) ** 3
        # top_k zeros: tokens one side can give and the other cannot
        p[trial % V] = 0
        q[(trial + 1 + trial // V) % V] = 0
        p, q = p / p.sum(), q / q.sum()
        drafts = torch.arange(V)
        kept = decoding.acceptance(p.expand(V, V), q.expand(V, V), drafts)
        kept = torch.where(q > 0, kept, 0)  # a draft q cannot give is never drawn
        r = decoding.residual(p[None], q[None])[0]
        out = q * kept + (1 - (q * kept).sum()) * r / r.sum()
        torch.testing.assert_close(out, p, rtol=0, atol=1e-12)


def test_sampled_tokens_follow_the_target_distribution():
    # the sampler itself, on 200,000 rows: frequencies within 5 standard errors of p
    g = torch.Generator().manual_seed(1)
    N, V = 200_000, 5
    p = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    q = torch.tensor([0.1, 0.1, 0.3, 0.3, 0.2])
    drafts = torch.multinomial(q.expand(N, V), 1, replacement=True, generator=g)[:, 0]
    kept, tokens = decoding.accept(p.expand(N, V), q.expand(N, V), drafts, g)
    freq = torch.bincount(tokens, minlength=V).double() / N
    se = (p.double() * (1 - p.double()) / N).sqrt()
    assert ((freq - p.double()).abs() < 5 * se).all(), (freq, p)
    # drafts kept at the rate sum_x min(q(x), p(x)) = 0.1 + 0.1 + 0.15 + 0.1 + 0.05 = 0.5
    assert abs(kept.double().mean() - 0.5) < 5 * (0.25 / N) ** 0.5


def test_sampling_with_drafts_runs_and_is_reproducible_by_seed():
    model = float64_model("FLT", "gqa")
    ids, mask = padded_prompts(seed=6)

    def sample(seed):
        with torch.no_grad():
            return torch.cat(list(model.generate(ids, 10, temperature=0.9, top_k=20, seed=seed,
                                                 attention_mask=mask, draft_loops=2)), 1)
    assert torch.equal(sample(3), sample(3)) and sample(3).shape == (3, 10)


SETTINGS = ("draft_loops", "draft_len", "cache_slots", "exit_threshold")


@pytest.mark.parametrize("kwargs, named, bound", [
    # K_d < K: the draft runs fewer loops than K, so K_d loops need K >= K_d + 1
    (dict(draft_loops=K), ["draft_loops=3"], "fewer loops than K=3, so K_d loops need K >= K_d + 1; "
     "allowed: an integer from 1 to 2"),
    (dict(draft_loops=0), ["draft_loops=0"], "allowed: an integer from 1 to 2"),
    (dict(draft_loops=1.0), ["draft_loops=1.0"], "allowed: an integer from 1 to 2"),
    (dict(draft_loops=2, loops=2), ["draft_loops=2"], "than K=2, so K_d loops need K >= K_d + 1; "
     "allowed: an integer from 1 to 1"),
    (dict(draft_loops=1, loops=1), ["draft_loops=1"], "allowed: none: K=1 has no fewer loops"),
    (dict(draft_loops=1, draft_len=0), ["draft_len=0"], "expected an integer >= 1"),
    (dict(draft_loops=1, cache_slots=1), ["cache_slots=1", "draft_loops=1"],
     "needs the exact cache, where loop t's keys are loop t's own: cache_slots unset (None"),
    (dict(draft_loops=2, exit_threshold=0.1), ["exit_threshold=0.1", "draft_loops=2"],
     "use one of the two"),
])
def test_bad_draft_settings_get_one_line_naming_only_their_cause(kwargs, named, bound):
    model = make_model("FLT", "full", loops=K)
    with pytest.raises(ValueError) as refused:
        next(model.generate(random_tokens(1, 4), 4, **kwargs))
    message = str(refused.value)
    assert "\n" not in message and bound in message, message
    assert all(name in message for name in named), message
    # the settings that play no part in the refusal go unnamed
    causes = {name.split("=")[0] for name in named}
    assert not any(f"{other}=" in message for other in set(SETTINGS) - causes), message
    # the same check, as a command line's settings (eval.py): each name with its --
    K_used = kwargs.get("loops", K)
    args = {key: kwargs.get(key) for key in ("draft_loops", "cache_slots", "exit_threshold")}
    with pytest.raises(ValueError) as flagged:
        decoding.check_draft(K_used, draft_len=kwargs.get("draft_len", 4), prefix="--", **args)
    want = message
    for name in SETTINGS:
        want = want.replace(f"{name}=", f"--{name}=").replace(f"{name} unset", f"--{name} unset")
    assert str(flagged.value) == want


def test_valid_drafts_and_cache_slots_pass_their_checks():
    for K_used in (2, 3, 6):
        for draft_loops in range(1, K_used):
            decoding.check_draft(K_used, draft_loops, 1, cache_slots=K_used)
            decoding.check_draft(K_used, draft_loops, 4, prefix="--")
        for slots in [None, *range(1, K_used + 1)]:
            decoding.check_cache_slots(slots, K_used)


@pytest.mark.parametrize("value", [0, 4, 2.0, "2"])
def test_a_bad_cache_slots_names_itself_and_the_true_bound(value):
    for prefix in ("", "--"):
        with pytest.raises(ValueError) as refused:
            decoding.check_cache_slots(value, 3, prefix=prefix)
        message = str(refused.value)
        assert message.startswith(f"{prefix}cache_slots={value!r}: expected an integer 1 to loops=3")
        assert "or None (3 slots, exact)" in message and "draft" not in message
