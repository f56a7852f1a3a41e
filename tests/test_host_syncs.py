"""The training loop reads the device once per optimizer step, so a GPU never idles waiting for the host:
counted as the difference between a short run of train.py and a longer one. (That the numbers it reads
and logs are the right ones: tests/test_recipe.py recomputes them from the saved parameters.)"""
import json
import textwrap

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from flt import diagnostics
from test_train import python
from model import GPT, GPTConfig
from optim import build_optimizers, reduce_gradients

TINY = ["--device=cpu", "--depth=1", "--sequence_len=32", "--device_batch_size=4", "--total_batch_size=128",
        "--bpe_vocab_size=512", "--eval_interval=100", "--eval_tokens=256", "--final_eval_tokens=256",
        "--sample_tokens=0", "--momentum_warmup_steps=5", "--save_interval=100", "--log_clipped_norms"]
# train.py runs in-process under diagnostics.count_host_reads; the counts are left beside the log.
RUNNER = textwrap.dedent("""
    import json, os, runpy, sys
    sys.argv[0] = "train.py"
    from flt import diagnostics
    with diagnostics.count_host_reads() as counts:
        g = runpy.run_path("train.py", run_name="__main__")
    with open(os.path.join(g["out_dir"], "host_reads.json"), "w") as f:
        json.dump(counts, f)
""")
def run(tmp_path, data_dir, steps):
    out = tmp_path / f"run{steps}"
    script = tmp_path / "runner.py"
    script.write_text(RUNNER)
    p = python(str(script), *TINY, f"--num_steps={steps}", f"--out_dir={out}", f"--data_dir={data_dir}")
    assert p.returncode == 0, p.stderr
    with open(out / "log.jsonl") as f:
        records = {r["step"]: r for r in map(json.loads, f) if "loss" in r}
    with open(out / "host_reads.json") as f:
        return records, json.load(f)


def test_one_host_read_per_optimizer_step(tmp_path, data_dir):
    short, short_reads = run(tmp_path, data_dir, 4)
    long, long_reads = run(tmp_path, data_dir, 6)
    per_step = {k: (long_reads.get(k, 0) - short_reads.get(k, 0)) / 2 for k in long_reads.keys() | short_reads}
    assert {k: n for k, n in per_step.items() if n} == {"tolist": 1}, (short_reads, long_reads)
    assert sorted(long) == list(range(6)) and all("grad_attn_mid_clipped" in r for r in long.values())


def test_reduce_gradients_sums_the_callers_numbers_in_its_one_all_reduce():
    """8 ranks simulated with a fake process group (no communication: each 'rank' sees its own values)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(sequence_len=8, vocab_size=32, n_layer=2, n_head=1, n_kv_head=1, n_embd=16, loops=2))
    model.init_weights()
    idx = torch.randint(0, 32, (2, 8))
    model(idx, idx).backward()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    calls = []
    all_reduce = dist.all_reduce
    try:
        dist.all_reduce = lambda tensor, *a, **k: calls.append(tensor.numel()) or all_reduce(tensor, *a, **k)
        optimizers = build_optimizers(model, distributed=True)
        with diagnostics.count_host_reads() as reads:
            norms, summed = reduce_gradients(optimizers, {"loss": torch.tensor(2.5), "flag": torch.tensor(1.0)})
    finally:
        dist.all_reduce = all_reduce
        dist.destroy_process_group()
    params = list(model.parameters())
    assert calls == [len(params) + 2] and sum(reads.values()) == 0
    assert norms.keys() == set(params) and summed.keys() == {"loss", "flag"}
    assert all(n.dim() == 0 for n in norms.values()) and summed["loss"].item() == 2.5


def test_bench_counts_one_host_sync_and_the_collectives_of_a_step():
    """scripts/bench.py --mode=syncs at a tiny shape, 8 simulated ranks. Depth 1: 6 matrices of 3 shapes (3
    Muon blocks of up to 8) and 2 AdamW parameters: 5 reduce-scatters, 5 all-gathers and 1 all-reduce."""
    p = python("-m", "scripts.bench", "--mode=syncs", "--depth=1", "--vocab_size=512", "--sequence_len=16",
               "--batch_size=1", timeout=120)
    assert p.returncode == 0, p.stderr
    assert "one optimizer step: 1 host syncs {'tolist': 1}" in p.stdout and p.stdout.rstrip().endswith(
        " 11 collectives"), p.stdout
