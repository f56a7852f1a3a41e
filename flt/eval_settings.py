"""eval.py's settings, read and checked before any work. A bad value, or a setting that none of the
modes asked for reads, is a ValueError (a FileNotFoundError for a path; a FileExistsError for an
--out eval.py did not write) naming what the user typed and what it allows; eval.py prints it as one
line (flt/errors.py).

    path, settings = eval_settings.read(argv, settings_of(globals()), __file__)
    run_modes = eval_settings.chosen_modes(settings.modes)        # in the order of modes.PLANS
    loops_list = eval_settings.loop_budgets(settings.loops)       # sorted, each once
    exits = eval_settings.exit_plan(settings, defaults, run_modes)   # {rule: thresholds}
    eval_settings.check_checkpoint(settings.modes, run_modes, meta)   # once it is loaded
    eval_settings.check_gate(settings, exits, model, meta)            # the gate rule has a gate
    eval_settings.check_out(settings.out)   # read's check of --out: a .json path, eval.py's own if it exists

`settings` holds the values as given (eval.json records them); the functions above parse the lists.
"""
import os
from types import SimpleNamespace

from configurator import configure
from flt import errors, report, tasks, tracking
from flt.decoding import EXIT_RULES, check_cache_slots
from flt.decoding import check_draft
from flt.modes import PLANS, sample_prompts
from flt.runtime import dtype_bytes

# The settings only some modes read: given to a run of other modes they would do nothing, so they are
# refused. The others (modes, loops, device, dtype, out, wandb) serve every mode; the exit settings
# (exit_plan) and draft_len have checks of their own below.
READ_BY = {"batch_size": ("bpb", "wiki", "core", "exit", "tasks"),
           "bpb_tokens": ("bpb", "exit"), "protocol_ranks": ("bpb", "exit"),
           "protocol_batch": ("bpb", "wiki", "exit"), "val_files": ("bpb", "exit"),
           "data_dir": ("bpb", "wiki", "core", "exit"),
           "wiki_path": ("wiki",), "wiki_url": ("wiki",),
           "bundle_dir": ("core",), "bundle_url": ("core",), "max_per_task": ("core",),
           "sample_tokens": ("sample",), "prompt": ("sample",), "temperature": ("sample",),
           "seed": ("sample",), "cache_slots": ("sample",), "draft_loops": ("sample",),
           "draft_len": ("sample",), "task_items": ("tasks",),
           "exit_rules": ("exit", "tasks"), "exit_thresholds": ("exit", "tasks"),
           "argmax_counts": ("exit", "tasks")}
# Counts that must be positive integers
COUNTS = ("batch_size", "bpb_tokens", "protocol_ranks", "protocol_batch", "sample_tokens", "task_items")


def read(argv, defaults, source):
    """(the checkpoint's path, the settings) of eval.py's command line over its settings (defaults,
    read from the script `source`), every value checked. A checkpoint's file (step_*/model.pt)
    stands for its folder."""
    if {"--help", "-h"} & set(argv):
        # prints the settings and exits
        configure(defaults, argv, source=source)
    if not argv or argv[0].startswith("--") or argv[0].endswith(".py"):
        raise ValueError("usage: python eval.py <checkpoint dir> [config.py] [--key=value ...]; "
                         "--help lists the settings")
    # a copy of the defaults: importing eval.py (train.py, the tests) keeps them
    settings = SimpleNamespace(**configure(dict(defaults), argv[1:]))
    run_modes = chosen_modes(settings.modes)
    loops_list = loop_budgets(settings.loops)
    check_read(settings, defaults, run_modes)
    exit_plan(settings, defaults, run_modes)
    check_sampling(settings, defaults, loops_list)
    # the inputs a mode reads, found before any model time is spent
    given = [("--val_files", f) for f in settings.val_files.split(",") if f]
    given += [("--wiki_path", settings.wiki_path)] if settings.wiki_path else []
    for key, path in given:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{key}={path}: no such file")
    for key in COUNTS:
        errors.positive(f"--{key}", getattr(settings, key))
    if settings.max_per_task == 0 or settings.max_per_task < -1:
        raise ValueError(f"--max_per_task={settings.max_per_task!r}: expected -1 (every item) or a "
                         "positive count")
    # "" = the dtype the checkpoint was trained with
    if settings.dtype:
        dtype_bytes(settings.dtype)
    if settings.out:
        check_out(settings.out)
    errors.directory("--data_dir", settings.data_dir)
    if settings.wandb:
        # installed? found before any model time is spent
        tracking.require("--wandb=True")
    return checkpoint_path(argv[0]), settings


def check_out(path):
    """--out=path: the JSON file eval.py merges its results into (report.write_results), its table
    written to the .md beside it. A ValueError unless path ends in .json (a .md: the table's own
    file); a FileNotFoundError without its directory; a FileExistsError if a file there is not an
    eval.json eval.py wrote (eval_py_wrote): a checkpoint's file, lm_eval_flt's lm_eval.json, a
    user's JSON, one cut off. Each names path and touches nothing. An eval.json of another
    checkpoint is eval.py's own: write_results renames it aside."""
    ext = os.path.splitext(path)[1].lower()
    if ext == ".md":
        # the JSON's table goes to the .md beside it: the same file, were --out one
        raise ValueError(f"--out={path}: the JSON file, and eval.py writes its table to the .md beside it: "
                         "give a .json path (e.g. results.json, its table results.md)")
    if ext != ".json":
        raise ValueError(f"--out={path}: not a .json path; eval.py writes its JSON there and its table to the "
                         ".md beside it: give a .json path (e.g. results.json, its table results.md)")
    errors.output_file("--out", path)
    if os.path.exists(path) and not eval_py_wrote(path):
        raise FileExistsError(f"--out={path}: exists, and is not an eval.json of eval.py, which would merge its "
                              "results into it: move the file, or give --out another .json path")


def eval_py_wrote(path):
    """Whether the file at path is an eval.json eval.py wrote: report.read_results reads it, and each
    of its runs is eval.py's, its settings naming the modes run (lm_eval_flt's lm_eval.json has the
    same layout, its runs the harness's tasks)."""
    try:
        runs = report.read_results(path)["runs"]
    except (ValueError, OSError):
        return False
    settings = [r.get("settings") if isinstance(r, dict) else None for r in runs.values()]
    return bool(settings) and all(isinstance(s, dict) and "modes" in s for s in settings)


def chosen_modes(value):
    """The modes of a --modes setting such as "bpb,core", in the order of modes.PLANS."""
    asked = [m.strip() for m in value.split(",") if m.strip()]
    if not asked or set(asked) - set(PLANS):
        raise ValueError(f"--modes={value!r}: expected a comma-separated subset of {','.join(PLANS)}")
    return [m for m in PLANS if m in asked]


def loop_budgets(value):
    """The loop budgets K of a --loops setting such as "1,3,6,9,12": sorted, each once. Anything but
    comma-separated integers >= 1 is a ValueError naming the setting (eval.py, lm_eval_flt.py)."""
    budgets = [v.strip() for v in str(value).split(",") if v.strip()]
    if not budgets or not all(v.isdigit() and int(v) >= 1 for v in budgets):
        raise ValueError(f"--loops={value!r}: expected comma-separated integers >= 1, e.g. 1,3,6,9,12")
    return sorted(set(map(int, budgets)))


THRESHOLDS = ("--exit_thresholds={!r}: the exit mode needs comma-separated thresholds >= 0 for its "
              "rules other than argmax (kl, entropy: nats; latent: a relative change; gate: a "
              "probability), e.g. 0.1,0.03,0.01")


def exit_thresholds(value):
    """The thresholds of an --exit_thresholds setting such as "0.1,0.01"; [] for ""."""
    try:
        thresholds = [float(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise ValueError(THRESHOLDS.format(value)) from None
    if not all(t >= 0 for t in thresholds):
        raise ValueError(THRESHOLDS.format(value))
    return thresholds


def exit_rules(value):
    """The rules of an --exit_rules setting such as "kl,argmax" (flt/decoding.py: EXIT_RULES), each
    once, in EXIT_RULES' order."""
    asked = [r.strip() for r in value.split(",") if r.strip()]
    if not asked or set(asked) - set(EXIT_RULES):
        raise ValueError(f"--exit_rules={value!r}: expected comma-separated exit rules of "
                         f"{','.join(EXIT_RULES)}, e.g. kl,entropy,argmax")
    return [r for r in EXIT_RULES if r in asked]


def argmax_counts(value):
    """The argmax rule's thresholds, an --argmax_counts setting such as "1,2,3": the loops a
    position's top-1 token must stay the same, integers >= 1, sorted, each once."""
    counts = [v.strip() for v in str(value).split(",") if v.strip()]
    if not counts or not all(v.isdigit() and int(v) >= 1 for v in counts):
        raise ValueError(f"--argmax_counts={value!r}: expected comma-separated integers >= 1 (the "
                         "loops the top-1 token must stay the same), e.g. 1,2,3")
    return sorted(set(map(int, counts)))


# The settings of depth per token, read by the exit mode and, when one is given, the tasks mode
EXIT_SETTINGS = ("exit_rules", "exit_thresholds", "argmax_counts")


def exit_plan(settings, defaults, run_modes):
    """{rule: its thresholds} the exit and tasks modes score, {} for none: each rule of --exit_rules
    at --exit_thresholds, argmax at --argmax_counts (its thresholds are integers, so one list
    cannot serve it). The exit mode scores them always; the tasks mode when any of EXIT_SETTINGS
    is given. A ValueError names a setting that would do nothing or is missing."""
    rules = exit_rules(settings.exit_rules)
    thresholds = exit_thresholds(settings.exit_thresholds)
    counts = argmax_counts(settings.argmax_counts)
    given = [key for key in EXIT_SETTINGS if getattr(settings, key) != defaults[key]]
    if "exit" not in run_modes and not ("tasks" in run_modes and given):
        return {}
    if "argmax" not in rules and settings.argmax_counts != defaults["argmax_counts"]:
        raise ValueError(f"--argmax_counts={settings.argmax_counts!r} does nothing without the "
                         f"argmax rule: add it to --exit_rules={settings.exit_rules!r}, or remove "
                         "it")
    if rules != ["argmax"] and not thresholds:
        raise ValueError(THRESHOLDS.format(settings.exit_thresholds))
    if rules == ["argmax"] and thresholds:
        raise ValueError(f"--exit_thresholds={settings.exit_thresholds!r} does nothing with "
                         "--exit_rules='argmax', whose thresholds are --argmax_counts: remove it")
    return {rule: counts if rule == "argmax" else thresholds for rule in rules}


def check_gate(settings, exits, model, meta):
    """A ValueError unless a model scored with the gate rule carries a trained exit gate
    (exit_gate.pt beside its model.pt, attached by flt/checkpoint.py: load_model)."""
    if "gate" in exits and getattr(model, "exit_gate", None) is None:
        raise ValueError(f"--exit_rules={settings.exit_rules!r}: {meta['path']} has no exit gate "
                         "(exit_gate.pt beside model.pt); train one with `python -m flt.exit_gate "
                         "RUN`")


def check_read(settings, defaults, run_modes):
    """A ValueError naming the first setting off its default that none of run_modes reads."""
    for key, readers in READ_BY.items():
        value = getattr(settings, key)
        if value != defaults[key] and not set(readers) & set(run_modes):
            which = f"{readers[0]} mode"
            if len(readers) > 1:
                which = f"{', '.join(readers[:-1])} and {readers[-1]} modes"
            raise ValueError(f"--{key}={value!r} is read by the {which}, not by "
                             f"--modes={settings.modes!r}: remove it, or add a mode that reads it")


def check_sampling(settings, defaults, loops_list):
    """The sample mode's settings: its prompts (modes.sample_prompts: none empty), a temperature
    >= 0, a seed only when sampling, the cache's loop slots (at most the smallest K), and drafting
    (decoding.check_draft) at each K above draft_loops, of which there must be one: the other K
    decode without drafting."""
    sample_prompts(settings.prompt)
    if settings.temperature < 0:
        raise ValueError(f"--temperature={settings.temperature!r}: expected 0 (greedy) or a positive "
                         "number")
    if settings.seed != defaults["seed"] and settings.temperature == 0:
        raise ValueError(f"--seed={settings.seed!r} does nothing at --temperature=0 (greedy decoding): "
                         "remove it, or sample at a temperature > 0")
    check_cache_slots(settings.cache_slots, loops_list, prefix="--")
    draft_loops = settings.draft_loops
    if draft_loops is None:
        if settings.draft_len != defaults["draft_len"]:
            raise ValueError(f"--draft_len={settings.draft_len!r} does nothing without --draft_loops: "
                             "remove it, or draft")
        return
    drafted = [K for K in loops_list if isinstance(draft_loops, int) and K > draft_loops]
    # none: the largest K's check names the bound
    for K in drafted or loops_list[-1:]:
        check_draft(K, draft_loops, settings.draft_len, settings.cache_slots, prefix="--")


def checkpoint_path(path):
    """The checkpoint directory of eval.py's argument: the path itself, or the folder of a file in
    one (step_*/model.pt, an exported folder's files)."""
    folder = os.path.dirname(path) or "."
    if os.path.isfile(path) and any(os.path.isfile(os.path.join(folder, name))
                                    for name in ("model.pt", "model.safetensors")):
        return folder
    if not os.path.isdir(path):
        what = "a file, not a" if os.path.isfile(path) else "no such"
        raise FileNotFoundError(f"{path}: {what} checkpoint directory (a run's out_dir, a step_* "
                                "directory or an exported folder)")
    return path


def check_checkpoint(modes, run_modes, meta):
    """A ValueError unless the loaded checkpoint (meta) can run every mode asked for (--modes=modes):
    the tasks mode scores a model trained on a synthetic task (flt/tasks.py)."""
    trained = meta.get("settings", {})
    if "tasks" in run_modes and ("dataset" not in trained or tasks.task_of(trained) is None):
        raise ValueError(f"--modes={modes!r}: the tasks mode scores a model trained on a task "
                         f"({', '.join(tasks.TASKS)}), and {meta['path']} was trained on "
                         f"dataset={trained.get('dataset')!r}")
