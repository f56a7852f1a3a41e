"""
Optimizers for the Fully Looped Transformer (SPEC section 6).

Two optimizers split the parameters by role:
- Muon for every 2-D matrix inside the blocks (attention and MLP weights);
- AdamW for the token embedding and the LM head, which are lookup tables and
  a classifier rather than linear maps between hidden states, so orthogonalising
  their updates makes no sense.
`build_optimizers(model)` does the split by parameter name and returns
[adamw, muon]; the training loop steps both and sets `group['lr']` from
`group['initial_lr']` (and Muon's `group['momentum']` warm-up) every step.

Distributed training (torchrun). The contract: DDP averages, optimizers don't.
train.py wraps the model in DistributedDataParallel, so after backward every rank
already holds the same, averaged gradient (gradient clipping and the per-module
gradient diagnostics see it too). The distributed optimizers below therefore never
reduce gradients; they only split the *work and state* of the update and then
share the updated parameters so every rank ends the step with identical weights:
- DistAdamW (ZeRO-style state sharding): every parameter is viewed flat and cut
  into world_size equal slices (the last ones padded, some possibly empty); rank r
  updates only slice r and keeps exp_avg / exp_avg_sq for that slice only, then
  all ranks all-gather the updated slices.
- DistMuon: each matrix has one owner, rank = index % world_size over the
  parameters in group order (the same on every rank). The owner keeps the momentum
  buffer and runs Newton-Schulz; then it broadcasts the new matrix to the others.
Both use only all_gather (list form) and broadcast on gloo, so they also run on
CPU; on NCCL DistAdamW uses the faster all_gather_into_tensor.

Saving and resuming: every optimizer has the usual state_dict()/load_state_dict().
For the distributed ones the state is per rank (each holds different slices or
matrices), so save one file per rank. Their state dict records world_size and rank;
loading it into another world size or rank raises ValueError.
"""

import math

import torch
import torch.distributed as dist


def zeropower_via_newtonschulz5(G, steps=5, eps=1e-7):
    """
    Approximately replace G = U S V^T by U V^T (the nearest semi-orthogonal matrix).

    A quintic Newton-Schulz iteration X <- aX + b(XX^T)X + c(XX^T)^2 X maps each
    singular value s of X to p(s) = as + bs^3 + cs^5 and leaves U, V untouched. The
    coefficients (3.4445, -4.7750, 2.0315) make p very steep near 0, so five steps
    push every singular value in (0, 1] into roughly [0.7, 1.2] rather than exactly
    1, which is good enough for an update direction and much cheaper than an SVD.
    """
    a, b, c = (3.4445, -4.7750, 2.0315)
    # bf16 on CUDA (the iteration is robust to low precision and tensor cores are
    # fast at it); float32 on CPU, where bf16 matmuls are slow and tests want accuracy.
    X = G.to(torch.bfloat16 if G.is_cuda else torch.float32)
    # Work with the wide orientation so the Gram matrix XX^T is the small side.
    transposed = X.size(0) > X.size(1)
    if transposed:
        X = X.mT
    # The Frobenius norm bounds the spectral norm, so this puts all s in [0, 1],
    # inside the region where the iteration converges.
    X = X / (X.norm() + eps)
    for _ in range(steps):
        A = X @ X.mT
        B = b * A + c * A @ A
        X = a * X + B @ X
    if transposed:
        X = X.mT
    return X.to(G.dtype)


def muon_update(grad, momentum_buffer, momentum):
    """One Muon update direction for a matrix; advances momentum_buffer in place."""
    momentum_buffer.mul_(momentum).add_(grad)
    nesterov = grad.add(momentum_buffer, alpha=momentum)
    update = zeropower_via_newtonschulz5(nesterov)
    # An orthogonal update has unit singular values whatever the shape; for tall
    # matrices (rows > cols) scale it up so its per-element size matches square ones.
    return update * max(1.0, grad.size(0) / grad.size(1)) ** 0.5


class Muon(torch.optim.Optimizer):
    """
    Muon: MomentUm Orthogonalized by Newton-Schulz (Keller Jordan et al., 2024).

    For a weight matrix W, plain SGD with momentum steps along the momentum M, whose
    spectrum is dominated by a few large singular directions: most of the step goes
    into directions that are already being learned. Muon keeps the direction
    information but flattens the spectrum: it replaces M = U S V^T by U V^T, so every
    singular direction moves by the same amount. Computing U V^T exactly needs an SVD;
    a few Newton-Schulz steps (zeropower_via_newtonschulz5) get close enough in a
    handful of matmuls, in bf16 on GPU.

    Per step, for each matrix p with gradient g:
        buf <- momentum * buf + g                   (SGD momentum)
        u   <- NS5(g + momentum * buf)              (Nesterov, then orthogonalise)
        p   <- p - lr * sqrt(max(1, rows/cols)) * u

    Only for 2-D parameters (the block matrices); embeddings, the LM head and any
    vector go to AdamW. `momentum` is read from each param group at every step, so
    the training loop can warm it up (0.85 -> 0.95 in the paper).
    """

    def __init__(self, params, lr=0.02, momentum=0.95):
        super().__init__(params, dict(lr=lr, momentum=momentum))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                update = muon_update(p.grad, state["momentum_buffer"], group["momentum"])
                p.add_(update, alpha=-group["lr"])


class _RankLocalState:
    """
    Mixin for the distributed optimizers: their state differs per rank, so the state
    dict records (world_size, rank) and refuses to load into a different layout.
    """

    def state_dict(self):
        return {**super().state_dict(), "world_size": self.world_size, "rank": self.rank}

    def load_state_dict(self, state_dict):
        saved = (state_dict.get("world_size"), state_dict.get("rank"))
        if saved != (self.world_size, self.rank):
            raise ValueError(
                f"optimizer state was saved with (world_size, rank) = {saved}, but this "
                f"process is {(self.world_size, self.rank)}; the distributed optimizers "
                "keep per-rank state, so resume with the same world size and load each "
                "rank's own file")
        state_dict = {k: v for k, v in state_dict.items() if k not in ("world_size", "rank")}
        super().load_state_dict(state_dict)


class DistMuon(_RankLocalState, Muon):
    """
    Muon for torchrun: each matrix is updated by one owner rank, then broadcast.

    Gradients must already be averaged across ranks (DDP does this), so the owner's
    gradient is the global one. Owner of the i-th parameter (counting over the param
    groups in order, identical on every rank) is rank i % world_size; only the owner
    holds that matrix's momentum buffer and pays for its Newton-Schulz iteration, so
    the optimizer work and state are split about 1/world_size per rank. Broadcasts
    are launched asynchronously as soon as each owner's update is done and waited
    for at the end, so communication overlaps with the remaining updates.
    """

    def __init__(self, params, lr=0.02, momentum=0.95):
        super().__init__(params, lr=lr, momentum=momentum)
        self.world_size, self.rank = dist.get_world_size(), dist.get_rank()

    @torch.no_grad()
    def step(self):
        pending = []
        params = [(p, group) for group in self.param_groups for p in group["params"]]
        for i, (p, group) in enumerate(params):
            owner = i % self.world_size
            if owner == self.rank and p.grad is not None:
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                update = muon_update(p.grad, state["momentum_buffer"], group["momentum"])
                p.add_(update, alpha=-group["lr"])
            # Every rank joins every broadcast, even for a parameter without a gradient,
            # so the sequence of collectives is the same on all ranks.
            pending.append(dist.broadcast(p, src=owner, async_op=True))
        for work in pending:
            work.wait()


class DistAdamW(_RankLocalState, torch.optim.Optimizer):
    """
    AdamW with ZeRO-style sharded state, for torchrun.

    Adam keeps two moment tensors per parameter, twice the model's size. Since the
    update is elementwise, rank r can update just its slice of every parameter: view
    the parameter flat, cut it into world_size equal slices of ceil(numel/world_size)
    elements (the tail of the last slices is padding, and for tiny tensors some slices
    are empty), keep exp_avg / exp_avg_sq for slice r only, update it, and all-gather
    the slices so every rank has the whole new parameter. Gradients must already be
    averaged (DDP), so no reduce-scatter is needed; each rank reads its slice of the
    full gradient. The arithmetic is exactly torch.optim.AdamW's (decoupled weight
    decay, bias correction), so the result matches it to float rounding.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.world_size, self.rank = dist.get_world_size(), dist.get_rank()
        self._nccl = dist.get_backend() == "nccl"

    def _shard_bounds(self, p):
        shard = math.ceil(p.numel() / self.world_size)
        lo = min(self.rank * shard, p.numel())
        return shard, lo, min(lo + shard, p.numel())

    def _all_gather(self, gathered, mine):
        """All-gather equal-size 1-D `mine` from every rank into `gathered`, async."""
        if self._nccl:
            return dist.all_gather_into_tensor(gathered, mine, async_op=True)
        # gloo has no all_gather_into_tensor; the list form writes into views of
        # `gathered`, which ends up laid out the same way.
        return dist.all_gather(list(gathered.chunk(self.world_size)), mine, async_op=True)

    @torch.no_grad()
    def step(self):
        pending = []
        for group in self.param_groups:
            lr, (beta1, beta2), eps = group["lr"], group["betas"], group["eps"]
            for p in group["params"]:
                if p.grad is None:  # DDP leaves the same grads None on every rank
                    continue
                shard, lo, hi = self._shard_bounds(p)
                param, grad = p.view(-1)[lo:hi], p.grad.view(-1)[lo:hi]
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
                # Pad to the common slice size so the all-gather sees equal sizes.
                mine = torch.nn.functional.pad(param, (0, shard - param.numel()))
                gathered = mine.new_empty(shard * self.world_size)
                pending.append((self._all_gather(gathered, mine), gathered, p))
        for work, gathered, p in pending:
            work.wait()
            p.view(-1).copy_(gathered[:p.numel()])


def build_optimizers(model, distributed=False, matrix_lr=0.02, embedding_lr=0.2,
                     unembedding_lr=0.004):
    """
    Split the model's parameters by name into [AdamW, Muon] (SPEC section 6):
      transformer.wte.weight  -> AdamW, lr embedding_lr * sqrt(768 / d_model)
      lm_head.weight          -> AdamW, lr unembedding_lr * sqrt(768 / d_model)
      transformer.h.*         -> Muon,  lr matrix_lr (all 2-D, no biases or norm gains)
    AdamW uses betas (0.8, 0.95), eps 1e-10 and no weight decay. `model` is the bare
    model (not the DDP wrapper), with `model.config.n_embd`. Every parameter must land
    in exactly one group; anything else raises ValueError naming it. Each param group
    gets `initial_lr`, the base of the training loop's schedule. With
    distributed=True (torch.distributed initialised, model wrapped in DDP by the
    caller) the sharded DistAdamW and DistMuon are used instead.
    """
    if distributed and not dist.is_initialized():
        raise ValueError("build_optimizers(distributed=True) needs torch.distributed to be "
                         "initialised first (dist.init_process_group under torchrun)")
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
    adam_kwargs = dict(betas=(0.8, 0.95), eps=1e-10, weight_decay=0.0)
    if distributed:
        optimizers = [DistAdamW(adam_groups, **adam_kwargs),
                      DistMuon(matrices, lr=matrix_lr, momentum=0.95)]
    else:
        fused = embedding[0].is_cuda  # the fused kernel exists only for CUDA tensors
        optimizers = [torch.optim.AdamW(adam_groups, fused=fused, **adam_kwargs),
                      Muon(matrices, lr=matrix_lr, momentum=0.95)]
    for opt in optimizers:
        for group in opt.param_groups:
            group["initial_lr"] = group["lr"]
    return optimizers
