"""Every command the README and docs/ show runs as written: its settings parse and pass its program's
own checks, with no work done (nothing trained, loaded, measured or downloaded), so a documented
command cannot drift from the code.

The commands are those of train.py, eval.py, `python -m scripts.*` and `python -m flt.*` in a page's
shell blocks (fenced or indented) and inline code, a placeholder filled with the value the pages
recommend. bash expands each line as a reader's shell would (loops, braces, globs, variables), with
only stand-ins on its PATH that print their arguments. Each command is then checked in this process,
in a folder that holds what a reader following the pages has: the repository's folders, the runs
its training commands make (an out_dir and its checkpoints, as empty model.pt files), the folders
its exports make, and the two inputs no command makes (GIVEN)."""
import contextlib
import io
import os
import re
import runpy
import shlex
import shutil
import subprocess
import sys
import warnings
from types import SimpleNamespace
from unittest.mock import patch

import pytest
import torch

from configurator import configure, settings_of
from flt import authors, corpus, eval_settings, planning, runtime
from test_configs import train_defaults

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md"] + sorted(f"docs/{f}" for f in os.listdir(os.path.join(ROOT, "docs"))
                               if f.endswith(".md"))
# a shell line that runs one of the project's programs
PROGRAM = re.compile(r"(?:^|\s)(?:train\.py|eval\.py|-m\s+(?:scripts|flt)\.\w+)(?:\s|$)")
FIRST_WORDS = ("python", "torchrun", "srun", "for", "pip")
# A placeholder of the pages and the value they recommend for it
PLACEHOLDERS = (
    # import_authors writes a new run; eval.py reads the quick start's
    ("<their dir> <run>", "~/.cache/nanochat/base_checkpoints/FLT_L9_D12_END_attnfull out/theirs"),
    ("<run>", "out/d3_flt_k3"),
    (r"\bRUNS\b", "out/d3_flt_k3 out/d3_lt_k3"),
    # the reasoning run that eval.py's tasks mode scores
    (r"\bRUN\b", "out/reasoning/d2_flt_k4_s3"),
    # drafting: FLT's recommendation (docs/beyond.md), two loops drafting 8 tokens
    (r"--draft_loops=K_d\b", "--draft_loops=2"),
    (r"--draft_len=g\b", "--draft_len=8"),
    (r"--loops=K\b", "--loops=9"),
    # the exit mode's sweep, as its rerun command writes it out (docs/beyond.md)
    (r"--loops=1,\.\.\.,12\b", "--loops=1,2,3,4,5,6,7,8,9,10,11,12"),
    (r"--exit_thresholds=1,0\.3,\.\.\.,0\b", "--exit_thresholds=1,0.3,0.1,0.03,0.01,0.003,0.001,0"),
)
# the shell variables a page leaves to the reader's shell or scheduler
SHELL = {"k": "9", "s": "base", "v": "FLT", "NODE_RANK": "0", "HOST": "localhost",
         "SLURM_NNODES": "2", "SLURM_JOB_ID": "1"}
# what the pages assume a reader has, which no documented command makes
GIVEN = ("home/.cache/nanochat/base_checkpoints/FLT_L9_D12_END_attnfull/", "qwen3/tokenizer.json")
BASH = shutil.which("bash")
# a variable the later lines of a page use, computed by `python -c` (the standard library's folder):
# run too, so that they see it; it runs no program of the project
COMPUTED = re.compile(r"[A-Z_]+=\$\(python -c .*\)")
# the stand-ins: python and torchrun print their arguments (unit separator between, record
# separator after), but `python -c`, a value a page computes (the standard library's folder), runs;
# srun runs its command; pip installs nothing
STAND_INS = r"""
shown() { local a; for a in "$@"; do printf '%s\037' "$a"; done; printf '\036'; }
python() { if [ "$1" = -c ]; then "$PYTHON" "$@"; else shown python "$@"; fi; }
torchrun() { shown torchrun "$@"; }
srun() { "$@"; }
pip() { :; }
"""


# ----------------------------------------------------------------------------- the pages' commands
def is_command(line):
    words = line.split()
    starts = words and (words[0] in FIRST_WORDS or re.fullmatch(r"[A-Z_]+=\S*", words[0]))
    return (bool(starts) and bool(PROGRAM.search(line))) or bool(COMPUTED.fullmatch(line))


def shell_lines(block, first_line):
    """[(line number, line)] of a shell block's commands, a line continued by a backslash joined."""
    found, pending, start = [], "", first_line
    for i, line in enumerate(block.split("\n")):
        start = start if pending else first_line + i
        pending += line.strip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        if is_command(pending):
            found.append((start, pending))
        pending = ""
    return found


def inline(span):
    """An inline span as a command: `eval.py ...` and `train.py ...` run with python; eval.py's
    run, where the span leaves it out, is the quick start's."""
    span = " ".join(span.split())
    if re.match(r"(?:train|eval)\.py\s", span):
        span = f"python {span}"
    return re.sub(r"^python eval\.py (--)", r"python eval.py out/d3_flt_k3 \1", span)


def documented():
    """[(where, the command as the page writes it, as it is run)] of every page, in order."""
    found = []
    for page in PAGES:
        with open(os.path.join(ROOT, page), encoding="utf-8") as f:
            text = f.read()
        lines, blocks = [], []
        fence = re.compile(r"^( *)```(\w*)\n(.*?)^\1```", re.DOTALL | re.MULTILINE)
        for m in fence.finditer(text):
            if m.group(2) in ("", "bash", "sh"):
                blocks.append((text.count("\n", 0, m.start(3)) + 1, m.group(3)))
        # fenced blocks blanked, line numbers kept: then indented blocks and inline code
        prose = fence.sub(lambda m: "\n" * m.group(0).count("\n"), text)
        for m in re.finditer(r"(?:^\n)((?: {4,}\S.*\n)+)", prose, re.MULTILINE):
            blocks.append((prose.count("\n", 0, m.start(1)) + 1, m.group(1)))
        for first, block in blocks:
            lines += shell_lines(block, first)
        for m in re.finditer(r"`([^`]+)`", prose):
            if is_command(inline(m.group(1))):
                lines.append((prose.count("\n", 0, m.start()) + 1, inline(m.group(1))))
        for number, line in sorted(lines):
            run = line
            for placeholder, value in PLACEHOLDERS:
                run = re.sub(placeholder, value, run)
            found.append((f"{page}:{number}", line, run))
    return found


def expand(lines, world):
    """[the command lines each line of shell runs], bash expanding them in the folder `world`, all in
    one shell, each line alone (eval) so that a mistake in one leaves the others."""
    env = {"PATH": os.path.join(world, "no programs"), "HOME": os.path.join(world, "home"),
           "PYTHON": sys.executable, **SHELL}
    script = STAND_INS + "".join(f"eval {shlex.quote(line)}\nprintf '\\035'\n" for line in lines)
    p = subprocess.run([BASH, "--noprofile", "--norc", "-c", script], cwd=world, env=env,
                       capture_output=True, text=True, timeout=60)
    outputs = p.stdout.split("\035")[:-1]
    assert len(outputs) == len(lines), p.stderr
    return [[record.split("\037")[:-1] for record in out.split("\036")[:-1]] for out in outputs]


def program(argv):
    """(the program: train.py, eval.py, scripts.X, flt.X or another, its arguments, the processes
    that run it) of a command line."""
    runner, *rest = argv
    processes = 1
    if runner == "torchrun":
        options = [a for a in rest[:next(i for i, a in enumerate(rest) if not a.startswith("-"))]]
        counts = dict(a[2:].split("=", 1) for a in options if "=" in a)
        processes = int(counts.get("nproc_per_node", 1)) * int(counts.get("nnodes", 1))
        rest = rest[len(options):]
    if rest[0] == "-m":
        rest = rest[1:]
    return rest[0], rest[1:], processes


# ----------------------------------------------------------------------------- each program's checks
# Each takes the arguments and the processes and raises what the program would raise; a program that
# would write a run or a folder makes an empty one, as a reader's next command finds it.
def trained(s):
    """train.py's run directory with the checkpoints it keeps, each an empty model.pt."""
    last = s["num_steps"] if s["num_steps"] > 0 else s["save_interval"]
    saved = sorted({*range(s["save_interval"], last, s["save_interval"]), last})
    for step in saved[-s["keep_checkpoints"]:] if s["keep_checkpoints"] else saved:
        os.makedirs(os.path.join(s["out_dir"], f"step_{step:06d}"), exist_ok=True)
        open(os.path.join(s["out_dir"], f"step_{step:06d}", "model.pt"), "w").close()


def check_train(args, processes):
    """train.py's settings checks, as it makes them before any work (configurator.configure, then
    planning.check_settings and the batch split over its processes); the run it would write."""
    defaults = train_defaults()
    s = configure(dict(defaults), args, source=os.path.join(ROOT, "train.py"))
    planning.check_settings(s, defaults)
    s["out_dir"] = planning.out_dir_of(s)
    planning.check_grad_accum(s["total_batch_size"],
                              s["device_batch_size"] * s["sequence_len"] * processes)
    trained(s)


def check_eval(args, processes):
    """eval.py's settings, read and checked before its checkpoint loads."""
    import eval as evaluation
    eval_settings.read(args, settings_of(vars(evaluation)), evaluation.__file__)


def check_plot(args, processes):
    """scripts.plot's main, every figure and table stood in for (a table by an empty one): its
    argument checks alone."""
    from scripts import plot
    work = ("sweep", "exit_curves", "depth_curves", "task_exit_curves", "curves", "save",
            "default_label")
    with contextlib.ExitStack() as stack:
        for name in work:
            stack.enter_context(patch.object(plot, name, lambda *a, **k: None))
        for name in ("table", "exit_table"):
            stack.enter_context(patch.object(plot, name, lambda *a, **k: ""))
        plot.main(args)


def check_lm_eval(args, processes):
    from scripts import lm_eval_flt
    lm_eval_flt.parse(args)


def check_export(args, processes):
    """scripts.export_hf's main, the export stood in for by the folder it makes."""
    from scripts import export_hf
    with patch.object(export_hf, "export", lambda run, out, *a: os.makedirs(out, exist_ok=True)):
        export_hf.main(args)


def check_import(args, processes):
    """scripts.import_authors's main, the import stood in for by the run it makes."""
    from scripts import import_authors
    with patch.object(authors, "import_run", lambda src, out, *a: os.makedirs(out, exist_ok=True)):
        import_authors.main(args)


def check_bench(args, processes):
    """scripts.bench's settings checks (at its top level, over sys.argv), the machine's device
    taken as given; and, for a mode that reads runs, their checks (checked_runs)."""
    def on_this_machine(device):
        return SimpleNamespace(device="cpu", device_type="cpu")
    with patch.object(sys, "argv", ["scripts.bench", *args]), \
            patch.object(runtime, "setup", on_this_machine):
        settings = runpy.run_module("scripts.bench", run_name="scripts.bench.settings")
    if settings["mode"] in ("cache", "speculative"):
        settings["checked_runs"]()


class Checked(Exception):
    """main() got past its checks."""


def check_exit_gate(args, processes):
    """flt.exit_gate's main up to where it sets up the machine: its settings checks."""
    from flt import exit_gate

    def stop(device):
        raise Checked
    with patch.object(runtime, "setup", stop), pytest.raises(Checked):
        exit_gate.main(args)


def check_gpu_check(args, processes):
    """scripts.gpu_check as python -m runs it, up to where it sets up the machine: its settings
    and main's checks; a GPU taken as given."""
    def stop(device):
        raise Checked
    with patch.object(sys, "argv", ["scripts.gpu_check", *args]), \
            patch.object(runtime, "setup", stop), patch.object(torch.cuda, "is_available", lambda: True), \
            pytest.raises(Checked):
        runpy.run_module("scripts.gpu_check", run_name="__main__")


def check_torchrun_check(args, processes):
    """scripts.torchrun_check as python -m runs it, up to its first work (the embedded corpus): its
    settings and main's checks; a GPU taken as given."""
    def stop(data_dir):
        raise Checked
    with patch.object(sys, "argv", ["scripts.torchrun_check", *args]), \
            patch.object(corpus, "embedded_corpus", stop), \
            patch.object(torch.cuda, "is_available", lambda: True), pytest.raises(Checked):
        runpy.run_module("scripts.torchrun_check", run_name="__main__")


CHECKS = {"train.py": check_train, "eval.py": check_eval, "scripts.plot": check_plot,
          "scripts.lm_eval_flt": check_lm_eval, "scripts.export_hf": check_export,
          "scripts.import_authors": check_import, "scripts.bench": check_bench,
          "scripts.gpu_check": check_gpu_check, "scripts.torchrun_check": check_torchrun_check,
          "flt.exit_gate": check_exit_gate}


def check(argv):
    """None if the command's settings pass its program's checks (or it only prints its --help),
    else what the program would say."""
    name, args, processes = program(argv)
    if name not in CHECKS and not name.startswith(("scripts.", "flt.")) and name != "train.py":
        return None  # not one of the project's programs: pytest, tests/mutants.py
    if name not in CHECKS:
        return f"{name}: no way to check its settings without running it"
    err = io.StringIO()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err), \
                warnings.catch_warnings():
            warnings.filterwarnings("ignore", "'scripts\\.", RuntimeWarning)
            CHECKS[name](args, processes)
    except SystemExit as e:
        # --help prints and exits 0; a user's mistake, caught by the script itself, exits 1
        return None if e.code in (0, None) else err.getvalue().strip() or f"exit status {e.code}"
    except Exception as e:  # noqa: BLE001 - any error is the message the reader would meet
        return f"{type(e).__name__}: {e}"
    return None


COMMANDS = documented()


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """(A folder as a reader following every page has it, {command: the command lines it runs
    there}): the repository's folders, config/, the given inputs, then every run and folder the
    pages' commands make."""
    world = str(tmp_path_factory.mktemp("reader"))
    for folder, subfolders, _ in os.walk(ROOT):
        subfolders[:] = [d for d in subfolders if not d.startswith((".", "__", "out", "data", "hf"))]
        os.makedirs(os.path.join(world, os.path.relpath(folder, ROOT)), exist_ok=True)
    shutil.copytree(os.path.join(ROOT, "config"), os.path.join(world, "config"), dirs_exist_ok=True)
    os.makedirs(os.path.join(world, "no programs"))
    for path in GIVEN:
        os.makedirs(os.path.dirname(os.path.join(world, path)), exist_ok=True)
        if not path.endswith("/"):
            open(os.path.join(world, path), "w").close()
    runs = [run for _, _, run in COMMANDS]
    here = os.getcwd()
    os.chdir(world)
    try:
        for commands in expand(runs, world):
            for argv in commands:
                if program(argv)[0] in ("train.py", "scripts.export_hf", "scripts.import_authors"):
                    check(argv)
    finally:
        os.chdir(here)
    # expanded again: a glob now finds the runs
    return world, dict(zip(runs, expand(runs, world)))


def test_the_pages_show_commands_of_every_program(world):
    _, expanded = world
    shown = {program(argv)[0] for commands in expanded.values() for argv in commands}
    assert set(CHECKS) <= shown, set(CHECKS) - shown
    assert len(COMMANDS) > 60


@pytest.mark.parametrize("where, line, run", COMMANDS, ids=[w for w, _, _ in COMMANDS])
def test_the_documented_command_passes_its_checks(where, line, run, world, monkeypatch):
    folder, expanded = world
    monkeypatch.chdir(folder)
    assert expanded[run] or COMPUTED.fullmatch(run), f"{where}: bash ran nothing of: {run}"
    failures = [f"{' '.join(argv)}\n    {why}" for argv in expanded[run] if (why := check(argv))]
    assert not failures, f"{where}: {line}\n  " + "\n  ".join(failures)
