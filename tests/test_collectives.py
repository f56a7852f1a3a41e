"""optim.py's collectives on the torch at hand (optim.py: collectives): torch 2.13's
reduce_scatter_single / all_gather_single, or, on an older torch (a cluster image's), the same
operations as reduce_scatter_tensor / all_gather_into_tensor. Both pairs run here on gloo, 2 ranks,
and must give the same updates; and optimizers built distributed on a process group of one (what
scripts/zero_check.py runs on one GPU with NCCL) must give the single process's step."""
import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import optim
from conftest import config_for_depth
from model import GPT

PAIRS = {"2.13": ("reduce_scatter_single", "all_gather_single"),
         "older": ("reduce_scatter_tensor", "all_gather_into_tensor")}


def tiny_model():
    torch.manual_seed(0)
    model = GPT(config_for_depth(1, vocab_size=64, sequence_len=16, loops=2))
    model.init_weights()
    return model


def steps(model, distributed, seed, n=2):
    """The parameters after n optimizer steps, each on this rank's own gradients (seeded)."""
    model = copy.deepcopy(model)
    optimizers = optim.build_optimizers(model, distributed=distributed)
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        idx = torch.randint(0, 64, (2, 17), generator=g)
        model(idx[:, :-1], idx[:, 1:]).backward()
        optim.reduce_gradients(optimizers)
        for opt in optimizers:
            opt.step(grad_scale=0.5)
        model.zero_grad(set_to_none=True)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _worker(rank, world_size, init, out):
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world_size)
    model = tiny_model()
    result = {"2.13": steps(model, True, seed=rank)}
    # an older torch: no 2.13 names
    for name in PAIRS["2.13"]:
        delattr(dist, name)
    result["older"] = steps(model, True, seed=rank)
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def test_older_collectives_give_the_same_updates_on_two_ranks(tmp_path):
    # the ranks fork from one process that has imported this module (conftest.py: the forkserver's preload)
    mp.start_processes(_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, start_method="forkserver")
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    for result in results:
        assert result["2.13"].keys() == result["older"].keys()
        for name, p in result["2.13"].items():
            assert torch.equal(p, result["older"][name]), name
    # every rank ends with the same parameters, and they moved
    for name, p in results[0]["2.13"].items():
        assert torch.equal(p, results[1]["2.13"][name]), name
    moved = [n for n, p in tiny_model().named_parameters() if not torch.equal(p, results[0]["2.13"][n])]
    assert len(moved) == len(results[0]["2.13"])


def test_the_chosen_pair_is_2_13s_and_an_older_torch_gets_the_older(monkeypatch):
    assert optim.collectives() == (dist.reduce_scatter_single, dist.all_gather_single)
    monkeypatch.delattr(dist, "all_gather_single")
    assert optim.collectives() == (dist.reduce_scatter_tensor, dist.all_gather_into_tensor)


@pytest.fixture
def group_of_one(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("pair", PAIRS)
def test_distributed_on_a_group_of_one_runs_the_collectives_and_equals_one_process(
        group_of_one, pair, monkeypatch):
    calls = []

    def recorded(name):
        collective = getattr(dist, name)

        def call(output, input, *args, **kwargs):
            calls.append((name, input.dtype, input.numel()))
            return collective(output, input, *args, **kwargs)
        return call
    for name in PAIRS[pair]:
        monkeypatch.setattr(dist, name, recorded(name))
    if pair == "older":
        for name in PAIRS["2.13"]:
            monkeypatch.delattr(dist, name)
    model = tiny_model()
    alone = steps(model, False, seed=0)
    assert calls == []
    sharded = steps(model, True, seed=0)
    for name, p in alone.items():
        assert torch.equal(sharded[name], p), name
    # per step: a reduce-scatter and an all-gather of every AdamW parameter and Muon block
    n_params = len(alone)
    assert len(calls) == 2 * 2 * n_params
    assert {name for name, _, _ in calls} == set(PAIRS[pair])
