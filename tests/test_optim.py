"""Tests for optim.py: Newton-Schulz, Muon, AdamW config, the distributed variants, resume."""

import io
import math
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from optim import DistAdamW, Muon, build_optimizers, zeropower_via_newtonschulz5

NS_COEFFS = (3.4445, -4.7750, 2.0315)
D_MODEL, VOCAB = 15, 25  # odd sizes: 375-element tables do not split evenly over 2 ranks


def reference_newton_schulz(G, steps=5):
    """The SPEC formula X <- aX + b(XX^T)X + c(XX^T)^2 X, literally, in float64."""
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


@pytest.mark.parametrize("shape", SHAPES)
def test_newton_schulz_approximates_polar_factor(shape):
    G = well_conditioned(*shape, torch.Generator().manual_seed(1))
    out = zeropower_via_newtonschulz5(G.float()).double()
    U, _, Vh = torch.linalg.svd(G, full_matrices=False)
    polar = U @ Vh
    # Five quintic steps map every normalised singular value in [0.01, 1] into
    # [0.68, 1.14] (not exactly 1); here s_min / ||G||_F >= 0.5 / sqrt(32) > 0.08.
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
    """Named like the real model: an embedding, 5 block matrices (tall, wide, square), a head."""

    def __init__(self):
        super().__init__()
        d = D_MODEL
        self.config = SimpleNamespace(n_embd=d)
        block = nn.Module()
        block.attn, block.mlp = nn.Module(), nn.Module()
        block.attn.c_q = nn.Linear(d, d, bias=False)               # 15 x 15
        block.attn.c_k = nn.Linear(d, 8, bias=False)               # 8 x 15, wide
        block.attn.c_proj = nn.Linear(8, d, bias=False)            # 15 x 8, tall
        block.mlp.c_fc = nn.Linear(d, 2 * d, bias=False)           # 30 x 15, tall
        block.mlp.c_proj = nn.Linear(2 * d, d, bias=False)         # 15 x 30, wide
        self.transformer = nn.ModuleDict(dict(wte=nn.Embedding(VOCAB, d), h=nn.ModuleList([block])))
        self.lm_head = nn.Linear(d, VOCAB, bias=False)

    def forward(self, idx, targets):
        x = self.transformer.wte(idx)
        block = self.transformer.h[0]
        x = x + block.attn.c_q(x)
        x = x + block.attn.c_proj(torch.tanh(block.attn.c_k(x)))
        x = x + block.mlp.c_proj(F.relu(block.mlp.c_fc(x)) ** 2)
        return F.cross_entropy(self.lm_head(x).flatten(0, 1), targets.flatten())


def make_model():
    torch.manual_seed(0)
    return TinyModel()


def make_batch():
    gen = torch.Generator().manual_seed(3)
    idx, targets = torch.randint(0, VOCAB, (2, 4, 8), generator=gen)
    return idx, targets


def train_step(model, optimizers, idx, targets, step):
    """One step with a changing lr multiplier and Muon momentum, as train.py does."""
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = group["initial_lr"] * (1.0 - 0.2 * step)
    optimizers[1].param_groups[0]["momentum"] = 0.85 + 0.05 * step
    model(idx, targets).backward()
    for opt in optimizers:
        opt.step()
    model.zero_grad(set_to_none=True)


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
    assert isinstance(adamw, torch.optim.AdamW) and isinstance(muon, Muon)
    grouped = [p for opt in (adamw, muon) for g in opt.param_groups for p in g["params"]]
    assert sorted(map(id, grouped)) == sorted(id(p) for p in model.parameters())
    scale = math.sqrt(768 / D_MODEL)
    embedding, head = adamw.param_groups
    assert embedding["params"] == [model.transformer.wte.weight]
    assert head["params"] == [model.lm_head.weight]
    assert embedding["lr"] == pytest.approx(0.2 * scale)
    assert head["lr"] == pytest.approx(0.004 * scale)
    assert embedding["betas"] == (0.8, 0.95) and embedding["eps"] == 1e-10
    assert embedding["weight_decay"] == 0.0
    assert muon.param_groups[0]["params"] == list(model.transformer.h.parameters())
    assert muon.param_groups[0]["lr"] == 0.02 and muon.param_groups[0]["momentum"] == 0.95
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


def test_save_restore_matches_uninterrupted_run():
    idx, targets = make_batch()
    model = make_model()
    optimizers = build_optimizers(model)
    for step in range(2):
        train_step(model, optimizers, idx, targets, step)
    checkpoint = save(dict(model=model.state_dict(), optim=[o.state_dict() for o in optimizers]))
    train_step(model, optimizers, idx, targets, 2)

    checkpoint = torch.load(checkpoint)
    resumed = make_model()
    resumed.load_state_dict(checkpoint["model"])
    resumed_optimizers = build_optimizers(resumed)
    for opt, state in zip(resumed_optimizers, checkpoint["optim"]):
        opt.load_state_dict(state)
    train_step(resumed, resumed_optimizers, idx, targets, 2)
    for name, p in params_of(model).items():
        assert torch.equal(params_of(resumed)[name], p), name


def _distributed_worker(rank, world_size, init_file, out_dir):
    """Three DDP steps on half a batch each, a resume check, and state-layout records."""
    torch.set_num_threads(1)  # two processes on a 2-core machine: don't oversubscribe
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size)
    idx, targets = make_batch()
    half = idx.size(0) // world_size
    idx, targets = idx[rank * half:(rank + 1) * half], targets[rank * half:(rank + 1) * half]
    model = make_model()
    ddp = DDP(model)
    optimizers = build_optimizers(model, distributed=True)
    for step in range(2):
        train_step(ddp, optimizers, idx, targets, step)
    checkpoint = save(dict(model=model.state_dict(), optim=[o.state_dict() for o in optimizers]))
    train_step(ddp, optimizers, idx, targets, 2)
    adamw, muon = optimizers
    named = dict(model.named_parameters())
    result = dict(
        params=params_of(model),
        adam_shard_numel={n: adamw.state[p]["exp_avg"].numel() for n, p in named.items()
                          if p in adamw.state},
        muon_buffers=sorted(n for n, p in named.items()
                            if "momentum_buffer" in muon.state.get(p, {})),
    )

    # Resume from the step-2 checkpoint into fresh objects and take step 3 again.
    checkpoint = torch.load(checkpoint)
    resumed = make_model()
    resumed.load_state_dict(checkpoint["model"])
    resumed_optimizers = build_optimizers(resumed, distributed=True)
    for opt, state in zip(resumed_optimizers, checkpoint["optim"]):
        opt.load_state_dict(state)
    train_step(DDP(resumed), resumed_optimizers, idx, targets, 2)
    result["resumed_params"] = params_of(resumed)

    # DistAdamW alone against torch.optim.AdamW on identical gradients, with weight
    # decay and an odd-sized tensor (padded slices): the same elementwise arithmetic.
    gen = torch.Generator().manual_seed(4)
    sharded = nn.Parameter(torch.randn(7, 5, generator=gen))
    plain = nn.Parameter(sharded.detach().clone())
    pair = [DistAdamW([sharded], lr=0.1, weight_decay=0.1),
            torch.optim.AdamW([plain], lr=0.1, weight_decay=0.1)]
    for _ in range(3):
        sharded.grad = torch.randn(7, 5, generator=gen)
        plain.grad = sharded.grad.clone()
        for opt in pair:
            opt.step()
    result["adamw_pair"] = (sharded.detach(), plain.detach())
    result["wrong_world_size_errors"] = []
    for opt, state in zip(resumed_optimizers, checkpoint["optim"]):
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
    mp.spawn(_distributed_worker, args=(2, str(tmp / "init"), str(tmp)), nprocs=2, join=True)
    return [torch.load(tmp / f"rank{rank}.pt") for rank in range(2)]


@pytest.fixture(scope="module")
def single_process_params():
    """The same three steps by one process on the whole batch with Muon and torch AdamW."""
    idx, targets = make_batch()
    model = make_model()
    optimizers = build_optimizers(model)
    for step in range(3):
        train_step(model, optimizers, idx, targets, step)
    return params_of(model)


def test_distributed_matches_single_process(distributed_results, single_process_params):
    # DDP averages the two half-batch gradients = the full-batch gradient; the sharded
    # AdamW and owner-computed Muon must then reproduce torch.optim.AdamW + Muon. The
    # average of two half-batch means differs from the full mean by rounding (~1e-7
    # relative); Adam's division by sqrt(v) turns that into a relative error of the
    # step, and the embedding lr here is 0.2 * sqrt(768 / 15) = 1.4, hence rtol 1e-5.
    for result in distributed_results:
        for name, expected in single_process_params.items():
            torch.testing.assert_close(result["params"][name], expected, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, name=name: f"{name}: {m}")


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
    # Round-robin ownership over the 5 block matrices in order: rank 0 owns 3, rank 1 owns 2.
    block = [n for n, _ in make_model().named_parameters() if n.startswith("transformer.h.")]
    for rank, result in enumerate(distributed_results):
        assert result["muon_buffers"] == sorted(block[rank::2])


def test_distributed_save_restore(distributed_results):
    for result in distributed_results:
        for name, p in result["params"].items():
            assert torch.equal(result["resumed_params"][name], p), name
        errors = result["wrong_world_size_errors"]
        assert len(errors) == 2 and all("world_size" in e for e in errors)
