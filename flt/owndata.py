"""Your own text as train.py's dataset: --dataset=PATH, a folder, a file or a glob of

    .txt, .md    one document a file
    .jsonl       one document a line, its "text" field
    .parquet     one document a row of its "text" column (any file name, any row groups)

A folder is read whole (its sub-folders too, hidden names skipped); formats may be mixed, and a
file of any other kind there is refused, named. A file or a glob may name files of other kinds:
each is read as UTF-8 text, one document a file (e.g. 'src/**/*.py'). The files are only read:
nothing in their folder is written, renamed or deleted, and nothing is downloaded. Their
documents are converted once into parquet shards (the layout data.py reads) under
data_dir/own/<name>-<key>/, where key is a hash of every document's text on each side of the
split: the same corpus finds its shards again, and a changed corpus gets new ones, with a BPE of
its own (a stale one is never used).

Validation is kept apart by a rule the user can see: --val_dataset=PATH holds out all of its
documents (any of them also in the training files is left out of training); without it, a document
is held out when the first 8 hex digits of the sha256 of its UTF-8 text, read as a number, are a
multiple of HOLD_OUT (1 document in 20). Identical documents hash alike, so none is on both sides.

    paths = owndata.prepare(dataset, val_dataset, data_dir)   # training shards, validation last
    print(owndata.describe(dataset, val_dataset, tok))        # files, documents, tokens, bytes
"""
import functools
import glob
import hashlib
import json
import os
import re

import pyarrow as pa
import pyarrow.parquet as pq

from flt import corpus, runtime, tasks

FORMATS = {".txt": "text", ".md": "text", ".jsonl": "jsonl", ".parquet": "parquet"}
# 1 document in HOLD_OUT is held out for validation (by its hash: see the module's docstring)
HOLD_OUT = 20
# documents per row group (fewer for a small corpus, so that every rank gets row groups), and per
# training shard
ROW_GROUP = 1024
SHARD_DOCS = 64 * ROW_GROUP
# what the cache's key hashes besides the documents: a new layout of the shards gets new ones
LAYOUT = "own-data 1"


def is_own(dataset):
    """Whether train.py's dataset names your own files: anything but embedded, fineweb, a task."""
    return dataset not in ("embedded", "fineweb", *tasks.TASKS)


def files_of(spec):
    """The files PATH names, sorted: a folder's files of FORMATS (hidden names skipped), a file, or
    a glob's matches. A ValueError names what cannot be read: no files, or files of other kinds."""
    if os.path.isdir(spec):
        found = []
        for parent, dirs, names in os.walk(spec):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            found += [os.path.join(parent, n) for n in names if not n.startswith(".")]
    elif glob.has_magic(spec):
        found = [p for p in glob.glob(spec, recursive=True) if os.path.isfile(p)]
    elif os.path.isfile(spec):
        found = [spec]
    else:
        raise FileNotFoundError(f"dataset={spec!r}: no such file or folder (expected embedded, "
                                f"fineweb, {', '.join(tasks.TASKS)}, or a folder, file or glob of "
                                f"your text)")
    other = sorted({os.path.splitext(p)[1] or os.path.basename(p) for p in found
                    if os.path.splitext(p)[1].lower() not in FORMATS})
    if other and os.path.isdir(spec):
        raise ValueError(f"dataset={spec}: files of other kinds there ({', '.join(other[:8])}); a "
                         f"folder is read for {', '.join(FORMATS)}: give a glob of the files you "
                         f"mean, e.g. '{os.path.join(spec, '**', '*' + other[0])}' (text, one "
                         f"document a file)")
    if not found:
        raise ValueError(f"dataset={spec}: no {', '.join(FORMATS)} files there")
    return sorted(found)


def read_documents(path):
    """The documents of one file (FORMATS), blank ones skipped; an error names the file (and line)."""
    kind = FORMATS.get(os.path.splitext(path)[1].lower(), "text")
    if kind == "parquet":
        with corpus.open_parquet(path) as pf:
            groups = range(pf.num_row_groups)
        return [t for g in groups for t in corpus.read_texts(path, g) if t and t.strip()]
    with open(path, "rb") as f:
        raw = f.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte {e.start})") from None
    if kind == "text":
        return [text] if text.strip() else []
    docs = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            doc = json.loads(line)["text"]
        except (ValueError, KeyError, TypeError):
            doc = None
        if not isinstance(doc, str):
            raise ValueError(f"{path}:{n}: expected a JSON object with a string field 'text'")
        if doc.strip():
            docs.append(doc)
    return docs


def held_out(text):
    """Whether the default rule holds a document out for validation (the module's docstring)."""
    return int(hashlib.sha256(text.encode("utf-8")).hexdigest()[:8], 16) % HOLD_OUT == 0


def name_of(spec):
    """The dataset's name in run names: the folder's or file's name (a glob: its folder's)."""
    if glob.has_magic(spec):
        spec = spec[:re.search(r"[*?[]", spec).start()]
        spec = spec if spec.endswith(os.sep) else os.path.dirname(spec)
    name = os.path.basename(os.path.normpath(spec))
    if os.path.splitext(name)[1].lower() in FORMATS:
        name = os.path.splitext(name)[0]
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name) or "data"


@functools.lru_cache(maxsize=None)
def split(spec, val_spec):
    """(training documents, validation documents, {files, bytes, dropped}): every document of
    spec's files, held out by val_spec's files or the hash rule; read once per process."""
    files = files_of(spec)
    docs = [d for path in files for d in read_documents(path)]
    counts = {"files": len(files), "bytes": sum(os.path.getsize(p) for p in files), "dropped": 0}
    if val_spec:
        val = [d for path in files_of(val_spec) for d in read_documents(path)]
        held = set(val)
        train = [d for d in docs if d not in held]
        counts["dropped"] = len(docs) - len(train)
    else:
        train = [d for d in docs if not held_out(d)]
        val = [d for d in docs if held_out(d)]
    if not val or not train:
        side = "validation" if not val else "training"
        raise ValueError(f"dataset={spec}: {len(docs)} documents leave none for {side} (1 in "
                         f"{HOLD_OUT} is held out by its hash); give more documents, or "
                         f"--val_dataset=<other files>")
    return train, val, counts


def cache_dir(spec, val_spec, data_dir):
    """data_dir/own/<name>-<key>: key hashes LAYOUT and each side's documents, in order."""
    train, val, _ = split(spec, val_spec)
    key = hashlib.sha256(LAYOUT.encode())
    for side in (train, val):
        key.update(f"{len(side)}\n".encode())
        for doc in side:
            key.update(f"{len(doc)}\n{doc}".encode("utf-8"))
    return os.path.join(data_dir, "own", f"{name_of(spec)}-{key.hexdigest()[:12]}")


def shard_names(n_train):
    return [f"train_{i:05d}.parquet" for i in range(n_train)] + ["val.parquet"]


def prepare(spec, val_spec, data_dir, log=print):
    """The parquet shards of spec's documents (cache_dir), validation last: built once (every rank
    calls this; one builds under a lock, whole or not at all), then checked against their
    manifest."""
    train, val, _ = split(spec, val_spec)
    out = cache_dir(spec, val_spec, data_dir)
    names = shard_names(-(-len(train) // SHARD_DOCS))
    with corpus.locked(out):
        if not os.path.isdir(out):
            with runtime.atomic_dir(out) as tmp:
                sides = [train[i:i + SHARD_DOCS] for i in range(0, len(train), SHARD_DOCS)]
                for name, docs in zip(names, sides + [val]):
                    table = pa.table({"text": pa.array(docs, pa.string())})
                    # at least 64 row groups where there are 64 documents: a row group per rank
                    size = max(1, min(ROW_GROUP, len(docs) // 64))
                    pq.write_table(table, os.path.join(tmp, name), row_group_size=size)
                corpus.write_manifest(tmp, names)
            log(f"your data: converted {spec} -> {out}")
        if unknown := corpus.verify_manifest(out, names):
            raise ValueError(f"{out}: {', '.join(unknown)} missing or not as its manifest says; "
                             f"it is this project's conversion of {spec}: delete that folder, and it "
                             f"is made again")
    return [os.path.join(out, name) for name in names]


def describe(spec, val_spec, tokenizer=None):
    """One line: the files, the documents and tokens of each side (tokens given a tokenizer), the
    disk size: what train.py --dry_run and a run's log print."""
    train, val, counts = split(spec, val_spec)
    rule = f"held out by --val_dataset={val_spec}" if val_spec else f"1 in {HOLD_OUT} by hash"

    def side(docs):
        text = f"{len(docs):,} documents"
        if tokenizer is not None:
            text += f", {sum(map(len, tokenizer.encode_batch(docs))) + len(docs):,} tokens"
        return text
    dropped = f" ({counts['dropped']:,} also in --val_dataset left out)" if counts["dropped"] else ""
    return (f"your data: {spec}: {counts['files']:,} files, {runtime.size_text(counts['bytes'])}; "
            f"training {side(train)}{dropped}; validation ({rule}) {side(val)}")
