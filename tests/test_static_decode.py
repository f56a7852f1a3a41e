"""The static decode step (flt/decoding.py: StaticCache, Decoder): the loop cache allocated at its
capacity, a step's keys and values written at positions held on the device, and each layer attending
over the whole capacity with a mask (causal, its window, left padding), so that every decode step of
a kind has one shape and compiles to one graph (on CUDA captured as CUDA graphs). It must decode
today's tokens: greedy decoding on the static path, run eagerly and compiled, equals the eager KV
cache's (itself checked against the full forward in test_model.py and test_padded_generate.py) for the
five variants (Sec. 4) x {full attention, GQA with a sliding window, MLA} x {the exact cache, m loop
slots, drafting}, on left-padded batches, in float64 (the static step sums over more, masked, keys:
its logits differ from the eager step's in the last bits, which must not flip an argmax).

Compiling with inductor takes about 40 s a graph on this CPU, so the compiled cases trace the same
whole step with torch.compile's aot_eager backend (dynamo with fullgraph=True, then AOTAutograd's
functionalized graph, which turns the cache's in-place writes into the graph's mutations of its
inputs, as inductor sees them); `python -m scripts.bench --mode=decode` runs inductor's."""
import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounter

import model as model_py
from flt import decoding, diagnostics
from test_model import VARIANTS, make_model, random_tokens
from test_padded_generate import left_padded

K = 3
# the three kinds of attention: full, GQA with a sliding window (S L L: the window is 8, the
# longest prompt 14), MLA
ATTENTION = {"full": dict(attention="full"), "gqa_window": dict(attention="gqa", window_pattern="SL"),
             "mla": dict(attention="mla")}
# the exact cache, one loop slot of K, drafting with K_d = 1 of K = 3 (three drafts a round)
CACHES = {"exact": dict(), "m_slots": dict(cache_slots=1), "drafting": dict(draft_loops=1, draft_len=3)}


def model64(variant, kind, **overrides):
    return make_model(variant, **ATTENTION[kind], loops=K, **overrides).double()


def padded_prompts(seed=0, lengths=(3, 14, 9)):
    return left_padded([random_tokens(1, n, seed=seed + n)[0] for n in lengths], pad_id=5)


def decode(model, ids, mask, n=6, **kwargs):
    with torch.no_grad():
        return torch.cat(list(model.generate(ids, n, temperature=0, attention_mask=mask, **kwargs)), 1)


@pytest.fixture
def compiled(monkeypatch):
    """decode="compiled" on CPU traced by `backend` (the module docstring says why not inductor);
    dynamo's caches emptied before and after."""
    def install(backend):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        monkeypatch.setitem(decoding.COMPILED, "cpu", decoding.compile_step("cpu", backend))
    yield install
    torch._dynamo.reset()


@pytest.mark.parametrize("kind", list(ATTENTION))
@pytest.mark.parametrize("variant", VARIANTS)
def test_the_static_step_decodes_the_eager_caches_tokens(variant, kind):
    model = model64(variant, kind)
    ids, mask = padded_prompts()
    exact = decode(model, ids, mask)
    for cache, kwargs in CACHES.items():
        # drafting gives K-loop decoding's tokens (test_speculative.py)
        want = exact if cache == "drafting" else decode(model, ids, mask, **kwargs)
        assert torch.equal(decode(model, ids, mask, decode="static", **kwargs), want), cache


# compiled: each kind of attention once, each cache once (a graph costs seconds to trace)
@pytest.mark.parametrize("variant, kind, cache, graphs", [
    ("FLT", "full", "drafting", 2), ("LT_ai", "gqa_window", "m_slots", 1), ("FLT_res", "mla", "exact", 1)])
def test_the_compiled_static_step_decodes_the_eager_caches_tokens(variant, kind, cache, graphs, compiled):
    compiled("aot_eager")
    model = model64(variant, kind)
    ids, mask = padded_prompts(seed=7)
    kwargs = CACHES[cache]
    # 7 tokens: two whole drafting rounds of 3 after the prefill's
    want = decode(model, ids, mask, 7, **({} if cache == "drafting" else kwargs))
    assert torch.equal(decode(model, ids, mask, 7, decode="compiled", **kwargs), want)
    # a graph per kind of step: a token's K loops, or a draft step and a verification
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


def test_a_compiled_decode_of_64_tokens_adds_no_graph_after_its_first_step(compiled):
    counter = CompileCounter()
    compiled(counter)
    model = model64("FLT", "gqa_window", sequence_len=96)
    ids, mask = padded_prompts(seed=11)
    with torch.no_grad():
        tokens = model.generate(ids, 64, temperature=0, attention_mask=mask, decode="compiled")
        got = [next(tokens), next(tokens)]
        assert counter.frame_count == 1
        got += list(tokens)
        # another prompt of the batch's size, unpadded and at a temperature: the same graph
        other = random_tokens(3, 20, seed=12)
        sampled = list(model.generate(other, 16, temperature=0.8, top_k=10, seed=1, decode="compiled"))
    assert counter.frame_count == 1 and torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert torch.equal(torch.cat(got, 1), decode(model, ids, mask, 64))
    with torch.no_grad():
        eager = list(model.generate(other, 16, temperature=0.8, top_k=10, seed=1))
    assert torch.equal(torch.cat(sampled, 1), torch.cat(eager, 1))


def test_compiled_drafting_is_two_graphs_whatever_the_round(compiled):
    # a draft step and a verification; a round's last token is a slice of its tokens, whose strides
    # (at batch 1) must not make another graph; a shorter last round runs uncompiled
    counter = CompileCounter()
    compiled(counter)
    model = model64("LT_i", "mla", sequence_len=64)
    ids = random_tokens(1, 5, seed=13)
    got = decode(model, ids, None, 30, decode="compiled", draft_loops=2, draft_len=4)
    assert counter.frame_count == 2 and torch.equal(got, decode(model, ids, None, 30))


def test_a_compiled_step_reads_every_tensor_but_its_inputs_at_a_fixed_address(compiled):
    # what a CUDA graph needs: the weights, the RoPE tables, the cache's slots, position and padding
    # are static inputs (the graph reads and writes them in place; one it mutated that were not
    # would make inductor skip the capture); only the step's tokens, and a verification's h(K_d),
    # are copied in
    static = []

    def backend(graph, inputs):
        static.append([getattr(x, "_dynamo_static_input_type", None) is not None
                       for x in inputs if isinstance(x, torch.Tensor)])
        return graph.forward
    compiled(backend)
    model = model64("FLT", "gqa_window")
    ids, mask = padded_prompts(seed=14)
    decode(model, ids, mask, 7, decode="compiled")
    decode(model, ids, mask, 7, decode="compiled", draft_loops=1, draft_len=3)
    # the K-loop step, the draft step, the verification
    assert [flags.count(False) for flags in static] == [1, 1, 2]
    assert all(len(flags) > 4 * 3 for flags in static)


def test_every_step_of_a_kind_has_one_shape(monkeypatch):
    # what attention sees at each call: a token's step, a draft step and a verification attend over
    # the whole capacity at every position; the eager cache's keys grow by one a step
    seen, sdpa = [], F.scaled_dot_product_attention

    def recorded(q, k, v, attn_mask=None, **kwargs):
        seen.append((q.shape, k.shape, attn_mask.shape))
        return sdpa(q, k, v, attn_mask=attn_mask, **kwargs)
    model = model64("LT_i", "gqa_window")
    ids, mask = padded_prompts(seed=3)
    monkeypatch.setattr(model_py.F, "scaled_dot_product_attention", recorded)
    decode(model, ids, mask, 8, decode="static")
    L, B, T, S = 3, 3, ids.size(1), model.config.sequence_len
    prefill, steps = seen[:K * L], seen[K * L:]
    assert {shapes for shapes in prefill} == {((B, 4, T, 16), (B, 4, S, 16), (B, 1, T, S))}
    assert len(steps) == 7 * K * L and set(steps) == {((B, 4, 1, 16), (B, 4, S, 16), (B, 1, 1, S))}
    seen.clear()
    decode(model, ids, mask, 9, decode="static", draft_loops=2, draft_len=4)
    draws = {shapes for shapes in seen[K * L:] if shapes[0][2] == 1}
    checks = {shapes for shapes in seen[K * L:] if shapes[0][2] == 4}
    assert draws == {((B, 4, 1, 16), (B, 4, S, 16), (B, 1, 1, S))}
    assert checks == {((B, 4, 4, 16), (B, 4, S, 16), (B, 1, 4, S))}
    seen.clear()
    decode(model, ids, mask, 3)
    assert [k[2] for _, k, _ in seen[K * L:]] == [T + 1] * K * L + [T + 2] * K * L


def test_the_static_cache_stores_what_the_eager_cache_stores():
    # under CUDA autocast a layer's keys are fp32 (the fp32 norm) and its values bf16: both caches
    # keep them in the keys' dtype; a step sees the same keys and values at every visible position
    config = model64("FLT", "gqa_window").config
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    eager = decoding.KVCache(2, K, config, attention_mask=mask)
    static = decoding.StaticCache(2, K, config, torch.device("cpu")).reset(mask)
    g = torch.Generator().manual_seed(0)
    for n in (5, 1, 1):
        k = torch.randn(2, 2, n, 16, generator=g)
        v = torch.randn(2, 2, n, 16, generator=g).bfloat16()
        k_e, v_e, mask_e = eager.update(1, 0, k, v, window=None)
        k_s, v_s, mask_s = static.update(1, 0, k, v, window=None)
        end = k_e.size(2)
        assert k_s.dtype == v_s.dtype == torch.float32 and v_e.dtype == torch.float32
        assert torch.equal(k_s[:, :, :end], k_e) and torch.equal(v_s[:, :, :end], v_e)
        assert torch.equal(mask_s[..., :end], mask_e) and not mask_s[..., end:].any()
        eager.advance(n)
        static.advance(n)


def test_the_static_steps_read_nothing_back_to_the_host():
    # a token's step and its choice stay on the device (drafting reads once a round, by design)
    model = model64("FLT", "mla")
    ids, mask = padded_prompts(seed=5)
    for temperature in (0, 0.9):
        with torch.no_grad():
            tokens = model.generate(ids, 10, temperature=temperature, seed=0, attention_mask=mask,
                                    decode="static")
            next(tokens)
            with diagnostics.count_host_reads() as reads:
                rest = list(tokens)
        assert len(rest) == 9 and sum(reads.values()) == 0, dict(reads)


def test_the_static_cache_is_reused_and_never_shared_by_two_decodes():
    # the next decode of the same shape writes the same tensors (a captured graph replays at their
    # addresses); two decodes at once each get their own cache, and their own tokens
    model = model64("FLT_res", "full")
    ids, mask = padded_prompts(seed=9)
    other_ids, other_mask = padded_prompts(seed=10)
    want = decode(model, ids, mask, decode="static")
    addresses = {k.data_ptr() for k, _ in decoding.RESERVED[model].kv.values()}
    assert decode(model, ids, mask, decode="static").equal(want)
    assert {k.data_ptr() for k, _ in decoding.RESERVED[model].kv.values()} == addresses
    with torch.no_grad():
        pairs = zip(model.generate(ids, 6, temperature=0, attention_mask=mask, decode="static"),
                    model.generate(other_ids, 6, temperature=0, attention_mask=other_mask, decode="static"))
        first, second = (torch.cat(column, 1) for column in zip(*pairs))
    assert torch.equal(first, want) and torch.equal(second, decode(model, other_ids, other_mask))


def test_the_default_path_is_compiled_on_cuda_and_eager_elsewhere():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert decoding.decode_path(None, cpu) == "eager"
    assert decoding.decode_path(None, cuda) == "compiled"
    # the exit rule decodes eagerly
    assert decoding.decode_path(None, cuda, exit_threshold=0.1) == "eager"
    assert decoding.decode_path("static", cpu) == "static"
    model = model64("FLT", "full")
    ids = random_tokens(2, 4)
    for step in (decoding.Decoder(model, ids, K), decoding.Decoder(model, ids, K, exit_threshold=0.1)):
        assert step.path == "eager" and type(step.cache) is decoding.KVCache


@pytest.mark.parametrize("kwargs, message", [
    (dict(decode="graphs"), "decode='graphs': expected one of eager, static, compiled, or None"),
    (dict(decode="static", exit_threshold=0.1),
     "decode='static' with exit_threshold=0.1: the exit rule decodes on the eager path"),
    (dict(decode="compiled", exit_threshold=0.1), "decode='compiled' with exit_threshold=0.1"),
])
def test_a_bad_decode_path_is_refused_in_one_line(kwargs, message):
    model = model64("FLT", "full")
    with pytest.raises(ValueError, match=message):
        next(model.generate(random_tokens(1, 4), 4, **kwargs))
