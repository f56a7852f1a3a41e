"""Tests for corpus.py: the embedded corpus, locks, downloads (a local http.server only, never the
internet), progress lines, manifests, FineWeb-Edu shards, and the evaluation inputs."""
import contextlib
import glob
import logging
import io
import json
import multiprocessing
import os
import pathlib
import re
import shutil
import socket
import sys
import threading
import time
import zipfile

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import requests

from flt import corpus
import data
from flt import runtime


def no_locks(directory):
    return not glob.glob(os.path.join(directory, "**", "*.lock"), recursive=True)


def append_row(path):
    texts = pq.read_table(path).column("text").to_pylist()
    pq.write_table(pa.table({"text": texts + ["one more document"]}), path)

# ---------------------------------------------------------------- embedded corpus


def test_embedded_corpus_deterministic_cached_and_split(embedded, tmp_path, monkeypatch):
    # the same bytes whatever the building program did to sys (train.py sets sys.excepthook)
    monkeypatch.setattr(sys, "excepthook", lambda *args: None)
    monkeypatch.setattr(sys, "displayhook", lambda *args: None)
    # or what a library attached to a standard class (transformers: logging.Logger.info_once)

    def info_once(self, *args):
        """Another library's method, with a docstring."""
    monkeypatch.setattr(logging.Logger, "info_once", info_once, raising=False)
    again = corpus.embedded_corpus(str(tmp_path))
    assert [os.path.basename(p) for p in embedded] == [os.path.basename(p) for p in again]
    for a, b in zip(embedded, again):
        assert open(a, "rb").read() == open(b, "rb").read()
    # cached: a second call reads the shards, it does not rebuild
    monkeypatch.setattr(corpus, "_embedded_documents", lambda: pytest.fail("rebuilt"))
    assert corpus.embedded_corpus(str(tmp_path)) == again
    assert len(embedded) == corpus.EMBEDDED_SHARDS and embedded == sorted(glob.glob(os.path.join(os.path.dirname(embedded[0]), "*.parquet")))
    texts = []
    for path in embedded:
        pf = pq.ParquetFile(path)
        assert pf.schema_arrow.names == ["text"]
        assert pf.num_row_groups >= (2 if path == embedded[-1] else 4)
        texts.append(pf.read().column("text").to_pylist())
    n_bytes = [sum(len(t.encode()) for t in shard) for shard in texts]
    assert 0.05 < n_bytes[-1] / sum(n_bytes) < 0.10  # the last shard is validation
    assert 1.5e6 < sum(n_bytes) < 3e6
    all_docs = [t for shard in texts for t in shard]
    assert all(all_docs) and len(set(all_docs)) == len(all_docs)
    assert any(d.startswith("json\n\n") for d in all_docs)  # a module document
    assert not glob.glob(str(tmp_path / "*.lock")) and not glob.glob(str(tmp_path / "embedded" / "*.lock"))


def test_embedded_manifest_records_shards(embedded):
    manifest = json.load(open(os.path.join(os.path.dirname(embedded[0]), "manifest.json")))
    assert manifest == {os.path.basename(p): {"bytes": os.path.getsize(p),
                                              "rows": pq.ParquetFile(p).metadata.num_rows} for p in embedded}


@pytest.mark.parametrize("damage", ["truncate", "delete", "extra_row", "manifest_rows", "no_manifest"])
def test_embedded_corpus_rebuilt_when_damaged(embedded, tmp_path, capsys, damage):
    cache = shutil.copytree(os.path.dirname(embedded[0]), tmp_path / "embedded")
    victim, manifest = str(cache / "shard_00002.parquet"), cache / corpus.MANIFEST
    if damage == "truncate":
        os.truncate(victim, os.path.getsize(victim) - 100)
    elif damage == "delete":
        os.remove(victim)
    elif damage == "extra_row":
        append_row(victim)
    elif damage == "manifest_rows":  # same bytes, another row count: the rows are checked too
        entries = json.load(open(manifest))
        entries["shard_00002.parquet"]["rows"] += 1
        json.dump(entries, open(manifest, "w"))
    else:
        os.remove(manifest)
    paths = corpus.embedded_corpus(str(tmp_path))
    out = capsys.readouterr().out
    assert "rebuilding" in out and ("shard_00002.parquet" in out or damage == "no_manifest")
    assert all(open(a, "rb").read() == open(b, "rb").read() for a, b in zip(embedded, paths))

# ---------------------------------------------------------------- locks and downloads


def test_lock_is_exclusive_and_removed(tmp_path):
    path, inside, seen = str(tmp_path / "x"), [], []

    def work():
        for _ in range(20):
            with corpus.locked(path):
                inside.append(1)
                seen.append(len(inside))
                time.sleep(0.001)
                inside.pop()
    threads = [threading.Thread(target=work) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(seen) == 120 and max(seen) == 1 and no_locks(tmp_path)


def test_download_normal_and_skip_existing(server, tmp_path, capsys):
    path = str(tmp_path / "s.parquet")
    assert corpus.download(f"{server.url}/shard_00000.parquet", path, backoff=0.01) == path
    assert open(path, "rb").read() == server.files["/shard_00000.parquet"]
    corpus.download(f"{server.url}/shard_00000.parquet", path, backoff=0.01)
    assert len(server.requests) == 1 and not glob.glob(path + ".part*") and no_locks(tmp_path)
    mb = len(server.files["/shard_00000.parquet"]) / 1e6
    out = capsys.readouterr().out
    assert re.fullmatch(rf"{re.escape(path)}: 1/1 files, {mb:.1f} MB, [\d.,]+ MB/s\n", out)


def test_progress_lines_per_file_and_by_time(server, tmp_path, capsys, monkeypatch):
    big = server.files["/shard_00000.parquet"]
    assert len(big) > 3 * (1 << 16)  # several chunks: a line per chunk would show
    monkeypatch.setattr(corpus, "PROGRESS_SECONDS", 1e9)
    corpus.download(f"{server.url}/shard_00000.parquet", str(tmp_path / "a"))
    assert capsys.readouterr().out.count("\n") == 1  # only the finished file
    monkeypatch.setattr(corpus, "PROGRESS_SECONDS", 0)  # every chunk is "late": a line each
    corpus.download(f"{server.url}/shard_00000.parquet", str(tmp_path / "b"))
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) > 3 and all("0/1 files" in line for line in lines[:-1]) and "1/1 files" in lines[-1]


def test_unreachable_host_fails_fast_with_hint(tmp_path, monkeypatch):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    calls, get = [], requests.get
    monkeypatch.setattr(corpus.requests, "get", lambda *a, **kw: calls.append(kw) or get(*a, **kw))
    url = f"http://127.0.0.1:{port}/shard_00000.parquet"
    with pytest.raises(ConnectionError, match=re.escape(url) + "(.|\n)*data_dir"):
        corpus.download(url, str(tmp_path / "s.parquet"), retries=2, backoff=0.01)
    # requests' (connect, read) timeout: a host that does not answer fails within seconds per attempt
    assert len(calls) == 2 and all(isinstance(kw["timeout"], tuple) and kw["timeout"][0] <= 10
                                   for kw in calls)
    with pytest.raises(ConnectionError, match="put the shards in data_dir=(.|\n)*embedded"):
        corpus.download_shards(1, str(tmp_path), base_url=f"http://127.0.0.1:{port}", retries=1)
    assert no_locks(tmp_path) and not glob.glob(str(tmp_path / "*.part*"))


def test_an_unresolvable_host_fails_at_once(tmp_path, monkeypatch):
    """No such host, or no network (offline: no name resolves): retrying cannot help, one attempt."""
    calls, get = [], requests.get
    monkeypatch.setattr(corpus.requests, "get", lambda *a, **kw: calls.append(kw) or get(*a, **kw))
    url = "http://no-such-host.invalid/shard_00000.parquet"  # .invalid never resolves (RFC 2606)
    with pytest.raises(ConnectionError, match="after 1 attempts: " + re.escape(url)):
        corpus.download(url, str(tmp_path / "s.parquet"), retries=5, backoff=10)
    assert len(calls) == 1 and no_locks(tmp_path)


@pytest.mark.parametrize("mode", ["ok", "ignore_range"])
def test_download_resumes_after_dropped_connection(server, tmp_path, mode):
    server.mode, server.drops = mode, 1
    path = str(tmp_path / "s.parquet")
    corpus.download(f"{server.url}/shard_00001.parquet", path, backoff=0.01)
    assert open(path, "rb").read() == server.files["/shard_00001.parquet"]
    assert not glob.glob(path + ".part*")
    assert len(server.requests) == 2 and server.requests[0][1] is None
    have = int(re.fullmatch(r"bytes=(\d+)-", server.requests[1][1]).group(1))
    assert 0 < have <= len(server.files["/shard_00001.parquet"]) // 2  # resumed, not restarted


@pytest.mark.parametrize("mode,gets", [(404, 1), (500, 3)])  # 404 is final, 500 is retried
def test_download_http_errors(server, tmp_path, mode, gets):
    server.mode = mode
    url, path = f"{server.url}/shard_00000.parquet", str(tmp_path / "s.parquet")
    with pytest.raises(ConnectionError, match=re.escape(url)):
        corpus.download(url, path, retries=3, backoff=0.01)
    assert len(server.requests) == gets
    assert not os.path.exists(path) and not glob.glob(path + ".part*") and no_locks(tmp_path)


def test_concurrent_downloads_fetch_once(server, tmp_path):
    server.delay = 0.3
    url, path = f"{server.url}/shard_00002.parquet", str(tmp_path / "s.parquet")
    threads = [threading.Thread(target=corpus.download, args=(url, path)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(server.requests) == 1 and no_locks(tmp_path)
    assert open(path, "rb").read() == server.files["/shard_00002.parquet"]

# ---------------------------------------------------------------- FineWeb-Edu shards


def test_shards_for_tokens():
    """By hand: a shard holds ~55M tokens and a run asks for 10% to spare, so one shard serves
    55M / 1.1 = 50M of the run's tokens; FineWeb-Edu has 1822 training shards (1823 less validation)."""
    assert corpus.shards_for_tokens(1) == 1
    assert corpus.shards_for_tokens(50_000_000) == 1  # 50M x 1.1 = 55M: exactly one shard
    assert corpus.shards_for_tokens(50_000_001) == 2  # a token more needs a second one
    assert corpus.shards_for_tokens(100_000_000) == 2  # 110M: exactly two
    assert corpus.shards_for_tokens(165_000_000) == 4  # 181.5M: 3.3 shards
    assert corpus.shards_for_tokens(1_234_567_890) == 25  # 1,358,024,679 / 55M = 24.69
    assert corpus.shards_for_tokens(1821.5 * 50e6) == 1822  # 1821.5 shards: every training shard
    assert corpus.shards_for_tokens(91_100_000_000) == 1822  # 1822 x 50M: every shard, exactly
    for bad in (0, 91_100_000_001, 1822.5 * 50e6):  # none; one token more than FineWeb-Edu serves
        with pytest.raises(ValueError, match="training tokens.*1..1822 training shards"):
            corpus.shards_for_tokens(bad)


def test_shard_names_leave_out_the_validation_shard():
    name = "shard_{:05d}.parquet".format
    assert corpus.shard_names(2) == [name(0), name(1), name(249)]
    # the authors' files (run.sh downloads 0..249; their loader validates on the last, 249)
    assert corpus.AUTHORS_TRAIN_SHARDS == 249 and corpus.shard_names(249) == [name(i) for i in range(250)]
    assert corpus.shard_names(251)[-4:] == [name(248), name(250), name(251), name(249)]
    every = corpus.shard_names(1822)
    assert len(set(every)) == 1823 and every[-3:] == [name(1821), name(1822), name(249)]
    for bad in (0, 1823):
        with pytest.raises(ValueError, match=f"1..1822, got {bad}"):
            corpus.shard_names(bad)


def test_download_shards_manifest_and_plan(server, embedded, tmp_path, capsys):
    # the served shards are real parquet: the embedded corpus, renamed; validation (shard 249) last
    served = dict(zip(["shard_00000.parquet", "shard_00001.parquet", "shard_00249.parquet"], embedded))
    server.files = {f"/{name}": open(p, "rb").read() for name, p in served.items()}
    d = str(tmp_path)
    paths = corpus.download_shards(2, d, base_url=server.url, backoff=0.01)
    assert [os.path.basename(p) for p in paths] == list(served)
    assert all(open(p, "rb").read() == server.files[f"/{os.path.basename(p)}"] for p in paths)
    out = capsys.readouterr().out.splitlines()
    assert "0 present, downloading 3 (~0.3 GB)" in out[0]
    assert [line.split(": ")[1].split(" files")[0] for line in out[1:]] == ["1/3", "2/3", "3/3"]
    assert f"{sum(map(len, server.files.values())) / 1e6:.1f} MB" in out[-1]
    manifest = json.load(open(tmp_path / "manifest.json"))
    assert manifest == {name: {"bytes": os.path.getsize(p), "rows": pq.ParquetFile(p).metadata.num_rows}
                        for name, p in served.items()}
    # a missing shard is downloaded again; the ones present are checked, not fetched
    os.remove(paths[1])
    server.requests = []
    corpus.download_shards(2, d, base_url=server.url, backoff=0.01)
    assert "2 present, downloading 1 (~0.1 GB)" in capsys.readouterr().out
    assert [r[0] for r in server.requests] == ["/shard_00001.parquet"]
    # a truncated or changed shard is an error naming it (and saying what to do), not a new split
    for damage in (lambda p: os.truncate(p, os.path.getsize(p) - 1), append_row):
        damage(paths[0])
        with pytest.raises(ValueError, match=re.escape(paths[0]) + ".*delete it"):
            corpus.download_shards(2, d, base_url=server.url, backoff=0.01)
        shutil.copy(served["shard_00000.parquet"], paths[0])
    assert no_locks(tmp_path)
    server.files.pop("/shard_00002.parquet", None)
    with pytest.raises(ConnectionError, match="shard_00002.parquet(.|\n)*embedded"):
        corpus.download_shards(3, d, base_url=server.url, backoff=0.01)

# ---------------------------------------------------------------- evaluation inputs


def test_val_shard_is_the_runs_held_out_shard(server, embedded, tmp_path):
    """embedded (also a run that saved no dataset setting): the embedded corpus's last shard, the
    cached one; fineweb: shard_00249, downloaded once (here from the local server)."""
    data_dir = os.path.dirname(os.path.dirname(embedded[0]))
    assert os.path.basename(embedded[-1]) == "shard_00004.parquet"  # 4 training shards, then validation
    assert corpus.val_shard({}, data_dir) == corpus.val_shard({"dataset": "embedded"}, data_dir) == embedded[-1]
    server.files = {"/shard_00249.parquet": open(embedded[-1], "rb").read()}
    fineweb = {"dataset": "fineweb"}
    path = corpus.val_shard(fineweb, str(tmp_path), base_url=server.url)
    assert path == str(tmp_path / "shard_00249.parquet")
    assert open(path, "rb").read() == server.files["/shard_00249.parquet"]
    assert corpus.val_shard(fineweb, str(tmp_path), base_url=server.url) == path
    assert server.requests == [("/shard_00249.parquet", None)] and no_locks(tmp_path)  # present: not fetched again


def test_fetch_wikitext_into_data_dir(server, tmp_path):
    server.files = {"/wikitext/test.parquet": b"the wikitext-2 test split"}
    path = corpus.fetch_wikitext(f"{server.url}/wikitext/test.parquet", str(tmp_path))
    assert path == str(tmp_path / "wikitext" / "wikitext-2-v1-test.parquet")
    assert open(path, "rb").read() == b"the wikitext-2 test split"


def test_a_failed_download_leaves_no_folder_it_made(server, tmp_path, monkeypatch):
    """WikiText offline: the error names the path as given (relative stays relative), and the folders the
    download made for it (data_dir/wikitext) are gone again; a data_dir that was there stays."""
    server.mode = 404
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    with pytest.raises(ConnectionError, match=re.escape(" -> data/wikitext/wikitext-2-v1-test.parquet: ") +
                       "(.|\n)*--wiki_path="):
        corpus.fetch_wikitext(f"{server.url}/wikitext/test.parquet", "data")
    with pytest.raises(ConnectionError, match=re.escape(" -> new/eval_bundle.zip: ") + "(.|\n)*--bundle_dir="):
        corpus.fetch_bundle("new/eval_bundle/", f"{server.url}/eval_bundle.zip")
    assert os.listdir(tmp_path) == ["data"] and os.listdir(tmp_path / "data") == []


def zipped(files):
    """The bytes of a zip archive of files {name: text}."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    return buffer.getvalue()


BUNDLE = {"eval_bundle/core.yaml": "icl_tasks:\n- label: mc_task\n  dataset_uri: qa/mc.jsonl\n",
          "eval_bundle/eval_meta_data.csv": "Eval Task,Random baseline\nmc_task,25.0\n",
          "eval_bundle/eval_data/qa/mc.jsonl": '{"query": "Q?", "choices": ["a", "b"], "gold": 1}\n'}


def test_bundle_download_from_local_server(server, tmp_path, monkeypatch):
    """The DCLM bundle: the zip's eval_bundle/ unpacked whole at bundle_dir (every file, byte for
    byte: what eval.load_bundle reads), the zip removed, no temporary directory left behind."""
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    server.files = {"/eval_bundle.zip": zipped(BUNDLE)}
    target = tmp_path / "data" / "eval_bundle"
    assert corpus.fetch_bundle(str(target), f"{server.url}/eval_bundle.zip") == str(target)
    unpacked = {str(p.relative_to(target)): p.read_text() for p in pathlib.Path(target).rglob("*") if p.is_file()}
    assert unpacked == {name.removeprefix("eval_bundle/"): text for name, text in BUNDLE.items()}
    leftovers = [n for n in os.listdir(tmp_path / "data") if n != "eval_bundle" and not n.endswith(".lock")]
    assert leftovers == []  # the zip is removed and no temporary directory is left
    assert corpus.fetch_bundle(str(target), "http://127.0.0.1:9/unreachable") == str(target)  # present: no download
    assert [r[0] for r in server.requests] == ["/eval_bundle.zip"]
    # a zip without a top-level eval_bundle/ is an error naming it, and nothing appears at bundle_dir
    server.files = {"/flat.zip": zipped({"core.yaml": BUNDLE["eval_bundle/core.yaml"]})}
    with pytest.raises(ValueError, match=re.escape(str(tmp_path / "flat.zip")) + ": expected a top-level eval_bundle/"):
        corpus.fetch_bundle(str(tmp_path / "flat"), f"{server.url}/flat.zip")
    assert not (tmp_path / "flat").exists()


# ---------------------------------------------------------------- disk space


def size_text(n):  # written out again: the messages must show both forms
    return (f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB") + f" ({n:,} bytes)"


def test_too_little_space_for_the_shards_downloads_nothing(server, embedded, tmp_path, monkeypatch):
    """The shards' space is checked before the first request: SHARD_GB for a shard never seen, the
    manifest's size for one downloaded before, less what this host's partial file already holds."""
    served = dict(zip(["shard_00000.parquet", "shard_00001.parquet", "shard_00249.parquet"], embedded))
    server.files = {f"/{name}": open(p, "rb").read() for name, p in served.items()}
    d = str(tmp_path / "data")  # not created yet: the free space is its parent's
    monkeypatch.setattr(runtime, "free_bytes", lambda path: 1000)
    with pytest.raises(runtime.DiskSpaceError) as e:
        corpus.download_shards(2, d, base_url=server.url, backoff=0.01)
    assert str(e.value) == (f"downloading 3 FineWeb-Edu shards: needs {size_text(300_000_000)} in {d}, but its disk "
                            f"has only {size_text(1000)} free; nothing was downloaded; free some space, choose another "
                            "data_dir, or train on fewer shards (num_shards)")
    assert server.requests == [] and not glob.glob(os.path.join(d, "*.parquet*"))
    monkeypatch.undo()
    paths = corpus.download_shards(2, d, base_url=server.url, backoff=0.01)
    os.remove(paths[1])  # its size is in the manifest now; 1000 bytes of it are downloaded again
    body = server.files["/shard_00001.parquet"]
    with open(f"{paths[1]}.part.{socket.gethostname()}", "wb") as f:
        f.write(body[:1000])
    monkeypatch.setattr(runtime, "free_bytes", lambda path: len(body) - 1001)
    server.requests = []
    with pytest.raises(runtime.DiskSpaceError, match=re.escape(f"needs {size_text(len(body) - 1000)} in {d}, ")):
        corpus.download_shards(2, d, base_url=server.url, backoff=0.01)
    assert server.requests == []
    monkeypatch.setattr(runtime, "free_bytes", lambda path: len(body) - 1000)  # exactly enough
    corpus.download_shards(2, d, base_url=server.url, backoff=0.01)
    assert open(paths[1], "rb").read() == body and server.requests == [("/shard_00001.parquet", "bytes=1000-")]


def test_a_download_checks_the_size_its_response_announces(server, tmp_path, monkeypatch):
    url, path = f"{server.url}/shard_00000.parquet", str(tmp_path / "s.parquet")
    body = server.files["/shard_00000.parquet"]
    monkeypatch.setattr(runtime, "free_bytes", lambda p: len(body) - 1)
    with pytest.raises(runtime.DiskSpaceError) as e:
        corpus.download(url, path, backoff=0.01)
    assert str(e.value) == (f"downloading {url}: needs {size_text(len(body))} in {tmp_path}, but its disk has only "
                            f"{size_text(len(body) - 1)} free; nothing more was written; free some space, or choose "
                            "another data_dir")
    assert len(server.requests) == 1 and os.listdir(tmp_path) == []  # no retries: waiting frees no space
    monkeypatch.setattr(runtime, "free_bytes", lambda p: len(body))
    corpus.download(url, path, backoff=0.01)
    assert open(path, "rb").read() == body


def test_unpacking_the_bundle_checks_its_size(server, tmp_path, monkeypatch):
    server.files = {"/eval_bundle.zip": zipped(BUNDLE)}
    unpacked = sum(len(text) for text in BUNDLE.values())  # ASCII: a character is a byte
    # room for the zip in tmp_path, not for what it unpacks into the directory made inside it
    monkeypatch.setattr(runtime, "free_bytes", lambda path: 10**9 if path == str(tmp_path) else unpacked - 1)
    target = tmp_path / "eval_bundle"
    with pytest.raises(runtime.DiskSpaceError, match=re.escape(f"unpacking {target}.zip: needs {size_text(unpacked)} in ")):
        corpus.fetch_bundle(str(target), f"{server.url}/eval_bundle.zip")
    assert not target.exists()

# ---------------------------------------------------------------- several hosts, one shared directory


@pytest.fixture
def no_lock(monkeypatch):
    """corpus.locked as on a shared filesystem whose flock does not reach across hosts: no exclusion."""
    monkeypatch.setattr(corpus, "locked", lambda path: contextlib.nullcontext())


def on_two_hosts(work):
    """work() in two processes at once, whose socket.gethostname() says node-a and node-b (one pid
    each, as on two machines); their exit codes. A failure prints its traceback to stderr."""
    fork = multiprocessing.get_context("fork")

    def host(name):
        socket.gethostname = lambda: name
        work()
    procs = [fork.Process(target=host, args=(name,)) for name in ("node-a", "node-b")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    return [p.exitcode for p in procs]


def leftovers(directory):
    return [f for f in glob.glob(os.path.join(directory, "**", "*"), recursive=True)
            if re.search(r"\.(part|tmp)\b|\.lock$", f)]


def test_two_hosts_download_the_same_shards_at_once(server, embedded, tmp_path, no_lock):
    """Both hosts fetch every shard (the lock does not stop them), each into its own partial file,
    resuming after a dropped connection: the shards are the served bytes, the manifest whole."""
    served = dict(zip(["shard_00000.parquet", "shard_00001.parquet", "shard_00249.parquet"], embedded))
    server.files = {f"/{name}": open(p, "rb").read() for name, p in served.items()}
    server.delay, server.drops = 0.3, 2  # both hosts are mid-download together; two responses break off
    d = str(tmp_path)
    assert on_two_hosts(lambda: corpus.download_shards(2, d, base_url=server.url, backoff=0.01)) == [0, 0]
    assert sorted(r[0] for r in server.requests if r[1] is None) == sorted(2 * [f"/{n}" for n in served])
    assert sum(r[1] is not None for r in server.requests) == 2  # the two broken ones were resumed
    for name in served:
        assert open(tmp_path / name, "rb").read() == server.files[f"/{name}"]
    expected = {name: {"bytes": len(server.files[f"/{name}"]),
                       "rows": pq.ParquetFile(io.BytesIO(server.files[f"/{name}"])).metadata.num_rows} for name in served}
    assert json.load(open(tmp_path / "manifest.json")) == expected
    assert leftovers(d) == []


def test_two_hosts_build_the_embedded_corpus_at_once(embedded, tmp_path, monkeypatch, no_lock):
    """Both hosts find no corpus and build it at the same moment; the one whose rename comes second
    finds the other's in place and uses it. Both return the shards of a build by one host alone."""
    docs = [t for p in embedded for t in pq.read_table(p).column("text").to_pylist()]  # real text, no import walk
    start = multiprocessing.get_context("fork").Barrier(2)
    monkeypatch.setattr(corpus, "_embedded_documents", lambda: (start.wait(), list(docs))[1])
    assert on_two_hosts(lambda: corpus.embedded_corpus(str(tmp_path / "shared"))) == [0, 0]
    monkeypatch.setattr(corpus, "_embedded_documents", lambda: list(docs))
    alone = corpus.embedded_corpus(str(tmp_path / "alone"))
    shared = corpus.embedded_corpus(str(tmp_path / "shared"))  # whole, by its manifest: not rebuilt
    assert [open(p, "rb").read() for p in shared] == [open(p, "rb").read() for p in alone]
    assert open(tmp_path / "shared" / "embedded" / corpus.MANIFEST).read() == \
        open(tmp_path / "alone" / "embedded" / corpus.MANIFEST).read()
    assert sorted(os.listdir(tmp_path / "shared")) == ["embedded"] and leftovers(str(tmp_path)) == []


def test_two_hosts_with_the_same_pid_train_the_bpe_at_once(embedded, tmp_path, monkeypatch, no_lock):
    """Two threads of this process stand for two hosts whose processes have the same pid (containers
    number them from 1): both train the tokenizer and write it; the file is the one a single
    training writes, and both tokenizers encode alike."""
    monkeypatch.setattr(socket, "gethostname", lambda: threading.current_thread().name)
    rename, together = os.replace, threading.Barrier(2, timeout=60)
    monkeypatch.setattr(os, "replace", lambda src, dst: (together.wait(), rename(src, dst)))  # both written, then renamed
    results = {}

    def host():
        results[threading.current_thread().name] = data.get_tokenizer("bpe", str(tmp_path / "shared"), embedded[:-1], 512)
    os.makedirs(tmp_path / "shared")
    threads = [threading.Thread(target=host, name=name) for name in ("node-a", "node-b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    monkeypatch.setattr(os, "replace", rename)
    alone = data.train_tokenizer(embedded[:-1], 512, str(tmp_path / "alone.json"))
    assert open(tmp_path / "shared" / "tokenizer_bpe512.json", "rb").read() == open(tmp_path / "alone.json", "rb").read()
    text = pq.read_table(embedded[-1]).column("text")[0].as_py()
    assert results["node-a"].encode(text) == results["node-b"].encode(text) == alone.encode(text)
    assert os.listdir(tmp_path / "shared") == ["tokenizer_bpe512.json"]
