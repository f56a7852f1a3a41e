"""Support for train.py on a shared cluster: preemption, a shared out_dir, time-based checkpoints.

    preemption = cluster.Preemption()   # SIGTERM / SIGUSR1 set a flag; nothing stops mid-step
    clock = cluster.Clock(minutes)      # due() once `minutes` have passed since the last reset()
    cluster.check_shared_out_dir(out_dir, rt)   # every rank sees rank 0's out_dir, or an error

train.py folds preemption.requested and clock.due() into the all-reduce every step already runs,
so every rank takes the same decision at the same step even if only one rank got the signal (or
the clocks of two nodes disagree): save that step's checkpoint, and, if preempted, exit with
PREEMPTED. A job script tests that status and requeues (docs/operations.md, "Running on a cluster").
"""
import os
import secrets
import signal
import time

import torch
import torch.distributed as dist

PREEMPTED = 75  # the exit status of a preempted run: sysexits.h's EX_TEMPFAIL, "try again later"
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)  # a scheduler's kill; SLURM's --signal warning


class Preemption:
    """Remembers the first of SIGNALS this process receives, instead of dying of it. The handler
    only sets a flag: a second signal (say, during the checkpoint) changes nothing."""

    def __init__(self, signals=SIGNALS):
        self.signal = None
        for s in signals:
            signal.signal(s, self._received)

    def _received(self, signum, frame):
        self.signal = self.signal or signal.Signals(signum).name

    @property
    def requested(self):
        return self.signal is not None


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
