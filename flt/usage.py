"""--help for the scripts whose module-level variables are their settings (train.py, eval.py,
bench.py; configurator.py calls it): each setting with its default and its comment, as the file
writes them, under the comment lines that group them."""


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
