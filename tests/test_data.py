"""Tests for data.py: the tokenizers (BPE training, byte tables, document token) and the streaming
loader (packing, ranks, epochs, resume, bad input). Downloads and the corpora: test_corpus.py."""
import itertools
import json
import os
import re
import shutil
import sys
import threading

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tokenizers
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import data  # noqa: E402
from flt import corpus  # noqa: E402


@pytest.fixture(scope="module")
def tok(embedded, tmp_path_factory):
    return data.train_tokenizer(embedded[:1], 512, str(tmp_path_factory.mktemp("tok") / "bpe512.json"))


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

# ---------------------------------------------------------------- tokenizer


UNICODE = "naïve café — 日本語のテキスト 🎉🐍 Ünïcödé\n\ttabs  and   spaces <|endoftext|> Ω≈ç√"


def test_bpe_roundtrip_bos_and_token_bytes(tok, embedded):
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
    for text in pq.read_table(embedded[-1]).column("text").to_pylist():
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


def test_bos_token_configurable(tok, embedded, tmp_path):
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
    x, y = next(data.DataLoader(embedded[-1:], qwen_like, 2, 32))
    assert chunks([(x, y)]) == expected_stream(embedded[-1:], qwen_like)[:65] and x[0, 0] == 512
    # asking for a document token the tokenizer lacks names the token and the setting
    tok.save(str(tmp_path / "bpe.json"))
    for make in (lambda: data.load_tokenizer(str(tmp_path / "bpe.json"), bos=data.QWEN3_BOS),
                 lambda: data.get_tokenizer("bpe", str(tmp_path), embedded[:1], 300, bos=data.QWEN3_BOS)):
        with pytest.raises(ValueError, match=re.escape(data.QWEN3_BOS) + ".*bos_token"):
            make()
    assert data.get_tokenizer(path, str(tmp_path), [], 0, bos=data.QWEN3_BOS).bos_id == 512


def test_load_tokenizer_from_hub_name(server, tok, tmp_path, monkeypatch):
    tok.save(str(tmp_path / "tokenizer.json"))
    server.files = {"/org/tiny/resolve/main/tokenizer.json": open(tmp_path / "tokenizer.json", "rb").read()}
    monkeypatch.setattr(corpus, "TOKENIZER_URL", server.url + "/{name}/resolve/main/tokenizer.json")
    loaded = data.load_tokenizer("org/tiny", cache_dir=str(tmp_path / "cache"))
    assert loaded.encode(UNICODE) == tok.encode(UNICODE) and loaded.bos_id == tok.bos_id
    assert os.path.exists(tmp_path / "cache" / "org--tiny.tokenizer.json")

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
def test_loader_without_cycle_covers_the_stream(tok, embedded, rank, world_size):
    B, T = 3, 64
    batches = take(data.DataLoader(embedded[-1:], tok, B, T, rank, world_size, cycle=False), 10_000)
    stream = expected_stream(embedded[-1:], tok, rank, world_size)
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


def test_packed_chunks_by_hand():
    """Each document as [bos] + its ids in one stream (bos = 0 here), cut into chunks that never
    overlap; a resumed stream starts `skip` tokens in; a chunk reads only the documents it needs."""
    docs = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]  # the stream 0 1 2 3 0 4 5 0 6 7 8 9
    assert list(data.packed_chunks(docs, 0, 5)) == [[0, 1, 2, 3, 0], [4, 5, 0, 6, 7], [8, 9]]
    assert list(data.packed_chunks(docs, 0, 4)) == [[0, 1, 2, 3], [0, 4, 5, 0], [6, 7, 8, 9]]
    assert list(data.packed_chunks(docs, 0, 5, skip=6)) == [[5, 0, 6, 7, 8], [9]]
    assert list(data.packed_chunks(docs, 0, 3, skip=4)) == [[0, 4, 5], [0, 6, 7], [8, 9]]
    read = []
    chunks = data.packed_chunks((read.append(d) or d for d in docs), 0, 5)
    assert next(chunks) == [0, 1, 2, 3, 0] and read == docs[:2]


def reference_epoch(files, tok, rank, world_size):
    """(the rank's token stream of one epoch, where each of its row groups starts in it)."""
    starts, stream = [], []
    for f, g in row_groups(files, rank, world_size):
        starts.append(len(stream))
        stream += [t for text in docs_of(f, g) for t in [tok.bos_id] + tok.encode(text)]
    return stream, starts


@pytest.mark.parametrize("B,T,rank,world_size,prefetch", [
    (1, 2, 0, 1, 1),  # chunks of 3 tokens: an epoch of 27 is exactly 9 of them
    (2, 3, 0, 1, 2),  # chunks of 7: they cross row groups and epochs
    (1, 4, 1, 2, 1),  # rank 1 of 2
    (4, 8, 0, 2, 1),  # chunks of 33, twice the rank's epoch of 16: one crosses two epoch ends
])
def test_loader_batches_states_and_epoch_lines_follow_the_packed_stream(
        numbers, tmp_path, capsys, B, T, rank, world_size, prefetch):
    """The authors' packing computed here from the documents: batch k is tokens [kL, (k+1)L) of
    the rank's stream, cycled (L = B*T+1); the state after it is where token (k+1)L lies (epoch,
    file, row group, offset), with the epoch's tokens read and batches begun; an epoch's line
    comes with the batch that reads its last token. A loader resumed from any of those states
    gives the same batches, states and lines after it."""
    texts = ["1 2 3", "4 5", "6 7 8 9", "10", "11 12 13 14 15"]
    files = [write_parquet(tmp_path / "a.parquet", texts),
             write_parquet(tmp_path / "b.parquet", ["16 17", "18 19 20"], row_group_size=1)]
    groups = row_groups(files, rank, world_size)
    stream, starts = reference_epoch(files, numbers, rank, world_size)
    E, L = len(stream), B * T + 1
    n = 3 * E // L + 2  # three epochs and more

    def want(k):
        """Batch k (x, y), the state after it, and the lines it prints."""
        chunk = [stream[i % E] for i in range(k * L, (k + 1) * L)]
        end = (k + 1) * L
        epoch, at = divmod(end, E)
        pos = max(i for i, s in enumerate(starts) if s <= at)
        state = {"epoch": epoch, "file": os.path.basename(groups[pos][0]),
                 "row_group": groups[pos][1], "offset": at - starts[pos], "rank": rank,
                 "world_size": world_size, "epoch_tokens": at,
                 "epoch_batches": sum(1 for j in range(k + 1) if j * L >= epoch * E)}
        lines = "".join(
            f"DataLoader rank {rank}: epoch {e - 1} is used up (row groups: {len(groups)}, files: "
            f"{len({f for f, _ in groups})}, tokens: {E:,}, batches served: "
            f"{sum(1 for j in range(k + 1) if (e - 1) * E <= j * L < e * E)}); epoch {e} starts: "
            "its documents are seen again\n" for e in range(k * L // E + 1, end // E + 1))
        xy = torch.tensor(chunk[:-1]).view(B, T), torch.tensor(chunk[1:]).view(B, T)
        return xy, state, lines

    loader = data.DataLoader(files, numbers, B, T, rank, world_size, prefetch=prefetch)
    states = []
    for k in range(n):
        (x, y), state, lines = want(k)
        x2, y2 = next(loader)
        assert torch.equal(x2, x) and torch.equal(y2, y), k
        assert loader.state_dict() == state and capsys.readouterr().out == lines, k
        states.append(json.loads(json.dumps(state)))
    assert states[-1]["epoch"] >= 3 and any(s["offset"] for s in states)
    for k, state in enumerate(states):
        resumed = data.DataLoader(files, numbers, B, T, rank, world_size, state=state,
                                  prefetch=prefetch)
        for j in range(k + 1, k + 4):
            (x, y), state, lines = want(j)
            x2, y2 = next(resumed)
            assert torch.equal(x2, x) and torch.equal(y2, y), (k, j)
            assert resumed.state_dict() == state and capsys.readouterr().out == lines, (k, j)


def test_loader_matches_independent_stream(tok, embedded):
    B, T = 3, 64
    batches = take(data.DataLoader(embedded[:1], tok, B, T), 20)
    stream = expected_stream(embedded[:1], tok)
    for n, (x, y) in enumerate(batches):
        assert x.shape == y.shape == (B, T) and x.dtype == y.dtype == torch.long
        want = torch.tensor(stream[n * (B * T + 1):(n + 1) * (B * T + 1)])
        assert torch.equal(x, want[:-1].view(B, T)) and torch.equal(y, want[1:].view(B, T))
        assert torch.equal(y[:-1, -1], x[1:, 0])  # a row's last target is the next row's first input
    assert stream[0] == tok.bos_id  # documents start with bos; the stream is made of [bos] + doc


def test_loader_ranks_disjoint_and_cover_everything(tok, embedded):
    files = embedded[:1]
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


@pytest.mark.parametrize("old, new", [(2, 1), (1, 2), (2, 3), (3, 2)])
def test_loader_continues_from_another_world_size(numbers, tmp_path, old, new):
    """A run saved by `old` ranks continues on `new` ranks: after the furthest row group any old rank
    had begun, each document read once at most, the others counted as skipped."""
    texts = [" ".join([str(i)] * (1 + i % 4)) for i in range(1, 31)]  # 30 documents, told apart by their ids
    files = [write_parquet(tmp_path / f"{name}.parquet", texts[10 * k:10 * k + 10])
             for k, name in enumerate("abc")]  # 5 row groups of 2 documents each
    groups = [(f, g) for f in files for g in range(5)]
    for batches in range(1, 9):
        loaders = [data.DataLoader(files, numbers, 1, 3, r, old) for r in range(old)]
        used = [len(chunks(take(loader, batches))) for loader in loaders]
        states = json.loads(json.dumps([loader.state_dict() for loader in loaders]))
        if any(s["epoch"] for s in states):
            break  # a rank's stream ended: this test follows one epoch
        read, begun = set(), []  # documents whose bos an old rank read; the row groups it had begun
        for r, used in enumerate(used):
            stream = expected_stream(files, numbers, r, old)
            read |= {stream[i + 1] for i in range(used) if stream[i] == numbers.bos_id}
            for f, g in row_groups(files, r, old):
                begun += [(f, g)] if used > 0 else []
                used -= sum(1 + len(t.split()) for t in docs_of(f, g))
        later = [(f, g) for f, g in groups if groups.index((f, g)) > max(map(groups.index, begun))]
        skipped = 0
        for r in range(new):
            loader = data.DataLoader(files, numbers, 1, 3, r, new, state=states, cycle=False)
            got = [t for x, y in loader for t in torch.cat([x.flatten()[:1], y.flatten()]).tolist() if t != -1]
            want = [t for f, g in later if g % new == r for d in docs_of(f, g) for t in [numbers.bos_id] + numbers.encode(d)]
            assert got == want[:len(got)] and len(want) - len(got) <= 1  # a last lone token is no chunk
            mine = {want[i + 1] for i in range(len(got)) if want[i] == numbers.bos_id}
            assert not mine & read
            read |= mine
            skipped = loader.skipped_documents  # the same on every new rank
        assert len(read) + skipped == 30
    assert batches > 4  # positions in several files were tried
    with pytest.raises(ValueError, match="expected one per rank of the saved run"):
        data.DataLoader(files, numbers, 1, 3, 0, new, state=states[1:])


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
    calls, tokenize = [], data.DataLoader.tokenize

    def recorded(self, file, row_group):  # one file: row group = position
        calls.append((row_group, threading.current_thread() is threading.main_thread()))
        return tokenize(self, file, row_group)
    monkeypatch.setattr(data.DataLoader, "tokenize", recorded)
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
