"""Support for train.py: what it watches while it trains, kept out of the training loop's way.

    watched = diagnostics.watched_modules(model, watch_layer)  # the modules of Figures 3 and 8
    norms = diagnostics.gradient_norms(sq_norms, watched)      # the rank-averaged gradient, before clipping
    own = diagnostics.own_gradient_norms(model, watched)       # rank 0's own gradient, the authors' view
    host = diagnostics.read(norms=norms, own=own, ...)         # the step's one host sync
    record |= diagnostics.norm_record(host["norms"], watched)  # grad_norm, grad_<module>
    record |= diagnostics.norm_record(host["own"], watched, 1.0)  # grad_<module>_clipped
    monitor = diagnostics.divergence(monitor, loss, nats)      # the smoothed loss against its minimum
    log = diagnostics.Log(out_dir, settings)                   # settings.json, then log.jsonl line by line
    timer = diagnostics.StepTimer()  # lap(): a step's seconds, less pause() .. resume()
"""
import collections
import contextlib
import json
import math
import os
import time

import torch

from optim import clip_coefficient, squared_norm
from flt.runtime import atomic_write


def watched_modules(model, watch_layer=-1):
    """The modules whose gradient norms train.py logs (the paper's Sec. 3, Figures 3 and 8): the
    first block's MLP, the LM head, and block watch_layer's MLP and attention (-1: the paper's "5th
    layer", index 4, or the last block of a shallower model)."""
    blocks = model.transformer.h
    mid = watch_layer if watch_layer >= 0 else min(4, len(blocks) - 1)
    return {"mlp_first": blocks[0].mlp, "lm_head": model.lm_head, "mlp_mid": blocks[mid].mlp,
            "attn_mid": blocks[mid].attn}


def gradient_norms(sq_norms, watched):
    """(1 + len(watched),) tensor on the device: the L2 norm of the whole gradient, then of each watched
    module's, from {parameter: squared norm of its gradient (0-d tensor)}; no host read."""
    parts = [list(sq_norms.values())] + [[sq_norms[p] for p in m.parameters()] for m in watched.values()]
    return torch.stack([torch.stack(sq).double().sum() for sq in parts]).sqrt()  # float64, as a host sum was


@torch.no_grad()
def own_gradient_norms(model, watched):
    """gradient_norms of this rank's own gradient (before the ranks are averaged): the authors'
    diagnostic script (scripts/base_check.py) logs them, clipped by norm_record. An extra pass over every
    gradient: train.py's log_clipped_norms asks for it."""
    return gradient_norms({p: squared_norm(p.grad) for p in model.parameters() if p.grad is not None}, watched)


def norm_record(norms, watched, max_norm=None):
    """gradient_norms read to the host, as log entries: {"grad_norm", "grad_<name>"}; with max_norm (the
    authors' view, after clip_grad_norm_ by the total): {"grad_<name>_clipped"}. The paper's figures say
    "before clipping": without max_norm. norms None (not asked for): {}."""
    if norms is None:
        return {}
    total, *modules = norms
    if max_norm is None:
        return {"grad_norm": total} | {f"grad_{k}": n for k, n in zip(watched, modules)}
    coef = clip_coefficient(total, max_norm)
    return {f"grad_{k}_clipped": coef * n for k, n in zip(watched, modules)}


def read(**tensors):
    """{name: a float (0-d tensor) or a list (1-D)} of the tensors given (None: left out), in one
    device-to-host copy: the training loop's one host sync per step."""
    tensors = {k: t for k, t in tensors.items() if t is not None}
    flat = torch.cat([t.detach().double().reshape(-1) for t in tensors.values()]).tolist()  # float64: exact
    out, start = {}, 0
    for name, t in tensors.items():
        out[name] = flat[start] if t.dim() == 0 else flat[start:start + t.numel()]
        start += t.numel()
    return out


HOST_READS = ("item", "tolist", "__float__", "__int__", "__bool__", "cpu", "numpy")


@contextlib.contextmanager
def count_host_reads():
    """Counts, by method, the tensor-to-Python reads (each a host sync on a GPU) and torch.cuda.synchronize
    calls made inside the block (tests/test_host_syncs.py, scripts/bench.py --mode=syncs)."""
    counts, originals = collections.Counter(), {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def counted(name, original):
        def method(*args, **kwargs):
            counts[name] += 1
            return original(*args, **kwargs)
        return method
    for name, original in originals.items():
        setattr(torch.Tensor, name, counted(name, original))
    synchronize = torch.cuda.synchronize
    torch.cuda.synchronize = counted("cuda.synchronize", synchronize)
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
        torch.cuda.synchronize = synchronize


NEW_MONITOR = {"ema": None, "best": math.inf, "above": 0}


def divergence(monitor, loss, nats):
    """The divergence monitor after one more step's loss: {"ema": the loss smoothed (decay 0.9), "best":
    the smallest ema so far, "above": steps in a row with ema > best + nats}. train.py stops a run once
    "above" reaches divergence_window; the monitor is saved with each checkpoint."""
    ema = loss if monitor["ema"] is None else 0.9 * monitor["ema"] + 0.1 * loss
    best = min(monitor["best"], ema)
    return {"ema": ema, "best": best, "above": monitor["above"] + 1 if ema > best + nats else 0}


def diverged(step, monitor, nats, window):
    """Why divergence stopped the run at step (train.py's divergence_nats and divergence_window)."""
    return (f"step {step}: diverged: the smoothed loss {monitor['ema']:.3f} has been more than divergence_nats="
            f"{nats} above its minimum {monitor['best']:.3f} for {monitor['above']} steps "
            f"(divergence_window={window})")


class StepTimer:
    """The seconds of a training step, without its evaluations and checkpoints: lap() is called
    right after the step's one host read (on a GPU the one wait, so no torch.cuda.synchronize), and
    returns the time since the last lap() less the time spent between pause() and resume()."""

    def __init__(self):
        self.last = time.time()
        self.paused_at = None
        self.paused = 0.0  # seconds paused since the last lap

    def pause(self):
        self.paused_at = time.time()

    def resume(self):
        self.paused += time.time() - self.paused_at

    def lap(self):
        now = time.time()
        seconds = now - self.last - self.paused
        self.last = now
        self.paused = 0.0
        return seconds


class Log:
    """out_dir/settings.json (written at once) and out_dir/log.jsonl (appended, one JSON line per
    record, flushed); out_dir None (ranks other than 0) writes nothing. A tracker (tracking.Tracker)
    gets each record too, and is finished with the log."""

    def __init__(self, out_dir, settings, tracker=None):
        self.file, self.tracker = None, tracker
        if out_dir is not None:
            atomic_write(os.path.join(out_dir, "settings.json"), json.dumps(settings, indent=1))
            self.file = open(os.path.join(out_dir, "log.jsonl"), "a")

    def write(self, record):
        if self.file:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        if self.tracker:
            self.tracker.log(record)

    def close(self):
        if self.file:
            self.file.close()
        if self.tracker:
            self.tracker.finish()
