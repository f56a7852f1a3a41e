"""Support for train.py on a shared cluster: preemption, a shared out_dir, time-based checkpoints.

    preemption = cluster.Preemption()   # SIGTERM, SIGUSR1, Ctrl-C: a flag; nothing stops mid-step
    clock = cluster.Clock(minutes)      # due() once `minutes` have passed since the last reset()
    cluster.check_shared_out_dir(out_dir, rt)   # every rank sees rank 0's out_dir, or an error

train.py folds preemption.requested and clock.due() into the all-reduce every step already runs,
so every rank takes the same decision at the same step even if only one rank got the signal (or
the clocks of two nodes disagree): save that step's checkpoint, and, if preempted, exit with
PREEMPTED. A job script tests that status and requeues (docs/operations.md, "Running on a cluster").
A Ctrl-C (SIGINT) asks for the same stop, exit INTERRUPTED, which no job script requeues; a second
Ctrl-C quits at once.
"""
import os
import secrets
import signal
import time

import torch
import torch.distributed as dist

from flt import errors

PREEMPTED = 75  # the exit status of a preempted run: sysexits.h's EX_TEMPFAIL, "try again later"
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)  # a scheduler's kill; SLURM's --signal warning
# The exit status of a run stopped by Ctrl-C (errors.py's, 130): the shell's for a program SIGINT
# ended (128 + 2), what a user who pressed it expects. Not PREEMPTED: a job script requeues on 75,
# and a run its user stopped must not start again by itself.
INTERRUPTED = errors.INTERRUPTED
# what a Ctrl-C says at once; after one, QUIT quits at once: a second, or torchrun's SIGTERM on one
SAVING = "Ctrl-C: finishing this step, then saving a checkpoint and exiting; Ctrl-C again quits now"
QUIT = ("SIGINT", "SIGTERM")
QUITTING = f"Ctrl-C again: quit at once (exit {INTERRUPTED}), unsaved; the checkpoints saved stay"


class Preemption:
    """Remembers the first of SIGNALS, or SIGINT (Ctrl-C), this process receives, instead of dying
    of it. The handler only sets a flag: a second signal (say, during the checkpoint) changes
    nothing, but after a Ctrl-C, QUIT quits at once: a second Ctrl-C, or the SIGTERM torchrun's
    agent sends its ranks on a second Ctrl-C (it forwards the first as SIGINT). Each Ctrl-C says
    what it does at once (SAVING, QUITTING), once a node (its LOCAL_RANK 0). A checkpoint a quit
    cuts short stays a tmp_step_N, never a checkpoint (flt/checkpoint.py), and the run directory's
    lock goes with the process."""

    def __init__(self, signals=SIGNALS):
        # the first signal's name; a Ctrl-C's outranks another's (its run is not requeued)
        self.signal = None
        # and Ctrl-C, unless this process started out ignoring it (a script's background job)
        ctrl_c = () if signal.getsignal(signal.SIGINT) == signal.SIG_IGN else (signal.SIGINT,)
        for s in signals + ctrl_c:
            signal.signal(s, self._received)

    def _received(self, signum, frame):
        name = signal.Signals(signum).name
        if self.interrupted and name in QUIT:
            say(QUITTING)
            # at once: no exception to unwind through torch, no traceback, no cleanup
            os._exit(INTERRUPTED)
        if name == "SIGINT":
            say(SAVING)
        self.signal = name if name == "SIGINT" else self.signal or name

    @property
    def requested(self):
        return self.signal is not None

    @property
    def interrupted(self):
        return self.signal == "SIGINT"


def say(line):
    """line on stderr, once a node (LOCAL_RANK 0), from a signal handler: one write, no buffer that
    the code the signal interrupted may be in the middle of."""
    if int(os.environ.get("LOCAL_RANK", 0)) == 0:
        os.write(2, f"{line}\n".encode())


class Clock:
    """save_interval_minutes: due() once `minutes` (> 0) have passed since the last reset()."""

    def __init__(self, minutes):
        self.seconds, self.start = minutes * 60, time.monotonic()

    def due(self):
        return self.seconds > 0 and time.monotonic() - self.start >= self.seconds

    def reset(self):
        self.start = time.monotonic()


def check_shared_out_dir(out_dir, rt):
    """Rank 0 writes a random token into out_dir; after a barrier every rank reads it back. A rank
    that cannot (each node has its own out_dir) makes every rank raise the same ValueError: a
    checkpoint is written by all ranks into one directory, and resumed from it."""
    if not rt.ddp:
        return
    token = torch.tensor([secrets.randbits(62) if rt.master else 0], device=rt.device)
    dist.broadcast(token, 0)
    path = os.path.join(out_dir, ".shared_out_dir")
    if rt.master:
        with open(path, "w") as f:
            f.write(str(token.item()))
    dist.barrier()
    try:
        with open(path) as f:
            seen = f.read() == str(token.item())
    except OSError:
        seen = False
    missing = torch.tensor([0 if seen else 1], device=rt.device)
    dist.all_reduce(missing)
    if rt.master:
        os.remove(path)
    if missing.item():
        raise ValueError(f"out_dir={out_dir!r}: {missing.item()} of {rt.world} ranks do not see the file rank 0 "
                         f"wrote there: out_dir must be on a filesystem shared by all nodes")
