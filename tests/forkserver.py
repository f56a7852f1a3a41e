"""Runs a script (train.py, eval.py, a runner) in a fresh process forked from one that has already
imported torch and the project's modules, instead of starting a new interpreter: the same process
boundary as `python script.py` (its own pid, exit code, stdout/stderr, signals, and Python's exit:
threads joined, atexit's functions, the streams flushed), without paying the ~3 s of imports per run,
nor, at exit, the ~0.65 s of freeing the imported modules object by object (exit_fast). One server
per test process (pytest-xdist worker), started on first use, and one more for each script that runs
while the others run theirs.

torchrun's ranks too (start(..., fork_ranks=True)): the agent, itself forked, asks a rank server for
each rank (`python -u script args...`, as torchrun starts it: in a session of its own, with the
agent's stdin, stdout and stderr), and polls, waits for and signals it as the process torchrun
started; without it, each rank is a new interpreter (~6 s of CPU: torch, and torch._dynamo, which
the first optimizer step imports)."""
import atexit
import functools
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Both servers first import what train.py and eval.py import (never running a torch op, so no thread
# pool exists to be broken by fork); a child of either becomes the program with become(request).
PRELOAD = r"""
import atexit, gc, io, json, os, runpy, select, socket, sys, threading, warnings
ROOT = sys.path[0] = os.environ.pop("FORKSERVER_ROOT")  # the project's modules, as PYTHONPATH=ROOT gives them
import torch, torch.distributed
import configurator, data, eval, model, optim  # noqa: F401
from flt import checkpoint, cluster, corpus, diagnostics, planning, runtime, tracking  # noqa: F401
import torch._dynamo  # noqa: F401 (what a model on the meta device, --dry_run's, and torch.compile import first)
# What the children inherit is never collected: the garbage collector of a child (at exit, and in its
# runs) would otherwise walk, and so copy page by page, the whole heap of torch (~0.7 s a run).
gc.freeze()


def become(req):
    # from here on, `python argv...` in cwd with env; an exception or SystemExit ends the child as it
    # would end `python script` or `python -m module`
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    if req.get("fork_ranks"):  # torchrun's agent: its ranks forked by the rank server too (fork_ranks below)
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        __import__("forkserver").fork_ranks()
        del sys.path[0]
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


def exit_fast(code):
    # Python's own exit, in its order (threads joined, atexit's functions run, the standard streams
    # flushed), less the teardown of the modules the server imported: freeing torch's heap object by
    # object would copy every page of it from the server (~0.65 s a run)
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def run(req):
    # become(req), ended as `python script` ends: an exit status as such, an exception that ends the
    # script through sys.excepthook and with status 1; each then by exit_fast. A Ctrl-C that ends it (the
    # process then kills itself with SIGINT) and a SystemExit with a message take Python's own way out.
    try:
        become(req)
    except SystemExit as e:
        if e.code is not None and type(e.code) is not int:
            raise
        exit_fast(e.code or 0)
    except KeyboardInterrupt:
        raise
    except BaseException:
        sys.excepthook(*sys.exc_info())
        exit_fast(1)
"""

# The server: for each request on stdin, fork a child that becomes the script, and reply on stdout
# with its pid, then its exit status.
SERVER = PRELOAD + r"""
reply = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # the server itself never prints to the reply channel
for line in sys.stdin:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
        out = os.open(req["stdout"], os.O_WRONLY)
        # stderr into stdout (subprocess.STDOUT): one file, written through one offset
        err = os.dup(out) if req["stderr"] == req["stdout"] else os.open(req["stderr"], os.O_WRONLY)
        for std, fd in enumerate([os.open(os.devnull, os.O_RDONLY), out, err]):
            os.dup2(fd, std)
            os.close(fd)
        reply.close()
        run(req)
    reply.write(json.dumps({"pid": pid}) + "\n")
    reply.write(json.dumps({"code": os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])}) + "\n")
"""

# The rank server: any number of ranks at once, each asked for on a connection of its own to a Unix
# socket (a request and the three standard file descriptors it is to have), answered with its pid,
# then its exit status. As subprocess.Popen's child, a rank that has exited stays a zombie (its pid
# and process group still there to be signalled) until the agent has read its status and hung up.
RANKS = PRELOAD + r"""
listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
listener.bind(os.environ.pop("FORKSERVER_SOCKET"))
listener.listen(64)
print("ready", flush=True)
os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
running, told, gone = {}, set(), set()  # running: {connection: pid}; told: exit status sent; gone: to reap
while True:
    for connection in select.select([listener, *running], [], [], 0.05)[0]:
        if connection is not listener:  # the agent hung up: reaped as soon as it has exited
            gone.add(running.pop(connection))
            connection.close()
            continue
        connection = listener.accept()[0]
        message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 3)
        req = json.loads(message)
        pid = os.fork()
        if pid == 0:
            for other in [listener, connection, *running]:
                other.close()
            os.setsid()  # torchrun's start_new_session: the agent signals the rank's process group
            for std, fd in enumerate(fds):
                os.dup2(fd, std)
                os.close(fd)
            # python -u: stdout and stderr unbuffered
            out, err = (open(fd, "wb", 0, closefd=False) for fd in (1, 2))
            sys.stdout = sys.__stdout__ = io.TextIOWrapper(out, write_through=True)
            sys.stderr = sys.__stderr__ = io.TextIOWrapper(err, write_through=True, errors="backslashreplace")
            run(req)
        for fd in fds:
            os.close(fd)
        connection.send(json.dumps({"pid": pid}).encode())
        running[connection] = pid
    for connection, pid in running.items():
        exited = None if pid in told else os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        if exited:  # its status, as subprocess gives it: the exit code, or minus the signal that ended it
            code = exited.si_status if exited.si_code == os.CLD_EXITED else -exited.si_status
            connection.send(json.dumps({"code": code}).encode())
            told.add(pid)
    for pid in list(gone):
        if os.waitpid(pid, os.WNOHANG)[0]:
            gone.discard(pid)
            told.discard(pid)
"""

_idle, _runs, _ranks = [], [0], []  # _idle: servers running nothing; _ranks: the rank server, once started


@functools.cache
def _outputs():
    """The folder of the runs' stdout and stderr and of the rank server's socket, made on first use
    (not by torchrun's agent, which imports this module for fork_ranks only)."""
    folder = tempfile.mkdtemp(prefix="forkserver")
    atexit.register(shutil.rmtree, folder, True)
    return folder


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


def _rank_server():
    """The socket of this process's rank server, started on first use."""
    if _ranks and _ranks[0].poll() is None:
        return _ranks[0].socket
    path = os.path.join(_outputs(), f"ranks{len(_ranks)}.sock")
    env = dict(os.environ, OMP_NUM_THREADS="1", FORKSERVER_ROOT=ROOT, FORKSERVER_SOCKET=path)
    server = subprocess.Popen([sys.executable, "-c", RANKS], cwd=ROOT, env=env, stdout=subprocess.PIPE)
    atexit.register(server.kill)
    if server.stdout.readline() != b"ready\n":
        raise RuntimeError("the rank server did not start")
    server.socket = path
    _ranks.insert(0, server)
    return path


class Rank:
    """What torchrun's agent holds of a rank the rank server forked: subprocess.Popen's pid, poll, wait
    and returncode (the agent signals the rank's process group by its pid)."""

    def __init__(self, connection, pid):
        self.connection, self.pid, self.returncode = connection, pid, None

    def poll(self):
        if self.returncode is None and select.select([self.connection], [], [], 0)[0]:
            self.returncode = json.loads(self.connection.recv(4096))["code"]
            self.connection.close()
        return self.returncode

    def wait(self, timeout=None):
        if self.returncode is None and not select.select([self.connection], [], [], timeout)[0]:
            raise subprocess.TimeoutExpired(self.pid, timeout)
        return self.poll()


def fork_ranks():
    """In torchrun's agent: each rank, `python -u script args...` as torchrun starts it, forked by the
    rank server at $FORKSERVER_RANKS, with the agent's stdin and the stdout and stderr torchrun gives it."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

    def popen(handler, args, env):
        assert list(args[:2]) == [sys.executable, "-u"], args
        fds = [0, (handler._stdout or sys.stdout).fileno(), (handler._stderr or sys.stderr).fileno()]
        request = {"argv": [str(a) for a in args[2:]], "cwd": os.getcwd(), "env": env}
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        connection.connect(os.environ["FORKSERVER_RANKS"])
        socket.send_fds(connection, [json.dumps(request).encode()], fds)
        return Rank(connection, json.loads(connection.recv(4096))["pid"])
    subprocess_handler.SubprocessHandler._popen = popen


def start(argv, cwd, env, stderr_to_stdout=False, fork_ranks=False):
    """subprocess.Popen([sys.executable, *argv], cwd=cwd, env=env, stdout=PIPE, stderr=PIPE, text=True),
    forked from a server; env must hold OMP_NUM_THREADS=1 (the server's, set before torch was
    imported). stdout and stderr pass through files; stderr_to_stdout: stderr is written into
    stdout (subprocess's stderr=STDOUT), and the result's stderr is None. fork_ranks: the program
    is torchrun (or runs it), and its ranks are forked by the rank server."""
    assert env.get("OMP_NUM_THREADS") == "1", "the server's torch has one thread"
    if fork_ranks:
        env = dict(env, FORKSERVER_RANKS=_rank_server())  # where the agent asks for its ranks
    _runs[0] += 1
    out, err = (os.path.join(_outputs(), f"{_runs[0]}.{name}") for name in ("stdout", "stderr"))
    err = out if stderr_to_stdout else err
    for path in (out, err):
        open(path, "w").close()
    server = _server()
    server.stdin.write(json.dumps({"argv": [str(a) for a in argv], "cwd": str(cwd), "env": env,
                                   "stdout": out, "stderr": err, "fork_ranks": fork_ranks}).encode() + b"\n")
    pid = _reply(server, 300)["pid"]  # a new server's first run waits for its imports
    return Started(argv, server, pid, out, err)


def run(argv, cwd, env, timeout=300, stderr_to_stdout=False, fork_ranks=False):
    """subprocess.run([sys.executable, *argv], cwd=cwd, env=env, capture_output=True, text=True,
    timeout=timeout), forked from a server: start(...).wait(timeout)."""
    return start(argv, cwd, env, stderr_to_stdout, fork_ranks).wait(timeout)
