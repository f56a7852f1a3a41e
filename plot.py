"""
Redraw the paper's figures from this repo's outputs (needs matplotlib: pip install -r requirements-plot.txt).
    python plot.py diag out/diag_lt_k12 out/diag_flt_k12 -o diag.png        # Figure 3
    python plot.py budget out/flt_base/step_007683/eval.json ... --metric val_bpb -o budget.png
diag: one column per quantity of the paper's diagnostic figure (Sec. 3), one line per run, from
train.py's log.jsonl (a run directory or the file itself): the residual-state norm at the last
loop (--max_over_loops adds the largest over loops, dashed), the training loss smoothed by a
debiased EMA, and the first-layer MLP gradient norm (log scale).
budget: test-time compute, a metric of eval.py's JSON against the evaluated loop count K, one
line per checkpoint. --metric is a key of each K's results (val_bpb, wiki_ppl, CORE) or a CORE
task label (its raw accuracy, e.g. hellaswag).
"""
import argparse
import json
import os
import sys


def read_log(path):
    """The records of a train.py log.jsonl, one per step in step order. A resumed run appends
    to the same log, so a step may appear twice: the last occurrence wins. Evaluation-only
    records (the final step) have no "loss"."""
    if os.path.isdir(path):
        path = os.path.join(path, "log.jsonl")
    records = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                records[r["step"]] = r
    return [records[s] for s in sorted(records)]


def ema(values, beta=0.9):
    """Exponential moving average s_t = beta * s_(t-1) + (1 - beta) * x_t from s_0 = 0, divided by
    (1 - beta^t) as Adam does, so the first points are not pulled towards 0."""
    s, out = 0.0, []
    for t, x in enumerate(values, 1):
        s = beta * s + (1 - beta) * x
        out.append(s / (1 - beta**t))
    return out


def read_eval(path, metric):
    """(run name, {K: value}) from eval.py's JSON: {"checkpoint": <step dir>, "results": {"<K>":
    {"val_bpb", "wiki_ppl", "CORE", "tasks": {label: {"accuracy", "centered"}}, ...}}}.
    The run name is the checkpoint's run directory (out/flt_base/step_007683 -> flt_base)."""
    with open(path) as f:
        e = json.load(f)
    points = {}
    for K, r in e["results"].items():
        value = r.get(metric, r.get("tasks", {}).get(metric, {}).get("accuracy"))
        if value is not None:
            points[int(K)] = value
    if not points:
        found = sorted({k for r in e["results"].values() for k in [*r, *r.get("tasks", {})]})
        raise ValueError(f"{path}: no {metric!r} in its results; found {', '.join(found)}")
    ckpt = os.path.normpath(e["checkpoint"])
    run = os.path.dirname(ckpt) if os.path.basename(ckpt).startswith("step_") else ckpt
    return os.path.basename(run), dict(sorted(points.items()))


def pyplot():
    try:
        import matplotlib
    except ImportError:
        sys.exit("plot.py needs matplotlib: pip install -r requirements-plot.txt")
    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt
    return plt


def run_name(path):
    path = os.path.abspath(path)
    return os.path.basename(path if os.path.isdir(path) else os.path.dirname(path))


def plot_diag(logs, labels, out, max_over_loops=False):
    plt = pyplot()
    fig, (ax_resid, ax_loss, ax_grad) = plt.subplots(1, 3, figsize=(15, 4.2))
    for path, label in zip(logs, labels):
        train = [r for r in read_log(path) if "loss" in r]
        steps = [r["step"] for r in train]
        line, = ax_resid.plot(steps, [r["resid_norms"][-1] for r in train], label=label)
        if max_over_loops:
            ax_resid.plot(steps, [max(r["resid_norms"]) for r in train], ls="--", color=line.get_color())
        ax_loss.plot(steps, ema([r["loss"] for r in train]), label=label)
        ax_grad.plot(steps, [r["grad_mlp_first"] for r in train], label=label)
    ax_resid.set_title("residual-state norm, last loop" + (" (dashed: max)" if max_over_loops else ""))
    ax_loss.set_title("training loss (EMA 0.9)")
    ax_grad.set_title("first-layer MLP gradient norm")
    ax_grad.set_yscale("log")
    for ax in (ax_resid, ax_loss, ax_grad):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    ax_loss.legend()
    save(fig, out)


def plot_budget(evals, labels, out, metric):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4.2))
    ks = set()
    for path, label in zip(evals, labels):
        name, points = read_eval(path, metric)
        ax.plot(list(points), list(points.values()), marker="o", label=label or name)
        ks |= set(points)
    ax.set_xticks(sorted(ks))
    ax.set_xlabel("loops at evaluation (K)")
    ax.set_ylabel(metric)
    ax.grid(alpha=0.3)
    ax.legend()
    save(fig, out)


def save(fig, out):
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    diag = commands.add_parser("diag", help="the diagnostic figure from train.py logs")
    diag.add_argument("logs", nargs="+", help="run directories or their log.jsonl")
    diag.add_argument("--max_over_loops", action="store_true", help="also the largest residual norm over loops")
    budget = commands.add_parser("budget", help="a metric against the evaluated loop count K")
    budget.add_argument("evals", nargs="+", help="eval.py JSON files")
    budget.add_argument("--metric", default="val_bpb", help="val_bpb, wiki_ppl, CORE or a task label")
    for p in (diag, budget):
        p.add_argument("--labels", nargs="+", help="one per input (default: the run directory's name)")
        p.add_argument("-o", "--out", default=f"{p.prog.split()[-1]}.png", help="PNG to write")
    args = parser.parse_args(argv)
    inputs = args.logs if args.command == "diag" else args.evals
    if args.labels and len(args.labels) != len(inputs):
        parser.error(f"--labels: {len(args.labels)} given for {len(inputs)} inputs")
    if args.command == "diag":
        plot_diag(inputs, args.labels or [run_name(p) for p in inputs], args.out, args.max_over_loops)
    else:
        plot_budget(inputs, args.labels or [None] * len(inputs), args.out, args.metric)


if __name__ == "__main__":
    main(sys.argv[1:])
