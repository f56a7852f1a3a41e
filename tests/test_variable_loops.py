"""Training over variable loop counts and depth per token at inference (beyond the paper):
sampled K per step (same on every rank, same after a resume), truncated backpropagation through
the last bptt_loops loops, its FLOP count, and the KL exit rule with its KV cache."""
import json
import math
import os
import re
import shutil
import statistics
import textwrap
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from flt.decoding import ExitRule
from model import GPT, injection, norm, restart
from optim import sample_loops
from flt.planning import e_in_loop_1_only
from test_model import ATTENTION, REFERENCE_RULES, VARIANTS, make_config, make_model, random_tokens
from test_train import losses, runner, train


# ----------------------------------------------------------------------------- the sampler

def test_uniform_sampler_covers_its_bounds_only():
    draws = [sample_loops("uniform", step, 1337, 4, loops_min=3, loops_max=7) for step in range(4000)]
    assert set(draws) == {3, 4, 5, 6, 7}
    assert statistics.mean(draws) == pytest.approx(5, abs=0.1)
    assert sample_loops("fixed", 17, 1337, 4) == 4


def test_lognormal_poisson_sampler_has_the_requested_mean():
    draws = [sample_loops("lognormal_poisson", step, 1, 4) for step in range(20000)]
    # K = 1 + Poisson(r), r ~ LogNormal with E[r] = 3: Var K = E[r] + Var r = 3 + 9 (e^0.25 - 1) = 5.55
    assert statistics.mean(draws) == pytest.approx(4, abs=0.1)
    assert statistics.variance(draws) == pytest.approx(3 + 9 * (torch.e**0.25 - 1), rel=0.1)
    assert min(draws) == 1 and max(draws) > 12  # right-skewed
    capped = [sample_loops("lognormal_poisson", step, 1, 4, loops_max=6) for step in range(2000)]
    assert max(capped) == 6


def test_sampler_depends_on_seed_and_step_only():
    torch.manual_seed(0)
    a = [sample_loops("lognormal_poisson", s, 7, 6) for s in range(50)]
    torch.manual_seed(1)  # the global RNG plays no part
    assert a == [sample_loops("lognormal_poisson", s, 7, 6) for s in range(50)]
    assert a != [sample_loops("lognormal_poisson", s, 8, 6) for s in range(50)]


# ----------------------------------------------------------------------------- truncated backprop

@pytest.mark.parametrize("variant", VARIANTS)
def test_truncated_backprop_equals_detaching_the_early_loops(variant):
    """bptt_loops=2 at K=5: the gradients of a hand-written run whose first 3 loops' output is
    detached, continued by loops 4 and 5; and not those of full backpropagation."""
    model = make_model(variant).double().train()
    idx, y = random_tokens(2, 12), random_tokens(2, 12, seed=1)
    grads = {}
    for how in ("bptt", "by_hand", "full"):
        model.zero_grad()
        if how == "by_hand":
            e = model.transformer.wte(idx)
            x0, T = norm(e), idx.size(1)
            rope = (model.cos[:T].double(), model.sin[:T].double())
            h = model.loop_states(idx, loops=3).states[-1].detach()
            # loops 4 and 5 by hand: the restart, the L blocks with their injection, the norm
            for _ in range(2):
                x = restart(variant, e, x0, h)
                for i, block in enumerate(model.transformer.h):
                    x = block(x, rope, h, injection(variant, i))
                h = norm(x)
            loss = model.loss(h, y)
        else:
            loss = model(idx, y, loops=5, bptt_loops=2 if how == "bptt" else None)
        loss.backward()
        grads[how] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert grads["bptt"].keys() == grads["by_hand"].keys()
    for n in grads["bptt"]:
        torch.testing.assert_close(grads["bptt"][n], grads["by_hand"][n], rtol=1e-10, atol=1e-12, msg=n)
    assert any(not torch.allclose(grads["bptt"][n], grads["full"][n]) for n in grads["bptt"])


@pytest.mark.parametrize("variant", VARIANTS)
def test_truncated_backprop_reaches_the_embedding_unless_only_loop_1_reads_it(variant):
    """A variant whose later loops restart without e (by the float64 reference's rule: LT) reads
    it in loop 1 alone: truncated to the last loops, its token embedding gets no gradient, and
    train.py refuses it (flt/planning.py: e_in_loop_1_only); every other variant trains it."""
    model = make_model(variant).train()
    model(random_tokens(2, 12), random_tokens(2, 12, seed=1), loops=3, bptt_loops=2).backward()
    reached = model.transformer.wte.weight.grad is not None
    e = torch.ones(4, requires_grad=True)
    later_loops_read_e = REFERENCE_RULES[variant][0](e, torch.ones(4), norm).requires_grad
    assert reached == later_loops_read_e == (not e_in_loop_1_only(variant))
    assert all(p.grad is not None for n, p in model.named_parameters() if "wte" not in n)


@pytest.mark.parametrize("bptt_loops", [0, -1, 2.0])
def test_bptt_loops_is_checked_by_the_forward_that_uses_it(bptt_loops):
    # the one check of train.py's bptt_loops (train.py passes -1 as None; the loop-sampler and inert
    # rules: tests/test_planning.py)
    with pytest.raises(ValueError, match=re.escape(f"bptt_loops={bptt_loops!r} is invalid: expected an integer >= 1")):
        make_model("FLT")(random_tokens(1, 8), random_tokens(1, 8), loops=3, bptt_loops=bptt_loops)


def test_estimate_flops_counts_no_grad_loops_as_forward_only():
    model = GPT(make_config("FLT", n_layer=2, sequence_len=32))
    c, K, G = model.config, 5, 2
    block = 12 * c.n_layer * c.n_embd**2
    head = c.padded_vocab * c.n_embd
    attn_fwd = 4 * c.n_embd * c.sequence_len * c.n_layer  # per loop: QK^T and AV, 2 FLOPs each
    want = 6 * block * G + 2 * block * (K - G) + 6 * head + 3 * attn_fwd * G + attn_fwd * (K - G)
    assert model.estimate_flops(loops=K, bptt_loops=G) == want
    assert model.estimate_flops(loops=K, bptt_loops=9) == model.estimate_flops(loops=K)
    # the loss on every loop: a frozen loop's h takes no gradient, so its head costs the forward
    # and the weight's gradient, 4 per weight, and a trained loop's 6
    every = GPT(make_config("FLT", n_layer=2, sequence_len=32, loss_all_loops=True))
    want_every = want - 6 * head + 6 * head * G + 4 * head * (K - G)
    assert every.estimate_flops(loops=K, bptt_loops=G) == want_every


def test_regional_compile_does_not_recompile_as_k_varies():
    """Dynamo builds one graph per kind of layer (injection) and grad mode (the no_grad loops
    before the bptt window are a second mode): once K=1, 3 and 5 with bptt_loops=2 have run them
    all (loop 1 with and without grad, later loops with and without grad), no K adds a graph."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    model = make_model("FLT").train().compile_regions(backend="eager", dynamic=False)
    idx, y = random_tokens(2, 12), random_tokens(2, 12, seed=1)
    for K in (3, 1, 5):
        model(idx, y, loops=K, bptt_loops=2).backward()
    graphs = counters["stats"]["unique_graphs"]
    for K, bptt in ((2, 2), (7, 2), (4, 2), (9, None), (12, 3)):
        model(idx, y, loops=K, bptt_loops=bptt).backward()
    assert counters["stats"]["unique_graphs"] == graphs
    torch._dynamo.reset()


# ----------------------------------------------------------------------------- the exit rule

def exit_threshold(model, idx, K):
    """A threshold with which some positions exit early and some run all K loops: the median KL
    between successive loops' predictions of the fixed-K forward."""
    with torch.no_grad():
        logp = [F.log_softmax(x, -1) for x in model(idx, loops=K, all_loops=True)]
    kls = [F.kl_div(b, a, log_target=True, reduction="none").sum(-1) for a, b in zip(logp, logp[1:])]
    return torch.stack(kls).median().item()


@pytest.mark.parametrize("variant", VARIANTS)
def test_threshold_zero_is_fixed_k(variant):
    model = make_model(variant, "window").double()
    idx = random_tokens(2, 20)
    with torch.no_grad():
        fixed = model(idx, loops=4, all_loops=True)
        gated, looped = model(idx, loops=4, all_loops=True, exit_threshold=0.0, return_loops=True)
    assert (looped.exit_loops == 4).all()
    for a, b in zip(fixed, gated):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


@pytest.mark.parametrize("attention", list(ATTENTION))
@pytest.mark.parametrize("variant", VARIANTS)
def test_cached_decoding_equals_recompute_under_the_exit_rule(variant, attention):
    model = make_model(variant, attention).double()
    B, T, prefix, K = 2, 20, 6, 4
    idx = random_tokens(B, T)
    threshold = exit_threshold(model, idx, K)
    with torch.no_grad():
        full, looped = model(idx, loops=K, exit_threshold=threshold, return_loops=True)
        used = looped.exit_loops
        assert (used < K).any() and (used == K).any()  # the rule really acts, both ways
        kv = model.new_kv_cache(B, K)
        steps = [model(idx[:, :prefix], loops=K, kv_cache=kv, exit_threshold=threshold, return_loops=True)]
        for n in range(prefix, T):
            steps.append(model(idx[:, n:n + 1], loops=K, kv_cache=kv, exit_threshold=threshold, return_loops=True))
        steps, cached_used = zip(*((logits, looped.exit_loops) for logits, looped in steps))
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=0, atol=1e-9)
    assert torch.equal(torch.cat(cached_used, 1), used)
    # the cache holds the definition: after its exit loop a position's keys/values are its exit loop's
    for b in range(B):
        for i in range(T):
            k = used[b, i].item()
            for layer in range(model.config.n_layer):
                for t in range(k, K):
                    for z_t, z_exit in zip(kv.kv[t, layer], kv.kv[k - 1, layer]):
                        assert torch.equal(z_t[b, :, i], z_exit[b, :, i])
    # and an exited position's prediction is that of its exit loop
    with torch.no_grad():
        per_loop = model(idx, loops=K, all_loops=True, exit_threshold=threshold)
    picked = torch.stack(per_loop).gather(0, (used - 1)[None, ..., None].expand(1, B, T, full.size(-1)))[0]
    torch.testing.assert_close(picked, full, rtol=0, atol=0)


def test_generate_with_the_exit_rule_equals_greedy_recompute():
    model = make_model("FLT").double()
    prompt = random_tokens(1, 5)
    threshold = exit_threshold(model, random_tokens(1, 20), 4)
    tokens = [t.item() for t in model.generate(prompt, 10, temperature=0, loops=4, exit_threshold=threshold)]
    seq = prompt[0].tolist()
    with torch.no_grad():
        for _ in range(10):
            seq.append(model(torch.tensor([seq]), loops=4, exit_threshold=threshold)[0, -1].argmax().item())
    assert tokens == seq[5:]


# ----------------------------------------------------------------------------- train.py

RECORD_LOOPS = textwrap.dedent("""
    import os, model
    forward = model.GPT.forward
    def spy(self, idx, targets=None, **kw):
        if targets is not None and self.training:
            with open(os.path.join(os.environ["SPY_DIR"], f"loops_rank{os.environ.get('RANK', '0')}.txt"), "a") as f:
                f.write(f"{kw['loops']} {kw['bptt_loops']}\\n")
        return forward(self, idx, targets, **kw)
    model.GPT.forward = spy
""")


def test_sampled_loops_same_on_every_rank_and_after_resume(tmp_path, data_dir, monkeypatch):
    args = ["--num_steps=8", "--save_interval=4", "--total_batch_size=256", "--sample_tokens=0",
            "--loops_sampler=uniform", "--loops_min=1", "--loops_max=5", "--bptt_loops=2"]
    full, cut = tmp_path / "full", tmp_path / "cut"
    os.makedirs(full)
    monkeypatch.setenv("SPY_DIR", str(full))
    train(full, data_dir, *args, script=runner(tmp_path, RECORD_LOOPS), nproc=2)
    want = [sample_loops("uniform", s, 1337, 3, 1, 5) for s in range(8)]
    for rank in (0, 1):
        assert (full / f"loops_rank{rank}.txt").read_text().split("\n")[:-1] == [f"{k} 2" for k in want]
    by_step, records = losses(full)
    assert [r["loops"] for r in records if "loss" in r] == want and len(set(want)) > 1
    # resumed from step 4 on two ranks: the same K, the same losses
    os.makedirs(cut)
    shutil.copytree(full / "step_000004", cut / "step_000004")
    monkeypatch.setenv("SPY_DIR", str(cut))
    train(cut, data_dir, *args, "--resume", script=runner(tmp_path, RECORD_LOOPS), nproc=2)
    got, records = losses(cut)
    assert [r["loops"] for r in records if "loss" in r] == want[4:]
    assert [got[s] for s in range(4, 8)] == [by_step[s] for s in range(4, 8)]
    settings = json.loads((cut / "settings.json").read_text())
    assert settings["loops_sampler"] == "uniform" and settings["bptt_loops"] == 2


# ----------------------------------------------------------------------------- eval.py and plot.py

def test_evaluate_exit_spans_k2_to_kmax():
    """Threshold 0: nobody exits, eval's fixed-K bpb at K_max. An infinite threshold: every token
    exits at loop 2 (the first check), which is the fixed K=2 model exactly."""
    import eval as evaluation
    model = make_model("FLT").double()
    token_bytes = torch.randint(0, 4, (model.config.vocab_size,), generator=torch.Generator().manual_seed(3))
    batches = [(random_tokens(2, 16, seed=s), random_tokens(2, 16, seed=s + 50)) for s in range(3)]
    fixed = evaluation.evaluate_bpb(model, batches, {"t": token_bytes}, [2, 5])[0]["t"]
    curve = evaluation.evaluate_exit(model, batches, token_bytes, 5, [0.0, float("inf")])
    assert [r["threshold"] for r in curve] == [0.0, float("inf")]
    assert curve[0]["mean_loops"] == 5 and curve[1]["mean_loops"] == 2
    assert curve[0]["val_bpb"] == pytest.approx(fixed[5], rel=1e-9)
    assert curve[1]["val_bpb"] == pytest.approx(fixed[2], rel=1e-9)


def test_exit_curve_counts_loops_and_nats_of_the_targets_with_bytes():
    """At a threshold between the extremes positions exit at different loops; the curve's
    mean_loops and bpb are those of a hand count over the targets with bytes (0-byte and ignored
    targets out of both), from the model's own exit_loops and logits."""
    import eval as evaluation
    model = make_model("FLT").double()
    token_bytes = torch.randint(0, 4, (model.config.vocab_size,), generator=torch.Generator().manual_seed(3))
    batches = [(random_tokens(2, 16, seed=s), random_tokens(2, 16, seed=s + 50)) for s in range(3)]
    batches[0][1][0, :5] = -1
    # a threshold at the median KL between loops 1 and 2 splits the positions
    hs = model.loop_states(batches[0][0], 2).states
    logp = [F.log_softmax(model.head(h), dim=-1) for h in hs]
    threshold = F.kl_div(logp[1], logp[0], log_target=True, reduction="none").sum(-1).median().item()
    nats = n_bytes = loops_run = n_tokens = 0.0
    spread = set()
    for x, y in batches:
        logits, looped = model(x, loops=5, exit_threshold=threshold, return_loops=True)
        counts = torch.where(y >= 0, token_bytes[y.clamp(min=0)], 0)
        losses = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-1, reduction="none")
        nats += losses[counts.flatten() > 0].sum().item()
        n_bytes += counts.sum().item()
        loops_run += looped.exit_loops[counts > 0].sum().item()
        n_tokens += (counts > 0).sum().item()
        spread |= set(looped.exit_loops.unique().tolist())
    assert len(spread) > 1
    (point,) = evaluation.evaluate_exit(model, batches, token_bytes, 5, [threshold])
    assert point["mean_loops"] == pytest.approx(loops_run / n_tokens, rel=1e-12)
    assert point["val_bpb"] == pytest.approx(nats / (math.log(2) * n_bytes), rel=1e-9)


def test_plot_exit_draws_both_curves_per_run(tmp_path):
    pytest.importorskip("matplotlib")
    from scripts import plot
    run = tmp_path / "run"
    os.makedirs(run / "step_000010")
    (run / "settings.json").write_text(json.dumps({"variant": "FLT", "loops": 4, "loops_sampler": "uniform"}))
    exit_curve = [{"threshold": 0.1, "val_bpb": 2.5, "mean_loops": 2.4}, {"threshold": 0.0, "val_bpb": 2.3, "mean_loops": 6}]
    results = {"2": {"val_bpb": 2.6}, "4": {"val_bpb": 2.4}, "6": {"val_bpb": 2.35, "exit": exit_curve}}
    (run / "step_000010" / "eval.json").write_text(json.dumps({"results": results}))
    fig = plot.main(["exit", str(run), "-o", str(tmp_path / "exit.png")])
    fixed, gated = fig.axes[0].get_lines()
    assert list(fixed.get_xdata()) == [2, 4, 6] and list(fixed.get_ydata()) == [2.6, 2.4, 2.35]
    assert list(gated.get_xdata()) == [2.4, 6] and list(gated.get_ydata()) == [2.5, 2.3]
    assert fixed.get_label() == "FLT K=4 (uniform): K loops for every token"
    assert os.path.isfile(tmp_path / "exit.png")
    # results eval.py kept apart under a label (a protocol off its default): drawn with --label
    labelled = {K: {f"{key}[bpb_tokens=512]": v for key, v in r.items()} for K, r in results.items()}
    (run / "step_000010" / "eval.json").write_text(json.dumps({"results": labelled}))
    with pytest.raises(ValueError, match=r"no exit curve .*it holds exit\[bpb_tokens=512\]: --label"):
        plot.main(["exit", str(run), "-o", str(tmp_path / "exit.png")])
    fig = plot.main(["exit", str(run), "--label", "bpb_tokens=512", "-o", str(tmp_path / "exit.png")])
    fixed, gated = fig.axes[0].get_lines()
    assert list(fixed.get_ydata()) == [2.6, 2.4, 2.35] and list(gated.get_ydata()) == [2.5, 2.3]


def test_a_position_exits_when_kl_of_the_previous_loop_from_the_current_is_below_the_threshold():
    """Huginn's rule: exit at loop t once KL(p(t-1) || p(t)) < threshold. Two positions whose loops 1 and 2
    predict (0.9, 0.1) and (0.6, 0.4), in either order: the two directions of KL differ (0.226 and 0.311
    nats), so with a threshold between them exactly one position exits, the one the direction names."""
    p = torch.tensor([[0.9, 0.1], [0.6, 0.4]], dtype=torch.float64)
    loop1, loop2 = p[None], p.flip(0)[None]  # (B=1, T=2, V=2): position 1 has loop 1 and 2 swapped
    kl = (loop1 * (loop1 / loop2).log()).sum(-1)  # KL(p(1) || p(2)), written out
    assert kl[0, 0] < 0.27 < kl[0, 1]
    cache = SimpleNamespace(loops=3, fill=lambda *args: None)
    model = SimpleNamespace(head=lambda h: h)  # the head: logits = h
    rule = ExitRule(0.27, torch.zeros(1, 2, dtype=torch.long), model, cache)
    hs = [loop1.log()]
    assert not rule.update(1, hs)
    hs.append(loop2.log())
    rule.update(2, hs)
    assert rule.exit_loops.tolist() == [[2, 3]] and rule.done.tolist() == [[True, False]]
    hs.append(hs[-1] + 1.0)  # loop 3: position 0 keeps its loop-2 state
    rule.update(3, hs)
    assert torch.equal(hs[2][0, 0], hs[1][0, 0]) and not torch.equal(hs[2][0, 1], hs[1][0, 1])
