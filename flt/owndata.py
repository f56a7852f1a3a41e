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


def check_data_dir(spec, data_dir):
    """A ValueError if data_dir lies inside the folder of your files: the shards and BPE written
    there would be read back as documents, and that folder is only ever read."""
    inside = os.path.realpath(data_dir) + os.sep
    if os.path.isdir(spec) and inside.startswith(os.path.realpath(spec) + os.sep):
        raise ValueError(f"data_dir={data_dir} is inside dataset={spec}, which this project only "
                         "reads: what it writes there would be read back as your documents; choose "
                         "a data_dir outside it")


def walk(folder):
    """Every file under folder (hidden names skipped), through symlinked sub-folders once each; an
    OSError names a sub-folder that cannot be read rather than skipping it."""
    found, seen = [], set()

    def unreadable(error):
        raise error
    for parent, dirs, names in os.walk(folder, onerror=unreadable, followlinks=True):
        real = os.path.realpath(parent)
        if real in seen:
            dirs[:] = []
            continue
        seen.add(real)
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        found += [os.path.join(parent, n) for n in names if not n.startswith(".")]
    return found


def files_of(spec, key="dataset"):
    """The files PATH names (the setting `key`), sorted: a folder's files of FORMATS (hidden names
    skipped), a file, or a glob's matches (a path that exists is never read as a glob). A
    ValueError names what cannot be read: no files, or files of other kinds."""
    if os.path.isdir(spec):
        found = walk(spec)
    elif os.path.isfile(spec):
        found = [spec]
    elif glob.has_magic(spec):
        found = [p for p in glob.glob(spec, recursive=True) if os.path.isfile(p)]
        if not found:
            raise ValueError(f"{key}={spec}: the glob matches no file")
    else:
        names = f"embedded, fineweb, {', '.join(tasks.TASKS)}, or " if key == "dataset" else ""
        raise FileNotFoundError(f"{key}={spec!r}: no such file or folder (expected {names}a folder, "
                                "file or glob of your text)")
    other = [p for p in found if os.path.splitext(p)[1].lower() not in FORMATS]
    if other and os.path.isdir(spec):
        kinds = sorted({os.path.splitext(p)[1] or os.path.basename(p) for p in other})
        raise ValueError(f"{key}={spec}: {len(other)} files of other kinds there (e.g. {sorted(other)[0]}; "
                         f"{', '.join(kinds[:8])}); a folder is read for {', '.join(FORMATS)}: give a "
                         f"glob of the files you mean, e.g. '{os.path.join(spec, '**', '*' + kinds[0])}' "
                         "(text, one document a file)")
    if not found:
        raise ValueError(f"{key}={spec}: no {', '.join(FORMATS)} files there")
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
        # utf-8-sig: a leading byte-order mark is no part of the text
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte {e.start})") from None
    if kind == "text":
        return [text] if text.strip() else []
    docs = []
    # JSON Lines end at \n alone: U+2028 and the like may stand raw inside a JSON string
    for n, line in enumerate(text.split("\n"), 1):
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
    if glob.has_magic(spec) and not os.path.exists(spec):
        spec = spec[:re.search(r"[*?[]", spec).start()]
        spec = spec if spec.endswith(os.sep) else os.path.dirname(spec)
    name = os.path.basename(os.path.normpath(spec))
    if os.path.splitext(name)[1].lower() in FORMATS:
        name = os.path.splitext(name)[0]
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name) or "data"


@functools.lru_cache(maxsize=None)
def split(spec, val_spec):
    """(training documents, validation documents, {files, bytes, dropped, key}): every document of
    spec's files, held out by val_spec's files or the hash rule; read once per process."""
    files = files_of(spec)
    docs = [d for path in files for d in read_documents(path)]
    counts = {"files": len(files), "bytes": sum(os.path.getsize(p) for p in files), "dropped": 0}
    if val_spec:
        val = [d for path in files_of(val_spec, "val_dataset") for d in read_documents(path)]
        held = set(val)
        train = [d for d in docs if d not in held]
        counts["dropped"] = len(docs) - len(train)
    else:
        train = [d for d in docs if not held_out(d)]
        val = [d for d in docs if held_out(d)]
    if val_spec and not val:
        raise ValueError(f"val_dataset={val_spec}: its files hold no document")
    if val_spec and not train:
        raise ValueError(f"dataset={spec}: each of its {len(docs)} documents is also in "
                         f"val_dataset={val_spec}, which leaves none for training")
    if not val or not train:
        side = "validation" if not val else "training"
        raise ValueError(f"dataset={spec}: {len(docs)} documents leave none for {side} (1 in "
                         f"{HOLD_OUT} is held out by its hash); give more documents, or "
                         f"--val_dataset=<other files>")
    # the key: LAYOUT and each side's documents, in order, hashed
    key = hashlib.sha256(LAYOUT.encode())
    for side in (train, val):
        key.update(f"{len(side)}\n".encode())
        for doc in side:
            key.update(f"{len(doc)}\n{doc}".encode("utf-8"))
    return train, val, counts | {"key": key.hexdigest()[:12]}


def identity(spec, val_spec):
    """<name>-<key>, the name of the documents' cache folder (split's key), which changes with any
    document. Saved with each checkpoint (checkpoint.save's meta["data"]): a resume and eval.py
    check their documents against it."""
    return f"{name_of(spec)}-{split(spec, val_spec)[2]['key']}"


def cache_dir(spec, val_spec, data_dir):
    """data_dir/own/<identity>: the documents' shards, converted once."""
    return os.path.join(data_dir, "own", identity(spec, val_spec))


def data_of(s):
    """A run's data identity (identity) where train.py's settings s name your own files; else None."""
    dataset = s.get("dataset", "embedded")
    return identity(dataset, s.get("val_dataset", "")) if is_own(dataset) else None


def run_shards(s, data_dir, saved=None, what="dataset"):
    """The shards of a run on your own files (s: its settings; saved: its checkpoint's meta["data"]):
    the cache folder it trained on where that is still whole, so that eval.py scores the same
    held-out documents; else converted from the files (prepare), which must still hold them."""
    folder = os.path.join(data_dir, "own", saved or "")
    if saved and os.path.isdir(folder):
        names = sorted(n for n in os.listdir(folder) if re.fullmatch(r"train_\d{5}\.parquet", n))
        names.append("val.parquet")
        if not corpus.verify_manifest(folder, names):
            return [os.path.join(folder, name) for name in names]
    check_unchanged(saved, s, what, f"the folder {folder} they were converted into")
    return prepare(s["dataset"], s.get("val_dataset", ""), data_dir)


def check_unchanged(saved, s, what, remedy="start a new run in another out_dir"):
    """A ValueError naming the dataset if your own files no longer hold the documents a checkpoint
    trained on (saved: its meta["data"]; None: another dataset, or saved before it was recorded)."""
    if saved and data_of(s) != saved:
        raise ValueError(f"{what}: dataset={s['dataset']} no longer holds the documents this run trained on "
                         f"(they were {saved}, the files now give {data_of(s)}: edited, added or removed "
                         f"since?); restore the files as they were, or {remedy}")


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
