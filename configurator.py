"""nanoGPT-style settings: a script's module-level variables *are* its settings.
    python train.py config/flt_base.py --loops=9 --resume
A config file (positional) overrides the defaults, each --key=value overrides both, a bare
--key sets a boolean. Order does not matter: files first, in their order, then flags.
Errors (an unknown key, a wrong type) name the key, or a config file and its line.
"""
import ast

from flt import usage

BOOLS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def settings_of(namespace):
    """The settings in a module namespace: public variables of simple types, not UPPERCASE
    constants or names its file imports (eval.py's ROPE_SPAN is model.py's, not a setting)."""
    theirs = usage.imported(namespace["__file__"]) if "__file__" in namespace else ()
    public = {k: v for k, v in namespace.items() if not k.startswith("_") and not k.isupper()}
    return {k: v for k, v in public.items() if k not in theirs and type(v) in usage.SETTING_TYPES}


def _parse(key, raw, default, source, words=()):
    """The value of --key=raw: a string as written, a bool from its words, else a Python literal
    of the default's type (usage.checked)."""
    if isinstance(default, str) or raw in words:
        return raw  # strings are taken as written: --loops=1,3,6
    if isinstance(default, bool):
        if raw.lower() not in BOOLS:
            allowed = " or ".join(("a bool (true/false)",) + words)
            raise ValueError(usage.expected(source, key, allowed, repr(raw)))
        return BOOLS[raw.lower()]
    try:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        value = raw  # a bare string: only a None default takes it (usage.checked)
    return usage.checked(key, value, default, source)


def configure(namespace, argv, source=None):
    """Apply config files and --key=value flags from argv to the settings in namespace (a
    script's globals()), in place; return the final settings as a dict. --help (or -h) prints
    the settings of the script `source` (default: namespace's __file__) and exits. A script's
    `_ALSO_ACCEPTS = {key: (word, ...)}` lets a setting also take those strings (--resume=auto)."""
    defaults, words = settings_of(namespace), namespace.get("_ALSO_ACCEPTS", {})
    usage.help_requested(argv, source or namespace.get("__file__"), defaults)  # prints, exits
    # the files first, then the flags (a stable sort)
    for arg in sorted(argv, key=lambda a: a.startswith("--")):
        if arg.startswith("--"):
            key, sep, raw = arg[2:].partition("=")
            if key not in defaults:
                raise ValueError(usage.unknown(f"--{key}", key, defaults))
            if not sep and not isinstance(defaults[key], bool):
                raise ValueError(f"--{key}: expected --{key}=value")
            raw = raw if sep else "true"  # a bare --key sets a boolean
            namespace[key] = _parse(key, raw, defaults[key], f"--{key}", words.get(key, ()))
        elif arg.endswith(".py"):
            # run as Python; its mistake: an error naming its line
            for key, value in usage.config_file(arg).items():
                if key not in defaults:
                    raise ValueError(usage.unknown(arg, key, defaults))
                namespace[key] = usage.checked(key, value, defaults[key], arg,
                                               words.get(key, ()))
        else:
            raise ValueError(f"{arg!r}: expected a config file (*.py) or --key=value")
    return settings_of({k: namespace[k] for k in defaults})
