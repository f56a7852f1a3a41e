"""Files written whole or not at all, without torch (scripts/plot.py runs without it): a
temporary name no other process writes to, renamed over the file; and names that replace nothing.
flt/runtime.py: atomic_dir does the same for a directory.

    atomic_write(path, text)             # readers see the old file or the new one
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png"))
    unused_name(path + ".old")           # path.old, or path.old2, ...: a name nothing holds
"""
import os
import socket


def temp_path(path):
    """path + a suffix no other process writes to: its host and pid. Processes on several nodes may
    prepare files in one shared directory at once (flock does not reach across NFS or Lustre
    clients everywhere), and pids alone repeat across hosts (containers start them at 1)."""
    return f"{path}.tmp.{socket.gethostname()}.{os.getpid()}"


def atomic_write(path, content):
    """Write content (str, bytes, or a function that writes the file it is given) to path + a temp
    suffix, then rename it over path: readers see the old file or the new one, never half of one. A
    write that fails (a full disk) leaves no temp file behind."""
    tmp = temp_path(path)
    try:
        if callable(content):
            content(tmp)
        else:
            with open(tmp, "wb" if isinstance(content, bytes) else "w") as f:
                f.write(content)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def unused_name(path):
    """path, or path2, path3, ...: the first that does not exist (a rename never replaces)."""
    n = 1
    found = path
    while os.path.lexists(found):
        n += 1
        found = f"{path}{n}"
    return found
