"""One rule for every entry point (flt/errors.py): a mistake in the user's input (a setting, a path, a
file's contents, the machine) is ONE line on stderr, `<program>: <error type>: <message>`, printed by
rank 0 only, and exit status 1; a bug keeps its traceback."""
import errno
import sys

import pytest

from flt import errors, runtime


# ----------------------------------------------------------------------------- the rule, in-process
@pytest.mark.parametrize("error, user", [
    (ValueError("depth=0: expected a positive integer"), True),
    (FileNotFoundError(2, "No such file or directory", "config/nope.py"), True),
    (runtime.DiskSpaceError("checkpoint step 4", "out", 2_000_000, 1_000, "free some space"), True),
    (OSError(errno.ENOSPC, "No space left on device"), True),  # the disk filled during a write
    (ConnectionError("download failed after 1 attempts"), True),
    (PermissionError(13, "Permission denied", "out/run"), True),
    (RuntimeError("an invariant broke"), False), (KeyError("step"), False), (OSError(errno.EIO, "I/O"), False),
])
def test_user_errors_are_one_line_and_bugs_keep_their_traceback(monkeypatch, capsys, error, user):
    monkeypatch.delenv("RANK", raising=False)
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


def test_only_rank_0_prints_and_every_rank_exits_1(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(SystemExit) as ended, errors.user_errors("train.py"):
        raise ValueError("loops=0: expected a positive integer")
    assert ended.value.code == 1 and capsys.readouterr() == ("", "")


def test_the_hook_of_a_flat_script_follows_the_same_rule(monkeypatch, capsys):
    """train.py has no main() to wrap: errors.install sets sys.excepthook, which Python calls with the
    exception that ends the script (and then exits with status 1)."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # restored after the test
    tracebacks = []
    monkeypatch.setattr(sys, "__excepthook__", lambda *exc: tracebacks.append(exc[1]))
    errors.install("train.py")
    sys.excepthook(ValueError, ValueError("loops=0: expected a positive integer"), None)
    bug = RuntimeError("an invariant broke")
    sys.excepthook(RuntimeError, bug, None)
    assert capsys.readouterr().err == "train.py: ValueError: loops=0: expected a positive integer\n"
    assert tracebacks == [bug]
