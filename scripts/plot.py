"""
Redraw the paper's figures and tables from this repo's outputs, one subcommand each (figures need
matplotlib: pip install -r requirements/plot.txt):
    python -m scripts.plot diag out/diag/small_lt_k{6,9,12} out/diag/small_flt_k12 -o fig2.png  # Figs. 2-4
    python -m scripts.plot loss out/fig5/* -o fig5.png                          # Figs. 5, 10: training loss
    python -m scripts.plot val out/fig5/* -o val.png                            # val bpb over training
    python -m scripts.plot sweep out/base_flt_k{3,6,9,12} --metric avg -o fig6.png   # Fig. 6: test-time sweep
    python -m scripts.plot exit out/loops/d2_flt_k4* -o exit.png              # bpb against loops per token
    python -m scripts.plot exit-table out/loops/d2_flt_k4*                    # loops to match fixed K
    python -m scripts.plot depth out/reasoning/* -o depth.png                 # a reasoning task's accuracy
    python -m scripts.plot task-exit out/reasoning/* -o task_exit.png         # loops per answer by difficulty
    python -m scripts.plot resid out/diag/small_*_k12 --loops 6 9 12 -o fig7.png      # Fig. 7
    python -m scripts.plot grads out/diag/small_*_k12 -o fig8.png                     # Fig. 8
    python -m scripts.plot core out/base_flt_k12* -o fig9.png                         # Fig. 9: CORE in training
    python -m scripts.plot table out/*_k[369] --paper -o table1.md                    # Tables 1, 2
    python -m scripts.plot runs out/                                   # the runs below out/, a row each
Inputs are runs: train.py's out_dir, or a file or step_* directory inside it (runs takes folders and
finds the runs below them). The curves (diag, loss, val, resid, grads, core) and runs read the run's
log.jsonl (runs its settings.json too); sweep, exit, depth, task-exit and the tables read eval.py's
eval.json (given, in the step directory given, or in the run's newest step_* that has one). A run is labelled
"<variant> K=<loops>" from the settings.json train.py writes into out_dir, else by its directory's
name; --labels overrides. Training losses are smoothed by an EMA with beta 0.9, as in the paper.
An --out that exists is replaced only if this script wrote it (a rerun): a figure that names it as
its Creator, a table that is its table and nothing else; any other file is refused before any
work, unless --force. A figure's --out without an extension is the .png savefig writes. Outputs
are written whole or not at all (a temporary file beside them, renamed over them).
"""
import argparse
import json
import math
import os
import sys

from flt import errors, report
from flt.files import atomic_write


# ----------------------------------------------------------------------------- reading runs
def enclosing_run(path):
    """train.py's out_dir holding path: a run directory, a step_* directory or a file in either."""
    path = os.path.abspath(path)
    if not os.path.isdir(path):
        path = os.path.dirname(path)
    return os.path.dirname(path) if os.path.basename(path).startswith("step_") else path


def run_settings(path):
    """The run's training settings (out_dir/settings.json, written by train.py); {} if it has none."""
    settings = os.path.join(enclosing_run(path), "settings.json")
    if not os.path.isfile(settings):
        return {}
    with open(settings) as f:
        return json.load(f)


def model_name(settings):
    """The loop variant, with the attention where it is not plain MHA: FLT, FLT GQA(2), FLT MLA, FLT SWA(SSSL)."""
    name = settings["variant"]
    if settings.get("n_kv_head", -1) not in (-1, None):  # -1 (None before) = as many as query heads
        name += f" GQA({settings['n_kv_head']})"
    if settings.get("attn", "full") != "full":
        name += " " + settings["attn"].upper()
    if "S" in settings.get("window_pattern", "L"):
        name += f" SWA({settings['window_pattern']})"
    return name


def run_name(path):
    """The run's model name from its settings, else its directory's name."""
    settings = run_settings(path)
    return model_name(settings) if settings else os.path.basename(enclosing_run(path))


def default_label(path):
    """<model> K=<loops>, with the loop sampler of a run trained over variable loop counts."""
    settings = run_settings(path)
    if not settings:
        return run_name(path)
    sampler = settings.get("loops_sampler", "fixed")
    return f"{run_name(path)} K={settings['loops']}" + (f" ({sampler})" if sampler != "fixed" else "")


def read_log(path):
    """The records of a train.py log.jsonl (or the run's), one per step in step order. A resumed run
    appends to the same log, so a step may appear twice: the last occurrence wins. Evaluation-only
    records (the final step) have no "loss". A last line without its newline that is not JSON yet (a
    running train.py writing it) is left out."""
    if os.path.isdir(path):
        path = os.path.join(enclosing_run(path), "log.jsonl")
    records = {}
    with open(path) as f:
        lines = f.readlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except ValueError:
            # the last line of a running train.py's log, not all written yet
            if number == len(lines) and not line.endswith("\n"):
                continue
            raise ValueError(f"{path}: line {number} is not a JSON record of train.py's log") from None
        records[r["step"]] = r
    return [records[s] for s in sorted(records)]


def diverged(path):
    """Whether the run's log marks it diverged (a record with "diverged": true)."""
    log = os.path.join(enclosing_run(path), "log.jsonl")
    return os.path.isfile(log) and any(r.get("diverged") for r in read_log(log))


def read_eval(path):
    """{K: results at K} of eval.py's JSON: {"results": {"<K>": {"val_bpb", "wiki_ppl", "CORE", "tasks":
    {label: {"accuracy", "centered"}}}}, ...}, for the file, a step directory or a run's newest step_*."""
    if os.path.isdir(path):
        steps = [d for d in sorted(os.listdir(path)) if os.path.isfile(os.path.join(path, d, "eval.json"))]
        path = os.path.join(path, *steps[-1:], "eval.json")  # a step directory holds it directly
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no eval.json; run eval.py on the run's checkpoint first")
    return {int(K): r for K, r in sorted(report.read_results(path)["results"].items(), key=lambda kv: int(kv[0]))}


def ema(values, beta=0.9):
    """Exponential moving average s_t = beta * s_(t-1) + (1 - beta) * x_t from s_0 = 0, divided by
    (1 - beta^t) as Adam does, so the first points are not pulled towards 0."""
    s, out = 0.0, []
    for t, x in enumerate(values, 1):
        s = beta * s + (1 - beta) * x
        out.append(s / (1 - beta**t))
    return out


def series(value, smooth=False):
    """A panel's curve of a run: (steps, value(record)) over the log records where it is a finite
    number, EMA-smoothed if smooth."""
    def curve(records):
        points = [(r["step"], v) for r in records if (v := value(r)) is not None and math.isfinite(v)]
        ys = [v for _, v in points]
        return [s for s, _ in points], ema(ys) if smooth else ys
    return curve


def loop_norm(k):
    """The residual-state norm at the end of loop k (1-based); None for runs with fewer loops."""
    return series(lambda r: r["resid_norms"][k - 1] if len(r.get("resid_norms", ())) >= k else None)


SMOOTHED_LOSS = ("training loss (EMA 0.9)", "loss", series(lambda r: r.get("loss"), smooth=True), False)


# ----------------------------------------------------------------------------- figures
def pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ValueError("the figures need matplotlib, which is not installed: pip install -r requirements/plot.txt")
    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt
    return plt


def overlay(runs, panels, title, xlabel="step", mark_stops=True, marker=None):
    """A row of panels, every run one line of its own colour in each. runs: [(label, data)]; panels:
    [(title, y label, curve, log scale)], curve(data) -> (xs, ys), empty where the run lacks it. With
    mark_stops, a line that ends before the longest one (a run that stopped early, e.g. diverged) ends
    in an x."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.2), squeeze=False)
    for ax, (name, ylabel, curve, log) in zip(axes[0], panels):
        lines = [(f"C{i}", label, *curve(data)) for i, (label, data) in enumerate(runs)]
        lines = [line for line in lines if line[2]]
        if not lines:
            plt.close(fig)
            raise ValueError(f"{name}: none of the runs has it ({', '.join(label for label, _ in runs)})")
        end = max(xs[-1] for _, _, xs, _ in lines)
        for color, label, xs, ys in lines:
            stopped = mark_stops and xs[-1] < end
            ax.plot(xs, ys, color=color, marker=marker, label=label + (f" (stopped at {xs[-1]})" if stopped else ""))
            if stopped:
                ax.plot(xs[-1:], ys[-1:], "x", color=color, ms=10, mew=2)
        ax.set(title=name, xlabel=xlabel, ylabel=ylabel, yscale="log" if log else "linear")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    return fig


def curves(command, logs, labels, loops, clipped=False):
    """The figure of a log subcommand: its panels over the runs' logs. Gradient norms are before
    clipping (the paper's words), or with clipped as the authors' script logged them: rank 0's own
    gradient after clipping (train.py's grad_<module>_clipped)."""
    grad = "_clipped" if clipped else ""
    view = " (rank 0, after clipping)" if clipped else ""
    panels = {
        "diag": [("residual-state norm, loop 1", "norm", loop_norm(1), False), SMOOTHED_LOSS,
                 (f"first-layer FFN gradient norm{view}", "gradient norm",
                  series(lambda r: r.get(f"grad_mlp_first{grad}")), True)],
        "loss": [SMOOTHED_LOSS],
        "val": [("validation bits per byte", "val bpb", series(lambda r: r.get("val_bpb")), False)],
        "resid": [(f"residual-state norm, loop {k}", "norm", loop_norm(k), False) for k in loops],
        "grads": [(f"{name} gradient norm{view}", "gradient norm", series(lambda r, key=key: r.get(key + grad)), True)
                  for name, key in (("LM head", "grad_lm_head"), ("5th-layer FFN", "grad_mlp_mid"),
                                    ("5th-layer attention", "grad_attn_mid"))],
        "core": [("CORE during training", "CORE (mean centered accuracy)", series(lambda r: r.get("core")), False)],
    }[command]
    titles = {"diag": "Training diagnostics (Figs. 2-4)", "loss": "Training loss (Figs. 5, 10)",
              "val": "Validation bits per byte during training",
              "resid": "Residual-state norm at later loops (Fig. 7)", "grads": "Gradient norms (Fig. 8)",
              "core": "CORE during training (Fig. 9)"}
    return overlay([(label, read_log(path)) for path, label in zip(logs, labels)], panels, titles[command])


def metrics(results):
    """The metrics eval.py's results ({K: results at K}) have a number for at some K, by report.metric's
    names: each number it holds, each task label (its raw accuracy), and avg with all six of Table 1's tasks."""
    names = {k for r in results.values() for k, v in r.items() if isinstance(v, (int, float))}
    names |= {label for r in results.values() for label in r.get("tasks", {})}
    return names | ({"avg"} if any(report.metric(r, "avg") is not None for r in results.values()) else set())


def sweep(evals, labels, name=None):
    """Fig. 6: a metric against the loop count K at evaluation, one line per run, in training-K order.
    name None: the six-task average (avg) where a run has it, else val_bpb, saying so."""
    runs = sorted(((run_settings(path).get("loops", math.inf), label, read_eval(path))
                   for path, label in zip(evals, labels)), key=lambda run: run[0])
    found = sorted(set().union(*(metrics(results) for *_, results in runs)))
    asked = f"--metric {name!r}" if name else "the six-task average (avg) or val_bpb"
    if name is None and "avg" not in found and "val_bpb" in found:
        print("sweep: no run has Table 1's six tasks (eval.py --modes=core), so no six-task average: drawing "
              f"val_bpb; --metric draws another of: {', '.join(found)}")
    name = name or ("avg" if "avg" in found or "val_bpb" not in found else "val_bpb")
    if name not in found:
        raise ValueError(f"{asked}: not in the runs' eval.json; they have: "
                         f"{', '.join(found) or 'no metric (eval.py --modes=bpb,wiki,core computes them)'}")
    points = [{K: v for K, r in results.items() if (v := report.metric(r, name)) is not None} for _, _, results in runs]
    ylabel = "six-task average accuracy" if name == "avg" else name
    fig = overlay([(label, p) for (_, label, _), p in zip(runs, points)],
                  [(ylabel, ylabel, lambda p: (list(p), list(p.values())), False)],
                  "Test-time loop sweep, one line per trained K (Fig. 6)",
                  xlabel="loops at evaluation (K)", mark_stops=False, marker="o")
    fig.axes[0].set_xticks(sorted(set().union(*points)))
    return fig


# Each exit rule's look in the exit figure (a run's colour is its own): kl's as the figure drew it
# before there were other rules
RULE_STYLES = {"kl": "s-", "entropy": "^-.", "latent": "v:", "argmax": "D-", "gate": "P--"}


def exit_curves(evals, labels, label=None):
    """Depth per token: val bpb against loops per token, for each run its fixed-K sweep (every token
    runs K loops, dashed) and each exit rule's curve (mean loops per token over eval.py's thresholds;
    report.exit_curves), a marker and line style per rule (RULE_STYLES), a colour per run.
    label: the results eval.py kept apart under it (e.g. "bpb_tokens=32768"), not the defaults."""
    bpb = f"val_bpb[{label}]" if label else "val_bpb"
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.6))
    for i, (path, name) in enumerate(zip(evals, labels)):
        results = read_eval(path)
        fixed = {K: r[bpb] for K, r in results.items() if bpb in r}
        # (rule, K_max): a curve each, as a rule at another cap is another curve
        rules = {}
        for K, r in results.items():
            for rule, points in report.exit_curves(report.by_label(r).get(label or "", {})).items():
                rules[rule, int(K)] = [(p["mean_loops"], p["val_bpb"]) for p in points]
        if not rules:
            kept = sorted({k for r in results.values() for k in r if k.startswith(("exit[", "exit_rules["))})
            exit = f"exit[{label}]" if label else "exit"
            raise ValueError(f"{path}: no {exit} curve in its eval.json; run eval.py --modes=bpb,exit "
                             f"--exit_thresholds=..." + (f" (it holds {', '.join(kept)}: --label)" if kept else ""))
        ax.plot(list(fixed), list(fixed.values()), "o--", color=f"C{i}", label=f"{name}: K loops for every token")
        caps = {K for _, K in rules}
        for (rule, K), curve in rules.items():
            what = "exit rule" if {r for r, _ in rules} == {"kl"} else f"{rule} exit rule"
            cap = f", K <= {K}" if len(caps) > 1 else ""
            ax.plot(*zip(*sorted(curve)), RULE_STYLES[rule], color=f"C{i}",
                    alpha=1.0 if K == max(caps) else 0.5,
                    label=f"{name}: {what}{cap} (mean loops per token)")
    ax.set(title="Loops per token against val bpb", xlabel="loops per token", ylabel="val bpb")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def exit_table(evals, labels, label=None):
    """Markdown: for each run and exit rule, the fewest mean loops per token whose val bpb is within
    0.1% and 1% of the run's best fixed-K bpb (report.exit_rows: every K the bpb mode scored), and
    fixed K's own; a row saying so where the run has no fixed-K bpb."""
    rows = []
    for path, name in zip(evals, labels):
        found = report.exit_rows(read_eval(path), None, label or "")
        if not found:
            raise ValueError(f"{path}: no exit curve{f' [{label}]' if label else ''} in its eval.json; "
                             "run eval.py --modes=bpb,exit --exit_thresholds=...")
        rows += [[name, *row] for row in found]
    return report.grid(["run", *report.EXIT_HEADER], rows)


def task_exit_curves(evals, labels):
    """A reasoning task's depth per answer (eval.py --modes=tasks with exit settings: task_exit):
    a row of panels per run, a panel per rule, the mean loops an answer ran against its
    difficulty, a line per threshold (lighter the larger the threshold), its accuracy and mean
    loops in the legend."""
    plt = pyplot()
    runs = []
    for path, name in zip(evals, labels):
        found = [(K, key, r[key]) for K, r in read_eval(path).items() for key in r
                 if key.partition("[")[0] == "task_exit"]
        if not found:
            raise ValueError(f"{path}: no task_exit in its eval.json; run eval.py --modes=tasks "
                             "--exit_rules=... --exit_thresholds=...")
        runs.append((name, found))
    # the rules any run holds, in EXIT_RULES' order: a column each
    held = {rule for _, found in runs for *_, by_rule in found for rule in by_rule}
    rules = [rule for rule in RULE_STYLES if rule in held]
    fig, axes = plt.subplots(len(runs), len(rules), figsize=(4.2 * len(rules), 3.8 * len(runs)),
                             squeeze=False, sharey=True)
    shades = plt.get_cmap("viridis")
    for row, (name, found) in zip(axes, runs):
        for ax, rule in zip(row, rules):
            for K, key, by_rule in found:
                tag = key.partition("[")[2].removesuffix("]")
                ordered = sorted(by_rule.get(rule, []), key=lambda p: p["threshold"])
                for j, p in enumerate(ordered):
                    levels = p["loops_by_difficulty"]
                    ax.plot([int(d) for d in levels], list(levels.values()), RULE_STYLES[rule],
                            color=shades(0.9 * j / max(1, len(ordered) - 1)),
                            label=f"{p['threshold']:g}{f' [{tag}]' if tag else ''}: accuracy "
                                  f"{p['acc']:.3f}, {p['mean_loops']:.2f} loops")
                ax.set_title(f"{name}: {rule}, K <= {K}", fontsize=10)
            ax.set(xlabel="difficulty (prefix length or hops)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=6.5, loc="upper left", title="threshold", title_fontsize=7)
        row[0].set(ylabel="mean loops per answer")
    fig.tight_layout()
    return fig


def depth_curves(evals, labels, loops):
    """A reasoning task's accuracy (eval.py --modes=tasks): against K at evaluation, one line per
    run; and, in a panel per run, against the task's difficulty at every evaluated K (or those of
    `loops`), a line per K. Lines that coincide (two K at 1.0) stay visible: each K has its own
    marker, drawn larger the smaller K is, so equal points show as rings around each other."""
    plt = pyplot()
    runs = []
    for path, label in zip(evals, labels):
        results = {K: r for K, r in read_eval(path).items() if "task_acc" in r}
        if not results:
            raise ValueError(f"{path}: no task accuracy in its eval.json; run eval.py --modes=tasks")
        depth = run_settings(path).get("depth")
        runs.append((f"{label}, {depth} blocks" if depth else label, results))
    evaluated = sorted({K for _, results in runs for K in results})
    # the panels in rows of at most four, the accuracy against K first
    n = 1 + len(runs)
    cols = min(4, n)
    rows = math.ceil(n / cols)
    fig, grid = plt.subplots(rows, cols, figsize=(4.6 * cols, 4.4 * rows), squeeze=False)
    axes = list(grid.flat)
    for ax in axes[n:]:
        ax.remove()
    by_k, panels = axes[0], axes[1:n]
    for i, (label, results) in enumerate(runs):
        by_k.plot(list(results), [r["task_acc"] for r in results.values()], "o-", color=f"C{i}",
                  label=label)
    by_k.set(title="Accuracy against loops at evaluation", xlabel="loops at evaluation (K)",
             ylabel="exact-match accuracy", xscale="log", ylim=(0, 1.05))
    by_k.minorticks_off()
    by_k.set_xticks(evaluated)
    by_k.set_xticklabels(evaluated)
    colors = plt.get_cmap("viridis")
    markers = "osD^vP*X"
    for ax, (label, results) in zip(panels, runs):
        shown = [K for K in loops or evaluated if K in results]
        for j, K in enumerate(shown):
            levels = results[K]["task_acc_by_difficulty"]
            ax.plot([int(d) for d in levels], list(levels.values()), "-",
                    marker=markers[j % len(markers)], ms=4 + 2 * (len(shown) - j), mfc="none",
                    color=colors(j / max(1, len(shown) - 1)), label=f"{label} at K={K}")
        ax.set(title=label, xlabel="difficulty (prefix length or hops)",
               ylabel="exact-match accuracy", ylim=(0, 1.05))
    for ax in axes[:n]:
        ax.grid(alpha=0.3)
        # where it hides the fewest points
        ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------- Table 1
def table(evals, labels, paper=False):
    """Markdown in the paper's Table 1 layout (report.py), one row per run at its training K (every
    evaluated K if the run has no settings.json). Two marks: "-" for a value never measured, and
    "collapsed" (the paper's word, its other cells blank) for a run whose training collapsed: its log
    marks it diverged, or a value at that K is not finite. paper: the paper's row below each run it reports."""
    rows = []
    for path, label in zip(evals, labels):
        settings, collapsed = run_settings(path), diverged(path)
        results = {} if collapsed else read_eval(path)
        for K in [settings["loops"]] if "loops" in settings else list(results) or ["-"]:
            values = report.values(results.get(K, {}))
            bad = any(v is not None and not math.isfinite(v) for v in values)
            rows.append([label or run_name(path), settings.get("depth", "-"), K,
                         *(report.COLLAPSED if collapsed or bad else report.cells(values))])
            key = (settings.get("depth"), model_name(settings), K) if settings else None
            if paper and key in report.PAPER:
                theirs = report.PAPER[key]  # None: collapsed
                rows.append(["paper", key[0], K, *(report.cells([theirs.get(k) for _, k, *_ in report.COLUMNS])
                                                   if theirs else report.COLLAPSED)])
    return report.markdown(["model", "depth", "K"], rows)


# ----------------------------------------------------------------------------- the runs in folders
RUNS_HEADER = ["run", "variant", "K", "dataset", "last step", "val bpb", "final val bpb"]


def find_runs(folders):
    """The runs at or below each folder, each once, by path: the directories that hold train.py's
    settings.json or log.jsonl."""
    found = set()
    for folder in folders:
        for path, _, files in os.walk(folder):
            if {"settings.json", "log.jsonl"} & set(files):
                found.add(os.path.normpath(path))
    return sorted(found)


def runs_table(folders):
    """A Markdown row per run below the folders (find_runs), from its settings.json and log.jsonl
    alone: variant, K, dataset, the last step logged, the last val bpb logged and the final one
    (or, where the log's last end is a divergence, "diverged at step N"); "-" where a file or a
    record is missing."""
    rows = []
    for path in find_runs(folders):
        settings = run_settings(path)
        log = os.path.join(path, "log.jsonl")
        records = read_log(log) if os.path.isfile(log) else []
        val = [f"{r['val_bpb']:.4f}" for r in records if "val_bpb" in r]
        # in step order: a resumed run's later end replaces an earlier one
        final = [f"{r['final_val_bpb']:.4f}" if "final_val_bpb" in r else f"diverged at step {r['step']}"
                 for r in records if "final_val_bpb" in r or r.get("diverged")]
        variant = model_name(settings) if "variant" in settings else "-"
        rows.append([path, variant, settings.get("loops", "-"), settings.get("dataset", "-"),
                     records[-1]["step"] if records else "-", (val or ["-"])[-1], (final or ["-"])[-1]])
    if not rows:
        print(f"runs: no run below {', '.join(folders)} (a run: a folder with train.py's settings.json "
              "or log.jsonl)", file=sys.stderr)
    return report.grid(RUNS_HEADER, rows)


# ----------------------------------------------------------------------------- outputs
# The mark of a figure this script wrote: its Creator (savefig's metadata), in each format that keeps
# one, as that format stores it (PNG's text chunk, PDF's info, SVG's Dublin Core, PostScript's header).
MARK = "python -m scripts.plot"
CREATOR = {".png": b"tEXtCreator\x00", ".pdf": b"/Creator (", ".svg": b"<dc:title>", ".eps": b"%%Creator: ",
           ".ps": b"%%Creator: "}


def written_here(path):
    """Whether the file at path is one this script wrote, which a rerun may replace: a figure whose
    Creator is MARK, or a table (table's, runs_table's) with its header and nothing but its rows."""
    with open(path, "rb") as f:
        content = f.read()
    if any(creator + MARK.encode() in content for creator in CREATOR.values()):
        return True
    headers = (report.markdown(["model", "depth", "K"], []), report.grid(RUNS_HEADER, []),
               report.grid(["run", *report.EXIT_HEADER], []))
    return (any(content.startswith(header.encode()) for header in headers)
            and all(line.startswith(b"|") for line in content.splitlines()))


def check_out(path, force, key="--out"):
    """A FileExistsError naming path, found before any work, if it exists and this script did not
    write it, unless force (None: the program, scripts.bench, has no --force)."""
    if os.path.exists(path) and not force and not written_here(path):
        way = (f"choose another {key}, move the file, or add --force to replace it" if force is not None
               else f"choose another {key}, or move the file")
        raise FileExistsError(f"{key}={path}: exists, and {MARK} did not write it: {way}")


def figure_path(path):
    """The file savefig writes for path: path itself, or, where it has no extension, path with
    matplotlib's default one (fig, fig. -> fig.png), as savefig adds it (save passes the format)."""
    return path if os.path.splitext(path)[1][1:] else path.rstrip(".") + ".png"


def out_file(key, path, figure, force=None):
    """The file an output (key: the setting, "--out"; scripts.bench's "--plot") is written to, checked
    before any work: a figure's figure_path, in an existing directory (errors.output_file), and not
    a file this script did not write (check_out; force None: the program has no --force)."""
    path = figure_path(path) if figure else path
    errors.output_file(key, path)
    check_out(path, force, key)
    return path


def save(fig, out):
    """The figure to out (figure_path: the file written, and named in the line printed), whole."""
    out = figure_path(out)
    fig.tight_layout()
    # the format is out's, not the temporary name's; the mark a rerun knows its figure by
    # (written_here), in the formats that keep one
    fmt = os.path.splitext(out)[1][1:].lower()
    mark = {"Creator": MARK} if f".{fmt}" in CREATOR else None
    try:
        atomic_write(out, lambda tmp: fig.savefig(tmp, format=fmt, dpi=120, metadata=mark))
    finally:
        pyplot().close(fig)
    print(f"wrote {out}")


# the subcommands that print Markdown (and write it to --out), with no matplotlib
TABLES = ("table", "runs", "exit-table")


def main(argv):
    """Runs a subcommand; returns its matplotlib Figure (saved to --out) or, for the TABLES, its
    Markdown."""
    parser = errors.ArgumentParser(prog="python -m scripts.plot", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    helps = {"diag": "residual norm (loop 1), training loss, first-layer FFN gradient norm (Figs. 2-4)",
             "loss": "smoothed training loss; runs that stopped early end in an x (Figs. 5, 10)",
             "val": "val bpb over training, from the logs' evaluations; runs that stopped early end in an x",
             "sweep": "a metric against the loop count at evaluation, one line per trained K (Fig. 6)",
             "resid": "residual-state norm at chosen loops over training (Fig. 7)",
             "grads": "gradient norms of the LM head and the 5th layer's FFN and attention (Fig. 8)",
             "core": "CORE during training (Fig. 9)",
             "exit": "val bpb against loops per token: fixed K and the exit rule (eval.py --modes=bpb,exit)",
             "exit-table": "the fewest loops per token within 0.1% and 1% of the best fixed-K bpb, per exit "
                           "rule, Markdown (eval.py --modes=bpb,exit)",
             "depth": "a reasoning task's accuracy against K and difficulty (eval.py --modes=tasks)",
             "task-exit": "a reasoning task's mean loops per answer against difficulty, per exit rule and "
                          "threshold (eval.py --modes=tasks --exit_rules=...)",
             "table": "eval.json results in the paper's Table 1 layout, Markdown (Tables 1, 2)",
             "runs": "a Markdown row per run below the folders: variant, K, dataset, last step, val bpb"}
    for command, text in helps.items():
        # argparse formats a help with %: a percent sign is written %%
        p = commands.add_parser(command, help=text.replace("%", "%%"), description=text)
        if command == "runs":
            p.add_argument("runs", nargs="+", metavar="folder", help="folders holding runs (out_dirs) at any depth")
        else:
            p.add_argument("runs", nargs="+", help="run directories (out_dir), or files or step_* directories in them")
            p.add_argument("--labels", nargs="+", help="one per run (default: <variant> K=<loops> from settings.json)")
        p.add_argument("-o", "--out", help="Markdown file (default: stdout)" if command in TABLES else
                       f"PNG to write (default: {command}.png in the folder the runs share)")
        p.add_argument("--force", action="store_true", help="replace --out even if this script did not write it "
                       "(a rerun replaces its own file without it)")
    commands.choices["sweep"].add_argument("--metric", help="avg (of the six tasks; the default, or val_bpb "
                                           "where no run has them), val_bpb, wiki_ppl, CORE or a task label "
                                           "(its raw accuracy)")
    commands.choices["resid"].add_argument("--loops", nargs="+", type=int, default=[6, 9, 12], help="loops to show")
    for command in ("exit", "exit-table"):
        commands.choices[command].add_argument("--label", help="the results eval.py kept apart under this "
                                               "label (e.g. bpb_tokens=32768) instead of the default ones")
    commands.choices["depth"].add_argument("--loops", nargs="+", type=int, default=[], help="the Ks whose accuracy by "
                                           "difficulty is drawn (default: every K evaluated)")
    for command in ("diag", "grads"):
        commands.choices[command].add_argument("--clipped", action="store_true", help="gradient norms as the "
                                               "authors' base_check.py logged them: rank 0's own, after clipping")
    commands.choices["table"].add_argument("--paper", action="store_true", help="the paper's numbers below ours")
    args = parser.parse_args(argv)
    if getattr(args, "labels", None) and len(args.labels) != len(args.runs):
        parser.error(f"--labels: {len(args.labels)} given for {len(args.runs)} runs")
    for path in args.runs:
        if not os.path.exists(path):
            what = "folder" if args.command == "runs" else "run, step directory or file"
            raise FileNotFoundError(f"{path}: no such {what}")
    for k in getattr(args, "loops", ()):
        errors.positive("--loops", k)
    if args.command not in TABLES and not args.out:
        # beside the runs, never into the folder the command was run from
        args.out = os.path.join(os.path.commonpath([enclosing_run(p) for p in args.runs]),
                                f"{args.command}.png")
    if args.out:
        # the file written: a figure's with the extension savefig would add
        args.out = out_file("--out", args.out, args.command not in TABLES, args.force)
    if args.command in TABLES:
        if args.command == "runs":
            md = runs_table(args.runs)
        elif args.command == "exit-table":
            md = exit_table(args.runs, args.labels or [default_label(p) for p in args.runs], args.label)
        else:
            md = table(args.runs, args.labels or [None] * len(args.runs), args.paper)
        if args.out:
            atomic_write(args.out, md)
        print(md, end="")
        return md
    labels = args.labels or [default_label(p) for p in args.runs]
    if args.command == "sweep":
        fig = sweep(args.runs, labels, args.metric)
    elif args.command == "exit":
        fig = exit_curves(args.runs, labels, args.label)
    elif args.command == "depth":
        fig = depth_curves(args.runs, labels, args.loops)
    elif args.command == "task-exit":
        fig = task_exit_curves(args.runs, labels)
    else:
        fig = curves(args.command, args.runs, labels, getattr(args, "loops", ()), getattr(args, "clipped", False))
    save(fig, args.out)
    return fig


if __name__ == "__main__":
    with errors.user_errors("scripts.plot"):  # a bad path or input: one line and exit status 1
        main(sys.argv[1:])
