"""Tests for optim.py: Newton-Schulz, Muon, AdamW, the gradient reduction, the sharded run, resume."""

import io
import math
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

from optim import (AdamW, Muon, build_optimizers, clip_coefficient, lr_multiplier, muon_momentum, reduce_gradients,
                   zeropower_via_newtonschulz5)

NS_COEFFS = (3.4445, -4.7750, 2.0315)
D_MODEL, VOCAB = 15, 25  # odd sizes: 375-element tables do not split evenly over 2 ranks
CLIP = 0.5  # below the tiny model's gradient norm, so clipping is active in the runs below


def reference_newton_schulz(G, steps=5):
    """The paper's formula X <- aX + b(XX^T)X + c(XX^T)^2 X, literally, in float64."""
    a, b, c = NS_COEFFS
    X = G.double()
    tall = X.shape[0] > X.shape[1]
    if tall:
        X = X.T
    X = X / (X.norm() + 1e-7)
    for _ in range(steps):
        gram = X @ X.T
        X = a * X + b * gram @ X + c * gram @ gram @ X
    return X.T if tall else X


def well_conditioned(rows, cols, generator):
    """U diag(s) V^T with singular values s in [0.5, 1] (condition number <= 2)."""
    k = min(rows, cols)
    U, _ = torch.linalg.qr(torch.randn(rows, k, generator=generator, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(cols, k, generator=generator, dtype=torch.float64))
    s = 0.5 + 0.5 * torch.rand(k, generator=generator, dtype=torch.float64)
    return U @ torch.diag(s) @ V.T


SHAPES = [(48, 16), (16, 48), (32, 32)]  # tall, wide, square


@pytest.mark.parametrize("shape", SHAPES)
def test_newton_schulz_matches_float64_formula(shape):
    G = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    out = zeropower_via_newtonschulz5(G)
    assert out.dtype == G.dtype and out.shape == G.shape
    # Float32 (CPU path) against float64: only rounding differs; entries are O(0.1).
    torch.testing.assert_close(out.double(), reference_newton_schulz(G), rtol=0, atol=2e-5)


def test_the_documented_band_is_five_quintic_steps_of_every_singular_value_in_0_01_to_1():
    """optim.py's docstring: five steps take [0.01, 1] into [0.682, 1.134] (to three places) and
    0.001 to about 0.47, recomputed in float64 on the scalar polynomial p(s) = as + bs^3 + cs^5."""
    a, b, c = (3.4445, -4.7750, 2.0315)
    s = torch.cat([torch.linspace(0.01, 1, 1_000_001, dtype=torch.float64),
                   torch.tensor([0.001], dtype=torch.float64)])
    for _ in range(5):
        s = a * s + b * s ** 3 + c * s ** 5
    band, small = s[:-1], s[-1].item()
    assert (round(band.min().item(), 3), round(band.max().item(), 3)) == (0.682, 1.134)
    assert round(small, 2) == 0.47
    assert "[0.01, 1] into [0.682, 1.134], and s = 0.001 to about 0.47" in " ".join(
        zeropower_via_newtonschulz5.__doc__.split())


@pytest.mark.parametrize("shape", SHAPES)
def test_newton_schulz_approximates_polar_factor(shape):
    G = well_conditioned(*shape, torch.Generator().manual_seed(1))
    out = zeropower_via_newtonschulz5(G.float()).double()
    U, _, Vh = torch.linalg.svd(G, full_matrices=False)
    polar = U @ Vh
    # Five quintic steps map every normalised singular value in [0.01, 1] into
    # [0.682, 1.134] (not exactly 1); here s_min / ||G||_F >= 0.5 / sqrt(32) > 0.08.
    s_out = torch.linalg.svdvals(out)
    assert s_out.min() > 0.65 and s_out.max() < 1.2, s_out
    # The iteration is an odd polynomial in G, so it keeps G's singular vectors: the
    # polar factor of the output is U V^T itself, up to float32 rounding ...
    U2, _, Vh2 = torch.linalg.svd(out, full_matrices=False)
    torch.testing.assert_close(U2 @ Vh2, polar, rtol=0, atol=1e-4)
    # ... and the output points the way of U V^T: the cosine similarity is
    # sum(s) / (sqrt(k) * ||s||), at worst about 0.97 for s split between 0.68 and 1.14.
    cosine = (out * polar).sum() / (out.norm() * polar.norm())
    assert cosine > 0.96


@pytest.mark.parametrize("shape", SHAPES)
def test_newton_schulz_bf16_matches_float32_within_bf16_tolerance(shape):
    G = well_conditioned(*shape, torch.Generator().manual_seed(5))
    fp32 = zeropower_via_newtonschulz5(G.float())
    bf16 = zeropower_via_newtonschulz5(G.float(), dtype=torch.bfloat16)
    assert bf16.dtype == torch.float32
    assert not torch.equal(bf16, fp32)  # the switch really changed the working precision
    # bf16 rounds at 2^-9 relative; the iteration does not converge but keeps singular
    # values moving inside [0.682, 1.134], where the quintic's slope amplifies that
    # rounding: measured 3-4.5% relative (Frobenius) difference from float32.
    assert (bf16 - fp32).norm() / fp32.norm() < 0.06
    # What Muon needs survives: the same polar factor U V^T, singular values in the band.
    U, _, Vh = torch.linalg.svd(G, full_matrices=False)
    U2, s_out, Vh2 = torch.linalg.svd(bf16.double(), full_matrices=False)
    torch.testing.assert_close(U2 @ Vh2, U @ Vh, rtol=0, atol=0.03)
    assert s_out.min() > 0.65 and s_out.max() < 1.2, s_out


def test_muon_ns_dtype_reaches_the_update():
    gen = torch.Generator().manual_seed(6)
    grad = torch.randn(12, 5, generator=gen)
    results = {}
    for ns_dtype in (None, torch.bfloat16):
        p = nn.Parameter(torch.zeros(12, 5))
        p.grad = grad.clone()
        Muon([p], lr=1.0, ns_dtype=ns_dtype).step()
        results[ns_dtype] = p.detach()
    # One step from zero momentum (buf = grad): p = -sqrt(12/5) * NS5(grad + 0.95 * buf).
    nesterov = grad.add(grad, alpha=0.95)
    expected = -(zeropower_via_newtonschulz5(nesterov, dtype=torch.bfloat16) * (12 / 5) ** 0.5)
    assert torch.equal(results[torch.bfloat16], expected)
    assert not torch.equal(results[None], results[torch.bfloat16])
    assert build_optimizers(make_model(), ns_dtype=torch.bfloat16)[1].ns_dtype == torch.bfloat16


def test_muon_two_steps_match_hand_computation():
    gen = torch.Generator().manual_seed(2)
    params = [nn.Parameter(torch.randn(12, 5, generator=gen)),   # tall: step scaled
              nn.Parameter(torch.randn(5, 12, generator=gen))]   # wide: scale 1
    grads = [[torch.randn(p.shape, generator=gen) for p in params] for _ in range(2)]
    opt = Muon(params, lr=0.02, momentum=0.95)
    schedule = [(0.02, 0.95), (0.01, 0.9)]  # the training loop changes lr and momentum
    expected = [p.detach().double().clone() for p in params]
    buffers = [torch.zeros_like(e) for e in expected]
    for step, (lr, momentum) in enumerate(schedule):
        opt.param_groups[0].update(lr=lr, momentum=momentum)
        for p, g in zip(params, grads[step]):
            p.grad = g.clone()
        opt.step()
        for i, g in enumerate(grads[step]):
            buffers[i] = momentum * buffers[i] + g.double()
            nesterov = g.double() + momentum * buffers[i]
            rows, cols = g.shape
            expected[i] -= lr * math.sqrt(max(1, rows / cols)) * reference_newton_schulz(nesterov)
        for p, e in zip(params, expected):
            torch.testing.assert_close(p.detach().double(), e, rtol=0, atol=1e-6)


class TinyModel(nn.Module):
    """Named like the real model: an embedding, blocks of 5 matrices (tall, wide, square), a head."""

    def __init__(self, n_blocks):
        super().__init__()
        d = D_MODEL
        self.config = SimpleNamespace(n_embd=d)
        blocks = nn.ModuleList()
        for _ in range(n_blocks):
            block = nn.Module()
            block.attn, block.mlp = nn.Module(), nn.Module()
            block.attn.c_q = nn.Linear(d, d, bias=False)               # 15 x 15
            block.attn.c_k = nn.Linear(d, 8, bias=False)               # 8 x 15, wide
            block.attn.c_proj = nn.Linear(8, d, bias=False)            # 15 x 8, tall
            block.mlp.c_fc = nn.Linear(d, 2 * d, bias=False)           # 30 x 15, tall
            block.mlp.c_proj = nn.Linear(2 * d, d, bias=False)         # 15 x 30, wide
            blocks.append(block)
        self.transformer = nn.ModuleDict(dict(wte=nn.Embedding(VOCAB, d), h=blocks))
        self.lm_head = nn.Linear(d, VOCAB, bias=False)

    def forward(self, idx, targets):
        x = self.transformer.wte(idx)
        for block in self.transformer.h:
            x = x + block.attn.c_q(x)
            x = x + block.attn.c_proj(torch.tanh(block.attn.c_k(x)))
            x = x + block.mlp.c_proj(F.relu(block.mlp.c_fc(x)) ** 2)
        return F.cross_entropy(self.lm_head(x).flatten(0, 1), targets.flatten())


def make_model(n_blocks=3):
    """3 blocks by default: over 2 ranks each shape has a full block of matrices and a short one."""
    torch.manual_seed(0)
    return TinyModel(n_blocks)


def float64_setup(distributed=False):
    """The model and optimizers of the runs compared below, in float64 (Newton-Schulz too): one function
    computed two ways then agrees to ~1e-16 relative, on every CPU's kernels, far below any fault."""
    model = make_model().double()
    return model, build_optimizers(model, distributed=distributed, ns_dtype=torch.float64)


def make_batch():
    gen = torch.Generator().manual_seed(3)
    idx, targets = torch.randint(0, VOCAB, (2, 4, 8), generator=gen)
    return idx, targets


def train_step(model, optimizers, idx, targets, step):
    """One step as train.py takes it: schedule, backward, reduce, clip, update."""
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = group["initial_lr"] * (1.0 - 0.2 * step)
    optimizers[1].param_groups[0]["momentum"] = 0.85 + 0.05 * step
    model(idx, targets).backward()
    coefficient = clip_coefficient(math.sqrt(sum(reduce_gradients(optimizers)[0].values())), CLIP)
    for opt in optimizers:
        opt.step(grad_scale=coefficient)
    model.zero_grad(set_to_none=True)
    return coefficient


def params_of(model):
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def save(objects):
    buffer = io.BytesIO()
    torch.save(objects, buffer)
    buffer.seek(0)
    return buffer


def test_build_optimizers_groups_every_parameter_once():
    model = make_model()
    adamw, muon = build_optimizers(model)
    assert isinstance(adamw, AdamW) and isinstance(muon, Muon)
    assert (adamw.world_size, adamw.rank, muon.world_size, muon.rank) == (1, 0, 1, 0)
    grouped = [p for opt in (adamw, muon) for g in opt.param_groups for p in g["params"]]
    assert sorted(map(id, grouped)) == sorted(id(p) for p in model.parameters())
    embedding, head = adamw.param_groups
    assert embedding["params"] == [model.transformer.wte.weight]
    assert head["params"] == [model.lm_head.weight]
    # the paper's recipe / the authors' base_train.py: AdamW lr 0.2 (embedding) and 0.004 (head) x sqrt(768 / d),
    # betas (0.8, 0.95), eps 1e-10, no decay. Seen in what a step does: from zero state, Adam's first
    # update is lr * g / (|g| + eps'), so a gradient of ones moves every weight by lr (to 1e-9 relative).
    before = [p.detach().clone() for p in (model.transformer.wte.weight, model.lm_head.weight)]
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    adamw.step()
    moved = [b - p.detach() for b, p in zip(before, (model.transformer.wte.weight, model.lm_head.weight))]
    for step, lr in zip(moved, (0.2, 0.004)):  # D_MODEL = 15
        assert torch.allclose(step, torch.full_like(step, lr * math.sqrt(768 / 15)), rtol=1e-5, atol=0)
    assert embedding["betas"] == (0.8, 0.95) and embedding["eps"] == 1e-10 and embedding["weight_decay"] == 0.0
    assert muon.param_groups[0]["params"] == list(model.transformer.h.parameters())
    assert muon.param_groups[0]["lr"] == 0.02 and muon.param_groups[0]["momentum"] == 0.95
    assert muon.ns_dtype is None
    for group in adamw.param_groups + muon.param_groups:
        assert group["initial_lr"] == group["lr"]


def _with_vector_in_block(model):
    model.transformer.h[0].norm = nn.Module()
    model.transformer.h[0].norm.weight = nn.Parameter(torch.ones(D_MODEL))


def _with_final_norm(model):
    model.transformer.ln_f = nn.LayerNorm(D_MODEL, bias=False)


def _with_tied_head(model):
    model.lm_head.weight = model.transformer.wte.weight


@pytest.mark.parametrize("corrupt, name", [
    (_with_vector_in_block, "transformer.h.0.norm.weight"),
    (_with_final_norm, "transformer.ln_f.weight"),
    (_with_tied_head, "lm_head.weight"),
])
def test_build_optimizers_rejects_bad_parameters(corrupt, name):
    model = make_model()
    corrupt(model)
    with pytest.raises(ValueError, match=name):
        build_optimizers(model)


def test_build_optimizers_distributed_needs_process_group():
    with pytest.raises(ValueError, match="distributed=True"):
        build_optimizers(make_model(), distributed=True)


def test_adamw_three_steps_match_hand_computation():
    model = make_model()
    adamw, _ = build_optimizers(model)
    idx, targets = make_batch()
    w = model.transformer.wte.weight
    expected, m, v = w.detach().double().clone(), 0.0, 0.0
    lr, (beta1, beta2), eps = adamw.param_groups[0]["lr"], (0.8, 0.95), 1e-10
    for step in range(1, 4):
        model(idx, targets).backward()
        g = w.grad.double()
        adamw.step()
        model.zero_grad(set_to_none=True)
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        m_hat, v_hat = m / (1 - beta1 ** step), v / (1 - beta2 ** step)
        expected -= lr * m_hat / (v_hat.sqrt() + eps)
        torch.testing.assert_close(w.detach().double(), expected, rtol=0, atol=1e-5)


def test_grad_scale_equals_prescaled_gradient():
    """step(grad_scale=c) must be bit for bit the step on c * gradient (clipping)."""
    idx, targets = make_batch()
    models = [make_model() for _ in range(3)]  # grad_scale, pre-scaled gradient, unscaled
    runs = [build_optimizers(m) for m in models]
    # A different scale each step: both optimizers are nearly invariant to a constant one.
    for scale in (0.3, 2.0, 0.05):
        for model in models:
            model(idx, targets).backward()
        for p in models[1].parameters():
            p.grad.mul_(scale)
        for model, optimizers, grad_scale in zip(models, runs, (scale, 1.0, 1.0)):
            reduce_gradients(optimizers)
            for opt in optimizers:
                opt.step(grad_scale=grad_scale)
            model.zero_grad(set_to_none=True)
    scaled, prescaled, unscaled = map(params_of, models)
    for name, p in prescaled.items():
        assert torch.equal(scaled[name], p), name
    # ... and the scale mattered: without it the weights end up elsewhere.
    assert all((scaled[name] - p).abs().max() > 1e-4 for name, p in unscaled.items())


def resume_and_step(checkpoint, distributed, idx, targets, step):
    """Fresh model and optimizers from a checkpoint (tensors and numbers only), one step."""
    checkpoint = torch.load(checkpoint, weights_only=True)
    model, optimizers = float64_setup(distributed)
    model.load_state_dict(checkpoint["model"])
    for opt, state in zip(optimizers, checkpoint["optim"]):
        opt.load_state_dict(state)
    train_step(model, optimizers, idx, targets, step)
    return model, optimizers


def test_save_restore_matches_uninterrupted_run():
    idx, targets = make_batch()
    model, optimizers = float64_setup()
    for step in range(2):
        train_step(model, optimizers, idx, targets, step)
    checkpoint = save(dict(model=model.state_dict(), optim=[o.state_dict() for o in optimizers]))
    train_step(model, optimizers, idx, targets, 2)
    resumed, _ = resume_and_step(checkpoint, False, idx, targets, 2)
    for name, p in params_of(model).items():
        assert torch.equal(params_of(resumed)[name], p), name


COLLECTIVES = ("all_reduce", "reduce_scatter_single", "all_gather_single", "reduce_scatter_tensor",
               "all_gather_into_tensor", "reduce_scatter", "all_gather", "broadcast", "reduce")


def _count_bytes(traffic):
    """Wrap the torch.distributed collectives: per name, the bytes of the full-size buffer
    (the reduce-scatter input, the all-gather output, the all-reduce tensor)."""
    originals = {name: getattr(dist, name) for name in COLLECTIVES}

    def counting(name):
        def collective(*args, **kwargs):
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            traffic[name] = traffic.get(name, 0) + max(t.numel() * t.element_size() for t in tensors)
            return originals[name](*args, **kwargs)
        return collective
    for name in COLLECTIVES:
        setattr(dist, name, counting(name))
    return originals


def _averaged_grad_sq_norms(model, world_size):
    """Independently of optim.py: gather every rank's gradient, average, square, sum (float64)."""
    norms = {}
    for p in model.parameters():
        grads = [torch.empty_like(p.grad) for _ in range(world_size)]
        dist.all_gather(grads, p.grad)
        norms[p] = (torch.stack(grads).double().mean(0) ** 2).sum().item()
    return norms


def _distributed_worker(rank, world_size, init_file, out_dir):
    """Three steps on half a batch each, a resume, a counted step, state-layout records."""
    torch.set_num_threads(1)  # two processes on a 2-core machine: don't oversubscribe
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size)
    idx, targets = make_batch()
    half = idx.size(0) // world_size
    idx, targets = idx[rank * half:(rank + 1) * half], targets[rank * half:(rank + 1) * half]
    model, optimizers = float64_setup(distributed=True)
    coefficients = [train_step(model, optimizers, idx, targets, step) for step in range(2)]
    checkpoint = save(dict(model=model.state_dict(), optim=[o.state_dict() for o in optimizers]))
    coefficients.append(train_step(model, optimizers, idx, targets, 2))
    adamw, muon = optimizers
    states_after = [o.state_dict() for o in optimizers]
    named = dict(model.named_parameters())
    result = dict(
        params=params_of(model), coefficients=coefficients,
        adam_shard_numel={n: adamw.state[p]["exp_avg"].numel() for n, p in named.items()
                          if p in adamw.state},
        muon_buffers=sorted(n for n, p in named.items()
                            if "momentum_buffer" in muon.state.get(p, {})),
    )
    result["optimizer_states"] = states_after
    resumed, resumed_optimizers = resume_and_step(checkpoint, True, idx, targets, 2)
    result["resumed_params"] = params_of(resumed)

    # One step of a 2-block model (every Muon block full) with the collectives counted,
    # and its gradient norms against an independent average of the ranks' gradients.
    counted = make_model(n_blocks=2)
    counted_optimizers = build_optimizers(counted, distributed=True)
    counted(idx, targets).backward()
    expected_norms = _averaged_grad_sq_norms(counted, world_size)
    traffic = {}
    originals = _count_bytes(traffic)
    norms = {p: v.item() for p, v in reduce_gradients(counted_optimizers)[0].items()}
    for opt in counted_optimizers:
        opt.step()
    for name, original in originals.items():
        setattr(dist, name, original)
    names = {p: n for n, p in counted.named_parameters()}
    result.update(traffic=traffic, norms={names[p]: v for p, v in norms.items()},
                  expected_norms={names[p]: v for p, v in expected_norms.items()},
                  counted_param_bytes=sum(p.numel() * p.element_size() for p in counted.parameters()))

    # Sharded AdamW alone against torch.optim.AdamW on identical gradients, with weight
    # decay and an odd-sized tensor (padded slices): the same elementwise arithmetic.
    gen = torch.Generator().manual_seed(4)
    sharded = nn.Parameter(torch.randn(7, 5, generator=gen))
    plain = nn.Parameter(sharded.detach().clone())
    pair = [AdamW([sharded], lr=0.1, weight_decay=0.1, distributed=True),
            torch.optim.AdamW([plain], lr=0.1, weight_decay=0.1)]
    for _ in range(3):
        sharded.grad = torch.randn(7, 5, generator=gen)  # the same on both ranks: the average
        plain.grad = sharded.grad.clone()
        for opt in pair:
            opt.step()
    result["adamw_pair"] = (sharded.detach(), plain.detach())
    result["wrong_world_size_errors"] = []
    checkpoint.seek(0)
    for opt, state in zip(resumed_optimizers, torch.load(checkpoint, weights_only=True)["optim"]):
        try:
            opt.load_state_dict(dict(state, world_size=world_size + 1))
        except ValueError as error:
            result["wrong_world_size_errors"].append(str(error))
    torch.save(result, f"{out_dir}/rank{rank}.pt")
    dist.barrier()  # no rank tears gloo down while the other still talks to it
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def distributed_results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dist")
    mp.start_processes(_distributed_worker, args=(2, str(tmp / "init"), str(tmp)), nprocs=2, start_method="forkserver")
    return [torch.load(tmp / f"rank{rank}.pt", weights_only=False) for rank in range(2)]


@pytest.fixture(scope="module")
def single_process_run():
    """The same three steps by one process on the whole batch, with the same optimizers."""
    idx, targets = make_batch()
    model, optimizers = float64_setup()
    coefficients = [train_step(model, optimizers, idx, targets, step) for step in range(3)]
    return params_of(model), coefficients


def test_distributed_matches_single_process(distributed_results, single_process_run):
    params, coefficients = single_process_run
    rank0, rank1 = distributed_results
    # The owners' results are all-gathered, so the ranks agree bit for bit.
    for name, p in rank0["params"].items():
        assert torch.equal(rank1["params"][name], p), name
    # Clipping was active, and both runs clipped by the norm of the full-batch gradient.
    assert max(coefficients) < 1
    assert rank0["coefficients"] == pytest.approx(coefficients, rel=1e-12)
    # Averaging two half-batch gradients = the full-batch gradient up to float64 rounding (~1e-16
    # relative); Adam's division by sqrt(v) passes that on to the step, and the embedding (lr
    # 0.2 * sqrt(768 / 15) = 1.4) reaches entries of 5: 1e-10 is far above that, far below a fault.
    for name, expected in params.items():
        torch.testing.assert_close(rank0["params"][name], expected, rtol=1e-10, atol=1e-10,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_reduce_gradients_returns_averaged_gradient_norms(distributed_results):
    for result in distributed_results:
        assert result["norms"].keys() == result["expected_norms"].keys()
        for name, expected in result["expected_norms"].items():
            assert result["norms"][name] == pytest.approx(expected, rel=1e-5), name


def test_communication_is_reduce_scatter_plus_all_gather(distributed_results):
    # Hand count for 2 ranks, float32. AdamW: each 25 x 15 = 375-element table is padded
    # to 2 slices of 188 = 376 elements. Muon: each of the 5 shapes has 2 matrices, one
    # full block; its stack holds exactly the 2 matrices, 2 x 1365 elements over all shapes.
    full = (2 * 376 + 2 * 1365) * 4
    assert distributed_results[0]["counted_param_bytes"] == (2 * 375 + 2 * 1365) * 4
    for result in distributed_results:
        # Once down (gradients) and once up (parameters): 2x the parameter bytes plus the
        # 2 padding elements per direction, and a 12-float vector for the norms. Nothing
        # else, in particular no all-reduce of the gradients (DDP) and no broadcast.
        assert result["traffic"] == {"reduce_scatter_single": full, "all_gather_single": full,
                                     "all_reduce": 12 * 4}
        assert 2 * full == 2 * result["counted_param_bytes"] + 2 * 2 * 4


def test_dist_adamw_matches_torch_adamw(distributed_results):
    for result in distributed_results:
        sharded, plain = result["adamw_pair"]
        torch.testing.assert_close(sharded, plain, rtol=0, atol=0)


def test_distributed_state_is_split_across_ranks(distributed_results):
    numel = D_MODEL * VOCAB  # 375 -> slices of 188 and 187
    assert distributed_results[0]["adam_shard_numel"] == {
        "transformer.wte.weight": 188, "lm_head.weight": 188}
    assert distributed_results[1]["adam_shard_numel"] == {
        "transformer.wte.weight": numel - 188, "lm_head.weight": numel - 188}
    # Each shape has 3 matrices, one per block: blocks of world_size = (h.0, h.1), (h.2,).
    # Rank 0 owns the first of each block (h.0 and h.2), rank 1 the second (h.1).
    block = [n for n, _ in make_model().named_parameters() if n.startswith("transformer.h.")]
    owned = [[n for n in block if n.split(".")[2] in layers] for layers in (("0", "2"), ("1",))]
    for rank, result in enumerate(distributed_results):
        assert result["muon_buffers"] == sorted(owned[rank])


def test_distributed_save_restore(distributed_results):
    for result in distributed_results:
        for name, p in result["params"].items():
            assert torch.equal(result["resumed_params"][name], p), name
        errors = result["wrong_world_size_errors"]
        assert len(errors) == 2 and all("world_size" in e for e in errors)


# ----------------------------------------------------------------------------- the schedules, by hand


def test_lr_multiplier_at_the_boundaries():
    """1000 steps, warm-down 0.2: flat through step 800, then (1000 - step) / 200 down to 0 at step 1000."""
    lrm = [lr_multiplier(step, 1000, 0.2) for step in (0, 799, 800, 801, 900, 999, 1000)]
    assert lrm == pytest.approx([1.0, 1.0, 1.0, 0.995, 0.5, 0.005, 0.0])
    assert lr_multiplier(7, 10, 0.0) == 1.0 and lr_multiplier(10, 10, 0.0) == 1.0  # no warm-down: flat
    # 10 steps x 0.25 = 2.5 warm-down steps: Python's round gives 2 (to even), as in the authors' code
    assert [lr_multiplier(s, 10, 0.25) for s in (8, 9, 10)] == [1.0, 0.5, 0.0]


def test_muon_momentum_warms_up_linearly():
    assert [muon_momentum(s, 300) for s in (0, 150, 299, 300, 5000)] == pytest.approx(
        [0.85, 0.90, 0.85 + 0.1 * 299 / 300, 0.95, 0.95])
    assert muon_momentum(0, 0) == 0.95


def test_clip_coefficient_is_clip_grad_norms_rule():
    assert clip_coefficient(0.5, 1.0) == 1.0 and clip_coefficient(4.0, 1.0) == pytest.approx(0.25)
    assert clip_coefficient(4.0, 2.0) == pytest.approx(0.5) and clip_coefficient(1.0, 1.0) == pytest.approx(1.0)
    p = nn.Parameter(torch.zeros(4))
    p.grad = torch.full((4,), 2.0)  # norm 4: torch scales it by the same factor
    torch.nn.utils.clip_grad_norm_([p], 1.0)
    assert torch.allclose(p.grad, torch.full((4,), 2.0 * clip_coefficient(4.0, 1.0)))


def as_rank(optimizers, rank, world_size):
    """Optimizers of one process that keep the pieces of `rank` of `world_size` (state only: no collectives)."""
    for opt in optimizers:
        opt.rank, opt.world_size = rank, world_size
    return optimizers


def assert_same_state(a, b, **tol):
    assert a.keys() == b.keys()
    for i in a:
        assert a[i].keys() == b[i].keys()
        for key in a[i]:
            if torch.is_tensor(a[i][key]):
                torch.testing.assert_close(a[i][key], b[i][key], **tol)
            else:
                assert a[i][key] == b[i][key]


def test_optimizer_state_reshards_exactly_between_world_sizes(distributed_results):
    """2 ranks -> 1 and 1 -> 2: the whole state after resharding equals the whole state before it, and
    equals the state a single process reaches on the same steps (an independent computation)."""
    from flt import checkpoint
    idx, targets = make_batch()
    model, single = float64_setup()
    for step in range(3):
        train_step(model, single, idx, targets, step)
    for i, opt in enumerate(float64_setup()[1]):  # 2 -> 1
        saved = [result["optimizer_states"][i] for result in distributed_results]
        whole = checkpoint.full_optimizer_state(opt, saved)
        checkpoint.load_optimizer(opt, saved)
        assert_same_state(checkpoint.full_optimizer_state(opt, [opt.state_dict()]), whole, rtol=0, atol=0)
        assert_same_state(whole, checkpoint.full_optimizer_state(opt, [single[i].state_dict()]), rtol=0, atol=1e-10)
    for i, opt in enumerate(single):  # 1 -> 2: each rank keeps its pieces, as the 2-rank run's own
        saved = [opt.state_dict()]
        ranks = [as_rank(float64_setup()[1], r, 2)[i] for r in range(2)]
        for r, sharded in enumerate(ranks):
            checkpoint.load_optimizer(sharded, saved)
            assert_same_state(sharded.state_dict()["state"], distributed_results[r]["optimizer_states"][i]["state"],
                              rtol=0, atol=1e-10)
        resharded = [sharded.state_dict() for sharded in ranks]
        assert_same_state(checkpoint.full_optimizer_state(opt, resharded),
                          checkpoint.full_optimizer_state(opt, saved), rtol=0, atol=0)
    with pytest.raises(ValueError, match="expected every rank of the saved run, in rank order"):
        checkpoint.load_optimizer(single[0], [distributed_results[1]["optimizer_states"][0]])  # rank 0 missing


@pytest.mark.parametrize("opt", ["adamw", "muon"])
def test_a_parameter_the_loss_never_reached_is_named_not_a_crash(opt):
    # torch's optimizers skip a None gradient; these reduce every parameter, so they refuse one
    used, unused = nn.Parameter(torch.ones(2, 2)), nn.Parameter(torch.ones(2, 2))
    optimizer = AdamW([used, unused]) if opt == "adamw" else Muon([used, unused])
    (used ** 2).sum().backward()
    with pytest.raises(ValueError, match="a parameter got no gradient: the loss must reach each one"):
        reduce_gradients([optimizer])
