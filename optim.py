"""Optimizers for the Fully Looped Transformer (the paper's recipe, docs/recipe.md): Muon for every
2-D matrix inside the blocks; AdamW for the token embedding and the LM head, a lookup table and a
classifier rather than maps between hidden states, so orthogonalising their updates makes no sense.
`build_optimizers(model)` splits the parameters by name into [adamw, muon]; the training loop sets
`group['lr']` from `group['initial_lr']` (and Muon's `group['momentum']` warm-up) every step.

The contract (no DDP: the optimizers own the gradient reduction), alike in one process or torchrun:
  1. backward on each micro-batch: p.grad is this rank's own, un-averaged gradient.
  2. sq_norms, sums = reduce_gradients(optimizers, to_sum) averages every gradient over the ranks:
     {parameter: squared L2 norm of its average} and the caller's `to_sum` summed over the ranks
     (0-d device tensors, read in one go): clipping sees the averaged gradient, as under DDP.
  3. opt.step(grad_scale=c) for each optimizer updates with c times the averaged gradient (c = the
     clip coefficient, 1.0 = none); all ranks end with the same parameters. It consumes the
     gradients (one process scales p.grad in place): zero them next. step() alone reduces first.
Traffic for P parameter elements: a reduce-scatter (AVG, gloo's too) of the gradients to the pieces
each rank updates and an all-gather of the updated pieces, 2P and padding as DDP's all-reduce, plus
an all_reduce of a number per tensor and `to_sum`. One process skips every collective unless built
distributed (scripts/zero_check.py: a group of one). A parameter with no gradient: an error.

The state is per rank (its slices or matrices, world_size and rank), another rank's refused;
owns(p) and piece(p, whole) say which of p's state it keeps, for flt/checkpoint.py to reshard.
"""

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F


# (reduce-scatter, all-gather): torch 2.13's names, then those torch 2.0 to 2.12 give them
COLLECTIVES = (("reduce_scatter_single", "all_gather_single"),
               ("reduce_scatter_tensor", "all_gather_into_tensor"))


def collectives():
    """The first pair of COLLECTIVES this torch has (flt/runtime.py: check_torch refuses none)."""
    pair = next((p for p in COLLECTIVES if all(hasattr(dist, n) for n in p)), COLLECTIVES[-1])
    return tuple(getattr(dist, name) for name in pair)


def zeropower_via_newtonschulz5(G, steps=5, eps=1e-7, dtype=None):
    """Approximately replace G = U S V^T by U V^T (the nearest semi-orthogonal matrix).

    A quintic Newton-Schulz iteration X <- aX + b(XX^T)X + c(XX^T)^2 X maps each singular
    value s of X to p(s) = as + bs^3 + cs^5 and leaves U, V untouched. The coefficients
    (3.4445, -4.7750, 2.0315) make p steep near 0: five steps take every singular value in
    [0.01, 1] into [0.682, 1.134], and s = 0.001 to about 0.47: enough for an update direction, much
    cheaper than an SVD. `dtype`: None = bf16 on CUDA (tensor cores), float32 elsewhere.
    """
    a, b, c = (3.4445, -4.7750, 2.0315)
    X = G.to(dtype or (torch.bfloat16 if G.is_cuda else torch.float32))
    # Work with the wide orientation so the Gram matrix XX^T is the small side.
    transposed = X.size(0) > X.size(1)
    if transposed:
        X = X.mT
    # The Frobenius norm bounds the spectral norm: every s in [0, 1], where the iteration converges
    X = X / (X.norm() + eps)
    for _ in range(steps):
        A = X @ X.mT
        B = b * A + c * A @ A
        X = a * X + B @ X
    if transposed:
        X = X.mT
    return X.to(G.dtype)


def muon_update(grad, momentum_buffer, momentum, ns_dtype=None):
    """One Muon update direction for a matrix; advances momentum_buffer in place."""
    momentum_buffer.mul_(momentum).add_(grad)
    nesterov = grad.add(momentum_buffer, alpha=momentum)
    update = zeropower_via_newtonschulz5(nesterov, dtype=ns_dtype)
    # An orthogonal update has unit singular values whatever the shape; a tall matrix (rows >
    # cols; weights are (out, in): the MLP's c_fc, 4d x d) is scaled up to match square ones.
    return update * max(1.0, grad.size(0) / grad.size(1)) ** 0.5


def squared_norm(g):
    """A 0-d tensor: the sum of g's squares in at least fp32 (a float64 run's in float64)."""
    return g.to(torch.promote_types(g.dtype, torch.float32)).square().sum()


class _Sharded(torch.optim.Optimizer):
    """The module docstring's cycle; a state dict tied to (world_size, rank). Subclasses say which
    pieces a rank updates (_reduce_scatter_grads), and update and all-gather them (_update)."""

    def __init__(self, params, defaults, distributed):
        super().__init__(params, defaults)
        if distributed and not dist.is_initialized():
            raise ValueError("distributed=True needs dist.init_process_group first (torchrun)")
        self.distributed = distributed
        self.world_size = dist.get_world_size() if distributed else 1
        self.rank = dist.get_rank() if distributed else 0
        self._reduced = None  # {param: this rank's piece of its averaged gradient}, until step()
        self._scatters = []   # the gradients' async reduce-scatters, waited for before the update
        self._gathers = []    # (async all-gather, its output, params), waited for after it

    def parameters(self):
        """Every parameter, group by group: the order of state_dict()'s indices."""
        return [p for group in self.param_groups for p in group["params"]]

    # The collectives move equal flat pieces of `size` elements, one per rank, so both
    # zero-pad. Flat, because gloo takes only the concatenated form (NCCL also stacks).
    def _reduce_scatter(self, tensors, size):
        """Piece `rank`, flat, of the tensors run together: averaged by the collective (AVG)."""
        if not self.distributed:
            return tensors[0].view(-1)  # the whole gradient, no copy
        padding = tensors[0].new_zeros(self.world_size * size - sum(t.numel() for t in tensors))
        full = torch.cat([t.view(-1) for t in tensors] + [padding])
        mine = full.new_empty(size)
        reduce_scatter, _ = collectives()
        self._scatters.append(reduce_scatter(mine, full, op=dist.ReduceOp.AVG, async_op=True))
        return mine

    def _all_gather(self, mine, params, size):
        """Every rank's `mine`, run together in rank order, into the params at the end of step()."""
        if self.distributed:
            full = mine.new_empty(self.world_size * size)
            mine = F.pad(mine.view(-1), (0, size - mine.numel()))
            _, all_gather = collectives()
            self._gathers.append((all_gather(full, mine, async_op=True), full, params))

    @torch.no_grad()
    def reduce_grads(self):
        """Start averaging the gradients over the ranks (once per step)."""
        if self._reduced is None:
            if any(p.grad is None for p in self.parameters()):
                raise ValueError("a parameter got no gradient: the loss must reach each one")
            self._reduced = self._reduce_scatter_grads()

    def _averaged(self):
        self.reduce_grads()
        for work in self._scatters:
            work.wait()
        self._scatters = []
        return self._reduced

    def grad_sq_norms(self):
        """{param: this rank's share of its averaged gradient's squared norm} (sum over ranks)."""
        reduced = self._averaged()
        squares = {p: squared_norm(g) for p, g in reduced.items()}
        return {p: squares.get(p, torch.zeros((), device=p.device)) for p in self.parameters()}

    @torch.no_grad()
    def step(self, grad_scale=1.0):
        reduced, self._reduced = self._averaged(), None
        for grad in reduced.values():
            grad.mul_(grad_scale)  # clipping: exactly a pre-scaled gradient
        self._update(reduced)
        for work, full, params in self._gathers:
            work.wait()
            # full (world_size * size): AdamW's one p flat, or Muon's block of same-shape p's, then
            # zeros; each p is params[0].numel() long, so zip stops before the padding
            for p, new in zip(params, full.split(params[0].numel())):
                p.copy_(new.view_as(p))
        self._gathers = []

    def state_dict(self):
        return {**super().state_dict(), "world_size": self.world_size, "rank": self.rank}

    def load_state_dict(self, state_dict):
        saved = (state_dict.get("world_size"), state_dict.get("rank"))
        if saved != (self.world_size, self.rank):
            raise ValueError(f"optimizer state was saved with (world_size, rank) = {saved}, but "
                             f"this process is {(self.world_size, self.rank)}; load each rank's "
                             "own file, or reshard with checkpoint.load_optimizer")
        state_dict = {k: v for k, v in state_dict.items() if k not in ("world_size", "rank")}
        super().load_state_dict(state_dict)


class Muon(_Sharded):
    """Muon: MomentUm Orthogonalized by Newton-Schulz (Keller Jordan et al., 2024).

    SGD with momentum steps along M (below: Nesterov's g + momentum * buf), whose spectrum is
    dominated by a few large singular directions, already being learned. Muon flattens it: it
    replaces M = U S V^T by U V^T, so every singular direction moves alike, approximated by
    a few Newton-Schulz steps (zeropower_via_newtonschulz5) instead of an SVD, in ns_dtype.

    Per step, for each matrix p with averaged gradient g:
        buf <- momentum * buf + g                   (SGD momentum)
        u   <- NS5(g + momentum * buf)              (Nesterov, then orthogonalise)
        p   <- p - lr * sqrt(max(1, rows/cols)) * u

    Only for 2-D parameters; `momentum` is read from the group each step (the loop warms it up,
    0.85 -> 0.95). Distributed, a group's same-shape matrices go world_size at a time, rank i
    owning the i-th of such a block: a reduce-scatter of the stacked block hands it its averaged
    gradient (a short block is padded with zero matrices), it alone keeps its momentum and runs
    Newton-Schulz, and an all-gather of the block shares the new matrices.
    """

    def __init__(self, params, lr=0.02, momentum=0.95, ns_dtype=None, distributed=False):
        super().__init__(params, dict(lr=lr, momentum=momentum), distributed)
        # An attribute, not a group setting, so the state dict stays plain numbers.
        self.ns_dtype = ns_dtype

    def _blocks(self):
        """(group, block, this rank's matrix in it or None), blocks as in the docstring."""
        for group in self.param_groups:
            for shape in dict.fromkeys(p.shape for p in group["params"]):  # first-seen order
                same = [p for p in group["params"] if p.shape == shape]
                for i in range(0, len(same), self.world_size):
                    block = same[i:i + self.world_size]
                    yield group, block, block[self.rank] if self.rank < len(block) else None

    def _reduce_scatter_grads(self):
        reduced = {}
        for _, block, p in self._blocks():
            grad = self._reduce_scatter([q.grad for q in block], block[0].numel())
            if p is not None:
                reduced[p] = grad.view_as(p)
        return reduced

    def _update(self, reduced):
        for group, block, p in self._blocks():
            if p is not None:
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                update = muon_update(reduced[p], state["momentum_buffer"], group["momentum"],
                                     self.ns_dtype)
                p.add_(update, alpha=-group["lr"])
            # In a short block, a rank without a matrix sends only padding (zeros).
            self._all_gather(block[0].new_empty(0) if p is None else p, block, block[0].numel())

    def owns(self, p):
        """Whether this rank keeps p's state: the matrix it updates in p's block."""
        return any(p is mine for _, _, mine in self._blocks())

    def piece(self, p, full):
        """This rank's piece of `full`, a state tensor of p's shape: a matrix's state is whole."""
        return full


class AdamW(_Sharded):
    """AdamW sharded over the ranks (ZeRO-1: the state sharded, p.grad and p whole on each rank).

    The update is elementwise, so rank r updates just its slice of each parameter: viewed
    flat and cut into world_size slices of ceil(numel / world_size) elements (zero-padded),
    rank r gets slice r of the averaged gradient, keeps exp_avg / exp_avg_sq for it, updates it,
    all-gathers the slices: torch.optim.AdamW's arithmetic (decoupled decay, bias correction).
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 distributed=False):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay),
                         distributed)

    def _shard_bounds(self, p):
        shard = math.ceil(p.numel() / self.world_size)
        lo = min(self.rank * shard, p.numel())
        return shard, lo, min(lo + shard, p.numel())

    def _reduce_scatter_grads(self):
        return {p: self._reduce_scatter([p.grad], self._shard_bounds(p)[0])
                for p in self.parameters()}

    def owns(self, p):
        """True: this rank keeps a slice of every parameter (empty if it lies past numel)."""
        return True

    def piece(self, p, full):
        """This rank's slice of `full`, a state tensor of p's shape, flat (as its exp_avg)."""
        _, lo, hi = self._shard_bounds(p)
        return full.view(-1)[lo:hi].clone()

    def _update(self, reduced):
        for group in self.param_groups:
            lr, (beta1, beta2), eps = group["lr"], group["betas"], group["eps"]
            for p in group["params"]:
                shard, lo, hi = self._shard_bounds(p)
                param, grad = p.view(-1)[lo:hi], reduced[p][:hi - lo]
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(param)
                    state["exp_avg_sq"] = torch.zeros_like(param)
                state["step"] += 1
                exp_avg, exp_avg_sq, step = state["exp_avg"], state["exp_avg_sq"], state["step"]
                # The same operations, in the same order, as torch.optim.AdamW.
                param.mul_(1 - lr * group["weight_decay"])
                exp_avg.lerp_(grad, 1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                step_size = lr / (1 - beta1 ** step)
                denom = (exp_avg_sq.sqrt() / (1 - beta2 ** step) ** 0.5).add_(eps)
                param.addcdiv_(exp_avg, denom, value=-step_size)
                self._all_gather(param, [p], shard)


@torch.no_grad()
def reduce_gradients(optimizers, to_sum=None):
    """Average the gradients: reduce_grads launches, grad_sq_norms waits; one all-reduce sums the
    pieces' squared norms and to_sum. Returns ({param: squared norm of its average}, to_sum)."""
    for opt in optimizers:
        opt.reduce_grads()  # every reduce-scatter is launched before any is waited for
    shares = {p: sq for opt in optimizers for p, sq in opt.grad_sq_norms().items()}
    values = torch.stack([*shares.values(), *(v.float() for v in (to_sum or {}).values())])
    if any(opt.distributed for opt in optimizers):
        dist.all_reduce(values)  # each rank holds the squares of its slices and matrices
    values = values.unbind()
    return dict(zip(shares, values)), dict(zip(to_sum or {}, values[len(shares):]))


def build_optimizers(model, distributed=False, matrix_lr=0.02, embedding_lr=0.2,
                     unembedding_lr=0.004, ns_dtype=None):
    """Split the parameters by name into [AdamW, Muon] (the paper's recipe, docs/recipe.md):
      transformer.wte.weight  -> AdamW, lr embedding_lr * sqrt(768 / d_model)
      lm_head.weight          -> AdamW, lr unembedding_lr * sqrt(768 / d_model)
      transformer.h.*         -> Muon,  lr matrix_lr (all 2-D, no biases or norm gains)
    AdamW: betas (0.8, 0.95), eps 1e-10, no weight decay; Muon's Newton-Schulz in ns_dtype (None:
    bf16 on CUDA, else float32). A parameter in no group or two is a ValueError naming it. Each
    group's `initial_lr` is the schedule's base. distributed=True (a process group initialised)
    shards both optimizers over the ranks; the model is not wrapped in DDP."""
    # The AdamW learning rates were tuned at d_model = 768; scale like 1/sqrt(width).
    scale = (768 / model.config.n_embd) ** 0.5
    embedding, head, matrices, seen = [], [], [], {}
    # remove_duplicate=False so a tensor shared under two names (tied weights) is caught.
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            raise ValueError(f"parameter {name!r} is the same tensor as {seen[id(p)]!r}; "
                             "each parameter must be in exactly one optimizer group")
        seen[id(p)] = name
        if name == "transformer.wte.weight":
            embedding.append(p)
        elif name == "lm_head.weight":
            head.append(p)
        elif name.startswith("transformer.h."):
            if p.ndim != 2:
                raise ValueError(f"parameter {name!r} has shape {tuple(p.shape)}; Muon "
                                 "takes only 2-D matrices under transformer.h.")
            matrices.append(p)
        else:
            raise ValueError(f"parameter {name!r} matches no optimizer group; allowed: "
                             "'transformer.wte.weight', 'lm_head.weight', 'transformer.h.*'")
    for name, group in (("transformer.wte.weight", embedding), ("lm_head.weight", head)):
        if not group:
            raise ValueError(f"model has no parameter named {name!r}")

    adam_groups = [dict(params=embedding, lr=embedding_lr * scale),
                   dict(params=head, lr=unembedding_lr * scale)]
    optimizers = [AdamW(adam_groups, betas=(0.8, 0.95), eps=1e-10, weight_decay=0.0,
                        distributed=distributed),
                  Muon(matrices, lr=matrix_lr, momentum=0.95, ns_dtype=ns_dtype,
                       distributed=distributed)]
    for opt in optimizers:
        for group in opt.param_groups:
            group["initial_lr"] = group["lr"]
    return optimizers


# ------------------------------- the schedules (train.py, every step; the authors' base_train.py)
def lr_multiplier(step, num_steps, warmdown_frac):
    """No warm-up; 1 until num_steps - round(warmdown_frac * num_steps), then linear to 0 at
    num_steps (their get_lr_multiplier with warmup_ratio 0 and final_lr_frac 0)."""
    warmdown = round(warmdown_frac * num_steps)
    return 1.0 if step <= num_steps - warmdown else (num_steps - step) / warmdown


def muon_momentum(step, warmup_steps, start=0.85, end=0.95):
    """Muon's momentum: linear from start to end over warmup_steps (their 300), then end."""
    frac = min(step / warmup_steps, 1.0) if warmup_steps > 0 else 1.0
    return (1 - frac) * start + frac * end


def clip_coefficient(total_norm, max_norm):
    """The factor on every gradient, clip_grad_norm_'s rule: min(1, max / (norm + 1e-6))."""
    return min(1.0, max_norm / (total_norm + 1e-6))


# ----------------------------------------------------------------------- the loop count per step
# Training over variable loop counts (beyond the paper, which trains at one K; Huginn,
# Geiping et al. 2025, samples K per step): train.py's loops_sampler.
LOOP_SAMPLERS = ("fixed", "uniform", "lognormal_poisson")


def sample_loops(sampler, step, seed, loops, loops_min=1, loops_max=-1):
    """K for one optimizer step, drawn from (seed, step) alone with a generator of its own: every
    rank draws the same K, and a resumed run redraws the K of each step it repeats.
      fixed              loops
      uniform            an integer uniform on [loops_min, loops_max]
      lognormal_poisson  Huginn's: K = 1 + Poisson(r), r ~ LogNormal(mu, 0.5), mu = log(loops - 1)
                         - 0.5^2 / 2, so E[r] = loops - 1 and E[K] = loops (Huginn sets E[r] to its
                         mean_recurrence, so its K averages one more). Right-skewed; loops_max > 0
                         caps it (and lowers the mean a little)."""
    if sampler == "fixed":
        return loops
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    if sampler == "uniform":
        return int(torch.randint(loops_min, loops_max + 1, (), generator=g))
    sigma = 0.5
    rate = torch.empty(()).log_normal_(math.log(loops - 1) - sigma**2 / 2, sigma, generator=g)
    K = 1 + int(torch.poisson(rate, generator=g))
    return min(K, loops_max) if loops_max > 0 else K
