"""Runs a script (train.py, eval.py, a runner) in a fresh process forked from one that has already
imported torch and the project's modules, instead of starting a new interpreter: the same process
boundary as `python script.py` (its own pid, exit code, stdout/stderr, signals, atexit and interpreter
shutdown), without paying the ~3 s of imports per run. One server per test process (pytest-xdist
worker), started on first use."""
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
import json, os, runpy, sys
sys.path[0] = os.environ.pop("FORKSERVER_ROOT")  # the project's modules, as PYTHONPATH=ROOT gives them
import torch, torch.distributed
import configurator, data, eval, model, optim  # noqa: F401
from flt import checkpoint, cluster, corpus, diagnostics, planning, runtime, tracking  # noqa: F401
reply = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # the server itself never prints to the reply channel
for line in sys.stdin:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:  # the child: from here on, `python script args...` in cwd with env
        fds = [os.open(os.devnull, os.O_RDONLY), os.open(req["stdout"], os.O_WRONLY), os.open(req["stderr"], os.O_WRONLY)]
        for std, fd in enumerate(fds):
            os.dup2(fd, std)
            os.close(fd)
        reply.close()
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        # an exception or SystemExit ends the child as it would end `python script` or `python -m module`
        if req["argv"][0] == "-m":
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

_server, _outputs, _runs = None, tempfile.mkdtemp(prefix="forkserver"), [0]
atexit.register(shutil.rmtree, _outputs, True)


def _start():
    global _server, _pending
    if _server is None or _server.poll() is not None:
        env = dict(os.environ, OMP_NUM_THREADS="1", FORKSERVER_ROOT=ROOT)
        _server, _pending = subprocess.Popen([sys.executable, "-c", SERVER], cwd=ROOT, env=env, stdin=subprocess.PIPE,
                                             stdout=subprocess.PIPE, bufsize=0), b""
        atexit.register(_server.kill)
    return _server


def _reply(server, timeout):
    """The server's next JSON line, or None if none came within timeout seconds."""
    global _pending
    end = time.monotonic() + timeout
    while b"\n" not in _pending:
        if not select.select([server.stdout], [], [], max(0.0, end - time.monotonic()))[0]:
            return None
        chunk = os.read(server.stdout.fileno(), 65536)
        if not chunk:
            raise RuntimeError("the fork server died")
        _pending += chunk
    line, _pending = _pending.split(b"\n", 1)
    return json.loads(line)


def run(argv, cwd, env, timeout=300):
    """subprocess.run([sys.executable, *argv], cwd=cwd, env=env, capture_output=True, text=True,
    timeout=timeout), forked from the server; env must hold OMP_NUM_THREADS=1 (the server's, set
    before torch was imported). stdout and stderr pass through files."""
    assert env.get("OMP_NUM_THREADS") == "1", "the server's torch has one thread"
    _runs[0] += 1
    out, err = (os.path.join(_outputs, f"{_runs[0]}.{name}") for name in ("stdout", "stderr"))
    for path in (out, err):
        open(path, "w").close()
    server = _start()
    server.stdin.write(json.dumps({"argv": [str(a) for a in argv], "cwd": str(cwd), "env": env,
                                   "stdout": out, "stderr": err}).encode() + b"\n")
    pid = _reply(server, 300)["pid"]  # the first run waits for the server's imports
    done = _reply(server, timeout)
    if done is None:
        os.kill(pid, signal.SIGKILL)
        _reply(server, 60)
        raise subprocess.TimeoutExpired(argv, timeout)
    with open(out) as f, open(err) as g:
        result = subprocess.CompletedProcess(argv, done["code"], f.read(), g.read())
    os.remove(out), os.remove(err)
    return result
