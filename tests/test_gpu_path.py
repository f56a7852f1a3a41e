"""What would only break on a GPU, checked on CPU: norm's numerics in bf16, compiled training that
stays compiled while train.py evaluates, the torch version (the eval bundle on several nodes:
tests/test_cluster.py)."""
import os
import re
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.backends.registry import lookup_backend

from flt import runtime
from model import norm
from test_eval import make_bundle
from test_model import make_model, random_tokens
from test_train import runner, train


# ----------------------------------------------------------------------------- norm in bf16

def fp32_rms_norm(x):
    """RMSNorm written out as F.rms_norm computes it: in fp32, with fp32's eps, rounded to x's dtype."""
    y = x.float()
    return (y * torch.rsqrt(y.square().mean(-1, keepdim=True) + torch.finfo(torch.float32).eps)).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [1.0, 3e-4])  # 3e-4: the mean square (1e-7) is the size of the eps
def test_norm_is_the_authors_rms_norm(dtype, scale):
    g = torch.Generator().manual_seed(0)
    for shape in [(4, 16, 64), (2, 16, 4, 32)]:  # the stream (B, T, d) and QK-norm's heads (B, T, H, D)
        x = (torch.randn(shape, generator=g) * scale).to(dtype)
        out = norm(x)
        assert out.dtype == dtype
        torch.testing.assert_close(out, F.rms_norm(x, (x.size(-1),)), atol=0, rtol=0)
        torch.testing.assert_close(out, fp32_rms_norm(x), atol=0, rtol=0)


def test_norm_of_a_bf16_embedding_is_not_shrunk_by_bf16_eps():
    # x0 = norm(e) with e ~ N(0, 1) in bf16: adding bf16's eps (0.0078) would scale it by 0.996
    e = torch.randn(64, 768, generator=torch.Generator().manual_seed(0)).bfloat16()
    rms = norm(e).float().square().mean(-1).sqrt()
    torch.testing.assert_close(rms, torch.ones(64), atol=2e-3, rtol=0)  # bf16 rounding only
    with torch.autocast("cpu", dtype=torch.bfloat16):  # CPU autocast keeps it bf16 (CUDA's: fp32)
        assert norm(e).dtype == torch.bfloat16


# ----------------------------------------------------------------------------- compiled training stays compiled

class Counting:
    """A torch.compile backend (dynamo, then `backend`'s compiler) that counts the runs of the graphs it
    compiled: `graphs` built, `runs` of them. A call that fell back to eager runs none."""

    def __init__(self, backend):
        self.backend, self.graphs, self.runs = lookup_backend(backend), 0, 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        compiled = self.backend(gm, example_inputs)

        def run(*args):
            self.runs += 1
            return compiled(*args)
        return run


# train.py compiled through Counting("aot_eager") (dynamo's guards and caches are inductor's; only the code
# generation is skipped), failing at dynamo's recompile limit instead of running on eagerly. After every
# training forward (train mode, autograd on) it appends "K L runs" to $COUNTS: its loop count, the layers, and
# the compiled graphs it ran (the blocks and the loss are the only compiled regions).
COUNTING = textwrap.dedent("""
    import os, sys, torch
    sys.path.insert(0, "tests")
    from test_gpu_path import Counting
    from model import GPT
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    counting, compile_regions, forward = Counting("aot_eager"), GPT.compile_regions, GPT.forward
    def counted_forward(self, *args, loops=None, **kwargs):
        before = counting.runs
        out = forward(self, *args, loops=loops, **kwargs)
        if self.training and torch.is_grad_enabled():
            with open(os.environ["COUNTS"], "a") as f:
                f.write(f"{self.loop_count(loops)} {self.config.n_layer} {counting.runs - before}\\n")
        return out
    GPT.compile_regions = lambda self, **kwargs: compile_regions(self, **kwargs | {"backend": counting})
    GPT.forward = counted_forward
""")


def test_compiled_training_stays_compiled_with_core_windows_and_truncated_backprop(tmp_path, data_dir, monkeypatch):
    # Validation and CORE (prompts of many lengths) between the steps; a sliding window and bptt_loops with
    # K sampled in 1..4 need 10 graphs of the blocks, more than dynamo's default limit of 8.
    counts = tmp_path / "counts"
    monkeypatch.setenv("COUNTS", str(counts))
    bundle = make_bundle(tmp_path / "bundle")
    train(tmp_path / "run", data_dir, "--compile=on", "--core_interval=2", f"--bundle_dir={bundle}",
          "--core_max_per_task=4", "--eval_interval=2", "--depth=2", "--window_pattern=SL", "--bptt_loops=2",
          "--loops_sampler=uniform", "--loops_min=1", "--loops_max=4", "--seed=3", "--num_steps=4",
          "--sample_tokens=0", script=runner(tmp_path, COUNTING))
    runs = [tuple(map(int, line.split())) for line in counts.read_text().splitlines()]
    assert len(runs) == 4 and {1, 4} <= {K for K, _, _ in runs}, runs  # one forward a step (TINY's batch)
    assert all(n == K * layers + 1 for K, layers, n in runs), runs  # every block call compiled, and the loss


@pytest.mark.parametrize("variant, attention, bptt_loops, checkpoint_loops", [
    ("FLT", "window", 2, False), ("FLT_res", "window", 1, True), ("LT_ai", "window", 2, True),
    ("LT", "window", 1, False), ("LT_i", "gqa", 2, False), ("FLT", "mla", None, True)])
def test_every_training_block_call_runs_compiled_with_eager_evaluation_between(variant, attention, bptt_loops,
                                                                              checkpoint_loops):
    # compile_regions' recompile limit holds every graph training needs, for every K; evaluation of
    # other shapes and grad modes, run eagerly as train.py runs it, builds none and runs none.
    torch._dynamo.reset()
    counting = Counting("eager")
    model = make_model(variant, attention, checkpoint_loops=checkpoint_loops).train()
    idx, L = random_tokens(2, 16), model.config.n_layer
    limit = torch._dynamo.config.recompile_limit  # restored on exit, as every setting patch() names
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True, recompile_limit=limit):
        model.compile_regions(backend=counting, dynamic=False)
        for K in (1, 4, 2, 5, 3):
            before = counting.runs
            loss = model(idx, idx, loops=K, bptt_loops=bptt_loops)
            assert counting.runs - before == K * L + 1  # every block call and the loss
            before = counting.runs
            loss.backward()  # checkpoint_loops recomputes the loops that have a graph, compiled too
            assert counting.runs - before == (min(K, bptt_loops or K) * L if checkpoint_loops else 0)
            graphs, runs = counting.graphs, counting.runs
            with torch.compiler.set_stance("force_eager"), torch.no_grad():
                for T in (3, 7, 16, 29):  # CORE's prompts, validation's batches
                    model.eval()(random_tokens(1, T), loops=K)
                    model.train()
            assert (counting.graphs, counting.runs) == (graphs, runs)
    torch._dynamo.reset()


# ----------------------------------------------------------------------------- the torch version

@pytest.mark.parametrize("missing", [name for pair in runtime.COLLECTIVES for name in pair])
def test_a_torch_with_either_pair_of_collectives_sets_up_under_torchrun(missing, monkeypatch):
    # torch 2.13's names or the older ones (a cluster image's torch): either pair serves optim.py
    monkeypatch.delattr(torch.distributed, missing)
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "2")):
        monkeypatch.setenv(key, value)
    assert runtime.setup("cpu").world == 2


def test_a_torch_without_the_collectives_stops_at_setup_under_torchrun(monkeypatch):
    # one name gone from each pair: neither serves
    for pair in runtime.COLLECTIVES:
        monkeypatch.delattr(torch.distributed, pair[0])
    # one process calls no collective: an older torch (a GPU node's own build) runs it
    assert runtime.setup("cpu").world == 1
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "2")):
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match=r"has neither torch\.distributed\.reduce_scatter_single and "
                                         r"\.all_gather_single or torch\.distributed\.reduce_scatter_tensor "
                                         r"and \.all_gather_into_tensor, which optim\.py calls: install "
                                         r"torch>=2\.6 \(requirements\.txt pins torch==2\.13\.0"):
        runtime.setup("cpu")


@pytest.mark.parametrize("name", runtime.NEEDED)
def test_a_torch_older_than_2_6_stops_at_setup_even_in_one_process(name, monkeypatch):
    # evaluation (during training too) calls set_stance, the static decode get_autocast_dtype
    owner, attribute = name.rsplit(".", 1)
    monkeypatch.delattr(torch.compiler if owner == "torch.compiler" else torch, attribute)
    with pytest.raises(ValueError, match=rf"has no {re.escape(name)}, which this code calls: install torch>=2\.6"):
        runtime.setup("cpu")


def test_train_py_with_an_old_torch_stops_before_any_download(tmp_path):
    # rank 0 of two, as torchrun starts it: the check comes before any process group
    patch = ("import os, torch.distributed as dist; del dist.reduce_scatter_single; "
             "del dist.reduce_scatter_tensor; os.environ.update(RANK='0', LOCAL_RANK='0', WORLD_SIZE='2')")
    p = train(tmp_path / "run", tmp_path / "data", script=runner(tmp_path, patch), check=False)
    assert p.returncode == 1 and "install torch>=2.6" in p.stderr.splitlines()[-1], p.stderr[-1500:]
    assert sorted(os.listdir(tmp_path)) == ["runner.py"]  # no data, no run directory
