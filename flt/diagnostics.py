"""Support for train.py: what it records while it trains, kept out of the training step's way.
Nothing here decides the step: its gradient norm and clip factor are train.py's; these only record.

    watch = diagnostics.Watch(model, watch_layer, clipped=True)  # the modules of Figures 3 and 8
    tensors = {"grad_norm": ..., **watch.tensors(sq_norms, looped)}  # 0-d, read in one .tolist()
    record |= watch.record(numbers, grad_clip)     # grad_<module> (and grad_<module>_clipped)
    record |= diagnostics.speed(tokens, dt, flops_per_token, peak, world_size)  # tok_per_s, dt, mfu
    print0(diagnostics.step_line(record, num_steps, timer))  # every log_interval steps
    monitor = diagnostics.divergence(monitor, loss, nats)  # the smoothed loss against its minimum
    log = diagnostics.Log(out_dir, settings)  # settings.json, then log.jsonl line by line
    timer = diagnostics.StepTimer()  # lap(): a step's seconds, less pause() .. resume(); time left
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


def module_norms(sq_norms, watched):
    """(len(watched),) float64 tensor on the device: the L2 norm of each watched module's gradient,
    from {parameter: squared norm of its gradient (0-d tensor)}; no host read."""
    squares = [torch.stack([sq_norms[p] for p in m.parameters()]).double().sum() for m in watched.values()]
    return torch.stack(squares).sqrt()


def gradient_norms(sq_norms, watched):
    """(1 + len(watched),) tensor on the device: the L2 norm of the whole gradient, then module_norms."""
    total = torch.stack(list(sq_norms.values())).double().sum().sqrt()  # float64, as a host sum was
    return torch.cat([total[None], module_norms(sq_norms, watched)])


@torch.no_grad()
def own_gradient_norms(model, watched):
    """gradient_norms of this rank's own gradient (before the ranks are averaged): the authors'
    diagnostic script (scripts/base_check.py) logs them, clipped (Watch.record). An extra pass over every
    gradient: train.py's log_clipped_norms asks for it."""
    return gradient_norms({p: squared_norm(p.grad) for p in model.parameters() if p.grad is not None}, watched)


class Watch:
    """What train.py records of each step's gradients (Sec. 3, Figures 3 and 8): the norms of the watched
    modules' rank-averaged gradient, before clipping, as the figures show them; with clipped=True (rank 0
    under log_clipped_norms) also the authors' view: this rank's own gradient, clipped by its own norm
    (clip_grad_norm_'s rule); and the residual stream's norm after each loop (this rank's last micro-batch:
    rank 0's is the one logged)."""

    def __init__(self, model, watch_layer=-1, clipped=False):
        self.model = model
        self.modules = watched_modules(model, watch_layer)
        self.clipped = clipped

    def tensors(self, sq_norms, looped):
        """{name: 0-d device tensor} for the step's one read, no host read here: "grad_<module>" (from
        reduce_gradients' squared norms), "resid_norm_<t>" for loop t = 1..K (the model's Loops), and
        if clipped "own_total", "own_<module>"."""
        norms = module_norms(sq_norms, self.modules).unbind()
        tensors = {f"grad_{k}": n for k, n in zip(self.modules, norms)}
        tensors |= {f"resid_norm_{t}": n for t, n in enumerate(looped.resid_norms.unbind(), 1)}
        if self.clipped:
            own = own_gradient_norms(self.model, self.modules).unbind()
            tensors |= {f"own_{k}": n for k, n in zip(["total", *self.modules], own)}
        return tensors

    def record(self, numbers, max_norm):
        """The log entries of the read `numbers`: "grad_<name>", "resid_norms" (a list, loop 1 first),
        and if clipped "grad_<name>_clipped" (clip_grad_norm_ by the total to max_norm, then each
        module's norm)."""
        record = {f"grad_{k}": numbers[f"grad_{k}"] for k in self.modules}
        record["resid_norms"] = [v for k, v in numbers.items() if k.removeprefix("resid_norm_").isdigit()]
        if self.clipped:
            coef = clip_coefficient(numbers["own_total"], max_norm)
            record |= {f"grad_{k}_clipped": coef * numbers[f"own_{k}"] for k in self.modules}
        return record


def speed(tokens, dt, flops_per_token, peak, world_size, memory=False):
    """{"tok_per_s", "dt", "mfu"} of a training step of `tokens` tokens in dt seconds; mfu: the model's
    FLOP/s over the peak of world_size accelerators (None where the peak is unknown: a CPU); memory=True
    adds "mem_gib", the peak CUDA memory allocated so far (GiB), to set beside planning's estimate."""
    tok_per_s = tokens / dt
    mfu = flops_per_token * tok_per_s / (peak * world_size) if peak else None
    record = {"tok_per_s": tok_per_s, "dt": dt, "mfu": mfu}
    if memory:
        record["mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return record


def step_line(r, num_steps, timer):
    """train.py's line for a training step's record r, each number rounded to what it means, and
    the time: since training began (timer: a StepTimer), and the estimate for the steps left."""
    mfu = f" | mfu {100 * r['mfu']:.1f}%" if r["mfu"] is not None else ""
    left = timer.left(num_steps - r["step"] - 1)
    left = f", ~{duration(left)} left" if left is not None else ""
    return (f"step {r['step']:5d}/{num_steps} | loss {r['loss']:.3f} | K {r['loops']} | "
            f"lrm {r['lrm']:.2f} | grad {r['grad_norm']:.2f} | resid {r['resid_norms'][-1]:.1f} | "
            f"{r['tok_per_s']:,.0f} tok/s{mfu} | {duration(timer.elapsed())} elapsed{left}")


def val_line(r, final=False):
    """train.py's line for an evaluation's record r: validation bits per byte and the tokens they
    are over and, for a task, its accuracy; final: the run's final numbers (r's final_ entries)."""
    key = "final_val" if final else "val"
    acc = f" | accuracy {r[key + '_acc']:.4f}" if key + "_acc" in r else ""
    if final:
        return f"final val bpb ({r['final_val_tokens']:,} tokens): {r['final_val_bpb']:.4f}{acc}"
    return f"step {r['step']:5d} | val bpb {r['val_bpb']:.4f} ({r['val_tokens']:,} tokens){acc}"


def duration(seconds):
    """seconds as a step line shows them, to the second or the minute: 42s, 1m23s, 2h05m, 3d04h."""
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


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
    once a step, after its optimizer step, and returns the time since the last lap() less the time
    spent between pause() and resume(). It never syncs (runtime.Timer does): on a GPU the step's one
    host read is its one wait, so each lap holds one step's work once the queue is steady.
    elapsed(): the wall time since the timer was made (train.py: as training, or its resume,
    begins), evaluations and saves included; left(n): n more steps at the mean lap so far."""

    def __init__(self):
        self.start = self.last = time.time()
        self.paused_at = None
        self.paused = 0.0  # seconds paused since the last lap
        self.laps = 0
        # the seconds of the laps after the first (torch.compile's and the allocator's warm-up)
        self.later = 0.0

    def pause(self):
        self.paused_at = time.time()

    def resume(self):
        self.paused += time.time() - self.paused_at

    def lap(self):
        now = time.time()
        seconds = now - self.last - self.paused
        self.last = now
        self.paused = 0.0
        self.laps += 1
        if self.laps > 1:
            self.later += seconds
        return seconds

    def elapsed(self):
        return time.time() - self.start

    def left(self, steps):
        """The seconds `steps` more steps take at the mean lap so far, the first lap left out (its
        warm-up, compilation, says little of the others); None until a later lap is timed.
        Evaluations and saves to come are not counted."""
        if self.laps < 2:
            return None
        return steps * self.later / (self.laps - 1)


class Log:
    """out_dir/settings.json (written at once) and out_dir/log.jsonl (appended, one JSON line per
    record, flushed); out_dir None (ranks other than 0) writes nothing. A tracker (tracking.Tracker)
    gets each record too, and is finished with the log. A run resumed at step `resumed_at` runs the
    steps after its checkpoint again: their lines move to log.replayed.jsonl (replay), so that
    log.jsonl holds each step once."""

    def __init__(self, out_dir, settings, tracker=None, resumed_at=None):
        self.file, self.tracker = None, tracker
        if out_dir is not None:
            atomic_write(os.path.join(out_dir, "settings.json"), json.dumps(settings, indent=1))
            if resumed_at is not None:
                replay(out_dir, resumed_at)
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


def replay(out_dir, step):
    """Move the lines of out_dir/log.jsonl from `step` on (those a crashed run wrote after the
    checkpoint a run resumes from) to the end of log.replayed.jsonl: kept, and out of the log. The
    log is rewritten whole (atomic_write), the replayed lines appended first."""
    path = os.path.join(out_dir, "log.jsonl")
    if not os.path.exists(path):
        return
    with open(path) as f:
        lines = f.readlines()
    keep = [line for line in lines if logged_step(line) < step]
    later = [line for line in lines if logged_step(line) >= step]
    if not later:
        return
    with open(os.path.join(out_dir, "log.replayed.jsonl"), "a") as f:
        f.writelines(later)
        f.flush()
        os.fsync(f.fileno())
    atomic_write(path, "".join(keep))
    print(f"log.jsonl: {len(later)} lines of steps {step} and later, which this run takes again, "
          f"moved to log.replayed.jsonl")


def logged_step(line):
    """The step of one line of log.jsonl; a line a kill cut short counts as after every step."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return math.inf
