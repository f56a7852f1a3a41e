"""Depth per token: the exit rules of flt/decoding.py (EXIT_RULES: Huginn's KL, entropy, latent change
and argmax stability, and Ouro's learned gate) in cached decoding, each against the float64 reference
of tests/test_loop_cache.py (slot_reference, whose rule_settled writes each rule again from its
definition): the positions' exit loops, their states and logits, with the exact cache and with m < K
slots, and the tokens of a left-padded batch. A threshold is chosen where every score compared is far
from it (asserted), so no rounding decides an exit on any CPU."""
import re

import pytest
import torch

from test_loop_cache import TIGHT, cached_states, model64, slot_reference
from test_model import make_model, random_tokens
from test_padded_generate import left_padded, prompts
from flt.decoding import EXIT_RULES, ExitGate

RULES = list(EXIT_RULES)
# (variant, attention) pairs the rules are checked on: the paper's FLT and plain LT
MODELS = [("FLT", "window"), ("LT", "gqa")]


def with_gate(model, seed=0):
    """The model with an untrained ExitGate (random weights from seed) in its dtype: the rule is the
    same function of h whatever the gate learned."""
    torch.manual_seed(seed)
    model.exit_gate = ExitGate(model.config.n_embd, hidden=16).to(model.lm_head.weight.dtype)
    with torch.no_grad():
        for p in model.exit_gate.parameters():
            p.normal_(0, 0.5)
    return model


def safe_threshold(model, idx, prefill, K, m, rule):
    """A threshold under which some compared positions exit and some do not, every score at least 1e-6
    from it: the first such midpoint between two scores of a run that never exits, nearest the median."""
    if rule == "argmax":  # two loops unchanged: the count matters, not only the last comparison
        return 2
    never = slot_reference(model, idx, prefill, K, m, -1.0, rule)[1].sort().values
    middle = len(never) // 2
    for i in sorted(range(1, len(never)), key=lambda i: abs(i - middle)):
        threshold = float(never[i - 1] + never[i]) / 2
        scores = slot_reference(model, idx, prefill, K, m, threshold, rule)[1]
        if (scores - threshold).abs().min() > 1e-6 and (scores < threshold).any() and (scores > threshold).any():
            return threshold
    raise AssertionError(f"no threshold for {rule} is far from every score")


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("variant, attention", MODELS)
def test_each_rule_decodes_as_the_float64_reference(rule, variant, attention):
    """K = 4; m = 4 (exact), 2 and 1 slots: every position's exit loop, h(K) and the logits equal the
    reference's, and the rule exits some positions before K and keeps others looping."""
    model, idx = with_gate(model64(variant, attention)), random_tokens(2, 12, seed=3)
    for m in (4, 2, 1):
        threshold = safe_threshold(model, idx, 5, 4, m, rule)
        want, _, want_loops = slot_reference(model, idx, 5, 4, m, threshold, rule)
        got, _, got_loops = cached_states(model, idx, 5, 4, m, threshold, rule)
        assert torch.equal(got_loops, want_loops), (m, got_loops, want_loops)
        assert (got_loops < 4).any() and (got_loops == 4).any(), (m, got_loops)
        torch.testing.assert_close(got, want, **TIGHT)
        torch.testing.assert_close(model.head(got), model.head(want), **TIGHT)


@pytest.mark.parametrize("rule, threshold", [("kl", 2e-3), ("entropy", 5.4), ("latent", 0.3), ("argmax", 1),
                                             ("gate", 0.45)])
def test_each_rule_gives_a_padded_batch_each_prompts_own_tokens(rule, threshold):
    """Greedy decoding of left-padded prompts of different lengths, with the exact cache and with one
    slot: each row's tokens are the prompt's alone, and the rule did exit tokens early."""
    model, rows = with_gate(make_model("FLT", "window")), prompts(seed=7)
    ids, mask = left_padded(rows)
    with torch.no_grad():
        _, looped = model(ids, loops=4, exit_threshold=threshold, exit_rule=rule, return_loops=True)
        assert (looped.exit_loops < 4).any(), rule
        for slots in (None, 1):
            kw = dict(temperature=0, loops=4, exit_threshold=threshold, exit_rule=rule, cache_slots=slots)
            got = torch.cat(list(model.generate(ids, 8, attention_mask=mask, **kw)), 1)
            for row, p in enumerate(rows):
                assert torch.equal(got[row], torch.cat(list(model.generate(p[None], 8, **kw)), 1)[0]), (row, slots)


def test_rules_that_read_one_loop_may_exit_after_it():
    """entropy and gate judge h(t) alone, so a loose threshold exits every position after loop 1; the
    rules that compare two loops (kl, latent, argmax) exit at loop 2 at the earliest."""
    model, idx = with_gate(make_model("FLT", "window")), random_tokens(2, 9)
    with torch.no_grad():
        for rule, threshold, first in [("entropy", 1e9, 1), ("gate", 1.1, 1), ("kl", 1e9, 2), ("latent", 1e9, 2),
                                       ("argmax", 1, 2)]:
            logits, looped = model(idx, loops=3, exit_threshold=threshold, exit_rule=rule, return_loops=True)
            if rule != "argmax":
                assert (looped.exit_loops == first).all(), rule
                torch.testing.assert_close(logits, model(idx, loops=first), atol=1e-5, rtol=0)
            assert (looped.exit_loops >= first).all(), rule


@pytest.mark.parametrize("kwargs, message", [
    (dict(exit_rule="cosine", exit_threshold=0.1), "exit_rule='cosine': expected one of kl, entropy, latent, argmax, gate"),
    (dict(exit_rule="argmax", exit_threshold=0.5), "exit_threshold=0.5 with exit_rule='argmax': expected an integer >= 1"),
    (dict(exit_rule="argmax", exit_threshold=0), "exit_threshold=0 with exit_rule='argmax': expected an integer >= 1"),
    (dict(exit_rule="entropy", exit_threshold=-1.0), "exit_threshold=-1.0: expected a number >= 0"),
    (dict(exit_rule="gate", exit_threshold=0.5), "exit_rule='gate': this model has no exit gate"),
])
def test_a_rule_that_cannot_run_is_refused_by_name(kwargs, message):
    model, idx = make_model("FLT", "window"), random_tokens(1, 5)
    with pytest.raises(ValueError, match=re.escape(message)):
        model(idx, loops=3, **kwargs)
    with pytest.raises(ValueError, match=re.escape(message)):
        next(model.generate(idx, 2, loops=3, **kwargs))
