"""One rule for every entry point (flt/errors.py): a mistake in the user's input (a setting, a path, a
file's contents, the machine) is ONE line on stderr, `<program>: <error type>: <message>`, printed
once per node (local rank 0), and exit status 1; a bug keeps its traceback. The rule in-process, then the commands as a
user types them (each a process forked from one that has imported torch: tests/forkserver.py)."""
import errno
import importlib.util
import json
import os
import sys

import pytest

import forkserver
from configurator import configure, settings_of
from flt import errors, runtime

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def python(*argv):
    return forkserver.run(argv, ROOT, dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT), timeout=300)


# ----------------------------------------------------------------------------- the rule, in-process
@pytest.mark.parametrize("error, user", [
    (ValueError("depth=0: expected a positive integer"), True),
    (FileNotFoundError(2, "No such file or directory", "config/nope.py"), True),
    (runtime.DiskSpaceError("checkpoint step 4", "out", 2_000_000, 1_000, "free some space"), True),
    (OSError(errno.ENOSPC, "No space left on device"), True),  # the disk filled during a write
    (OSError(errno.EROFS, "Read-only file system", "data/embedded.lock"), True),  # a read-only data_dir
    (OSError(errno.EIO, "Input/output error", "out/step_000006/model.pt"), True),  # a disk failing to read
    (ConnectionError("download failed after 1 attempts"), True),
    (PermissionError(13, "Permission denied", "out/run"), True),
    (RuntimeError("an invariant broke"), False), (KeyError("step"), False), (OSError(errno.EBADF, "fd"), False),
])
def test_user_errors_are_one_line_and_bugs_keep_their_traceback(monkeypatch, capsys, error, user):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.raises(SystemExit if user else type(error)) as ended:
        with errors.user_errors("prog"):
            raise error
    err = capsys.readouterr().err
    if user:
        assert ended.value.code == 1 and err == errors.line("prog", error) + "\n" and err.count("\n") == 1
        assert err.startswith(f"prog: {type(error).__name__}: ")
    else:
        assert ended.value is error and err == ""  # raised on: Python prints its traceback


def test_the_line_names_the_file_and_joins_a_message_of_several_lines():
    assert errors.line("train.py", FileNotFoundError(2, "No such file or directory", "config/nope.py")) == \
        "train.py: FileNotFoundError: config/nope.py: No such file or directory"
    several = ValueError("no readable checkpoint in 'out':\n  step_2: truncated\n  step_1: empty\n")
    assert errors.line("eval.py", several) == \
        "eval.py: ValueError: no readable checkpoint in 'out': step_2: truncated; step_1: empty"


def test_each_node_prints_it_once_and_every_rank_exits_1(monkeypatch, capsys):
    """torchrun's ranks 0..3 on two nodes of two: ranks 0 and 2 (LOCAL_RANK 0) print the line."""
    for rank, local_rank, prints in ((0, 0, True), (1, 1, False), (2, 0, True), (3, 1, False)):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("LOCAL_RANK", str(local_rank))
        with pytest.raises(SystemExit) as ended, errors.user_errors("train.py"):
            raise ValueError("loops=0: expected a positive integer")
        line = "train.py: ValueError: loops=0: expected a positive integer\n"
        assert ended.value.code == 1 and capsys.readouterr() == ("", line if prints else "")


def test_the_hook_of_a_flat_script_follows_the_same_rule(monkeypatch, capsys):
    """train.py has no main() to wrap: errors.install sets sys.excepthook, which Python calls with the
    exception that ends the script (and then exits with status 1)."""
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # restored after the test
    tracebacks = []
    monkeypatch.setattr(sys, "__excepthook__", lambda *exc: tracebacks.append(exc[1]))
    errors.install("train.py")
    sys.excepthook(ValueError, ValueError("loops=0: expected a positive integer"), None)
    bug = RuntimeError("an invariant broke")
    sys.excepthook(RuntimeError, bug, None)
    assert capsys.readouterr().err == "train.py: ValueError: loops=0: expected a positive integer\n"
    assert tracebacks == [bug]


def test_a_command_line_mistake_of_an_argparse_script_is_a_value_error():
    """scripts/ and flt.corpus parse with errors.ArgumentParser: argparse's usage lines and exit 2
    become one ValueError, which user_errors prints as the one line."""
    from scripts import plot
    with pytest.raises(ValueError, match=r"^the following arguments are required: runs \(python -m scripts.plot "
                                         r"sweep --help shows the usage\)$"):
        plot.main(["sweep"])
    with pytest.raises(ValueError, match=r"^unrecognized arguments: --nope"):
        plot.main(["table", "run", "--nope"])


# ----------------------------------------------------------------------------- settings a file declares
def test_imported_names_and_constants_are_not_settings(tmp_path):
    """A script's settings are the public simple-typed variables it assigns itself: eval.py imports
    ROPE_SPAN from model.py and holds constants (MODES); neither is a setting."""
    import eval as ev
    settings = settings_of(vars(ev))
    assert "ROPE_SPAN" not in settings and "MODES" not in settings and {"loops", "modes", "out"} <= set(settings)
    with pytest.raises(ValueError, match="--ROPE_SPAN: unknown setting 'ROPE_SPAN'"):
        configure(dict(settings), ["--ROPE_SPAN=2"])
    script = tmp_path / "script.py"
    script.write_text("from math import pi\nimport os\nLIMIT = 3\ndepth = 2\nname = 'x'\n")
    namespace = {"pi": 3.14, "os": os, "LIMIT": 3, "depth": 2, "name": "x", "__file__": str(script)}
    assert settings_of(namespace) == {"depth": 2, "name": "x"}


def test_a_misspelt_setting_is_answered_with_the_close_names(tmp_path):
    with pytest.raises(ValueError, match=r"^--lops: unknown setting 'lops'; did you mean 'loops'\?"):
        configure(dict(loops=3, depth=2), ["--lops=3"])
    with pytest.raises(ValueError, match="^--zzz: unknown setting 'zzz'; the settings: depth, loops"):
        configure(dict(loops=3, depth=2), ["--zzz=3"])
    config = tmp_path / "c.py"
    config.write_text("import math\nfrom os import sep\ndepht = 3\n")  # imports are not settings
    with pytest.raises(ValueError, match=f"^{config}: unknown setting 'depht'; did you mean 'depth'"):
        configure(dict(loops=3, depth=2), [str(config)])


# ----------------------------------------------------------------------------- the commands
def one_line(p, expected):
    """The process ended with status 1 and printed exactly `expected` on stderr, one line."""
    assert (p.returncode, p.stderr) == (1, expected + "\n"), p.stderr[-3000:]


def test_train_py_mistakes_are_one_line_each(tmp_path):
    """The mistakes of a first hour with train.py, each stopped before any data or model work."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "log.jsonl").write_text('{"step": 0}\n')
    where = [f"--data_dir={tmp_path / 'data'}"]
    run = str(tmp_path / "run")
    torch_version = __import__("torch").__version__
    mistakes = [
        ([f"--out_dir={run}"], f"ValueError: out_dir={run!r} already holds a run (log.jsonl): continue it with "
                               "--resume, choose another --out_dir, or replace it with --overwrite"),
        (["--device=cuda"], f"ValueError: device='cuda', but this torch ({torch_version}) sees no CUDA device; "
                            "use --device=cpu"),
        (["--loops=0"], "ValueError: loops=0: expected a positive integer"),
        (["--lops=3"], "ValueError: --lops: unknown setting 'lops'; did you mean 'loops'? (--help lists them)"),
        (["config/nope.py"], "FileNotFoundError: config/nope.py: No such file or directory"),
    ]
    for args, message in mistakes:
        if "cuda" in args[0] and __import__("torch").cuda.is_available():
            continue
        one_line(python("train.py", *where, f"--out_dir={tmp_path / 'new'}", *args), f"train.py: {message}")
    assert sorted(os.listdir(tmp_path)) == ["run"]  # no corpus, no run directory


def test_eval_py_refuses_a_constant_as_a_setting(tmp_path):
    one_line(python("eval.py", str(tmp_path), "--ROPE_SPAN=2"),
             "eval.py: ValueError: --ROPE_SPAN: unknown setting 'ROPE_SPAN'; the settings: " +
             ", ".join(sorted(settings_of(vars(__import__("eval"))))) + " (--help lists them)")


def test_plot_sweep_without_core_draws_val_bpb_and_says_so(tmp_path, capsys):
    """A sweep's default is Table 1's six-task average; runs evaluated without CORE have none, so it
    draws val_bpb and says so; a run with no metric at all is one line naming what eval.py computes."""
    from scripts import plot
    step = tmp_path / "run" / "step_000010"
    step.mkdir(parents=True)
    (step / "eval.json").write_text(json.dumps({"step": 10, "results": {"1": {"val_bpb": 2.0}, "3": {"val_bpb": 1.9}}}))
    if importlib.util.find_spec("matplotlib"):
        fig = plot.main(["sweep", str(tmp_path / "run"), "-o", str(tmp_path / "sweep.png")])
        assert [list(line.get_ydata()) for line in fig.axes[0].get_lines()] == [[2.0, 1.9]]
        assert capsys.readouterr().out.splitlines()[0] == (
            "sweep: no run has Table 1's six tasks (eval.py --modes=core), so no six-task average: drawing "
            "val_bpb; --metric draws another of: val_bpb")
    (step / "eval.json").write_text(json.dumps({"step": 10, "results": {"1": {"samples": ["The"]}}}))
    one_line(python("-m", "scripts.plot", "sweep", str(tmp_path / "run")),
             "scripts.plot: ValueError: the six-task average (avg) or val_bpb: not in the runs' eval.json; they "
             "have: no metric "
             "(eval.py --modes=bpb,wiki,core computes them)")
