"""Support for train.py and eval.py: optional experiment tracking in Weights & Biases.

    tracker = tracking.Tracker("flt", out_dir, settings)  # rank 0; train.py's wandb_project
    tracker.log(record)                                   # every log.jsonl record, as it is written
    tracking.log_results(out_dir, eval_json, step)        # eval.py --wandb: all eval.json holds, to the same run

Off by default: nothing here imports wandb unless asked (pip install -r requirements/wandb.txt).
The run's id is kept in out_dir/wandb.json, so a resumed run (and eval.py) continues the same
W&B run. WANDB_MODE=offline keeps everything on disk (`wandb sync` uploads it later).
"""
import json
import os
import pathlib


ID_FILE = "wandb.json"  # {"project", "id"}: the W&B run this out_dir logs to


def require(setting):
    """The wandb module, or a ValueError naming the setting and the package (also planning's check)."""
    try:
        import wandb
    except ImportError:
        raise ValueError(f"{setting} needs the wandb package, which is not installed: "
                         f"pip install -r requirements/wandb.txt") from None
    return wandb


def _init(out_dir, setting, project=None, **kwargs):
    """wandb.init for out_dir's run: the one wandb.json names (continued), else a new one (named)."""
    from flt.runtime import atomic_write  # here: report.py imports this module and must not import torch
    wandb, path = require(setting), os.path.join(out_dir, ID_FILE)
    saved = json.loads(pathlib.Path(path).read_text()) if os.path.exists(path) else None
    if saved is None and project is None:
        raise ValueError(f"{setting}: no {path}: the run was not logged to W&B (train.py --wandb_project)")
    if saved and project and saved["project"] != project:
        raise ValueError(f"{setting}, but {path} says this run logs to W&B project {saved['project']!r}")
    project = saved["project"] if saved else project
    run = wandb.init(project=project, id=saved and saved["id"], resume="allow" if saved else None,
                     name=os.path.basename(os.path.normpath(out_dir)), **kwargs)
    atomic_write(path, json.dumps({"project": project, "id": run.id}))
    return run


def flat(record, prefix=""):
    """A record as W&B takes it: numbers as they are; lists and dicts of them as key/1, key/2, ...
    (resid_norms per loop) and key/name (CORE's tasks); None and text (a checkpoint's path) left out."""
    out = {}
    for key, value in record.items():
        if isinstance(value, (list, dict)):
            out.update(flat(dict(enumerate(value, 1)) if isinstance(value, list) else value, f"{prefix}{key}/"))
        elif isinstance(value, (int, float)):
            out[f"{prefix}{key}"] = value
    return out


class Tracker:
    """The W&B run of a training run: train.py's settings as its config, log.jsonl's records as its
    history (by step; W&B drops steps below the last it has, e.g. those a resume repeats)."""

    def __init__(self, project, out_dir, settings):
        self.run = _init(out_dir, f"wandb_project={project!r}", project, config=settings, allow_val_change=True)

    def log(self, record):
        self.run.log(flat(record), step=record["step"])

    def finish(self):
        self.run.finish()


def log_results(out_dir, eval_json, step):
    """Everything eval.py's eval_json holds ({K: {metric: value}} of the checkpoint at `step`, every
    run's) into the W&B run train.py logged (out_dir's wandb.json): the summary's eval/<metric>/K<K>,
    and a table with a row per K."""
    from flt.report import read_results  # here: report.py imports this module
    run = _init(out_dir, "eval.py --wandb")
    rows = {K: flat(row) for K, row in read_results(eval_json)["results"].items()}
    metrics = sorted({m for row in rows.values() for m in row})
    run.summary.update({f"eval/{m}/K{K}": v for K, row in rows.items() for m, v in row.items()} | {"eval/step": step})
    table = [[int(K)] + [row.get(m) for m in metrics] for K, row in rows.items()]
    run.log({"eval/table": require("eval.py --wandb").Table(columns=["K"] + metrics, data=table)})
    run.finish()
