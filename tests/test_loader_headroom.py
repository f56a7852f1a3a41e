"""The loader keeps up with what a GPU consumes: each rank's tokenizer threads, and how many row groups it
keeps tokenized ahead (loader_prefetch)."""
import os
import subprocess
import sys
import threading
import time

import pytest

import data
from flt import corpus

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("cpus, local_world_size, threads", [(2, 1, 2), (2, 2, 1), (2, 8, 1), (96, 8, 12),
                                                             (64, 1, 64), (13, 4, 3)])
def test_tokenizer_threads_share_the_cpus_among_the_ranks_of_a_node(cpus, local_world_size, threads):
    assert data.tokenizer_threads(cpus, local_world_size) == threads


THREADS = """
import os, data
texts = ["some words to split " * 50] * 400
before = len(os.listdir("/proc/self/task"))
data.Tokenizer(data.load_tokenizer(os.environ["TOK"]).tok).encode_batch(texts)
print(os.environ["RAYON_NUM_THREADS"], len(os.listdir("/proc/self/task")) - before)
"""


@pytest.mark.parametrize("local_world_size", [1, 2])
def test_the_tokenizers_pool_has_that_many_threads(tmp_path, embedded, local_world_size):
    """Importing data sets RAYON_NUM_THREADS before the pool starts: the threads it starts are counted."""
    tok = tmp_path / "tok.json"
    data.train_tokenizer(embedded[:1], 300, str(tok))
    env = {k: v for k, v in os.environ.items() if k != "RAYON_NUM_THREADS"}
    env.update(TOK=str(tok), LOCAL_WORLD_SIZE=str(local_world_size), PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-c", THREADS], env=env, capture_output=True, text=True, check=True)
    want = data.tokenizer_threads(data.CPUS, local_world_size)
    assert out.stdout.split() == [str(want), str(want)]


class Counting:
    """A tokenizer whose encode_batch counts its calls (one per row group) and blocks while `stall` is set."""

    def __init__(self, tok):
        self.tok, self.bos_id, self.calls = tok, tok.bos_id, 0
        self.stall = threading.Event()

    def encode_batch(self, texts):
        self.calls += 1
        while self.stall.is_set():
            time.sleep(0.001)
        return self.tok.encode_batch(texts)


def settled(tok, want, timeout=10.0):
    end = time.time() + timeout
    while tok.calls < want and time.time() < end:
        time.sleep(0.005)
    time.sleep(0.05)  # and no more than that
    return tok.calls


def consume(loader, n):
    """A thread that takes n batches from loader."""
    thread = threading.Thread(target=lambda: [next(loader) for _ in range(n)], daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("prefetch", [1, 2, 4])
def test_prefetch_buffers_that_many_row_groups_through_a_stalled_tokenizer(embedded, prefetch):
    tok = Counting(data.get_tokenizer("bpe", os.path.dirname(embedded[0]), embedded[:-1], 4096))
    loader = data.DataLoader(embedded[:1], tok, 1, 8, prefetch=prefetch)
    assert len(loader.groups) > prefetch + 1
    # the tokens of the row group in use and of the `prefetch` after it, counted independently
    buffered = sum(1 + len(ids) for g in range(1 + prefetch)
                   for ids in tok.tok.encode_batch(corpus.read_texts(embedded[0], g)))
    next(loader)  # a slow consumer: the row group in use is tokenized, then prefetch more, then no more
    assert settled(tok, 1 + prefetch) == 1 + prefetch
    tok.stall.set()  # a stalled tokenizer: the consumer reads every chunk the buffer holds whole (9 tokens each)
    consumer = consume(loader, buffered // 9 - 1)
    consumer.join(timeout=10)
    assert not consumer.is_alive() and loader.pos == prefetch
    assert tok.calls == 2 + prefetch  # entering row group 1 queued one more: the stalled thread holds it
    blocked = consume(loader, 1)  # the next chunk needs the row group the stalled thread has not tokenized
    blocked.join(timeout=0.3)
    assert blocked.is_alive()
    tok.stall.clear()
    blocked.join(timeout=10)
    assert not blocked.is_alive()


@pytest.mark.parametrize("prefetch", [1, 2])
def test_a_resumed_loader_queues_the_next_row_groups_as_a_running_one(embedded, prefetch):
    """Resuming (state=...) tokenizes the saved row group and queues the `prefetch` after it, as the loader
    that saved the state had them: the next row group is not tokenized on the training step's path."""
    tok = Counting(data.get_tokenizer("bpe", os.path.dirname(embedded[0]), embedded[:-1], 4096))
    running = data.DataLoader(embedded[:1], tok, 1, 8, prefetch=prefetch)
    next(running)
    resumed = data.DataLoader(embedded[:1], tok, 1, 8, prefetch=prefetch, state=running.state_dict())
    assert [pos for pos, _ in resumed.ahead] == [pos for pos, _ in running.ahead] == list(range(1, 1 + prefetch))
    assert next(resumed)[0].tolist() == next(running)[0].tolist()
