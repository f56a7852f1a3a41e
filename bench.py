"""
Side-by-side speed checks of model.py (issue 2), each ratio measured in one run:
    python bench.py                  # CPU fp32, depth 4, T=256, B=8
    python bench.py --device=cuda    # the same on a GPU (bf16 autocast)
Timings alternate between the two sides of each ratio and keep the median of several
repeats, so machine noise hits both sides alike.
"""
import statistics
import sys
import time

import torch

from configurator import configure
from model import GPT, config_for_depth

device = "cpu"
depth = 4
sequence_len = 256
batch_size = 8
loops = 3
repeats = 5
gen_tokens = 256
configure(globals(), sys.argv[1:])
cuda = device.startswith("cuda")
autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda)


def make(variant="FLT", seq=sequence_len):
    torch.manual_seed(0)
    model = GPT(config_for_depth(depth, sequence_len=seq, vocab_size=8192, variant=variant, loops=loops))
    model.init_weights()
    return model.to(device)


def timed(fn):
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def ratio(name, fn_a, fn_b, bound):
    """Median time of fn_a / fn_b, alternating the two; fn_a/fn_b each run once to warm up."""
    fn_a(), fn_b()
    ta, tb = [], []
    for _ in range(repeats):
        ta.append(timed(fn_a))
        tb.append(timed(fn_b))
    a, b = statistics.median(ta), statistics.median(tb)
    print(f"{name:<52} {a * 1e3:9.1f} ms / {b * 1e3:9.1f} ms = {a / b:5.2f}   (target {bound})")
    return a / b


def train_step(model, idx, K):
    def step():
        with autocast:
            loss = model(idx, idx, loops=K)
        loss.backward()
        model.zero_grad(set_to_none=True)
    return step


idx = torch.randint(0, 8192, (batch_size, sequence_len), device=device)
flt, lt = make("FLT"), make("LT")
print(f"device {device}, depth {depth}, T={sequence_len}, B={batch_size}, median of {repeats}")
ratio(f"fwd+bwd FLT / LT, loops {loops}", train_step(flt, idx, loops), train_step(lt, idx, loops), "0.95-1.05")
ratio("fwd+bwd loops 6 / loops 3 (FLT)", train_step(flt, idx, 6), train_step(flt, idx, 3), "<= 2.1")

budgets = [1, 3, 6, 9, 12]


@torch.no_grad()
def one_pass():
    with autocast:
        [flt.head(h) for h in flt.loop_states(idx, max(budgets))]


@torch.no_grad()
def separate():
    with autocast:
        [flt(idx, loops=K) for K in budgets]


ratio(f"all loops {budgets}: one pass / separate passes", one_pass, separate, "<= 0.45")

gen = make("FLT", seq=2 * gen_tokens).eval()
prompt = torch.randint(0, 8192, (1, 16), device=device)


def cached():
    with autocast:
        for _ in gen.generate(prompt, gen_tokens, temperature=0, loops=loops):
            pass


@torch.no_grad()
def recompute():
    seq = prompt
    with autocast:
        for _ in range(gen_tokens):
            seq = torch.cat([seq, gen(seq, loops=loops)[:, -1:].argmax(-1)], dim=1)


r = ratio(f"generate {gen_tokens} tokens, loops {loops}: cached / recompute", cached, recompute, "<= 0.2")
print(f"cached generation is {1 / r:.1f}x faster than recomputing the full forward per token")
