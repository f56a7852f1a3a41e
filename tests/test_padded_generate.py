"""Left padding in model.py's decoding: a batch of prompts of different lengths, left-padded with an
attention mask (1 = token, 0 = padding), computes for each prompt what it computes alone. The padded
keys are never attended to and each row's RoPE positions start at its first token, so every row is
compared with an independent computation: the prompt alone, unpadded (its cached decoding, and greedy
decoding by a full forward per token, test_model.greedy_by_full_forward)."""
import pytest
import torch

from test_model import ATTENTION, VARIANTS, greedy_by_full_forward, make_model, random_tokens

LENGTHS = (3, 9, 14)  # the longest is past the sliding window (8), the shortest far from it


def left_padded(prompts, pad_id=0):
    """(ids, attention_mask), each (B, longest): every prompt right-aligned after pad_id tokens."""
    width = max(p.numel() for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - p.numel():] = p
        mask[row, width - p.numel():] = 1
    return ids, mask


def prompts(seed=0):
    return [random_tokens(1, n, seed=seed + n)[0] for n in LENGTHS]


@pytest.mark.parametrize("attention", list(ATTENTION))
@pytest.mark.parametrize("variant", VARIANTS)
def test_padded_prefill_and_steps_equal_each_prompt_alone(variant, attention):
    model, rows = make_model(variant, attention), prompts()
    ids, mask = left_padded(rows, pad_id=7)
    with torch.no_grad():
        kv = model.new_kv_cache(len(rows), 3, attention_mask=mask)
        batch = model(ids, loops=3, kv_cache=kv)
        step = model(ids[:, -1:], loops=3, kv_cache=kv)  # a decoding step: each row's last token again
        for row, p in enumerate(rows):
            alone = model.new_kv_cache(1, 3)
            want = model(p[None], loops=3, kv_cache=alone)
            torch.testing.assert_close(batch[row, -p.numel():], want[0], atol=1e-5, rtol=0)
            torch.testing.assert_close(step[row], model(p[None, -1:], loops=3, kv_cache=alone)[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("variant, attention", [("FLT", "window"), ("LT", "gqa"), ("FLT_res", "mla"),
                                                ("LT_ai", "full"), ("LT_i", "window")])
def test_padded_generate_gives_each_prompt_its_own_tokens(variant, attention):
    model, rows = make_model(variant, attention), prompts(seed=3)
    ids, mask = left_padded(rows)
    with torch.no_grad():
        got = torch.cat(list(model.generate(ids, 12, temperature=0, loops=3, attention_mask=mask)), 1)
    for row, p in enumerate(rows):
        alone = torch.cat(list(model.generate(p[None], 12, temperature=0, loops=3)), 1)
        assert torch.equal(got[row], alone[0]), row
        assert torch.equal(alone, greedy_by_full_forward(model, p[None], 12, loops=3)), row


def test_padded_generate_with_the_exit_rule_equals_each_prompt_alone():
    model, rows = make_model("FLT", "window"), prompts(seed=5)
    ids, mask = left_padded(rows)
    with torch.no_grad():
        got = torch.cat(list(model.generate(ids, 10, temperature=0, loops=4, exit_threshold=2e-3,
                                            attention_mask=mask)), 1)
        for row, p in enumerate(rows):
            alone = model.generate(p[None], 10, temperature=0, loops=4, exit_threshold=2e-3)
            assert torch.equal(got[row], torch.cat(list(alone), 1)[0]), row


def test_a_mask_without_padding_is_the_unpadded_forward():
    model, idx = make_model("FLT", "gqa"), random_tokens(2, 10)
    with torch.no_grad():
        kv = model.new_kv_cache(2, 2, attention_mask=torch.ones(2, 10, dtype=torch.long))
        assert kv.pad is None
        torch.testing.assert_close(model(idx, loops=2, kv_cache=kv), model(idx, loops=2), atol=1e-5, rtol=0)


@pytest.mark.parametrize("mask", [[[1, 1, 0], [1, 1, 1]], [[0, 1, 0], [1, 1, 1]], [[1, 1], [1, 1]]])
def test_a_mask_that_is_not_left_padding_is_refused(mask):
    model, idx = make_model("FLT", "full"), random_tokens(2, 3)
    shape = r"attention_mask \(2, 2\): expected the prompt's \(2, 3\)"
    message = r"attention_mask: expected left padding" if len(mask[0]) == 3 else shape
    with pytest.raises(ValueError, match=message):
        next(model.generate(idx, 2, attention_mask=torch.tensor(mask)))
