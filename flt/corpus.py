"""Corpus files, everything the tutorial reads but need not see: downloads, FineWeb-Edu shards,
manifests, the embedded corpus, and the evaluation inputs (the validation shard, WikiText-2, CORE).

data.py (tokenizers, the streaming loader) and eval.py read what this module fetches or builds. A
download is locked (concurrent ranks fetch a file once), resumed, retried and renamed into place
only when whole. Shards are parquet files with a `text` column; the last is validation. A
manifest.json beside complete shards records their sizes and rows, checked whenever they are used.

Several nodes may prepare one directory on a shared filesystem at once, and flock does not exclude
processes of different hosts on every NFS or Lustre mount: the lock only spares work. What makes
it safe is that every file is written under a name of its own host (and process) and renamed into
place whole: a file renamed by two hosts gets the same bytes twice (a download is the server's
file, a build is deterministic); a directory renamed second finds the first one in place and uses
it. Before bytes are written, the free space is checked (runtime.check_free_space).

    python -m flt.corpus --download 249   # the authors' 249 training shards + their validation shard
    python -m flt.corpus --embedded       # build the embedded corpus (no network)
"""
import argparse
import contextlib
import csv
import fcntl
import filecmp
import functools
import importlib
import inspect
import json
import math
import os
import pathlib
import pkgutil
import random
import re
import shutil
import socket
import sys
import tempfile
import threading
import time
import warnings
import zipfile
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction

import pyarrow as pa
import pyarrow.parquet as pq
import requests
from urllib3.exceptions import NameResolutionError
import yaml

from flt import errors, runtime
from flt.files import unused_name
from flt.runtime import atomic_write

DEFAULT_BASE_URL = "https://huggingface.co/datasets/karpathy/fineweb-edu-100b-shuffle/resolve/main"
SHARD_NAME = "shard_{:05d}.parquet"
LAST_SHARD = 1822  # shard_00000 .. shard_01822 on the hub
# The authors download shards 0..249 (run.sh: `-n 250`) and their loader validates on the last file
# it finds: shard_00249. Their training files are the 249 before it; more training shards skip 249.
VAL_SHARD, AUTHORS_TRAIN_SHARDS = 249, 249
# Shard sizes, from nanochat's speedrun.sh: each shard holds ~250M characters, ~100 MB of parquet.
# At ~4.5 characters per Qwen3 token that is ~55M tokens. The margin covers the uncertain characters
# per token (nanochat rounds its 216 shards up to 240), so a run does not silently repeat its data.
SHARD_TOKENS, SHARD_GB, SHARD_MARGIN = 55e6, 0.1, 1.1
DEFAULT_DATA_DIR = "data"
TOKENIZER_URL = "https://huggingface.co/{name}/resolve/main/tokenizer.json"  # data.load_tokenizer's hub names
MANIFEST = "manifest.json"  # beside complete shards: each one's size and rows, checked on use
TIMEOUT = (5, 30)  # seconds to connect (an unreachable host fails fast), then between two reads
PROGRESS_SECONDS = 10  # download progress: a line per finished file, else at most one per 10 s


# ---- Files: a lock so concurrent ranks do the work once, and a robust download
@contextlib.contextmanager
def locked(path):
    """Exclusive lock on path + '.lock'. flock is released by the kernel even if we crash.

    The lock file is removed while held, so none is left behind; a waiter that then gets the lock
    of the removed file sees it is no longer the one at the path, and starts over.
    """
    lock = path + ".lock"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    while True:
        f = open(lock, "a")
        fcntl.flock(f, fcntl.LOCK_EX)
        with contextlib.suppress(FileNotFoundError):
            if os.path.samestat(os.fstat(f.fileno()), os.stat(lock)):
                break
        f.close()
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):  # a host whose flock did not exclude ours removed it
            os.remove(lock)
        f.close()


class Progress:
    """Progress lines of long work: `label: done/total unit (percent), rate, ETA`, at most one per
    PROGRESS_SECONDS and one at the end; with each=True a line per finished unit too (downloaded
    files: few and slow). Downloads also count bytes (n=0, n_bytes) and show MB and MB/s. Thread-safe:
    download_shards' threads share one."""

    def __init__(self, label, total, unit, log=functools.partial(print, flush=True), each=False):
        self.label, self.total, self.unit, self.log, self.each = label, total, unit, log, each
        self.done, self.bytes, self.start = 0, 0, time.monotonic()
        self.last, self.lock = self.start, threading.Lock()

    def __call__(self, n=1, n_bytes=0):
        with self.lock:
            self.done, self.bytes, now = self.done + n, self.bytes + n_bytes, time.monotonic()
            if not (n and (self.each or self.done == self.total)) and now - self.last < PROGRESS_SECONDS:
                return
            self.last, seconds = now, max(now - self.start, 1e-3)
            line = f"{self.label}: {self.done:,}/{self.total:,} {self.unit}"
            if self.bytes:
                line += f", {self.bytes / 1e6:,.1f} MB, {self.bytes / 1e6 / seconds:.1f} MB/s"
            else:
                rate = self.done / seconds
                eta = f"{(self.total - self.done) / rate:.0f} s" if rate else "?"
                line += f" ({100 * self.done / max(self.total, 1):.0f}%), {rate:.3g} {self.unit}/s, ETA {eta}"
            self.log(line)


def _fetch(url, part, progress):
    """One attempt: fetch url into the temp file `part`, resuming it with a Range request. The bytes
    the response announces must fit on the disk before any is written."""
    have = os.path.getsize(part) if os.path.exists(part) else 0
    # identity encoding: a Range counts bytes of the stored file, not of a gzip stream
    headers = {"Accept-Encoding": "identity"} | ({"Range": f"bytes={have}-"} if have else {})
    with requests.get(url, headers=headers, stream=True, timeout=TIMEOUT) as r:
        if r.status_code == 416:  # our partial file is stale or already whole: start over
            os.remove(part)
            raise requests.ConnectionError(f"range {have}- not satisfiable, restarting")
        r.raise_for_status()
        if r.status_code != 206:  # the server ignored Range and sends the whole file
            have = 0
        expected = have + int(r.headers["Content-Length"]) if "Content-Length" in r.headers else None
        if expected is not None:
            runtime.check_free_space(os.path.dirname(part), expected - have, f"downloading {url}",
                                     "nothing more was written; free some space, or choose another data_dir")
        with open(part, "ab" if have else "wb") as f:
            for chunk in r.iter_content(1 << 16):
                f.write(chunk)
                progress(0, len(chunk))
    if expected is not None and os.path.getsize(part) != expected:
        raise requests.ConnectionError(f"got {os.path.getsize(part)} of {expected} bytes")


def _part(path):
    """Where a download of path collects its bytes: this host's own file, which a restart resumes."""
    return f"{path}.part.{socket.gethostname()}"


def tokenizer_file(name, cache_dir=None):
    """name itself, unless it is a hub name like 'Qwen/Qwen3-0.6B' (not a file): then its tokenizer.json,
    downloaded into cache_dir (default data/) once."""
    if os.path.exists(name) or name.endswith(".json") or name.count("/") != 1:
        return name
    return download(TOKENIZER_URL.format(name=name),
                    os.path.join(cache_dir or DEFAULT_DATA_DIR, name.replace("/", "--") + ".tokenizer.json"),
                    hint="offline? give the path of a tokenizer.json instead (setting tokenizer)")


def download(url, path, retries=5, backoff=1.0, hint=None, progress=None):
    """Download url to path once: retries with exponential back-off, resume, atomic rename.

    Concurrent callers wait on the lock; bytes go to path + '.part.<host>', renamed only when
    complete: a restart on the same host resumes it, another host sharing the directory (whose
    lock may not exclude ours) writes its own. hint ends the error message: how to do without the network.
    """
    made, parent = [], os.path.dirname(os.path.abspath(path))
    while not os.path.isdir(parent):  # the folders this call creates: a failure removes them again
        made.append(parent)
        parent = os.path.dirname(parent)
    try:
        with locked(path):
            if os.path.exists(path):  # already there, or another rank finished it while we waited
                return path
            part, progress = _part(path), progress or Progress(path, 1, "files", each=True)
            for attempt in range(1, retries + 1):
                try:
                    _fetch(url, part, progress)
                    os.replace(part, path)
                    progress()
                    return path
                except requests.RequestException as e:  # dropped connection, timeout, 5xx: retry
                    error, status = e, e.response.status_code if isinstance(e, requests.HTTPError) else 0
                    if isinstance(getattr(e.args[0] if e.args else None, "reason", None), NameResolutionError):
                        break  # no such host, or no network at all: waiting cannot help
                    if 400 <= status < 500 and status not in (408, 429):
                        # wrong URL or no access: retrying cannot help, and there is nothing to resume
                        with contextlib.suppress(FileNotFoundError):
                            os.remove(part)
                        break
                if attempt < retries:
                    time.sleep(backoff * 2 ** (attempt - 1))
            hint = hint or "offline? put the file at that path yourself (data_dir says where files are)"
            raise ConnectionError(f"download failed after {attempt} attempts: {url} -> {path}: {error}\n{hint}")
    except BaseException:
        for folder in made:  # deepest first; one that holds anything (a resumable .part file) stays
            with contextlib.suppress(OSError):
                os.rmdir(folder)
        raise


# ---- Parquet shards (a string column `text`) and the manifest that vouches for complete ones
def open_parquet(path):
    """Open a shard, turning a missing, truncated, empty or text-less file into an error naming it."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no such parquet file: {path}")
    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"{path}: not a readable parquet file (truncated or corrupt?): {e}") from e
    columns = {f.name: f.type for f in pf.schema_arrow}
    if columns.get("text") not in (pa.string(), pa.large_string()) or pf.metadata.num_rows == 0:
        raise ValueError(f"{path}: {pf.metadata.num_rows} rows, columns "
                         f"{ {k: str(t) for k, t in columns.items()} }; shards need a string column "
                         "named 'text' and at least one row")
    return pf


def row_groups(path):
    """The number of row groups of a shard (open_parquet's checks first)."""
    with open_parquet(path) as pf:
        return pf.num_row_groups


def read_texts(path, row_group):
    with open_parquet(path) as pf:
        try:
            return pf.read_row_group(row_group, columns=["text"]).column("text").to_pylist()
        except (pa.ArrowException, OSError) as e:
            raise ValueError(f"{path}: row group {row_group} is unreadable: {e}") from e


def _rows(path):
    with open_parquet(path) as pf:
        return pf.metadata.num_rows


def _read_manifest(directory):
    """directory's manifest.json, {shard name: {"bytes", "rows"}}; {} if there is none. A file of
    another shape (a user's, another tool's, unreadable) is a ValueError naming it: it is never read
    as empty, so never rewritten."""
    path = pathlib.Path(directory, MANIFEST)
    if not path.exists():
        return {}
    try:
        manifest = json.loads(path.read_text())
        ours = isinstance(manifest, dict) and all(isinstance(v, dict) and {"bytes", "rows"} <= v.keys()
                                                  for v in manifest.values())
    except ValueError:  # not JSON, or not text
        ours = False
    if not ours:
        raise ValueError(f"{path}: not this project's {MANIFEST} (a JSON object {{shard: {{\"bytes\", "
                         f"\"rows\"}}}}), and it is never rewritten: move it out of {directory}, or choose "
                         "another data_dir")
    return manifest


def write_manifest(directory, names):
    """Record the complete shards' sizes and rows in directory/manifest.json, keeping other entries.
    Read, merged, and replaced whole (runtime.atomic_write). Without a lock across hosts, a host
    writing other names at the same moment may drop ours; whoever uses them next records them again."""
    path = os.path.join(directory, MANIFEST)
    with locked(path):
        manifest = _read_manifest(directory)
        for name in names:
            shard = os.path.join(directory, name)
            manifest[name] = {"bytes": os.path.getsize(shard), "rows": _rows(shard)}
        text = json.dumps(manifest, indent=1, sort_keys=True)
        atomic_write(path, text)


def verify_manifest(directory, names):
    """The shards `names` the directory's manifest cannot vouch for (missing, or not listed).

    A listed shard whose size or rows changed is a ValueError naming it: a truncated or replaced
    file would silently change the training set or the validation split.
    """
    manifest, unknown = _read_manifest(directory), []
    for name in names:
        path, want = os.path.join(directory, name), manifest.get(name)
        if want is None or not os.path.exists(path):
            unknown.append(name)
        elif os.path.getsize(path) != want["bytes"] or _rows(path) != want["rows"]:
            raise ValueError(f"{path}: {os.path.getsize(path):,} bytes, but {MANIFEST} recorded "
                             f"{want['bytes']:,} bytes and {want['rows']:,} rows when it was complete "
                             "(truncated or replaced?)")
    return unknown


# ---- FineWeb-Edu: the authors' shards, as many as a run needs
def shards_for_tokens(n_tokens):
    """FineWeb-Edu training shards holding n_tokens tokens, with SHARD_MARGIN to spare."""
    # exact: in floats 50e6 * 1.1 / 55e6 is 1.0000000000000002, and 50M tokens would ask for 2 shards
    n = math.ceil(Fraction(n_tokens) * Fraction(str(SHARD_MARGIN)) / Fraction(SHARD_TOKENS))
    if not 1 <= n <= LAST_SHARD:
        raise ValueError(f"{n_tokens:,} training tokens would need {n} shards of ~{SHARD_TOKENS:.3g} tokens "
                         f"(x{SHARD_MARGIN} margin); FineWeb-Edu has 1..{LAST_SHARD} training shards")
    return n


def shard_names(n):
    """The first n training shards in order (VAL_SHARD left out), then the validation shard."""
    if not 1 <= n <= LAST_SHARD:
        raise ValueError(f"number of training shards must be in 1..{LAST_SHARD}, got {n}")
    train = [i for i in range(LAST_SHARD + 1) if i != VAL_SHARD][:n]
    return [SHARD_NAME.format(i) for i in [*train, VAL_SHARD]]


def download_shards(n, data_dir, base_url=DEFAULT_BASE_URL, retries=5, backoff=1.0, hint=None):
    """Paths of shard_names(n) (validation last), fetched 4 at a time; n=AUTHORS_TRAIN_SHARDS is their data.

    Shards already in data_dir must match its manifest; the manifest then records them all.
    """
    names = shard_names(n)
    # a manifest.json that is not this project's: its own error, before any shard is looked at
    recorded = _read_manifest(data_dir)
    try:
        todo = [name for name in verify_manifest(data_dir, names)
                if not os.path.exists(os.path.join(data_dir, name))]
    except ValueError as e:
        raise ValueError(f"{e}; delete it to download it again") from e
    print(f"FineWeb-Edu: {n} training + 1 validation shards in {data_dir}: "
          f"{len(names) - len(todo)} present, downloading {len(todo)} (~{len(todo) * SHARD_GB:.1f} GB)")
    # The space they need, before the first byte: a size the manifest recorded (a shard downloaded
    # before, since deleted), else SHARD_GB, less what this host's partial downloads already hold.
    # (Each download also checks its response's exact Content-Length before writing.)
    needed = 0
    for name in todo:
        part = _part(os.path.join(data_dir, name))
        needed += recorded.get(name, {}).get("bytes", int(SHARD_GB * 1e9))
        needed -= os.path.getsize(part) if os.path.exists(part) else 0
    runtime.check_free_space(data_dir, needed, f"downloading {len(todo)} FineWeb-Edu shards",
                             "nothing was downloaded; free some space, choose another data_dir, or train on "
                             "fewer shards (num_shards)")
    hint = hint or f"offline? put the shards in data_dir={data_dir!r}, or use dataset='embedded'"
    progress = Progress(f"downloading shards into {data_dir}", len(todo), "files", each=True)
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda name: download(f"{base_url}/{name}", os.path.join(data_dir, name), retries,
                                            backoff, hint, progress), todo))
    write_manifest(data_dir, names)
    return [os.path.join(data_dir, name) for name in names]


# ---- The embedded corpus: ~1.7 MB of English prose that ships with every Python
# Modules that act on import (open a browser, print, touch the terminal) or are not prose (encodings:
# ~100 codec stubs); distutils/lib2to3 are deprecated and environment-dependent: not deterministic.
_SKIP_MODULES = {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "readline",
                 "rlcompleter", "test", "encodings", "distutils", "lib2to3"}
EMBEDDED_SHARDS = 5      # 4 training shards + 1 validation shard
EMBEDDED_ROW_GROUP = 16  # documents per row group: several row groups per shard, for the ranks
EMBEDDED_VAL_FRACTION = 0.08  # of the characters


def _public(name):
    return not any(part.startswith("_") or part in ("test", "tests") for part in name.split("."))


def _doc(obj):
    doc = getattr(obj, "__doc__", None)
    return inspect.cleandoc(doc) if isinstance(doc, str) else ""


# sys's hooks as Python starts; a program may replace them (train.py's errors.install sets excepthook)
_SYS_HOOKS = {n: getattr(sys, f"__{n}__") for n in ("excepthook", "displayhook", "breakpointhook",
                                                      "unraisablehook") if hasattr(sys, f"__{n}__")}


def _stdlib(module_name):
    """Whether a routine's __module__ is the standard library's (or unknown, as C methods')."""
    return module_name is None or module_name.split(".")[0] in sys.stdlib_module_names


def _module_doc(mod):
    """The module's docstring, then each public class/function it defines (and their methods);
    for sys, its hooks as Python started, so the corpus does not depend on the program building it."""
    parts = [_doc(mod)]
    for name, obj in sorted((vars(mod) | (_SYS_HOOKS if mod is sys else {})).items()):
        if not (_public(name) and (inspect.isclass(obj) or inspect.isroutine(obj))
                and getattr(obj, "__module__", None) == mod.__name__):
            continue  # skip re-exports, so each docstring appears once
        # obj.__doc__, not inspect.getdoc: getdoc falls back to inherited docstrings (duplicates)
        if doc := _doc(obj):
            parts.append(f"{name}\n{doc}")
        if inspect.isclass(obj):
            # methods the class defines, not ones another library attached to it later
            # (transformers adds Logger.info_once to logging's Logger)
            parts += [f"{name}.{m}\n{_doc(f)}" for m, f in sorted(vars(obj).items())
                      if _public(m) and inspect.isroutine(f) and _doc(f)
                      and _stdlib(getattr(f, "__module__", None))]
    return "\n\n".join(p for p in parts if p)


def _embedded_documents():
    """One document per reference-manual topic and per stdlib module, in a fixed order."""
    from pydoc_data.topics import topics
    docs = list(dict.fromkeys(topics[key] for key in sorted(topics)))  # 'if' and 'else' share a text
    todo = sorted(n for n in sys.stdlib_module_names if _public(n) and n not in _SKIP_MODULES)
    with warnings.catch_warnings():  # deprecated modules warn on import; we only read them
        warnings.simplefilter("ignore")
        while todo:
            name = todo.pop(0)
            try:
                mod = importlib.import_module(name)
            except Exception:  # platform-specific modules (winreg, msvcrt, ...) are absent here
                continue
            if body := _module_doc(mod):
                docs.append(f"{name}\n\n{body}")
            if hasattr(mod, "__path__"):  # a package: visit its public submodules too, sorted
                todo = sorted(todo + [f"{name}.{m.name}" for m in pkgutil.iter_modules(mod.__path__)
                                      if _public(m.name)])
    return docs


def _cache_problem(directory, names):
    """Why directory does not hold the complete shards `names` its manifest vouches for; "" if it does."""
    if not os.path.isdir(directory):
        return "not built yet"
    try:
        unknown = verify_manifest(directory, names)
    except ValueError as e:
        return str(e)
    return f"{unknown} missing or not in {MANIFEST}" if unknown else ""


# data.py's BPE cache, tokenizer_bpe<N>.json (or a user's file of that name), and the copy
# _keep_tokenizers keeps of it through a rebuild
TOKENIZER_FILE = r"tokenizer_bpe\d+\.json(\.before-rebuild\d*)?"


def _keep_tokenizers(out, built):
    """Move the tokenizer files of out, a corpus about to be replaced, into the one built in
    `built`. tokenizer_bpe<N>.json becomes tokenizer_bpe<N>.json.before-rebuild (then
    ...before-rebuild2, 3, ... where taken; copies kept by earlier rebuilds keep their names): data.py
    trains a new BPE on the rebuilt shards, and the earlier file, data.py's or a user's, is kept."""
    for name in sorted(os.listdir(out), key=lambda name: (".before-rebuild" not in name, name)):
        if not re.fullmatch(TOKENIZER_FILE, name):
            continue
        base = name.split(".before-rebuild")[0]
        new = name if name != base else f"{base}.before-rebuild"
        if os.path.lexists(os.path.join(built, new)):
            new = os.path.basename(unused_name(os.path.join(built, f"{base}.before-rebuild")))
        try:
            os.rename(os.path.join(out, name), os.path.join(built, new))
        except FileNotFoundError:  # another host's rebuild moved it first
            continue
        if new != name:
            print(f"embedded corpus: kept {os.path.join(out, name)} as {new} in the rebuilt corpus")


def _not_ours(out, built, names):
    """The files in out, an embedded corpus about to be replaced by the one built in `built`, that this
    project did not write, and that are so never removed. Its own: out's manifest.json, if it is this
    project's, and the corpus shards (`names`) it lists; a file byte for byte the one just built;
    a tokenizer file, carried into the new corpus (_keep_tokenizers); the locks and temp files of
    those."""
    try:
        ours = {MANIFEST} | (_read_manifest(out).keys() & set(names))
    except ValueError:  # a manifest.json that is not the project's vouches for nothing
        ours = set()

    def own(name):
        base = name.split(".tmp.")[0].removesuffix(".lock")
        if base in ours or re.fullmatch(TOKENIZER_FILE, base):
            return True
        twin = os.path.join(built, name)
        return os.path.isfile(twin) and filecmp.cmp(twin, os.path.join(out, name), shallow=False)
    return sorted(name for name in os.listdir(out) if not own(name))


def embedded_corpus(data_dir):
    """Build (once, cached in data_dir/embedded/) the embedded corpus; return its shard paths.

    The cache is checked against its manifest on every call; the corpus is deterministic, so one
    that does not match is rebuilt: built beside it, then put in its place if the folder holds only
    the project's files (_not_ours); else a FileExistsError names the folder and the others.
    """
    out = os.path.join(data_dir, "embedded")
    names = [SHARD_NAME.format(i) for i in range(EMBEDDED_SHARDS)]
    paths = [os.path.join(out, name) for name in names]
    with locked(out):
        problem = _cache_problem(out, names)
        if not problem:
            return paths
        if os.path.isdir(out):
            print(f"embedded corpus: {problem}; rebuilding it in {out}")
        docs = _embedded_documents()
        random.Random(1234).shuffle(docs)  # mix topics and modules before splitting train/val
        total = sum(map(len, docs))  # the last documents, ~8% of the text, are the validation split
        n_val = next(n for n in range(1, len(docs))
                     if sum(map(len, docs[-n:])) >= EMBEDDED_VAL_FRACTION * total)
        train, val = docs[:-n_val], docs[-n_val:]
        per = -(-len(train) // (EMBEDDED_SHARDS - 1))
        shards = [train[i:i + per] for i in range(0, len(train), per)] + [val]
        tmp = runtime.temp_path(out)
        shutil.rmtree(tmp, ignore_errors=True)  # left over by a crashed build
        os.makedirs(tmp)
        for i, texts in enumerate(shards):  # into a temp dir, then rename: never half a corpus
            pq.write_table(pa.table({"text": pa.array(texts, pa.string())}),
                           os.path.join(tmp, SHARD_NAME.format(i)), row_group_size=EMBEDDED_ROW_GROUP)
        write_manifest(tmp, names)
        if os.path.isdir(out):
            foreign = _not_ours(out, tmp, names)
            if foreign:
                shutil.rmtree(tmp)
                raise FileExistsError(f"embedded corpus: {out} needs rebuilding, and holds files this project "
                                      f"did not write: {', '.join(foreign)}; move them out of {out} (or choose "
                                      "another data_dir), and the corpus is rebuilt there")
            # unless another host has put its build there meanwhile (the rename below then fails)
            if _cache_problem(out, names):
                _keep_tokenizers(out, tmp)
                shutil.rmtree(out, ignore_errors=True)  # another host may be removing it too
        try:
            os.rename(tmp, out)
        except OSError:  # another host renamed its build there first: the same corpus, so use it
            if _cache_problem(out, names):
                raise
            _keep_tokenizers(tmp, out)
            shutil.rmtree(tmp)
            return paths
        n_bytes = [sum(len(t.encode()) for t in shard) for shard in shards]
        print(f"embedded corpus: {len(docs)} docs, {sum(n_bytes):,} bytes in {len(shards)} shards at {out} "
              f"(validation: {len(val)} docs, {n_bytes[-1]:,} bytes)")
        return paths


# ---- The evaluation inputs: the run's validation shard, WikiText-2, the DCLM CORE bundle; fetched,
# then read and checked (every file and task type before any model time is spent)
def val_shard(settings, data_dir, base_url=DEFAULT_BASE_URL):
    """The validation shard the checkpoint's training run held out (train.py's layout): the embedded
    corpus's last shard, or FineWeb-Edu's shard_00249 (settings: the run's saved settings)."""
    if settings.get("dataset", "embedded") == "embedded":
        return embedded_corpus(data_dir)[-1]
    name = SHARD_NAME.format(VAL_SHARD)
    return download(f"{base_url}/{name}", os.path.join(data_dir, name))


def fetch_wikitext(url, data_dir):
    """The wikitext-2-v1 test split (a parquet file at url) in data_dir/wikitext/."""
    return download(url, os.path.join(data_dir, "wikitext", "wikitext-2-v1-test.parquet"),
                    hint="offline? put the file at that path, or give --wiki_path=<its parquet or wiki.test.tokens>")


def fetch_bundle(bundle_dir, url):
    """bundle_dir if it exists, else the zip at url (a top-level eval_bundle/) unpacked there.
    The unpacked directory is renamed into place, so a half-extracted bundle is never seen. The zip
    (<bundle_dir>.zip) is removed after if this call downloaded it; one that was there is kept."""
    if os.path.isdir(bundle_dir):
        return bundle_dir
    zip_path = os.path.normpath(bundle_dir) + ".zip"
    # a zip put there by hand (or another host) is kept: only one this call downloads is removed
    placed = os.path.exists(zip_path)
    download(url, zip_path,  # creates bundle_dir's parent
             hint="offline? put the zip at that path, or give --bundle_dir=<the unpacked eval_bundle>")
    try:
        z = zipfile.ZipFile(zip_path)
    except FileNotFoundError:  # another host sharing the directory unpacked it and removed the zip
        if os.path.isdir(bundle_dir):
            return bundle_dir
        raise
    with z, tempfile.TemporaryDirectory(dir=os.path.dirname(zip_path)) as tmp:
        runtime.check_free_space(tmp, sum(i.file_size for i in z.infolist()), f"unpacking {zip_path}",
                                 "nothing was unpacked; free some space, or choose another bundle_dir")
        z.extractall(tmp)
        inner = os.path.join(tmp, "eval_bundle")
        if not os.path.isdir(inner):
            raise ValueError(f"{zip_path}: expected a top-level eval_bundle/ directory")
        try:
            os.replace(inner, bundle_dir)
        except OSError:  # another host unpacked it there first: use that one
            if not os.path.isdir(bundle_dir):
                raise
    if not placed:
        with contextlib.suppress(FileNotFoundError):
            os.remove(zip_path)
    return bundle_dir


TASK_TYPES = ("multiple_choice", "schema", "language_modeling")  # the CORE tasks eval.py scores


def load_rows(path):
    """WikiText rows: a parquet file's `text` column, or the lines of wiki.test.tokens with blank
    lines as "" (how the Hugging Face parquet was built from that file)."""
    if path.endswith(".parquet"):
        names = pq.read_schema(path).names
        if "text" not in names:
            raise ValueError(f"{path}: no 'text' column (columns: {names})")
        return pq.read_table(path, columns=["text"]).column("text").to_pylist()
    with open(path, encoding="utf-8") as f:
        return [line if line.strip() else "" for line in f]


def load_bundle(bundle_dir):
    """The tasks of core.yaml, each {label, type, fewshot, delimiter, path, baseline (percent)}.
    Every file and task type is checked here, before any model time is spent."""
    yaml_path, meta_path = (os.path.join(bundle_dir, f) for f in ("core.yaml", "eval_meta_data.csv"))
    with open(yaml_path) as f:
        entries = (yaml.safe_load(f) or {}).get("icl_tasks")
    if not entries:
        raise ValueError(f"{yaml_path}: expected a non-empty 'icl_tasks' list")
    with open(meta_path, newline="") as f:
        rows = csv.DictReader(f)
        if not {"Eval Task", "Random baseline"} <= set(rows.fieldnames or ()):
            raise ValueError(f"{meta_path}: expected columns 'Eval Task' and 'Random baseline'")
        baselines = {row["Eval Task"]: float(row["Random baseline"]) for row in rows}
    tasks = []
    for entry in entries:
        missing = {"label", "dataset_uri", "num_fewshot", "icl_task_type"} - set(entry)
        if missing:
            raise ValueError(f"{yaml_path}: task entry {entry} lacks {sorted(missing)}")
        label = entry["label"]
        if entry["icl_task_type"] not in TASK_TYPES:
            raise ValueError(f"{yaml_path}: task {label!r} has icl_task_type {entry['icl_task_type']!r}; "
                             f"expected one of {TASK_TYPES}")
        path = os.path.join(bundle_dir, "eval_data", entry["dataset_uri"])
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{yaml_path}: task {label!r}: missing data file {path}")
        if label not in baselines:
            raise ValueError(f"{meta_path}: no 'Random baseline' row for task {label!r}")
        tasks.append(dict(label=label, type=entry["icl_task_type"], fewshot=entry["num_fewshot"][0],
                          delimiter=entry.get("continuation_delimiter", " "), path=path,
                          baseline=baselines[label]))
    return tasks


def load_items(task, max_per_task):
    """The task's items, shuffled with seed 1337, then cut to max_per_task if > 0 (nanochat)."""
    with open(task["path"], encoding="utf-8") as f:
        items = [json.loads(line) for line in f if line.strip()]
    random.Random(1337).shuffle(items)
    if max_per_task > 0:
        items = items[:max_per_task]
    if task["fewshot"] >= len(items):
        raise ValueError(f"task {task['label']!r}: {task['fewshot']}-shot needs more than {len(items)} items "
                         f"(max_per_task={max_per_task})")
    return items


if __name__ == "__main__":
    parser = errors.ArgumentParser(prog="python -m flt.corpus", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--download", type=int, metavar="N",
                        help="first N training shards (249: the authors') + validation shard 249")
    action.add_argument("--embedded", action="store_true", help="build the embedded corpus")
    parser.add_argument("--data_dir", default=DEFAULT_DATA_DIR)
    parser.add_argument("--base_url", default=DEFAULT_BASE_URL)
    with errors.user_errors("flt.corpus"):  # offline, a full disk, a bad shard: one line, exit status 1
        args = parser.parse_args()
        errors.directory("--data_dir", args.data_dir)
        if args.download is not None:
            errors.positive("--download", args.download)
        if args.download is not None:
            download_shards(args.download, args.data_dir, args.base_url)
        else:
            embedded_corpus(args.data_dir)
