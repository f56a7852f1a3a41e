"""Runs a script (train.py, eval.py, a runner) in a fresh process forked from one that has already
imported torch and the project's modules, instead of starting a new interpreter: the same process
boundary as `python script.py` (its own pid, exit code, stdout/stderr, signals, atexit and interpreter
shutdown), without paying the ~3 s of imports per run. One server per test process (pytest-xdist
worker), started on first use, and one more for each script that runs while the others run theirs."""
import atexit
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The server: import what train.py and eval.py import (never running a torch op, so no thread pool
# exists to be broken by fork), then for each request fork a child that becomes the script.
SERVER = r"""
import gc, json, os, runpy, sys, warnings
sys.path[0] = os.environ.pop("FORKSERVER_ROOT")  # the project's modules, as PYTHONPATH=ROOT gives them
import torch, torch.distributed
import configurator, data, eval, model, optim  # noqa: F401
from flt import checkpoint, cluster, corpus, diagnostics, planning, runtime, tracking  # noqa: F401
import torch._dynamo  # noqa: F401 (what a model on the meta device, --dry_run's, and torch.compile import first)
# What the children inherit is never collected: the garbage collector of a child (at exit, and in its
# runs) would otherwise walk, and so copy page by page, the whole heap of torch (~0.7 s a run).
gc.freeze()
reply = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # the server itself never prints to the reply channel
for line in sys.stdin:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:  # the child: from here on, `python script args...` in cwd with env
        out = os.open(req["stdout"], os.O_WRONLY)
        # stderr into stdout (subprocess.STDOUT): one file, written through one offset
        err = os.dup(out) if req["stderr"] == req["stdout"] else os.open(req["stderr"], os.O_WRONLY)
        for std, fd in enumerate([os.open(os.devnull, os.O_RDONLY), out, err]):
            os.dup2(fd, std)
            os.close(fd)
        reply.close()
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        # an exception or SystemExit ends the child as it would end `python script` or `python -m module`
        if req["argv"][0] == "-m":
            # a module the server imported (flt.corpus) runs again as __main__, as `python -m` runs it;
            # runpy's warning that it was imported before is about the server, not the program
            warnings.filterwarnings("ignore", f"'{req['argv'][1]}' found in sys.modules", RuntimeWarning)
            sys.argv, sys.path[0:1] = [""] + req["argv"][2:], [os.getcwd(), sys.path[0]]
            runpy.run_module(req["argv"][1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = req["argv"]
            sys.path[0:1] = [os.path.dirname(os.path.abspath(sys.argv[0])), sys.path[0]]
            runpy.run_path(sys.argv[0], run_name="__main__")
        sys.exit(0)
    reply.write(json.dumps({"pid": pid}) + "\n")
    reply.write(json.dumps({"code": os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])}) + "\n")
"""

_idle, _outputs, _runs = [], tempfile.mkdtemp(prefix="forkserver"), [0]  # _idle: servers running nothing
atexit.register(shutil.rmtree, _outputs, True)


def _server():
    """An idle server, or a new one when each is running a script (runs at once: two torchrun nodes)."""
    while _idle:
        server = _idle.pop()
        if server.poll() is None:
            return server
    env = dict(os.environ, OMP_NUM_THREADS="1", FORKSERVER_ROOT=ROOT)
    server = subprocess.Popen([sys.executable, "-c", SERVER], cwd=ROOT, env=env, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, bufsize=0)
    server.pending = b""  # what it replied past the last whole line
    atexit.register(server.kill)
    return server


def _reply(server, timeout):
    """The server's next JSON line, or None if none came within timeout seconds."""
    end = time.monotonic() + timeout
    while b"\n" not in server.pending:
        if not select.select([server.stdout], [], [], max(0.0, end - time.monotonic()))[0]:
            return None
        chunk = os.read(server.stdout.fileno(), 65536)
        if not chunk:
            raise RuntimeError("the fork server died")
        server.pending += chunk
    line, server.pending = server.pending.split(b"\n", 1)
    return json.loads(line)


class Started:
    """A script forked by start(), running: its pid; wait() ends it as subprocess.Popen.communicate."""

    def __init__(self, argv, server, pid, out, err):
        self.argv, self.server, self.pid, self.out, self.err = argv, server, pid, out, err
        self.done = None  # the server's reply once the script has exited

    def poll(self):
        """subprocess.Popen.poll: the exit status if the script has exited, else None."""
        self.done = self.done or _reply(self.server, 0)
        return self.done and self.done["code"]

    def wait(self, timeout=300):
        """subprocess.CompletedProcess once the script has exited (stdout and stderr as text); past
        timeout seconds it is killed and subprocess.TimeoutExpired raised."""
        done = self.done or _reply(self.server, timeout)
        if done is None:
            os.kill(self.pid, signal.SIGKILL)
            _reply(self.server, 60)
        _idle.append(self.server)
        if done is None:
            raise subprocess.TimeoutExpired(self.argv, timeout)
        with open(self.out) as f, open(self.err) as g:
            stderr = None if self.err == self.out else g.read()
            result = subprocess.CompletedProcess(self.argv, done["code"], f.read(), stderr)
        for path in {self.out, self.err}:
            os.remove(path)
        return result


def start(argv, cwd, env, stderr_to_stdout=False):
    """subprocess.Popen([sys.executable, *argv], cwd=cwd, env=env, stdout=PIPE, stderr=PIPE, text=True),
    forked from a server; env must hold OMP_NUM_THREADS=1 (the server's, set before torch was
    imported). stdout and stderr pass through files; stderr_to_stdout: stderr is written into
    stdout (subprocess's stderr=STDOUT), and the result's stderr is None."""
    assert env.get("OMP_NUM_THREADS") == "1", "the server's torch has one thread"
    _runs[0] += 1
    out, err = (os.path.join(_outputs, f"{_runs[0]}.{name}") for name in ("stdout", "stderr"))
    err = out if stderr_to_stdout else err
    for path in (out, err):
        open(path, "w").close()
    server = _server()
    server.stdin.write(json.dumps({"argv": [str(a) for a in argv], "cwd": str(cwd), "env": env,
                                   "stdout": out, "stderr": err}).encode() + b"\n")
    pid = _reply(server, 300)["pid"]  # a new server's first run waits for its imports
    return Started(argv, server, pid, out, err)


def run(argv, cwd, env, timeout=300, stderr_to_stdout=False):
    """subprocess.run([sys.executable, *argv], cwd=cwd, env=env, capture_output=True, text=True,
    timeout=timeout), forked from a server: start(...).wait(timeout)."""
    return start(argv, cwd, env, stderr_to_stdout).wait(timeout)
