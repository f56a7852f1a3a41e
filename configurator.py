"""nanoGPT-style settings: a script's module-level variables *are* its settings.
    python train.py config/flt_base.py --loops=9 --resume
A config file (positional) overrides the defaults, each --key=value overrides both, a bare
--key sets a boolean. Unknown keys and wrong types are errors naming the key, never ignored.
"""
import ast
import types

SETTING_TYPES = (bool, int, float, str, type(None))
BOOLS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def settings_of(namespace):
    """The settings in a module namespace: public variables of simple types."""
    return {k: v for k, v in namespace.items() if not k.startswith("_") and type(v) in SETTING_TYPES}


def _checked(key, value, default, source):
    if type(value) is type(default) or (default is None and type(value) in SETTING_TYPES):
        return value
    if type(default) is float and type(value) is int:
        return float(value)
    raise ValueError(f"{source}: setting {key!r} expects {type(default).__name__}, "
                     f"got {type(value).__name__} {value!r}")


def _parse(key, raw, default, source):
    if isinstance(default, str):
        return raw                       # strings are taken as written: --loops=1,3,6
    if isinstance(default, bool):
        if raw.lower() not in BOOLS:
            raise ValueError(f"{source}: setting {key!r} expects a bool (true/false), got {raw!r}")
        return BOOLS[raw.lower()]
    try:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        if default is not None:
            raise ValueError(f"{source}: setting {key!r} expects {type(default).__name__}, "
                             f"got {raw!r}") from None
        value = raw                      # a None default accepts a bare string
    return _checked(key, value, default, source)


def describe(path, defaults):
    """--help: every setting of the script at path with its default and its comment, under the
    comment lines that group them in the file."""
    lines = open(path).read().splitlines()
    spans = {}
    for node in ast.parse("\n".join(lines)).body:  # the block of settings: from the first to the next code
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name) and node.targets[0].id in defaults:
            spans[node.lineno] = node
        elif spans and not isinstance(node, (ast.Import, ast.ImportFrom)):
            break
    if not spans:
        return f"{path}: no settings"
    out, first, last = [f"{path}: settings (defaults; a config file, then --key=value, override them)"], min(spans), \
        max(node.end_lineno for node in spans.values())
    while first > 1 and lines[first - 2].startswith("#"):  # the headings above the first setting
        first -= 1
    for number, line in enumerate(lines[first - 1:last], start=first):
        text = line.strip()
        if number in spans:
            key, comment = spans[number].targets[0].id, line.partition("#")[2].strip()
            out.append(f"  --{key}={defaults[key]!r}".ljust(34) + f" {comment}".rstrip())
        elif text.startswith("#") and line.startswith("#"):  # a group heading
            out.append(text.lstrip("# -").strip() or "")
        elif text.startswith("#"):  # the comment of the setting above goes on
            out[-1] += " " + text.lstrip("# ")
    return "\n".join(line for line in out if line)


def configure(namespace, argv, source=None):
    """Apply config files and --key=value flags from argv to the settings in namespace
    (a script's globals()), in place. Returns the final settings as a dict. --help (or -h) prints
    the settings of the script `source` (default: namespace's __file__) and exits."""
    defaults = settings_of(namespace)
    if {"--help", "-h"} & set(argv):
        print(describe(source or namespace["__file__"], defaults))
        raise SystemExit(0)
    for arg in argv:
        if not arg.startswith("--"):
            if not arg.endswith(".py"):
                raise ValueError(f"{arg!r}: expected a config file (*.py) or --key=value")
            scope = {}
            with open(arg) as f:  # FileNotFoundError names the file
                exec(compile(f.read(), arg, "exec"), scope)
            for key, value in scope.items():
                if key.startswith("_") or isinstance(value, types.ModuleType):
                    continue  # builtins, and imports a config file may use
                if key not in defaults:
                    raise ValueError(f"{arg}: unknown setting {key!r}")
                namespace[key] = _checked(key, value, defaults[key], arg)
            continue
        key, sep, raw = arg[2:].partition("=")
        if key not in defaults:
            raise ValueError(f"--{key}: unknown setting {key!r}; known: {', '.join(sorted(defaults))}")
        if not sep and not isinstance(defaults[key], bool):
            raise ValueError(f"--{key}: expected --{key}=value")
        namespace[key] = _parse(key, raw, defaults[key], f"--{key}") if sep else True
    return settings_of({k: namespace[k] for k in defaults})
