"""One rule for every entry point (train.py, eval.py, the scripts): a mistake in what the user gave
(a setting, a path, a file's contents, the machine) ends the program with ONE line on stderr,
`<program>: <error type>: <message>`, printed once per node under torchrun (by its LOCAL_RANK 0: on a
cluster each node's log says why it stopped), and exit status 1; the message names the setting, file
or value and says what is allowed. Anything else is a bug and keeps its traceback. The exit codes a
program documents (train.py's preemption and divergence) are its own: they are not exceptions. No
torch here: scripts.plot runs without it.

    errors.install("train.py")                 # a flat script, from its first lines on
    with errors.user_errors("eval.py"):        # a script with a main()
        main(sys.argv[1:])
    errors.ArgumentParser(prog="python -m scripts.plot")  # argparse's, its mistakes one line too
    errors.positive("--repeats", repeats)      # the checks every entry point makes before any work
    errors.output_file("--plot", plot)
"""
import argparse
import contextlib
import errno
import os
import sys
import traceback

# What a user's input or machine raises. A full disk is an OSError with errno ENOSPC (or EDQUOT):
# runtime.DiskSpaceError, checked before writing, or the write itself; a read-only one, EROFS; one
# failing to read, EIO (checkpoint.load_file names the file).
USER_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError, FileExistsError,
               PermissionError, ConnectionError)
DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO)


def is_user_error(e):
    return isinstance(e, USER_ERRORS) or (isinstance(e, OSError) and e.errno in DISK_ERRNOS)


def line(program, e):
    """The one line: the program, the error's type and its message, a message's lines joined."""
    message = f"{e.filename}: {e.strerror}" if isinstance(e, OSError) and e.filename and e.strerror else str(e)
    text = ""
    for part in filter(None, (p.strip() for p in message.splitlines())):
        text += (" " if text.endswith(":") else "; ") + part if text else part
    return f"{program}: {type(e).__name__}: {text}"


def explained(e):
    """What a caller that goes on after e (eval.py: the other modes still run) prints: a user's
    error, its message; a bug, its message and its traceback."""
    if is_user_error(e):
        return str(e)
    return f"{e}\n" + "".join(traceback.format_exception(e)).rstrip()


# what a user's error ending the program undoes first (on_user_error): e.g. a run directory
# checkpoint.claim_out_dir made, still empty
UNDO = []


def on_user_error(undo):
    """Call undo() if the program ends on a user's error (report)."""
    UNDO.append(undo)


def missing(path):
    """The directories of path that do not exist yet, innermost first: what making it creates."""
    made = []
    parent = os.path.abspath(path)
    while not os.path.exists(parent):
        made.append(parent)
        parent = os.path.dirname(parent)
    return made


def remove_empty(made):
    """Remove the directories `made` (innermost first) while they hold nothing."""
    for path in made:
        if not os.path.isdir(path) or os.listdir(path):
            return
        os.rmdir(path)


def report(program, e):
    """The line on stderr (once per node: its local rank 0), what on_user_error registered undone,
    and the process group, if any, ended."""
    if int(os.environ.get("LOCAL_RANK", 0)) == 0:
        print(line(program, e), file=sys.stderr, flush=True)
    while UNDO:
        UNDO.pop()()
    dist = sys.modules.get("torch.distributed")  # imported by the program if it uses one
    if dist and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


# The exit status of a Ctrl-C: the shell's for a program SIGINT ended (128 + 2); one that reaches
# the program here (train.py's training loop saves first: flt/cluster.py) is one line, no traceback
INTERRUPTED = 130


def interrupted(program):
    """A Ctrl-C's line on stderr, and what on_user_error registered undone: the status to exit with."""
    if int(os.environ.get("LOCAL_RANK", 0)) == 0:
        print(f"{program}: interrupted (Ctrl-C)", file=sys.stderr, flush=True)
    while UNDO:
        UNDO.pop()()
    return INTERRUPTED


@contextlib.contextmanager
def user_errors(program):
    """A user's mistake raised inside: its line and SystemExit(1); a Ctrl-C: its line and
    SystemExit(130); any other exception goes on."""
    try:
        yield
    except KeyboardInterrupt:
        raise SystemExit(interrupted(program)) from None
    except Exception as e:
        if not is_user_error(e):
            raise
        report(program, e)
        raise SystemExit(1) from None


def install(program):
    """The same rule for an exception that ends the script (sys.excepthook): Python then exits with
    1; a Ctrl-C exits with 130 after its line."""
    def hook(kind, e, tb):
        if isinstance(e, KeyboardInterrupt):
            sys.stdout.flush()
            os._exit(interrupted(program))
        if is_user_error(e):
            report(program, e)
        else:
            sys.__excepthook__(kind, e, tb)
    sys.excepthook = hook


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser whose command-line mistakes follow the rule: a ValueError (one line through
    user_errors) instead of argparse's usage lines and exit status 2. --help prints the usage."""

    def error(self, message):
        raise ValueError(f"{message} ({self.prog} --help shows the usage)")


# ----------------------------------------------------------------------------- checks of inputs
# What every entry point checks before its first expensive step, each a one-line error naming the
# setting as the program spells it (key: "--repeats", "loops").

def positive(key, value):
    """A count: a ValueError unless value is an integer >= 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{key}={value!r}: expected a positive integer")


def output_file(key, path):
    """A file the program will write: a FileNotFoundError unless its directory exists and path is
    not itself a directory, found before any work rather than at the end of it."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path) or not os.path.isdir(folder):
        raise FileNotFoundError(f"{key}={path}: expected a file in an existing directory "
                                f"({'it is a directory' if os.path.isdir(path) else f'no directory {folder}'})")


def directory(key, path):
    """A directory the program reads or creates: a ValueError if path is a file."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{key}={path}: a file, not a directory")
