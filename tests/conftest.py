"""Shared fixtures: the embedded corpus, built once; train.py's data_dir; a tiny trained run; a local
HTTP server on 127.0.0.1 (never the internet) with Range support and scripted failures. And the run's
settings: one inductor cache for all its processes, new each run; one torch thread per pytest-xdist
worker; what torch.multiprocessing's forkserver imports before it forks the ranks of a test."""
import io
import multiprocessing
import os
import re
import runpy
import shutil
import signal
import sys
import tempfile
import threading
import time
import warnings
from contextlib import redirect_stderr, redirect_stdout
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from unittest.mock import patch

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the tutorial files, flt/, scripts/
from flt import corpus  # noqa: E402
from model import GPTConfig  # noqa: E402


def config_for_depth(depth, **overrides):
    """The paper's shape from one integer, written here independently of train.py: d = 64 * depth,
    n_head = ceil(d / 128), L = depth, n_kv_head = n_head; overrides replace or add GPTConfig fields."""
    d = 64 * depth
    n_head = -(-d // 128)
    return GPTConfig(**dict(n_layer=depth, n_embd=d, n_head=n_head, n_kv_head=n_head) | overrides)


def run_module(module, *argv):
    """`python -m <module> *argv` (a script of scripts/), run in this process by runpy: (exit
    status, stdout, stderr). Cheaper than a subprocess; the module may already be imported."""
    out, err = io.StringIO(), io.StringIO()
    with patch.object(sys, "argv", [module, *argv]), redirect_stdout(out), redirect_stderr(err), \
            warnings.catch_warnings():
        warnings.filterwarnings("ignore", f"'{module}' found in sys.modules")  # imported: fine
        try:
            runpy.run_module(module, run_name="__main__")
            status = 0
        except SystemExit as e:
            status = e.code
    return status, out.getvalue(), err.getvalue()


def pytest_configure(config):
    # Ctrl-C as a terminal gives it, also to a suite started in the background (`pytest &` in a script,
    # whose shell has it ignore SIGINT, and a run then rightly keeps ignoring it: flt/cluster.py): the
    # Ctrl-C tests need it, in this process and in the processes it starts
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    # The ranks of torch.multiprocessing's start_method="forkserver" (in test_optim, test_checkpoint, test_eval
    # and test_collectives) fork from one process that has imported their modules, not each a new interpreter;
    # and torch._dynamo, which a rank's first optimizer step would import (~2 s of CPU a rank)
    multiprocessing.set_forkserver_preload(["test_optim", "test_checkpoint", "test_eval", "test_collectives",
                                            "torch._dynamo"])
    # torch.compile's cache for this run's processes (xdist workers inherit the variable, and so do the
    # ranks they start), new each run: a compile test costs here what it costs a fresh CI machine.
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        config.inductor_cache = os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor")
    if os.environ.get("PYTEST_XDIST_WORKER"):  # `-n 2` on 2 cores: one thread each, or they fight for both
        import torch
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
        # and torch.compile compiles in this process: no pool of compile workers for each of them
        os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")


def pytest_unconfigure(config):
    if getattr(config, "inductor_cache", None):
        shutil.rmtree(config.inductor_cache, ignore_errors=True)
        del os.environ["TORCHINDUCTOR_CACHE_DIR"]


@pytest.fixture(scope="session")
def embedded(tmp_path_factory):
    """The embedded corpus's shard paths, validation last (a fixture named corpus would hide the module)."""
    return corpus.embedded_corpus(str(tmp_path_factory.mktemp("data")))


@pytest.fixture(scope="session")
def built_data(embedded):
    """A data_dir holding the embedded corpus and the tests' 512-token BPE, built once per worker."""
    import data
    data.get_tokenizer("bpe", os.path.dirname(embedded[0]), embedded[:-1], 512)
    return os.path.dirname(os.path.dirname(embedded[0]))


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory, built_data):
    """train.py's data_dir for a test module's runs: its own copy of built_data (a test may damage it),
    so a module's first run neither builds the corpus nor trains the tokenizer."""
    path = str(tmp_path_factory.mktemp("data"))
    shutil.copytree(built_data, path, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.lock"))
    return path


# train.py's tiny run: depth 1, sequence_len 32, K=3, the tests' 512-token BPE, 4 steps.
TINY_RUN = ["--device=cpu", "--depth=1", "--sequence_len=32", "--device_batch_size=4", "--total_batch_size=128",
            "--bpe_vocab_size=512", "--num_steps=4", "--eval_interval=4", "--eval_tokens=256",
            "--final_eval_tokens=256", "--sample_tokens=0"]


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory, built_data):
    """The run directory of TINY_RUN, trained once per worker for every test that reads a trained run
    (lm_eval_flt, the Hugging Face export). Read it, never change it: copy it first."""
    import forkserver
    tmp = tmp_path_factory.mktemp("tiny_run")
    shutil.copytree(built_data, tmp / "data", ignore=shutil.ignore_patterns("*.lock"))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = forkserver.run(["train.py", *TINY_RUN, f"--out_dir={tmp / 'run'}", f"--data_dir={tmp / 'data'}"], root,
                       dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=root))
    assert p.returncode == 0, p.stdout + p.stderr
    return str(tmp / "run")


class Handler(BaseHTTPRequestHandler):
    """Serves server.files with Range support; server.mode / drops / delay script failures."""

    def do_GET(self):
        srv = self.server
        with srv.lock:
            srv.requests.append((self.path, self.headers.get("Range")))
            drop = srv.drops > 0
            srv.drops -= drop
        body = srv.files.get(self.path)
        if srv.mode in (404, 500) or body is None:
            return self.send_error(404 if body is None else srv.mode)
        time.sleep(srv.delay)
        start = 0
        if self.headers.get("Range") and srv.mode != "ignore_range":
            start = int(re.fullmatch(r"bytes=(\d+)-", self.headers["Range"]).group(1))
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
        else:
            self.send_response(200)
        self.send_header("Content-Length", str(len(body) - start))  # the full size, even when dropping
        self.end_headers()
        # a drop sends half the bytes, then HTTP/1.0 closes the connection
        self.wfile.write(body[start:start + (len(body) - start) // 2] if drop else body[start:])

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def http_server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    srv.lock = threading.Lock()
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv
    srv.shutdown()


@pytest.fixture
def server(http_server, embedded):
    http_server.files = {f"/{os.path.basename(p)}": open(p, "rb").read() for p in embedded}
    http_server.mode, http_server.drops, http_server.delay, http_server.requests = "ok", 0, 0.0, []
    http_server.url = f"http://127.0.0.1:{http_server.server_address[1]}"
    return http_server
