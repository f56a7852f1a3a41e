"""Support for train.py: what it watches while it trains, kept out of the training loop's way.

    watched = diagnostics.watched_modules(model, watch_layer)  # the modules of Figures 3 and 8
    record |= diagnostics.clipped_norms(model, watched, 1.0)   # rank 0's own gradient, the authors' view
    record |= diagnostics.module_norms(norms, watched)         # the rank-averaged gradient, before clipping
    monitor = diagnostics.divergence(monitor, loss, nats)      # the smoothed loss against its minimum
    log = diagnostics.Log(out_dir, settings)                   # settings.json, then log.jsonl line by line
"""
import json
import math
import os

import torch

from optim import clip_coefficient
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
    """{"grad_<name>": L2 norm of the module's gradient} from {parameter: squared norm of its
    gradient} (optim.reduce_gradients: the rank-averaged gradient, before clipping)."""
    return {f"grad_{k}": math.sqrt(sum(sq_norms[p] for p in m.parameters())) for k, m in watched.items()}


@torch.no_grad()
def clipped_norms(model, watched, max_norm):
    """The watched modules' gradient norms as the authors' diagnostic script (scripts/base_check.py)
    logs them: of this rank's own gradient (before the ranks are averaged), after clip_grad_norm_ with
    its own total norm. The paper's figures say "before clipping": module_norms."""
    sq = {p: p.grad.float().square().sum() for p in model.parameters() if p.grad is not None}
    parts = torch.stack([sum(sq.values())] + [sum(sq[p] for p in m.parameters()) for m in watched.values()])
    total, *module = parts.sqrt().tolist()  # one device sync for all of them
    coef = clip_coefficient(total, max_norm)
    return {f"grad_{k}_clipped": coef * n for k, n in zip(watched, module)}


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
