"""--help for the scripts whose module-level variables are their settings (train.py, eval.py,
bench.py; configurator.py calls it): each setting with its default and its comment, as the file
writes them, under the comment lines that group them. And what configurator.py asks of a script's
file: the names it imports (not settings), the values a setting takes, and the errors for a setting
it does not have or a value it does not take; and a config file, run, its mistakes one line naming
its file and line."""
import ast
import difflib
import os
import runpy
import traceback

SETTING_TYPES = (bool, int, float, str, type(None))


def imported(path):
    """The names the Python file at path binds by its top-level imports: module globals that are not its
    own settings. A missing file is a FileNotFoundError naming path as given; its bad syntax a
    ValueError naming its line (located)."""
    with open(path) as f:
        source = f.read()
    try:
        body = ast.parse(source, filename=path).body
    except SyntaxError as e:
        raise ValueError(located(path, e)) from None
    return {(alias.asname or alias.name).split(".")[0] for node in body
            if isinstance(node, (ast.Import, ast.ImportFrom)) for alias in node.names}


def config_file(path):
    """The variables the config file at path sets, as running it (runpy) leaves them, less its
    private names and those it imports. A missing file is a FileNotFoundError naming it; a mistake
    in it, its syntax or any exception while it runs, a ValueError naming its line (located)."""
    theirs = imported(path)
    try:
        ran = runpy.run_path(path)
    except Exception as e:
        raise ValueError(located(path, e)) from None
    return {k: v for k, v in ran.items() if not k.startswith("_") and k not in theirs}


def located(path, e):
    """The message for the exception e the Python file at path raised, or its syntax: `path:line:
    <type>: <message>`, the line the file's own (the innermost of its lines e passed through)."""
    def ours(filename):
        return os.path.abspath(filename) == os.path.abspath(path)
    if isinstance(e, SyntaxError) and e.filename and ours(e.filename):
        return f"{path}:{e.lineno}: SyntaxError: {e.msg}"
    lines = [f.lineno for f in traceback.extract_tb(e.__traceback__) if ours(f.filename)]
    return f"{path}:{lines[-1] if lines else '?'}: {type(e).__name__}: {e}"


def unknown(source, key, defaults):
    """The error message for a setting `key` that is not among `defaults`: the close names, or every one."""
    close = difflib.get_close_matches(key, defaults, n=3, cutoff=0.7)
    hint = f"did you mean {' or '.join(map(repr, close))}?" if close else f"the settings: {', '.join(sorted(defaults))}"
    return f"{source}: unknown setting {key!r}; {hint} (--help lists them)"


def checked(key, value, default, source, words=()):
    """value, if a setting whose default is `default` takes it: a value of the default's type, one
    of the setting's words, any setting type for a None default, an int for a float (as a float);
    else a ValueError naming the key and its source (a config file or --key)."""
    if type(value) is type(default) or value in words:
        return value
    if default is None and type(value) in SETTING_TYPES:
        return value
    if type(default) is float and type(value) is int:
        return float(value)
    got = f"{type(value).__name__} {value!r}"
    raise ValueError(expected(source, key, type(default).__name__, got))


def expected(source, key, allowed, got):
    """The error message for a value the setting `key` does not take: what it takes (`allowed`), and
    what it got, as the message shows it."""
    return f"{source}: setting {key!r} expects {allowed}, got {got}"


def help_requested(argv, path, defaults):
    """With --help or -h in argv: the settings of the script at path printed, and SystemExit(0)."""
    if {"--help", "-h"} & set(argv):
        print(describe(path, defaults))
        raise SystemExit(0)


def describe(path, defaults):
    """The settings block of the script at path: from the comment lines heading its first setting to
    the first line of code that sets none (a setting's comment may go on in indented comment lines)."""
    lines = open(path).read().splitlines()
    first = next((i for i, line in enumerate(lines) if line.partition(" = ")[0] in defaults), None)
    if first is None:
        return f"{path}: no settings"
    while first and lines[first - 1].startswith("#"):  # the headings above the first setting
        first -= 1
    out, seen = [f"{path}: settings (defaults; a config file, then --key=value, override them)"], set()
    for line in lines[first:]:
        key, _, rest = line.partition(" = ")
        if key in defaults and key not in seen:
            seen.add(key)
            out.append(f"  --{key}={defaults[key]!r}".ljust(34) + f" {rest.partition('#')[2].strip()}".rstrip())
        elif line.startswith("#"):  # a group heading
            out.append(line.lstrip("# -").strip())
        elif line.lstrip().startswith("#"):  # the comment of the setting above goes on
            out[-1] += " " + line.strip().lstrip("# ")
        elif line[:1].strip():  # code at the top level: the settings have ended
            break
    return "\n".join(line for line in out if line)
