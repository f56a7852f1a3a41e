"""
optim.py's ZeRO path on the process group at hand, against the single-process optimizers:
    torchrun --nproc_per_node=1 -m scripts.zero_check                   # one GPU, NCCL
    torchrun --nproc_per_node=2 -m scripts.zero_check --tiny --device=cpu   # 2 gloo ranks
The optimizers are built as distributed even on one rank, so the reduce-scatter of the gradients
and the all-gather of the updates run with their real dtypes and sizes (config/flt_base.py's model
on CUDA: a bf16 embedding, bf16 Newton-Schulz). Every rank holds the same gradients, so the
average over the ranks is that gradient and one optimizer step must give the single-process
step's parameters. It runs once with this torch's collectives and, where this torch has them too,
once with the older names (optim.py: collectives). Rank 0 prints one line, `zero_check {json}`,
and the exit status is 1 if a step differs beyond
its dtype's rounding. scripts/torchrun_check.py runs it.
"""
import copy
import json
import math
import os
import sys

import torch
import torch.distributed as dist

import optim
from configurator import configure
from flt import runtime
from flt.errors import user_errors
from model import GPT, GPTConfig

device = "cuda"             # cuda (this rank's GPU) | cpu
tiny = False                # a one-layer model: what the tests run on CPU


def base_config():
    """config/flt_base.py's model (depth 12, Qwen3's padded vocabulary, K = 9), or a tiny one."""
    depth, vocab, T, K = (1, 512, 32, 3) if tiny else (12, 151680, 1024, 9)
    n_head = math.ceil(64 * depth / 128)
    return GPTConfig(sequence_len=T, vocab_size=vocab, n_layer=depth, n_head=n_head,
                     n_kv_head=n_head, n_embd=64 * depth, loops=K, variant="FLT")


# torch.testing's default tolerances of each parameter dtype
TOLERANCE = {torch.float32: dict(rtol=1.3e-6, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-5)}


def recording(name, calls):
    """torch.distributed's collective `name`, recording the dtype and elements of what it sends."""
    collective = getattr(dist, name)

    def call(output, input, *args, **kwargs):
        calls.append((str(input.dtype), input.numel()))
        return collective(output, input, *args, **kwargs)
    return call


def one_step(model, distributed, grads, ns_dtype):
    """model after one optimizer step on `grads`, and the gradient's squared norm as
    reduce_gradients sums it (unclipped: the clip factor is train.py's, from that norm)."""
    model = copy.deepcopy(model)
    for p, g in zip(model.parameters(), grads):
        p.grad = g.clone()
    optimizers = optim.build_optimizers(model, distributed=distributed, ns_dtype=ns_dtype)
    sq_norms, _ = optim.reduce_gradients(optimizers)
    for opt in optimizers:
        opt.step()
    return model, torch.stack(list(sq_norms.values())).double().sum().item()


def check(rt):
    cuda = rt.device_type == "cuda"
    torch.manual_seed(0)
    with torch.device(rt.device):
        model = GPT(base_config())
    model.init_weights()
    runtime.store_embedding(model, "bf16" if cuda else "fp32")
    # the same batch, so the same gradients, on every rank
    idx = torch.randint(0, model.config.vocab_size, (2, model.config.sequence_len + 1),
                        device=rt.device)
    with torch.autocast(rt.device_type, dtype=torch.bfloat16, enabled=cuda):
        loss = model(idx[:, :-1], idx[:, 1:])
    loss.backward()
    grads = [p.grad.detach() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    ns_dtype = torch.bfloat16 if cuda else None
    alone, alone_sq = one_step(model, False, grads, ns_dtype)
    result = {"world_size": rt.world, "backend": dist.get_backend(), "paths": {}}
    paths = {"this torch": [f.__name__ for f in optim.collectives()]}
    older = ["reduce_scatter_tensor", "all_gather_into_tensor"]
    if paths["this torch"] != older and all(hasattr(dist, name) for name in older):
        paths["older names"] = older
    originals = {name: getattr(dist, name) for names in paths.values() for name in names}
    newer = {name: originals[name] for name in paths["this torch"] if "older names" in paths}
    for path, names in paths.items():
        calls = []
        for name in names:
            setattr(dist, name, recording(name, calls))
        # the older names alone, as an older torch has them
        hidden = newer if path == "older names" else {}
        for name in hidden:
            delattr(dist, name)
        try:
            sharded, sharded_sq = one_step(model, True, grads, ns_dtype)
        finally:
            for name, collective in originals.items():
                setattr(dist, name, collective)
        pairs = list(zip(sharded.parameters(), alone.parameters()))
        diff = max((a.double() - b.double()).abs().max().item() for a, b in pairs)
        # equal up to the rounding of each dtype (the ranks' shares are summed in another order)
        close = all(torch.allclose(a, b, **TOLERANCE[a.dtype]) for a, b in pairs)
        result["paths"][path] = {"max_abs_param_diff": diff, "close": close,
                                 "grad_sq_norm_rel_diff": abs(sharded_sq - alone_sq) / alone_sq,
                                 "collectives": len(calls),
                                 "dtypes": sorted({dtype for dtype, _ in calls}),
                                 "elements": sum(n for _, n in calls)}
    result["close"] = all(p["close"] for p in result["paths"].values())
    return result


def main():
    rt = runtime.setup(device)
    cuda = rt.device_type == "cuda"
    # a process group even for one process: the collectives run on it
    if not dist.is_initialized():
        init = dict(device_id=torch.device(rt.device)) if cuda else {}
        dist.init_process_group("nccl" if cuda else "gloo", rank=rt.rank,
                                world_size=rt.world, **init)
    result = check(rt)
    if rt.rank == 0:
        print("zero_check " + json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    if not result["close"]:
        raise SystemExit(1)


if __name__ == "__main__":
    with user_errors("scripts.zero_check"):
        configure(globals(), sys.argv[1:])
        if "RANK" not in os.environ:
            raise ValueError("scripts.zero_check runs under torchrun: torchrun "
                             "--nproc_per_node=1 -m scripts.zero_check")
        main()
