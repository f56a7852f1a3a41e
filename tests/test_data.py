"""Tests for data.py: embedded corpus, tokenizer, loader, downloader (local http.server only)."""
import glob
import itertools
import json
import os
import re
import shutil
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import requests
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


def row_groups(files, rank=0, world_size=1):
    """The rank's row groups: of each file in turn, rank, rank + world_size, ... (the authors' rule)."""
    return [(f, g) for f in files for g in range(rank, pq.ParquetFile(f).num_row_groups, world_size)]


def docs_of(f, g):
    return pq.ParquetFile(f).read_row_group(g).column("text").to_pylist()


def expected_stream(files, tok, rank=0, world_size=1):
    """The rank's token stream, built one document at a time with encode (not encode_batch)."""
    out = []
    for f, g in row_groups(files, rank, world_size):
        for text in docs_of(f, g):
            out += [tok.bos_id] + tok.encode(text)
    return out


def take(loader, n):
    return list(itertools.islice(loader, n))


def chunks(batches):
    """Rebuild the stream from full batches: a chunk of B*T+1 tokens is x, then y's last token."""
    return torch.cat([torch.cat([x.flatten(), y.flatten()[-1:]]) for x, y in batches]).tolist()


@pytest.fixture(scope="module")
def numbers():
    """A tokenizer whose ids read as the text: "12 7" is [12, 7]; bos (<|endoftext|>) is 0."""
    vocab = {data.BOS: 0, **{str(i): i for i in range(1, 40)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token=data.BOS))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([data.BOS])
    return data.Tokenizer(tok)


@pytest.fixture
def two_files(tmp_path):
    """a.parquet: 3 row groups, b.parquet: 2, one document each; 3 is not a multiple of 2 ranks."""
    return [write_parquet(tmp_path / "a.parquet", ["1 2 3", "4 5", "6 7 8 9"], row_group_size=1),
            write_parquet(tmp_path / "b.parquet", ["10 11", "12 13 14"], row_group_size=1)]

# ---------------------------------------------------------------- embedded corpus


def test_embedded_corpus_deterministic_cached_and_split(corpus, tmp_path, monkeypatch):
    again = data.embedded_corpus(str(tmp_path))
    assert [os.path.basename(p) for p in corpus] == [os.path.basename(p) for p in again]
    for a, b in zip(corpus, again):
        assert open(a, "rb").read() == open(b, "rb").read()
    # cached: a second call reads the shards, it does not rebuild
    monkeypatch.setattr(data, "_embedded_documents", lambda: pytest.fail("rebuilt"))
    assert data.embedded_corpus(str(tmp_path)) == again
    assert len(corpus) == data.EMBEDDED_SHARDS and corpus == sorted(glob.glob(os.path.join(os.path.dirname(corpus[0]), "*.parquet")))
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
    assert not glob.glob(str(tmp_path / "*.lock")) and not glob.glob(str(tmp_path / "embedded" / "*.lock"))


def test_embedded_manifest_records_shards(corpus):
    manifest = json.load(open(os.path.join(os.path.dirname(corpus[0]), "manifest.json")))
    assert manifest == {os.path.basename(p): {"bytes": os.path.getsize(p),
                                              "rows": pq.ParquetFile(p).metadata.num_rows} for p in corpus}


def append_row(path):
    texts = pq.read_table(path).column("text").to_pylist()
    pq.write_table(pa.table({"text": texts + ["one more document"]}), path)


@pytest.mark.parametrize("damage", ["truncate", "delete", "extra_row", "manifest_rows", "no_manifest"])
def test_embedded_corpus_rebuilt_when_damaged(corpus, tmp_path, capsys, damage):
    cache = shutil.copytree(os.path.dirname(corpus[0]), tmp_path / "embedded")
    victim, manifest = str(cache / "shard_00002.parquet"), cache / data.MANIFEST
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
    paths = data.embedded_corpus(str(tmp_path))
    out = capsys.readouterr().out
    assert "rebuilding" in out and ("shard_00002.parquet" in out or damage == "no_manifest")
    assert all(open(a, "rb").read() == open(b, "rb").read() for a, b in zip(corpus, paths))

# ---------------------------------------------------------------- tokenizer


UNICODE = "naïve café — 日本語のテキスト 🎉🐍 Ünïcödé\n\ttabs  and   spaces <|endoftext|> Ω≈ç√"


def test_bpe_roundtrip_bos_and_token_bytes(tok, corpus):
    assert tok.vocab_size == 512
    ids = tok.encode(UNICODE)
    assert tok.decode(ids) == UNICODE
    assert tok.bos_id not in ids  # no BOS added, and "<|endoftext|>" in text stays text
    assert tok.encode_batch([UNICODE, "x"]) == [ids, tok.encode("x")]
    # the case the two counts differ on: an id that is part of a multi-byte character
    partial = [i for i in ids if tok.decode([i]) == "\ufffd"]
    assert partial
    table = tok.token_bytes("utf8")  # the true bytes: they add up to the text's
    assert table.shape == (512,) and table.dtype == torch.long and table[tok.bos_id] == 0
    assert table[ids].sum() == len(UNICODE.encode("utf-8"))
    for text in pq.read_table(corpus[-1]).column("text").to_pylist():
        assert table[tok.encode(text)].sum() == len(text.encode("utf-8"))
    # the authors' count (the default): 3 bytes for U+FFFD, the true bytes for every other id here
    authors = tok.token_bytes()
    assert authors.shape == (512,) and authors.dtype == torch.long and authors[tok.bos_id] == 0
    assert all(authors[i] == (3 if i in partial else table[i]) for i in ids)
    assert authors[ids].sum() == len(UNICODE.encode("utf-8")) + sum(3 - table[i] for i in partial)
    with pytest.raises(ValueError, match="'authors' or 'utf8'"):
        tok.token_bytes("bytes")


def gpt2_byte_chars():
    """Byte-level BPE's byte -> character map (GPT-2's bytes_to_unicode), written out."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    moved = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + i) for i, b in enumerate(moved)}}


def test_token_bytes_of_a_split_character():
    """"中" is e4 b8 ad; a vocabulary of the 256 bytes (id = byte), "e4 b8" (256), <|endoftext|>
    (257, special) and <think> (258, added, not special)."""
    char = gpt2_byte_chars()
    assert set(char.values()) == set(tokenizers.pre_tokenizers.ByteLevel.alphabet())
    vocab = {char[b]: b for b in range(256)} | {char[0xE4] + char[0xB8]: 256}
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, [(char[0xE4], char[0xB8])]))
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    bpe.add_special_tokens([data.BOS])
    bpe.add_tokens(["<think>"])
    tok = data.Tokenizer(bpe)
    assert tok.encode("中a") == [256, 0xAD, 97] and tok.decode([256, 0xAD]) == "中"
    assert (tok.bos_id, tok.tok.token_to_id("<think>"), tok.vocab_size) == (257, 258, 259)
    ids = [256, 0xAD, 0xE4, 97, 257, 258]
    # authors: len(decode([id]).encode()): "e4 b8", "ad", "e4" alone each decode to U+FFFD (3 bytes)
    assert tok.token_bytes("authors")[ids].tolist() == [3, 3, 3, 1, 0, 0]
    assert tok.token_bytes("utf8")[ids].tolist() == [2, 1, 1, 1, 0, 7]
    assert tok.token_bytes()[[256, 0xAD]].sum() == 6  # "中" counts 6 bytes for the authors, 3 in UTF-8


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

def test_bos_token_configurable(tok, corpus, tmp_path):
    both = tokenizers.Tokenizer.from_str(tok.tok.to_str())  # the BPE plus Qwen3's <|im_start|>
    both.add_special_tokens([data.QWEN3_BOS])
    path = str(tmp_path / "both.json")
    both.save(path)
    qwen_like = data.load_tokenizer(path, bos=data.QWEN3_BOS)
    assert qwen_like.bos_id == both.token_to_id(data.QWEN3_BOS) == 512 and qwen_like.vocab_size == 513
    assert data.load_tokenizer(path).bos_id == tok.bos_id  # the default stays <|endoftext|>
    for count in ("authors", "utf8"):  # both special tokens count 0 bytes
        table = qwen_like.token_bytes(count)
        assert table[512] == 0 and table[tok.bos_id] == 0 and torch.equal(table[:512], tok.token_bytes(count))
    text = UNICODE + data.QWEN3_BOS  # written in a document, it is text
    ids = qwen_like.encode(text)
    assert 512 not in ids and qwen_like.token_bytes("utf8")[ids].sum() == len(text.encode("utf-8"))
    x, y = next(data.DataLoader(corpus[-1:], qwen_like, 2, 32))
    assert chunks([(x, y)]) == expected_stream(corpus[-1:], qwen_like)[:65] and x[0, 0] == 512
    # asking for a document token the tokenizer lacks names the token and the setting
    tok.save(str(tmp_path / "bpe.json"))
    for make in (lambda: data.load_tokenizer(str(tmp_path / "bpe.json"), bos=data.QWEN3_BOS),
                 lambda: data.get_tokenizer("bpe", str(tmp_path), corpus[:1], 300, bos=data.QWEN3_BOS)):
        with pytest.raises(ValueError, match=re.escape(data.QWEN3_BOS) + ".*bos_token"):
            make()
    assert data.get_tokenizer(path, str(tmp_path), [], 0, bos=data.QWEN3_BOS).bos_id == 512

# ---------------------------------------------------------------- loader


def test_loader_packs_chunks_of_B_T_plus_1_by_hand(numbers, two_files, capsys):
    # Per file, rank 0 of 2 reads a's row groups 0, 2 then b's 0; rank 1 reads a's 1 then b's 1
    # (over the concatenated files rank 0 would read b's 1). With bos = 0 their streams are
    #   rank 0: 0 1 2 3  0 6 7 8 9  0 10 11      rank 1: 0 4 5  0 12 13 14
    # B=2, T=3: chunks of 7 tokens; x = the first 6, y = the last 6; the next chunk starts after it.
    rank0 = data.DataLoader(two_files, numbers, 2, 3, rank=0, world_size=2)
    x, y = next(rank0)  # chunk 0 1 2 3 0 6 7
    assert x.tolist() == [[0, 1, 2], [3, 0, 6]] and y.tolist() == [[1, 2, 3], [0, 6, 7]]
    assert capsys.readouterr().out == ""
    x, y = next(rank0)  # chunk 8 9 0 10 11 | 0 1: 8 is only an input; the stream wraps into epoch 1
    assert x.tolist() == [[8, 9, 0], [10, 11, 0]] and y.tolist() == [[9, 0, 10], [11, 0, 1]]
    x, y = next(rank0)  # chunk 2 3 0 6 7 8 9
    assert x.tolist() == [[2, 3, 0], [6, 7, 8]] and y.tolist() == [[3, 0, 6], [7, 8, 9]]
    rank1 = data.DataLoader(two_files, numbers, 2, 3, rank=1, world_size=2)
    for _ in range(2):  # its whole stream is one chunk: every batch is the same
        x, y = next(rank1)
        assert x.tolist() == [[0, 4, 5], [0, 12, 13]] and y.tolist() == [[4, 5, 0], [12, 13, 14]]


def test_loader_without_cycle_pads_the_last_chunk_then_stops(numbers, two_files, tmp_path):
    rank0 = data.DataLoader(two_files, numbers, 2, 3, rank=0, world_size=2, cycle=False)
    batches = take(rank0, 10)
    assert [(x.tolist(), y.tolist()) for x, y in batches] == [
        ([[0, 1, 2], [3, 0, 6]], [[1, 2, 3], [0, 6, 7]]),
        ([[8, 9, 0], [10, 0, 0]], [[9, 0, 10], [11, -1, -1]])]  # the 5 last tokens, padded
    with pytest.raises(StopIteration):
        next(rank0)
    # every token of 0 1 2 3 0 6 7 8 9 0 10 11 but the chunks' first (0 and 8) is a target, once
    targets = [t for _, y in batches for t in y.flatten().tolist() if t >= 0]
    assert targets == [1, 2, 3, 0, 6, 7, 9, 0, 10, 11]
    rank1 = data.DataLoader(two_files, numbers, 2, 3, rank=1, world_size=2, cycle=False)
    assert len(take(rank1, 10)) == 1  # 7 tokens: one full chunk, nothing left
    # after the chunk 0 1 2 3 0 4 5: one token left (6) is only an input, no batch; two (6 7) are one target
    first = ([[0, 1, 2], [3, 0, 4]], [[1, 2, 3], [0, 4, 5]])
    for last_doc, after in [("4 5 6", []), ("4 5 6 7", [([[6, 0, 0], [0, 0, 0]], [[7, -1, -1], [-1, -1, -1]])])]:
        files = [write_parquet(tmp_path / f"{len(last_doc)}.parquet", ["1 2 3", last_doc])]
        loader = data.DataLoader(files, numbers, 2, 3, cycle=False)
        assert [(x.tolist(), y.tolist()) for x, y in take(loader, 10)] == [first, *after]


@pytest.mark.parametrize("rank,world_size", [(0, 1), (1, 2)])
def test_loader_without_cycle_covers_the_stream(tok, corpus, rank, world_size):
    B, T = 3, 64
    batches = take(data.DataLoader(corpus[-1:], tok, B, T, rank, world_size, cycle=False), 10_000)
    stream = expected_stream(corpus[-1:], tok, rank, world_size)
    assert 0 < len(stream) % (B * T + 1) and len(batches) == -(-len(stream) // (B * T + 1))
    assert chunks(batches[:-1]) == stream[:len(stream) // (B * T + 1) * (B * T + 1)]
    targets = [t for _, y in batches for t in y.flatten().tolist() if t >= 0]
    assert targets == [t for i, t in enumerate(stream) if i % (B * T + 1)]  # all but each chunk's first
    n = len(stream) % (B * T + 1)
    x, y = batches[-1]
    assert x.flatten().tolist() == stream[-n:-1] + [tok.bos_id] * (B * T - n + 1)
    assert y.flatten().tolist() == stream[-n + 1:] + [-1] * (B * T - n + 1)


def test_loader_cycle_says_so(numbers, two_files, capsys):
    rank0 = data.DataLoader(two_files, numbers, 2, 3, rank=0, world_size=2)
    next(rank0)
    assert capsys.readouterr().out == "" and rank0.state_dict()["epoch"] == 0
    next(rank0)
    assert capsys.readouterr().out == (
        "DataLoader rank 0: epoch 0 is used up (row groups: 3, files: 2, tokens: 12, batches served: 2); "
        "epoch 1 starts: its documents are seen again\n")
    assert rank0.state_dict()["epoch"] == 1
    rank1 = data.DataLoader(two_files, numbers, 2, 3, rank=1, world_size=2)
    take(rank1, 2)  # its 7 tokens are exactly one chunk: each batch is a whole epoch
    assert capsys.readouterr().out == "".join(
        f"DataLoader rank 1: epoch {e} is used up (row groups: 2, files: 2, tokens: 7, batches served: 1); "
        f"epoch {e + 1} starts: its documents are seen again\n" for e in (0, 1))
    assert rank1.state_dict()["epoch"] == 2


def test_loader_matches_independent_stream(tok, corpus):
    B, T = 3, 64
    batches = take(data.DataLoader(corpus[:1], tok, B, T), 20)
    stream = expected_stream(corpus[:1], tok)
    for n, (x, y) in enumerate(batches):
        assert x.shape == y.shape == (B, T) and x.dtype == y.dtype == torch.long
        want = torch.tensor(stream[n * (B * T + 1):(n + 1) * (B * T + 1)])
        assert torch.equal(x, want[:-1].view(B, T)) and torch.equal(y, want[1:].view(B, T))
        assert torch.equal(y[:-1, -1], x[1:, 0])  # a row's last target is the next row's first input
    assert stream[0] == tok.bos_id  # documents start with bos; the stream is made of [bos] + doc


def test_loader_ranks_disjoint_and_cover_everything(tok, corpus):
    files = corpus[:1]
    docs = []
    for rank in range(2):
        loader = data.DataLoader(files, tok, 2, 32, rank=rank, world_size=2)
        seen = []
        while loader.state_dict()["epoch"] == 0:
            seen += chunks([next(loader)])
        stream = expected_stream(files, tok, rank, 2)
        assert seen[:len(stream)] == stream  # exactly this rank's row groups, in order
        # split the rank's first epoch into documents at each bos
        cuts = [i for i, t in enumerate(stream) if t == tok.bos_id] + [len(stream)]
        docs += [tuple(stream[a + 1:b]) for a, b in zip(cuts, cuts[1:])]
    everything = [tuple(tok.encode(t)) for t in pq.read_table(files[0]).column("text").to_pylist()]
    assert sorted(docs) == sorted(everything)  # disjoint and complete


def test_loader_loops_epochs(tok, tmp_path, capsys):
    files = [write_parquet(tmp_path / "tiny.parquet", ["a b c", "héllo", "😀 x"], row_group_size=3)]
    stream = expected_stream(files, tok)
    loader = data.DataLoader(files, tok, 2, 8)
    batches = take(loader, 10)
    n = len(chunks(batches))
    assert n > 3 * len(stream) and loader.state_dict()["epoch"] == (n // len(stream))
    assert chunks(batches) == (stream * (n // len(stream) + 1))[:n]
    assert capsys.readouterr().out.count("its documents are seen again\n") == n // len(stream)


@pytest.mark.parametrize("rank,world_size,cycle", [(0, 1, True), (1, 2, True), (0, 2, False)])
def test_loader_resume_reproduces_next_batches(tok, tmp_path, capsys, rank, world_size, cycle):
    texts = [f"doc {i}: " + "more words " * i for i in range(9)]  # 315 tokens in 3 + 2 row groups
    files = [write_parquet(tmp_path / "a.parquet", texts[:5]),
             write_parquet(tmp_path / "b.parquet", texts[5:])]

    def make(state=None, ranks=world_size):
        return data.DataLoader(files, tok, 2, 16, rank, ranks, state=state, cycle=cycle)
    said = []
    for k in range(12):  # every position: mid row group, row-group edges, across epochs
        loader = make()
        take(loader, k)
        state = json.loads(json.dumps(loader.state_dict()))
        if not cycle and state["epoch"] > 0:
            break  # the stream is over
        resumed, _ = make(state), capsys.readouterr()
        batches, out = take(loader, 5), capsys.readouterr().out
        again, out2 = take(resumed, 5), capsys.readouterr().out
        assert len(batches) == len(again) and (len(batches) == 5 or not cycle)
        assert out == out2  # the epoch's line too, with its counts
        for (x, y), (x2, y2) in zip(batches, again):
            assert torch.equal(x, x2) and torch.equal(y, y2)
        said.append(out)
    # with cycle, positions in later epochs and epoch lines after a resume; without, up to the padded chunk
    assert (state["epoch"] > 0 and sum(map(bool, said)) > 2) if cycle else (len(said) > 2 and k < 11)
    with pytest.raises(ValueError, match="loader state"):
        make(state, world_size + 1)
    with pytest.raises(ValueError, match=r"loader state .* lacks \['epoch_batches', 'epoch_tokens'\]"):
        make({key: v for key, v in state.items() if not key.startswith("epoch_")})


def test_loader_state_names_the_file(tok, tmp_path):
    texts = [f"doc {i}: " + "more words " * i for i in range(9)]
    files = [write_parquet(tmp_path / "a.parquet", texts[:5]),
             write_parquet(tmp_path / "b.parquet", texts[5:])]
    loader = data.DataLoader(files, tok, 2, 16)
    for _ in range(100):
        next(loader)
        if (state := loader.state_dict())["file"] == "b.parquet":
            break
    assert state["file"] == "b.parquet" and state["row_group"] == 0 and state["offset"] > 0  # mid-way
    # the same shards elsewhere, plus a new one after them: the state still points into b.parquet
    os.makedirs(tmp_path / "moved")
    moved = [shutil.copy(f, tmp_path / "moved") for f in files]
    moved.append(write_parquet(tmp_path / "moved" / "c.parquet", ["new data"]))
    resumed = data.DataLoader(moved, tok, 2, 16, state=state)
    x, y = next(loader)
    x2, y2 = next(resumed)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    for bad, match in [({"file": "c.parquet"}, "row group 0 of file 'c.parquet'"),
                       ({"row_group": 3}, "row group 3 of file 'b.parquet'.*'b.parquet': 2")]:
        with pytest.raises(ValueError, match=match):
            data.DataLoader(files, tok, 2, 16, state=state | bad)
    with pytest.raises(ValueError, match="names must differ"):
        data.DataLoader([files[0], files[0]], tok, 2, 16)


def test_loader_tokenizes_next_row_group_in_background(tok, tmp_path, monkeypatch):
    calls, tokenize = [], data.DataLoader._tokenize

    def recorded(self, pos):
        calls.append((pos, threading.current_thread() is threading.main_thread()))
        return tokenize(self, pos)
    monkeypatch.setattr(data.DataLoader, "_tokenize", recorded)
    files = [write_parquet(tmp_path / "a.parquet", [f"doc {i}: " + "word " * (3 * i) for i in range(12)])]
    loader, batches = data.DataLoader(files, tok, 2, 8), []
    while loader.state_dict()["row_group"] < 4:
        batches.append(next(loader))
    # the first row group in the caller's thread; each later one once, in the background, in order
    # (row group 5 is being tokenized now, and may not have been recorded yet)
    assert calls[:5] == [(0, True), (1, False), (2, False), (3, False), (4, False)] and len(calls) <= 6
    # the same batches as the plain stream, tokenized one document at a time in the test
    n = len(chunks(batches))
    assert chunks(batches) == expected_stream(files, tok)[:n]
    # and the state: the tokens of row group 4 used so far
    assert loader.state_dict()["offset"] == n - sum(len(tok.encode(t)) + 1 for g in range(4)
                                                    for t in docs_of(files[0], g))
    # without cycle no epoch follows: the last row group does not start tokenizing the first again
    calls.clear()
    assert take(data.DataLoader(files, tok, 2, 8, cycle=False), 10_000)
    assert calls == [(0, True), (1, False), (2, False), (3, False), (4, False), (5, False)]


# ---------------------------------------------------------------- bad input


def test_bad_input_names_the_file(tok, tmp_path):
    no_text = str(tmp_path / "no_text.parquet")
    pq.write_table(pa.table({"content": ["x"]}), no_text)
    good = write_parquet(tmp_path / "good.parquet", ["some text"] * 50, row_group_size=10)
    truncated = str(tmp_path / "truncated.parquet")
    with open(good, "rb") as f, open(truncated, "wb") as g:
        g.write(f.read()[:os.path.getsize(good) // 2])
    not_strings = str(tmp_path / "not_strings.parquet")
    pq.write_table(pa.table({"text": [1, 2]}), not_strings)
    empty = write_parquet(tmp_path / "empty.parquet", pa.array([], pa.string()))
    for path in (no_text, truncated, not_strings, empty):
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


def no_locks(directory):
    return not glob.glob(os.path.join(directory, "**", "*.lock"), recursive=True)


def test_download_normal_and_skip_existing(server, tmp_path, capsys):
    path = str(tmp_path / "s.parquet")
    assert data.download(f"{server.url}/shard_00000.parquet", path, backoff=0.01) == path
    assert open(path, "rb").read() == server.files["/shard_00000.parquet"]
    data.download(f"{server.url}/shard_00000.parquet", path, backoff=0.01)
    assert len(server.requests) == 1 and not os.path.exists(path + ".part") and no_locks(tmp_path)
    mb = len(server.files["/shard_00000.parquet"]) / 1e6
    out = capsys.readouterr().out
    assert re.fullmatch(rf"{re.escape(path)}: 1/1 files, {mb:.1f} MB, [\d.,]+ MB/s\n", out)


def test_progress_lines_per_file_and_by_time(server, tmp_path, capsys, monkeypatch):
    big = server.files["/shard_00000.parquet"]
    assert len(big) > 3 * (1 << 16)  # several chunks: a line per chunk would show
    monkeypatch.setattr(data, "PROGRESS_SECONDS", 1e9)
    data.download(f"{server.url}/shard_00000.parquet", str(tmp_path / "a"))
    assert capsys.readouterr().out.count("\n") == 1  # only the finished file
    monkeypatch.setattr(data, "PROGRESS_SECONDS", 0)  # every chunk is "late": a line each
    data.download(f"{server.url}/shard_00000.parquet", str(tmp_path / "b"))
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) > 3 and all("0/1 files" in line for line in lines[:-1]) and "1/1 files" in lines[-1]


def test_unreachable_host_fails_fast_with_hint(tmp_path, monkeypatch):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    calls, get = [], requests.get
    monkeypatch.setattr(data.requests, "get", lambda *a, **kw: calls.append(kw) or get(*a, **kw))
    url = f"http://127.0.0.1:{port}/shard_00000.parquet"
    with pytest.raises(ConnectionError, match=re.escape(url) + "(.|\n)*data_dir"):
        data.download(url, str(tmp_path / "s.parquet"), retries=2, backoff=0.01)
    # requests' (connect, read) timeout: a host that does not answer fails within seconds per attempt
    assert len(calls) == 2 and all(isinstance(kw["timeout"], tuple) and kw["timeout"][0] <= 10
                                   for kw in calls)
    with pytest.raises(ConnectionError, match="put the shards in data_dir=(.|\n)*embedded"):
        data.download_shards(1, str(tmp_path), base_url=f"http://127.0.0.1:{port}", retries=1)
    assert no_locks(tmp_path) and not glob.glob(str(tmp_path / "*.part"))


def test_an_unresolvable_host_fails_at_once(tmp_path, monkeypatch):
    """No such host, or no network (offline: no name resolves): retrying cannot help, one attempt."""
    calls, get = [], requests.get
    monkeypatch.setattr(data.requests, "get", lambda *a, **kw: calls.append(kw) or get(*a, **kw))
    url = "http://no-such-host.invalid/shard_00000.parquet"  # .invalid never resolves (RFC 2606)
    with pytest.raises(ConnectionError, match="after 1 attempts: " + re.escape(url)):
        data.download(url, str(tmp_path / "s.parquet"), retries=5, backoff=10)
    assert len(calls) == 1 and no_locks(tmp_path)


def test_lock_is_exclusive_and_removed(tmp_path):
    path, inside, seen = str(tmp_path / "x"), [], []

    def work():
        for _ in range(20):
            with data._locked(path):
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
    assert not os.path.exists(path) and not os.path.exists(path + ".part") and no_locks(tmp_path)


def test_concurrent_downloads_fetch_once(server, tmp_path):
    server.delay = 0.3
    url, path = f"{server.url}/shard_00002.parquet", str(tmp_path / "s.parquet")
    threads = [threading.Thread(target=data.download, args=(url, path)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(server.requests) == 1 and no_locks(tmp_path)
    assert open(path, "rb").read() == server.files["/shard_00002.parquet"]


def test_shards_for_tokens():
    assert data.shards_for_tokens(1) == 1
    assert data.shards_for_tokens(1_234_567_890) == 25  # 1.2346e9 * 1.1 / 55e6 = 24.69
    assert data.shards_for_tokens(3 * data.SHARD_TOKENS) == 4  # 3.3 shards with the margin
    assert data.shards_for_tokens(1821.5 * 50e6) == 1822  # every training shard: 1823 less validation
    for bad in (0, 1822.5 * 50e6):
        with pytest.raises(ValueError, match="training tokens.*1..1822 training shards"):
            data.shards_for_tokens(bad)


def test_shard_names_leave_out_the_validation_shard():
    name = "shard_{:05d}.parquet".format
    assert data.shard_names(2) == [name(0), name(1), name(249)]
    # the authors' files (run.sh downloads 0..249; their loader validates on the last, 249)
    assert data.AUTHORS_TRAIN_SHARDS == 249 and data.shard_names(249) == [name(i) for i in range(250)]
    assert data.shard_names(251)[-4:] == [name(248), name(250), name(251), name(249)]
    every = data.shard_names(1822)
    assert len(set(every)) == 1823 and every[-3:] == [name(1821), name(1822), name(249)]
    for bad in (0, 1823):
        with pytest.raises(ValueError, match=f"1..1822, got {bad}"):
            data.shard_names(bad)


def test_download_shards_manifest_and_plan(server, corpus, tmp_path, capsys):
    # the served shards are real parquet: the embedded corpus, renamed; validation (shard 249) last
    served = dict(zip(["shard_00000.parquet", "shard_00001.parquet", "shard_00249.parquet"], corpus))
    server.files = {f"/{name}": open(p, "rb").read() for name, p in served.items()}
    d = str(tmp_path)
    paths = data.download_shards(2, d, base_url=server.url, backoff=0.01)
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
    data.download_shards(2, d, base_url=server.url, backoff=0.01)
    assert "2 present, downloading 1 (~0.1 GB)" in capsys.readouterr().out
    assert [r[0] for r in server.requests] == ["/shard_00001.parquet"]
    # a truncated or changed shard is an error naming it (and saying what to do), not a new split
    for damage in (lambda p: os.truncate(p, os.path.getsize(p) - 1), append_row):
        damage(paths[0])
        with pytest.raises(ValueError, match=re.escape(paths[0]) + ".*delete it"):
            data.download_shards(2, d, base_url=server.url, backoff=0.01)
        shutil.copy(served["shard_00000.parquet"], paths[0])
    assert no_locks(tmp_path)
    server.files.pop("/shard_00002.parquet", None)
    with pytest.raises(ConnectionError, match="shard_00002.parquet(.|\n)*embedded"):
        data.download_shards(3, d, base_url=server.url, backoff=0.01)


def test_load_tokenizer_from_hub_name(server, tok, tmp_path, monkeypatch):
    tok.save(str(tmp_path / "tokenizer.json"))
    server.files = {"/org/tiny/resolve/main/tokenizer.json": open(tmp_path / "tokenizer.json", "rb").read()}
    monkeypatch.setattr(data, "HUB_URL", server.url + "/{name}/resolve/main/tokenizer.json")
    loaded = data.load_tokenizer("org/tiny", cache_dir=str(tmp_path / "cache"))
    assert loaded.encode(UNICODE) == tok.encode(UNICODE) and loaded.bos_id == tok.bos_id
    assert os.path.exists(tmp_path / "cache" / "org--tiny.tokenizer.json")
