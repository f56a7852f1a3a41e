"""Tests for data.py: embedded corpus, tokenizer, loader, downloader (local http.server only)."""
import json
import os
import re
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tokenizers
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import data  # noqa: E402


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return data.embedded_corpus(str(tmp_path_factory.mktemp("data")))


@pytest.fixture(scope="module")
def tok(corpus, tmp_path_factory):
    return data.train_tokenizer(corpus[:1], 512, str(tmp_path_factory.mktemp("tok") / "bpe512.json"))


def write_parquet(path, texts, row_group_size=2):
    pq.write_table(pa.table({"text": texts}), path, row_group_size=row_group_size)
    return str(path)


def row_groups(files):
    return [(f, g) for f in files for g in range(pq.ParquetFile(f).num_row_groups)]


def docs_of(f, g):
    return pq.ParquetFile(f).read_row_group(g).column("text").to_pylist()


def expected_stream(files, tok, rank=0, world_size=1):
    """The rank's token stream, built one document at a time with encode (not encode_batch)."""
    out = []
    for f, g in row_groups(files)[rank::world_size]:
        for text in docs_of(f, g):
            out += [tok.bos_id] + tok.encode(text)
    return out


def take(loader, n):
    return [next(loader) for _ in range(n)]


def windows(batches):
    """Rebuild the (T+1)-token windows from (x, y): window = x + last token of y."""
    return torch.cat([torch.cat([x, y[:, -1:]], dim=1) for x, y in batches]).flatten().tolist()

# ---------------------------------------------------------------- embedded corpus


def test_embedded_corpus_deterministic_cached_and_split(corpus, tmp_path, monkeypatch):
    again = data.embedded_corpus(str(tmp_path))
    assert [os.path.basename(p) for p in corpus] == [os.path.basename(p) for p in again]
    for a, b in zip(corpus, again):
        assert open(a, "rb").read() == open(b, "rb").read()
    # cached: a second call reads the shards, it does not rebuild
    monkeypatch.setattr(data, "_embedded_documents", lambda: pytest.fail("rebuilt"))
    assert data.embedded_corpus(str(tmp_path)) == again
    assert len(corpus) == data.EMBEDDED_SHARDS and data.list_shards(os.path.dirname(corpus[0])) == corpus
    texts = []
    for path in corpus:
        pf = pq.ParquetFile(path)
        assert pf.schema_arrow.names == ["text"]
        assert pf.num_row_groups >= (2 if path == corpus[-1] else 4)
        texts.append(pf.read().column("text").to_pylist())
    n_bytes = [sum(len(t.encode()) for t in shard) for shard in texts]
    assert 0.05 < n_bytes[-1] / sum(n_bytes) < 0.10  # the last shard is validation
    assert 1.5e6 < sum(n_bytes) < 3e6
    all_docs = [t for shard in texts for t in shard]
    assert all(all_docs) and len(set(all_docs)) == len(all_docs)
    assert any(d.startswith("json\n\n") for d in all_docs)  # a module document

# ---------------------------------------------------------------- tokenizer


UNICODE = "naïve café — 日本語のテキスト 🎉🐍 Ünïcödé\n\ttabs  and   spaces <|endoftext|> Ω≈ç√"


def test_bpe_roundtrip_bos_and_token_bytes(tok, corpus):
    assert tok.vocab_size == 512
    ids = tok.encode(UNICODE)
    assert tok.decode(ids) == UNICODE
    assert tok.bos_id not in ids  # no BOS added, and "<|endoftext|>" in text stays text
    assert tok.encode_batch([UNICODE, "x"]) == [ids, tok.encode("x")]
    # the case token_bytes must get right: an id that is part of a multi-byte character
    assert any(tok.decode([i]) == "\ufffd" for i in ids)
    table = tok.token_bytes()
    assert table.shape == (512,) and table[tok.bos_id] == 0
    assert table[ids].sum() == len(UNICODE.encode("utf-8"))
    for text in pq.read_table(corpus[-1]).column("text").to_pylist():
        assert table[tok.encode(text)].sum() == len(text.encode("utf-8"))


def test_load_and_get_tokenizer(tok, tmp_path, monkeypatch):
    path = str(tmp_path / "saved.json")
    tok.save(path)
    assert data.load_tokenizer(path).encode(UNICODE) == tok.encode(UNICODE)
    with pytest.raises(FileNotFoundError, match="nowhere/tok.json"):
        data.load_tokenizer("nowhere/tok.json")
    bare = tokenizers.Tokenizer(tokenizers.models.BPE())
    bare.save(str(tmp_path / "bare.json"))
    with pytest.raises(ValueError, match=re.escape(str(tmp_path / "bare.json"))):
        data.load_tokenizer(str(tmp_path / "bare.json"))
    # 'bpe': trained once, then read from the cache
    files = [write_parquet(tmp_path / "t.parquet", ["hello world, " * 20, "héllo wörld"])]
    first = data.get_tokenizer("bpe", str(tmp_path), files, 300)
    assert os.path.exists(tmp_path / "tokenizer_bpe300.json") and first.vocab_size <= 300
    monkeypatch.setattr(data, "train_tokenizer", lambda *a: pytest.fail("retrained"))
    again = data.get_tokenizer("bpe", str(tmp_path), files, 300)
    assert again.encode(UNICODE) == first.encode(UNICODE)
    assert data.get_tokenizer(path, str(tmp_path), files, 300).encode(UNICODE) == tok.encode(UNICODE)

# ---------------------------------------------------------------- loader


def test_loader_matches_independent_stream(tok, corpus):
    B, T = 3, 64
    batches = take(data.DataLoader(corpus[:1], tok, B, T), 20)
    stream = expected_stream(corpus[:1], tok)
    for n, (x, y) in enumerate(batches):
        assert x.shape == y.shape == (B, T) and x.dtype == y.dtype == torch.long
        want = torch.tensor(stream[n * B * (T + 1):(n + 1) * B * (T + 1)]).view(B, T + 1)
        assert torch.equal(x, want[:, :-1]) and torch.equal(y, want[:, 1:])
    assert stream[0] == tok.bos_id  # documents start with bos; the stream is made of [bos] + doc


def test_loader_ranks_disjoint_and_cover_everything(tok, corpus):
    files = corpus[:1]
    docs = []
    for rank in range(2):
        loader = data.DataLoader(files, tok, 2, 32, rank=rank, world_size=2)
        seen = []
        while loader.state_dict()["epoch"] == 0:
            seen += windows([next(loader)])
        stream = expected_stream(files, tok, rank, 2)
        assert seen[:len(stream)] == stream  # exactly this rank's row groups, in order
        # split the rank's first epoch into documents at each bos
        cuts = [i for i, t in enumerate(stream) if t == tok.bos_id] + [len(stream)]
        docs += [tuple(stream[a + 1:b]) for a, b in zip(cuts, cuts[1:])]
    everything = [tuple(tok.encode(t)) for t in pq.read_table(files[0]).column("text").to_pylist()]
    assert sorted(docs) == sorted(everything)  # disjoint and complete


def test_loader_loops_epochs(tok, tmp_path):
    files = [write_parquet(tmp_path / "tiny.parquet", ["a b c", "héllo", "😀 x"], row_group_size=3)]
    stream = expected_stream(files, tok)
    loader = data.DataLoader(files, tok, 2, 8)
    batches = take(loader, 10)
    n = len(windows(batches))
    assert n > 3 * len(stream) and loader.state_dict()["epoch"] == (n // len(stream))
    assert windows(batches) == (stream * (n // len(stream) + 1))[:n]


@pytest.mark.parametrize("rank,world_size", [(0, 1), (1, 2)])
def test_loader_resume_reproduces_next_batches(tok, tmp_path, rank, world_size):
    texts = [f"doc {i}: " + "more words " * i for i in range(9)]  # ~130 tokens in 5 row groups
    files = [write_parquet(tmp_path / "a.parquet", texts[:5]),
             write_parquet(tmp_path / "b.parquet", texts[5:])]
    for k in range(12):  # every position: mid row group, row-group edges, across epochs
        loader = data.DataLoader(files, tok, 2, 16, rank=rank, world_size=world_size)
        take(loader, k)
        state = json.loads(json.dumps(loader.state_dict()))
        resumed = data.DataLoader(files, tok, 2, 16, rank=rank, world_size=world_size, state=state)
        for (x, y), (x2, y2) in zip(take(loader, 5), take(resumed, 5)):
            assert torch.equal(x, x2) and torch.equal(y, y2)
    assert state["epoch"] > 0
    with pytest.raises(ValueError, match="loader state"):
        data.DataLoader(files, tok, 2, 16, rank=rank, world_size=world_size + 1, state=state)

# ---------------------------------------------------------------- bad input


def test_bad_input_names_the_file(tok, tmp_path):
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path))):
        data.list_shards(str(tmp_path))
    no_text = str(tmp_path / "no_text.parquet")
    pq.write_table(pa.table({"content": ["x"]}), no_text)
    good = write_parquet(tmp_path / "good.parquet", ["some text"] * 50, row_group_size=10)
    truncated = str(tmp_path / "truncated.parquet")
    with open(good, "rb") as f, open(truncated, "wb") as g:
        g.write(f.read()[:os.path.getsize(good) // 2])
    for path in (no_text, truncated):
        with pytest.raises(ValueError, match=re.escape(path)):
            data.DataLoader([good, path], tok, 2, 8)
        with pytest.raises(ValueError, match=re.escape(path)):
            data.train_tokenizer([path], 300, str(tmp_path / "t.json"))
    with pytest.raises(FileNotFoundError, match="missing.parquet"):
        data.DataLoader([str(tmp_path / "missing.parquet")], tok, 2, 8)
    with pytest.raises(ValueError, match="no files"):
        data.DataLoader([], tok, 2, 8)
    with pytest.raises(ValueError, match="rank 5 of 6 gets no documents"):  # 5 row groups, 6 ranks
        data.DataLoader([good], tok, 2, 8, rank=5, world_size=6)
    with pytest.raises(ValueError, match="rank"):
        data.DataLoader([good], tok, 2, 8, rank=2, world_size=2)

# ---------------------------------------------------------------- downloader


class Handler(BaseHTTPRequestHandler):
    """Serves server.files with Range support; server.mode / drops / delay script failures."""

    def do_GET(self):
        srv = self.server
        with srv.lock:
            srv.requests.append((self.path, self.headers.get("Range")))
            drop = srv.drops > 0
            srv.drops -= drop
        body = srv.files.get(self.path)
        if srv.mode in (404, 500) or body is None:
            return self.send_error(404 if body is None else srv.mode)
        time.sleep(srv.delay)
        start = 0
        if self.headers.get("Range") and srv.mode != "ignore_range":
            start = int(re.fullmatch(r"bytes=(\d+)-", self.headers["Range"]).group(1))
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
        else:
            self.send_response(200)
        self.send_header("Content-Length", str(len(body) - start))  # the full size, even when dropping
        self.end_headers()
        # a drop sends half the bytes, then HTTP/1.0 closes the connection
        self.wfile.write(body[start:start + (len(body) - start) // 2] if drop else body[start:])

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def http_server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    srv.lock = threading.Lock()
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv
    srv.shutdown()


@pytest.fixture
def server(http_server, corpus):
    http_server.files = {f"/{os.path.basename(p)}": open(p, "rb").read() for p in corpus}
    http_server.mode, http_server.drops, http_server.delay, http_server.requests = "ok", 0, 0.0, []
    http_server.url = f"http://127.0.0.1:{http_server.server_address[1]}"
    return http_server


def test_download_normal_and_skip_existing(server, tmp_path):
    path = str(tmp_path / "s.parquet")
    assert data.download(f"{server.url}/shard_00000.parquet", path, backoff=0.01) == path
    assert open(path, "rb").read() == server.files["/shard_00000.parquet"]
    data.download(f"{server.url}/shard_00000.parquet", path, backoff=0.01)
    assert len(server.requests) == 1 and not os.path.exists(path + ".part")


@pytest.mark.parametrize("mode", ["ok", "ignore_range"])
def test_download_resumes_after_dropped_connection(server, tmp_path, mode):
    server.mode, server.drops = mode, 1
    path = str(tmp_path / "s.parquet")
    data.download(f"{server.url}/shard_00001.parquet", path, backoff=0.01)
    assert open(path, "rb").read() == server.files["/shard_00001.parquet"]
    assert not os.path.exists(path + ".part")
    assert len(server.requests) == 2 and server.requests[0][1] is None
    have = int(re.fullmatch(r"bytes=(\d+)-", server.requests[1][1]).group(1))
    assert 0 < have <= len(server.files["/shard_00001.parquet"]) // 2  # resumed, not restarted


@pytest.mark.parametrize("mode,gets", [(404, 1), (500, 3)])  # 404 is final, 500 is retried
def test_download_http_errors(server, tmp_path, mode, gets):
    server.mode = mode
    url, path = f"{server.url}/shard_00000.parquet", str(tmp_path / "s.parquet")
    with pytest.raises(ConnectionError, match=re.escape(url)):
        data.download(url, path, retries=3, backoff=0.01)
    assert len(server.requests) == gets
    assert not os.path.exists(path) and not os.path.exists(path + ".part")


def test_concurrent_downloads_fetch_once(server, tmp_path):
    server.delay = 0.3
    url, path = f"{server.url}/shard_00002.parquet", str(tmp_path / "s.parquet")
    threads = [threading.Thread(target=data.download, args=(url, path)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(server.requests) == 1
    assert open(path, "rb").read() == server.files["/shard_00002.parquet"]


def test_download_shards_and_offline_hint(server, tmp_path):
    server.files = {f"/{data.SHARD_NAME.format(i)}": bytes([i % 256]) * 1000 for i in (0, 1, data.VAL_SHARD)}
    paths = data.download_shards(2, str(tmp_path), base_url=server.url, backoff=0.01)
    assert [os.path.basename(p) for p in paths] == ["shard_00000.parquet", "shard_00001.parquet",
                                                    "shard_01822.parquet"]
    assert all(open(p, "rb").read() == server.files[f"/{os.path.basename(p)}"] for p in paths)
    with pytest.raises(ConnectionError, match="embedded"):
        data.download_shards(3, str(tmp_path), base_url=server.url, backoff=0.01)


def test_load_tokenizer_from_hub_name(server, tok, tmp_path, monkeypatch):
    tok.save(str(tmp_path / "tokenizer.json"))
    server.files = {"/org/tiny/resolve/main/tokenizer.json": open(tmp_path / "tokenizer.json", "rb").read()}
    monkeypatch.setattr(data, "HUB_URL", server.url + "/{name}/resolve/main/tokenizer.json")
    loaded = data.load_tokenizer("org/tiny", cache_dir=str(tmp_path / "cache"))
    assert loaded.encode(UNICODE) == tok.encode(UNICODE) and loaded.bos_id == tok.bos_id
    assert os.path.exists(tmp_path / "cache" / "org--tiny.tokenizer.json")
