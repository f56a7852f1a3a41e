"""Data: parquet shards with a `text` column, a byte-level BPE tokenizer, a streaming loader.

The paper pretrains on FineWeb-Edu (nanochat's parquet shards). For CPU work with no network the
same code path runs on an embedded corpus built from text on every machine with Python (reference
manual topics, stdlib docstrings). Both are plain parquet shards; the last is validation. A
manifest.json beside complete shards records their sizes and rows, checked whenever they are used.
Packing and byte counts follow the paper authors' code (nanochat/dataloader.py, get_token_bytes).

    python data.py --download 249   # the authors' 249 training shards + their validation shard
    python data.py --embedded       # build the embedded corpus (no network)
"""
import argparse
import contextlib
import fcntl
import functools
import importlib
import inspect
import json
import math
import os
import pathlib
import pkgutil
import random
import shutil
import sys
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor

import pyarrow as pa
import pyarrow.parquet as pq
import requests
from urllib3.exceptions import NameResolutionError
import tokenizers
import torch

from runtime import atomic_write

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
HUB_URL = "https://huggingface.co/{name}/resolve/main/tokenizer.json"
DEFAULT_DATA_DIR = "data"
MANIFEST = "manifest.json"  # beside complete shards: each one's size and rows, checked on use
BOS = "<|endoftext|>"  # the document token: Qwen3 id 151643; prefixed to every document
QWEN3_VOCAB = 151669  # ids in Qwen3's tokenizer.json: 151643 BPE + 26 added (151644..151668); train.py --dry_run
QWEN3_BOS = "<|im_start|>"  # the paper authors' document token with the Qwen3 tokenizer (id 151644)
TIMEOUT = (5, 30)  # seconds to connect (an unreachable host fails fast), then between two reads
PROGRESS_SECONDS = 10  # download progress: a line per finished file, else at most one per 10 s


# ---- Files: a lock so concurrent ranks do the work once, and a robust download
@contextlib.contextmanager
def _locked(path):
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
    """One attempt: fetch url into the temp file `part`, resuming it with a Range request."""
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
        with open(part, "ab" if have else "wb") as f:
            for chunk in r.iter_content(1 << 16):
                f.write(chunk)
                progress(0, len(chunk))
    if expected is not None and os.path.getsize(part) != expected:
        raise requests.ConnectionError(f"got {os.path.getsize(part)} of {expected} bytes")


def download(url, path, retries=5, backoff=1.0, hint=None, progress=None):
    """Download url to path once: retries with exponential back-off, resume, atomic rename.

    Concurrent callers wait on the lock; bytes go to path + '.part', renamed only when complete.
    hint ends the error message: how to do without the network.
    """
    with _locked(path):
        if os.path.exists(path):  # already there, or another rank finished it while we waited
            return path
        part, progress = path + ".part", progress or Progress(path, 1, "files", each=True)
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


def shards_for_tokens(n_tokens):
    """FineWeb-Edu training shards holding n_tokens tokens, with SHARD_MARGIN to spare."""
    n = math.ceil(n_tokens * SHARD_MARGIN / SHARD_TOKENS)
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
    try:
        todo = [name for name in verify_manifest(data_dir, names)
                if not os.path.exists(os.path.join(data_dir, name))]
    except ValueError as e:
        raise ValueError(f"{e}; delete it to download it again") from e
    print(f"FineWeb-Edu: {n} training + 1 validation shards in {data_dir}: "
          f"{len(names) - len(todo)} present, downloading {len(todo)} (~{len(todo) * SHARD_GB:.1f} GB)")
    hint = hint or f"offline? put the shards in data_dir={data_dir!r}, or use dataset='embedded'"
    progress = Progress(f"downloading shards into {data_dir}", len(todo), "files", each=True)
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda name: download(f"{base_url}/{name}", os.path.join(data_dir, name), retries,
                                            backoff, hint, progress), todo))
    write_manifest(data_dir, names)
    return [os.path.join(data_dir, name) for name in names]


def _open_parquet(path):
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


def _read_texts(path, row_group):
    with _open_parquet(path) as pf:
        try:
            return pf.read_row_group(row_group, columns=["text"]).column("text").to_pylist()
        except (pa.ArrowException, OSError) as e:
            raise ValueError(f"{path}: row group {row_group} is unreadable: {e}") from e


def _rows(path):
    with _open_parquet(path) as pf:
        return pf.metadata.num_rows


def _read_manifest(directory):
    path = pathlib.Path(directory, MANIFEST)
    return json.loads(path.read_text()) if path.exists() else {}


def write_manifest(directory, names):
    """Record the complete shards' sizes and rows in directory/manifest.json, keeping other entries."""
    path = os.path.join(directory, MANIFEST)
    with _locked(path):
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


def _module_doc(mod):
    """The module's docstring, then each public class/function it defines (and their methods)."""
    parts = [_doc(mod)]
    for name, obj in sorted(vars(mod).items()):
        if not (_public(name) and (inspect.isclass(obj) or inspect.isroutine(obj))
                and getattr(obj, "__module__", None) == mod.__name__):
            continue  # skip re-exports, so each docstring appears once
        # obj.__doc__, not inspect.getdoc: getdoc falls back to inherited docstrings (duplicates)
        if doc := _doc(obj):
            parts.append(f"{name}\n{doc}")
        if inspect.isclass(obj):
            parts += [f"{name}.{m}\n{_doc(f)}" for m, f in sorted(vars(obj).items())
                      if _public(m) and inspect.isroutine(f) and _doc(f)]
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


def embedded_corpus(data_dir):
    """Build (once, cached in data_dir/embedded/) the embedded corpus; return its shard paths.

    The cache is checked against its manifest on every call; the corpus is deterministic, so one
    that does not match is rebuilt.
    """
    out = os.path.join(data_dir, "embedded")
    names = [SHARD_NAME.format(i) for i in range(EMBEDDED_SHARDS)]
    paths = [os.path.join(out, name) for name in names]
    with _locked(out):
        if os.path.isdir(out):
            try:
                unknown = verify_manifest(out, names)
                problem = unknown and f"{unknown} missing or not in {MANIFEST}"
            except ValueError as e:
                problem = e
            if not problem:
                return paths
            print(f"embedded corpus: {problem}; rebuilding it in {out}")
            shutil.rmtree(out)
        docs = _embedded_documents()
        random.Random(1234).shuffle(docs)  # mix topics and modules before splitting train/val
        total = sum(map(len, docs))  # the last documents, ~8% of the text, are the validation split
        n_val = next(n for n in range(1, len(docs))
                     if sum(map(len, docs[-n:])) >= EMBEDDED_VAL_FRACTION * total)
        train, val = docs[:-n_val], docs[-n_val:]
        per = -(-len(train) // (EMBEDDED_SHARDS - 1))
        shards = [train[i:i + per] for i in range(0, len(train), per)] + [val]
        tmp = f"{out}.tmp{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)  # left over by a crashed build
        os.makedirs(tmp)
        for i, texts in enumerate(shards):  # into a temp dir, then rename: never half a corpus
            pq.write_table(pa.table({"text": pa.array(texts, pa.string())}),
                           os.path.join(tmp, SHARD_NAME.format(i)), row_group_size=EMBEDDED_ROW_GROUP)
        write_manifest(tmp, names)
        os.rename(tmp, out)
        n_bytes = [sum(len(t.encode()) for t in shard) for shard in shards]
        print(f"embedded corpus: {len(docs)} docs, {sum(n_bytes):,} bytes in {len(shards)} shards at {out} "
              f"(validation: {len(val)} docs, {n_bytes[-1]:,} bytes)")
        return paths


# ---- Tokenizer
class Tokenizer:
    """A byte-level BPE `tokenizers.Tokenizer` with a document token (BOS) and a byte table."""

    def __init__(self, tok, name="tokenizer", bos=BOS):
        self.tok = tok
        self.bos_id = tok.token_to_id(bos)
        if self.bos_id is None:
            special = [t.content for t in tok.get_added_tokens_decoder().values() if t.special]
            raise ValueError(f"{name}: no {bos!r} token for the document token (setting bos_token); "
                             f"its special tokens: {special}")
        # "<|endoftext|>" written inside a document is text, not a fake document boundary
        tok.encode_special_tokens = True
        self.vocab_size = max(tok.get_vocab(with_added_tokens=True).values()) + 1

    def encode(self, text):
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts):
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids):
        return self.tok.decode(list(ids), skip_special_tokens=False)

    def token_bytes(self, count="authors"):
        """Bytes of each id for bits per byte, a (vocab_size,) long tensor. "authors" (what the paper
        reports; their get_token_bytes): len(decode([id]).encode()), 0 for every added token, so part of
        a multi-byte character counts 3 (U+FFFD). "utf8": the true bytes (in byte-level BPE one per
        character of the token string), 0 for special tokens only."""
        if count not in ("authors", "utf8"):
            raise ValueError(f"token_bytes: count must be 'authors' or 'utf8', got {count!r}")
        added = self.tok.get_added_tokens_decoder()
        if count == "authors":
            return torch.tensor([0 if i in added else len(self.decode([i]).encode("utf-8"))
                                 for i in range(self.vocab_size)], dtype=torch.long)
        alphabet = set(tokenizers.pre_tokenizers.ByteLevel.alphabet())
        table = torch.zeros(self.vocab_size, dtype=torch.long)
        for i in range(self.vocab_size):
            if i in added:  # added tokens are stored as plain text
                table[i] = 0 if added[i].special else len(added[i].content.encode("utf-8"))
            elif (token := self.tok.id_to_token(i)) is not None:
                if not set(token) <= alphabet:
                    raise ValueError(f"token {i} {token!r} is not byte-level; only byte-level BPE "
                                     "tokenizers (GPT-2, Qwen3, train_tokenizer) are supported")
                table[i] = len(token)
        return table

    def save(self, path):
        atomic_write(path, self.tok.save)


def train_tokenizer(files, vocab_size, path):
    """Train a byte-level BPE (GPT-2 pre-tokenizer) on the `text` of parquet files; save at path."""
    if vocab_size < 257:
        raise ValueError(f"vocab_size must be >= 257 (256 bytes + {BOS}), got {vocab_size}")
    row_groups = []
    for f in files:
        with _open_parquet(f) as pf:
            row_groups += [(f, g) for g in range(pf.num_row_groups)]
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[BOS], show_progress=False,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())  # every byte encodable
    tok.train_from_iterator((_read_texts(f, g) for f, g in row_groups), trainer)
    tokenizer = Tokenizer(tok, name=path)
    tokenizer.save(path)
    print(f"trained a {tokenizer.vocab_size}-token BPE on {len(files)} files -> {path}")
    return tokenizer


def load_tokenizer(name_or_path, cache_dir=None, bos=BOS):
    """A tokenizer.json path, or a hub name like 'Qwen/Qwen3-0.6B' (downloaded into cache_dir)."""
    path = name_or_path
    if not os.path.exists(path) and not path.endswith(".json") and path.count("/") == 1:
        cache = cache_dir or DEFAULT_DATA_DIR
        path = download(HUB_URL.format(name=name_or_path),
                        os.path.join(cache, name_or_path.replace("/", "--") + ".tokenizer.json"),
                        hint="offline? give the path of a tokenizer.json instead (setting tokenizer)")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"tokenizer {name_or_path!r}: no such file; give a tokenizer.json "
                                "path or a hub name like 'Qwen/Qwen3-0.6B'")
    try:
        tok = tokenizers.Tokenizer.from_file(path)
    except Exception as e:  # the library raises a bare Exception for a malformed file
        raise ValueError(f"{path}: not a valid tokenizer.json: {e}") from e
    return Tokenizer(tok, name=path, bos=bos)


def get_tokenizer(spec, data_dir, train_files, vocab_size, bos=BOS):
    """'bpe': a local BPE trained once on train_files (cached); anything else: load_tokenizer."""
    if spec != "bpe":
        return load_tokenizer(spec, cache_dir=data_dir, bos=bos)
    if bos != BOS:
        raise ValueError(f"the local 'bpe' tokenizer has {BOS!r}, not {bos!r} (setting bos_token)")
    path = os.path.join(data_dir, f"tokenizer_bpe{vocab_size}.json")
    with _locked(path):  # rank 0 trains, the other ranks wait and load
        if os.path.exists(path):
            return load_tokenizer(path)
        return train_tokenizer(train_files, vocab_size, path)


# ---- Streaming loader
class DataLoader:
    """(x, y) batches of shape (B, T) cut from one rank's token stream, as the authors' loader does.

    A rank's stream: each file in turn, its row groups rank, rank + world_size, ... (per file, as
    nanochat's dataloader.py), each document as [bos] + tokens. A batch is the next chunk of B*T+1
    tokens: x = its first B*T, y = its last B*T, viewed (B, T) (row b's last target is row b+1's first
    input). The next chunk starts after it: a chunk's first token is never a target.
    cycle=True (training): after its last row group the rank starts a new epoch, and prints so.
    cycle=False (evaluation): a final partial chunk of n >= 2 tokens comes once, x padded with bos and
    y with -1 (ignored targets), then StopIteration: no target twice, and the tail is not lost.
    state_dict() is the position of the next unread token ({"epoch", "file" (its name), "row_group",
    "offset" (tokens of that row group used), "rank", "world_size"}) and the epoch's "epoch_tokens"
    read and "epoch_batches" begun: a loader built with state=loader.state_dict() after batch n yields
    batch n+1. While a row group is used, the next one is tokenized in a background thread.
    """

    def __init__(self, files, tokenizer, batch_size, seq_len, rank=0, world_size=1, device="cpu", state=None,
                 cycle=True):
        if not files:
            raise ValueError("DataLoader: no files given")
        if batch_size < 1 or seq_len < 1:
            raise ValueError(f"batch_size and seq_len must be >= 1, got {batch_size}, {seq_len}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in 0..{world_size - 1}, got {rank}")
        self.files, self.tokenizer, self.B, self.T = list(files), tokenizer, batch_size, seq_len
        self.rank, self.world_size, self.device, self.cycle = rank, world_size, torch.device(device), cycle
        self.names = [os.path.basename(f) for f in self.files]
        if len(set(self.names)) < len(self.names):
            raise ValueError(f"DataLoader: file names must differ (a loader state names files): {self.names}")
        row_groups = {}  # of each file (every shard has rows: _open_parquet checks)
        for name, path in zip(self.names, self.files):
            with _open_parquet(path) as pf:
                row_groups[name] = pf.num_row_groups
        self.groups = [(i, g) for i, n in enumerate(row_groups.values()) for g in range(rank, n, world_size)]
        if not self.groups and cycle:  # would loop forever looking for a token
            raise ValueError(f"rank {rank} of {world_size} gets no documents: row groups per file "
                             f"{row_groups} in {self.files[0]}, ...; use fewer ranks or more data")
        self.epoch, self.pos, self.offset, self.tokens, self.done = 0, 0, 0, None, not self.groups
        self.epoch_tokens = self.epoch_batches = 0
        self.pool, self.prefetched = ThreadPoolExecutor(1), None
        if state is None:
            return
        if missing := sorted(self.state_dict().keys() - state.keys()):
            raise ValueError(f"loader state {state} lacks {missing}: saved before data.py packed as the authors' "
                             "loader does; resume with a state this loader saved")
        if not 0 <= state["row_group"] < row_groups.get(state["file"], 0):
            raise ValueError(f"loader state: no row group {state['row_group']} of file {state['file']!r} in "
                             f"the loader's files (row groups: {row_groups}); resume with the run's files")
        where = (self.names.index(state["file"]), state["row_group"])
        if (state["rank"], state["world_size"]) != (rank, world_size) or where not in self.groups:
            raise ValueError(f"loader state {state} is not a position of rank {rank} of "
                             f"{world_size} in these {len(self.files)} files")
        self.epoch, self.pos, self.offset = state["epoch"], self.groups.index(where), state["offset"]
        self.epoch_tokens, self.epoch_batches = state["epoch_tokens"], state["epoch_batches"]
        self.tokens = self._load()
        if not 0 <= self.offset < len(self.tokens):
            raise ValueError(f"loader state {state}: offset outside the row group "
                             f"({len(self.tokens)} tokens)")

    def state_dict(self):
        file, row_group = self.groups[self.pos]
        return {"epoch": self.epoch, "file": self.names[file], "row_group": row_group, "offset": self.offset,
                "rank": self.rank, "world_size": self.world_size, "epoch_tokens": self.epoch_tokens,
                "epoch_batches": self.epoch_batches}

    def _tokenize(self, pos):
        file, row_group = self.groups[pos]
        stream = []
        for ids in self.tokenizer.encode_batch(_read_texts(self.files[file], row_group)):
            stream += [self.tokenizer.bos_id, *ids]
        return torch.tensor(stream, dtype=torch.long)

    def _load(self):
        """Row group self.pos, tokenized; starts tokenizing the one after it in the background."""
        pos, future = self.prefetched or (None, None)
        tokens = future.result() if pos == self.pos else self._tokenize(self.pos)
        following = (self.pos + 1) % len(self.groups)
        if following or self.cycle:  # without cycle, no epoch follows the last row group
            self.prefetched = (following, self.pool.submit(self._tokenize, following))
        return tokens

    def _end_epoch(self):
        """The rank's row groups are used up: a new epoch (cycle), else the end of the stream."""
        if self.cycle:
            files = len({file for file, _ in self.groups})
            print(f"DataLoader rank {self.rank}: epoch {self.epoch} is used up (row groups: {len(self.groups)}, "
                  f"files: {files}, tokens: {self.epoch_tokens:,}, batches served: {self.epoch_batches}); "
                  f"epoch {self.epoch + 1} starts: its documents are seen again", flush=True)
        self.done = not self.cycle
        self.pos, self.epoch, self.epoch_tokens, self.epoch_batches = 0, self.epoch + 1, 0, 0

    def __iter__(self):
        return self

    def __next__(self):
        """The next chunk of B*T+1 tokens as (x, y), moving through row groups and epochs."""
        pieces, n = [], self.B * self.T + 1
        self.epoch_batches += 1  # a chunk that crosses the end of an epoch counts for the one it began in
        while n and not self.done:
            if self.tokens is None:
                self.tokens = self._load()
            piece = self.tokens[self.offset:self.offset + n]
            pieces.append(piece)
            n -= len(piece)
            self.offset += len(piece)
            self.epoch_tokens += len(piece)
            if self.offset == len(self.tokens):  # row group used up: the state names the next one
                self.pos, self.offset, self.tokens = self.pos + 1, 0, None
                if self.pos == len(self.groups):
                    self._end_epoch()
        chunk = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.long)
        if len(chunk) < 2:  # only without cycle: the stream is over
            raise StopIteration
        cuda = self.device.type == "cuda"
        # pinned host memory lets the copy to the GPU overlap with compute (non_blocking)
        xy = torch.empty(2, self.B * self.T, dtype=torch.long, pin_memory=cuda)
        xy[0], xy[1] = self.tokenizer.bos_id, -1  # the padding of a final partial chunk
        xy[0, :len(chunk) - 1], xy[1, :len(chunk) - 1] = chunk[:-1], chunk[1:]
        x, y = xy.view(2, self.B, self.T).to(self.device, non_blocking=cuda)
        return x, y


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--download", type=int, metavar="N",
                        help="first N training shards (249: the authors') + validation shard 249")
    action.add_argument("--embedded", action="store_true", help="build the embedded corpus")
    parser.add_argument("--data_dir", default=DEFAULT_DATA_DIR)
    parser.add_argument("--base_url", default=DEFAULT_BASE_URL)
    args = parser.parse_args()
    if args.download is not None:
        download_shards(args.download, args.data_dir, args.base_url)
    else:
        embedded_corpus(args.data_dir)
