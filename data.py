"""Data: the paper's text as (x, y) batches of token ids: byte-level BPE tokenizers, a loader.

The paper pretrains on FineWeb-Edu (nanochat's parquet shards) with the Qwen3 tokenizer; for CPU
work with no network the same code path runs on an embedded corpus built from text every Python
ships with, and a BPE trained on it. Both are parquet shards with a `text` column, the last one
held out for validation (`python -m flt.corpus` downloads or builds them). Packing and byte counts
follow the paper authors' code (nanochat/dataloader.py, get_token_bytes): each document is
[bos] + its tokens, one stream per rank, cut into chunks of B*T+1 tokens that never overlap. The
evaluation's tokens are cut the same way (protocol_chunks: the authors' eval.sh layout;
wiki_windows: their WikiText loader); eval.py scores them.
"""
import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from itertools import islice

import tokenizers
import torch

from flt import corpus, loader_state
from flt.runtime import atomic_write

# the document token prefixed to every document, the local BPE's (Qwen3's id 151643); the
# paper's Qwen3 runs use <|im_start|> (config/paper.py's bos_token)
BOS = "<|endoftext|>"
# ids in Qwen3's tokenizer.json, 151643 BPE + 26 added (151643..151668): train.py --dry_run's
QWEN3_VOCAB = 151669
# the paper authors' document token with the Qwen3 tokenizer (id 151644)
QWEN3_BOS = "<|im_start|>"


def tokenizer_threads(cpus, local_world_size):
    """Threads for the tokenizers library's pool in each rank: the CPUs this process may use, shared
    among the ranks on its node (its default: every core, in every rank: ranks x cores threads)."""
    return max(1, cpus // max(1, local_world_size))


# The tokenizers pool's threads: set before the pool starts, never over the user's own setting
CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
os.environ.setdefault("RAYON_NUM_THREADS",
                      str(tokenizer_threads(CPUS, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))))


# ---- Tokenizer
class Tokenizer:
    """A byte-level BPE `tokenizers.Tokenizer` with a document token (BOS) and a byte table."""

    def __init__(self, tok, name="tokenizer", bos=BOS):
        self.tok = tok
        self.bos_id = tok.token_to_id(bos)
        if self.bos_id is None:
            special = [t.content for t in tok.get_added_tokens_decoder().values() if t.special]
            raise ValueError(f"{name}: no {bos!r} token for the document token "
                             f"(setting bos_token); its special tokens: {special}")
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
        """Bytes of each id for bits per byte, a (vocab_size,) long tensor. "authors" (the paper's;
        their get_token_bytes): len(decode([id]).encode()), 0 for added tokens; a token holding
        part of a character decodes to U+FFFD, 3 bytes, per broken piece ("€" is E2 82 AC: E2 82
        is one, 3; 82 AC two, 6). "utf8": the true UTF-8 bytes, 0 for special tokens only."""
        if count not in ("authors", "utf8"):
            raise ValueError(f"token_bytes: count must be 'authors' or 'utf8', got {count!r}")
        added = self.tok.get_added_tokens_decoder()
        if count == "authors":
            return torch.tensor([0 if i in added else len(self.decode([i]).encode("utf-8"))
                                 for i in range(self.vocab_size)], dtype=torch.long)
        alphabet = set(tokenizers.pre_tokenizers.ByteLevel.alphabet())
        words = isinstance(self.tok.model, tokenizers.models.WordLevel)
        table = torch.zeros(self.vocab_size, dtype=torch.long)
        for i in range(self.vocab_size):
            # added tokens are stored as plain text
            if i in added:
                table[i] = 0 if added[i].special else len(added[i].content.encode("utf-8"))
            elif (token := self.tok.id_to_token(i)) is not None:
                if not set(token) <= alphabet:
                    raise ValueError(f"token {i} {token!r} is not byte-level; only byte-level BPE "
                                     "tokenizers (GPT-2, Qwen3, train_tokenizer) are supported")
                table[i] = len(token.encode("utf-8")) if words else len(token)
        return table

    def save(self, path):
        atomic_write(path, self.tok.save)


def bpe(texts, vocab_size):
    """A byte-level BPE (GPT-2's pre-tokenizer) trained on texts, an iterable of strings or of
    lists of them; its initial alphabet is the 256 bytes, so every byte is encodable."""
    if vocab_size < 257:
        raise ValueError(f"vocab_size must be >= 257 (256 bytes + {BOS}), got {vocab_size}")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[BOS], show_progress=False,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return tok


def train_tokenizer(files, vocab_size, path):
    """bpe on the `text` of parquet files, a row group at a time; saved at path."""
    texts = (corpus.read_texts(f, g) for f in files for g in range(corpus.row_groups(f)))
    tokenizer = Tokenizer(bpe(texts, vocab_size), name=path)
    tokenizer.save(path)
    print(f"trained a {tokenizer.vocab_size}-token BPE on {len(files)} files -> {path}")
    return tokenizer


def load_tokenizer(name_or_path, cache_dir=None, bos=BOS):
    """A tokenizer.json path, or a hub name like 'Qwen/Qwen3-0.6B' (downloaded into cache_dir)."""
    path = corpus.tokenizer_file(name_or_path, cache_dir)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"tokenizer {name_or_path!r}: no such file; give a tokenizer.json "
                                "path or a hub name like 'Qwen/Qwen3-0.6B'")
    try:
        tok = tokenizers.Tokenizer.from_file(path)
    # the library raises a bare Exception for a malformed file
    except Exception as e:
        raise ValueError(f"{path}: not a valid tokenizer.json: {e}") from e
    return Tokenizer(tok, name=path, bos=bos)


def get_tokenizer(spec, data_dir, train_files, vocab_size, bos=BOS):
    """'bpe': a local BPE trained once on train_files (cached); anything else: load_tokenizer."""
    if spec != "bpe":
        return load_tokenizer(spec, cache_dir=data_dir, bos=bos)
    if bos != BOS:
        raise ValueError(f"the local 'bpe' tokenizer has {BOS!r}, not {bos!r} (setting bos_token)")
    path = os.path.join(data_dir, f"tokenizer_bpe{vocab_size}.json")
    # rank 0 trains, the other ranks wait and load
    with corpus.locked(path):
        if os.path.exists(path):
            return load_tokenizer(path)
        return train_tokenizer(train_files, vocab_size, path)


# ---- Packing, as the authors' loader packs (nanochat/dataloader.py)
def packed_chunks(documents, bos, chunk_len, skip=0):
    """Each document as [bos] + its token ids, in one stream cut into chunks of chunk_len = B*T+1
    tokens that never overlap: a chunk is a batch, its first B*T tokens the inputs x and its last
    B*T the targets y (the inputs shifted by one), so its first token is no target. A stream that
    ends may end with a shorter chunk. `skip`: the stream's first tokens, packed before a resume."""
    stream = []
    for ids in documents:
        stream += [bos, *ids]
        # a resumed loader starts `skip` tokens into its first row group
        dropped = min(skip, len(stream))
        del stream[:dropped]
        skip -= dropped
        while len(stream) >= chunk_len:
            yield stream[:chunk_len]
            del stream[:chunk_len]
    if stream:
        yield stream


# ---- Streaming loader
class DataLoader:
    """(x, y) batches of shape (B, T): one rank's documents cut by packed_chunks, as the authors'
    loader cuts them. A rank's documents: each file in turn, its row groups rank, rank +
    world_size, ... (per file, as nanochat's dataloader.py). Within a chunk, row b's last target is
    row b+1's first input; attention crosses a bos, as in the authors' nanochat/gpt.py (is_causal).
    cycle=True (training): after its last row group the rank starts a new epoch, and prints so.
    cycle=False (evaluation): a final partial chunk of n >= 2 tokens comes once, x padded with bos
    and y with -1 (ignored targets), then StopIteration: no target twice, the tail not lost.
    state_dict() is the position of the next unread token ({"epoch", "file" (its name),
    "row_group", "offset" (tokens of that row group used), "rank", "world_size"}) and the epoch's
    "epoch_tokens" read and "epoch_batches" begun: a loader built with state=loader.state_dict()
    after batch n yields batch n+1; state=[every rank's state] of another world size:
    loader_state.continue_loader. While a row group is packed, the next `prefetch` are tokenized
    in a background thread (train.py's loader_prefetch)."""

    def __init__(self, files, tokenizer, batch_size, seq_len, rank=0, world_size=1, device="cpu",
                 state=None, cycle=True, prefetch=1):
        self.files = list(files)
        self.names = [os.path.basename(f) for f in self.files]
        # each a ValueError that names the bad argument (flt/loader_state.py)
        loader_state.check_arguments(files, self.names, batch_size, seq_len, rank, world_size)
        self.tokenizer = tokenizer
        self.B, self.T = batch_size, seq_len
        self.rank, self.world_size = rank, world_size
        self.device, self.cycle = torch.device(device), cycle
        # documents in each row group of each file (every shard has rows: open_parquet checks)
        self.rows = []
        for path in self.files:
            with corpus.open_parquet(path) as pf:
                groups = range(pf.num_row_groups)
                self.rows.append([pf.metadata.row_group(g).num_rows for g in groups])
        row_groups = {name: len(rows) for name, rows in zip(self.names, self.rows)}
        # this rank's row groups: (file, row group), per file rank, rank + world_size, ...
        self.groups = [(i, g) for i, n in enumerate(row_groups.values())
                       for g in range(rank, n, world_size)]
        loader_state.check_groups(self, row_groups)
        # the position of the next token (state_dict) and the epoch's counts
        self.epoch = self.pos = self.offset = self.epoch_tokens = self.epoch_batches = 0
        # the tokens of each row group handed to the packing, from self.pos on
        self.lengths = deque()
        self.pool, self.prefetch = ThreadPoolExecutor(1), prefetch
        # (position, the future of its documents): the next `prefetch` row groups, in order
        self.ahead = deque()
        self.skipped_documents = 0
        # resume at a saved position, or continue another world size's (flt/loader_state.py)
        first = None if state is None else loader_state.restore(self, state, row_groups)
        self.chunks = packed_chunks(self.documents(first), tokenizer.bos_id, self.B * self.T + 1,
                                    self.offset)

    def state_dict(self):
        file, row_group = self.groups[self.pos]
        return {"epoch": self.epoch, "file": self.names[file], "row_group": row_group,
                "offset": self.offset, "rank": self.rank, "world_size": self.world_size,
                "epoch_tokens": self.epoch_tokens, "epoch_batches": self.epoch_batches}

    def tokenize(self, file, row_group):
        """The token ids of each document in row group row_group of file number `file`."""
        return self.tokenizer.encode_batch(corpus.read_texts(self.files[file], row_group))

    def load(self, at):
        """Row group `at`, tokenized; keeps the next `prefetch` tokenizing in the background."""
        if self.ahead and self.ahead[0][0] == at:
            documents = self.ahead.popleft()[1].result()
        # the first row group, or a new start: nothing queued
        else:
            self.ahead.clear()
            documents = self.tokenize(*self.groups[at])
        following = self.ahead[-1][0] if self.ahead else at
        while len(self.ahead) < self.prefetch:
            following = (following + 1) % len(self.groups)
            # without cycle, no epoch follows the last row group
            if not (following or self.cycle):
                break
            future = self.pool.submit(self.tokenize, *self.groups[following])
            self.ahead.append((following, future))
        return documents

    def documents(self, group=None):
        """The rank's documents from the saved position on, row group by row group (group: the
        saved one's documents, when a resume has read them), each row group's tokens noted."""
        at = self.pos
        while at < len(self.groups):
            group = self.load(at) if group is None else group
            # its tokens in the stream, for the position (loader_state.advance)
            self.lengths.append(sum(1 + len(ids) for ids in group))
            yield from group
            group = None
            # with cycle, an epoch follows the last row group
            at = (at + 1) % len(self.groups) if self.cycle else at + 1

    def __iter__(self):
        return self

    def __next__(self):
        """The next chunk of B*T+1 tokens as (x, y)."""
        chunk = next(self.chunks, [])
        # the position after it (state_dict), the epoch's counts, and at its end its line
        loader_state.advance(self, len(chunk))
        # only without cycle: the stream is over
        if len(chunk) < 2:
            raise StopIteration
        cuda = self.device.type == "cuda"
        # pinned host memory lets the copy to the GPU overlap with compute (non_blocking)
        xy = torch.empty(2, self.B * self.T, dtype=torch.long, pin_memory=cuda)
        # the padding of a final partial chunk
        xy[0], xy[1] = self.tokenizer.bos_id, -1
        xy[:, :len(chunk) - 1] = torch.tensor([chunk[:-1], chunk[1:]])
        x, y = xy.view(2, self.B, self.T).to(self.device, non_blocking=cuda)
        return x, y


# ---- The evaluation's tokens, cut as the authors' loaders cut them (eval.py scores them)
def protocol_chunks(files, tokenizer, seq_len, n_tokens, ranks, batch, rank=0, world=1):
    """(this process's share of the chunks, chunks requested): the validation chunks an
    evaluation on `ranks` processes at device batch `batch` scores, as the authors' loader cuts
    them. Simulated rank r streams its own row groups (DataLoader), in (x, y) chunks of
    batch * seq_len + 1 tokens, scoring the first max(1, n_tokens // (ranks * batch * seq_len)) of
    them, or all of them if its row groups end sooner (never a second pass). The ranks' chunks,
    in order, are shared among the `world` processes in contiguous runs: any split gives the
    same sums."""
    steps = max(1, n_tokens // (ranks * batch * seq_len))
    per = -(-ranks * steps // world)
    # this process's chunks [first, last)
    first, last = rank * per, min(ranks * steps, (rank + 1) * per)
    chunks = []
    for r in range(first // steps, -(-last // steps)) if first < last else ():
        stream = DataLoader(files, tokenizer, batch, seq_len, r, ranks, cycle=False)
        lo, hi = max(first - r * steps, 0), min(last - r * steps, steps)
        chunks += list(islice(stream, lo, hi))
    return chunks, ranks * steps


def rows(chunks, batch_size):
    """The (x, y) rows of chunks, regrouped into batches of batch_size rows: the loss of a row does
    not depend on the rows beside it."""
    if not chunks:
        return []
    x, y = (torch.cat(t) for t in zip(*chunks))
    return [(x[i:i + batch_size], y[i:i + batch_size]) for i in range(0, len(x), batch_size)]


def wiki_windows(tokenizer, rows, seq_len, batch):
    """The authors' WikiText windows: BOS + tokens of every row in one stream, chunks of
    batch * seq_len + 1 tokens at a stride of batch * seq_len, each chunk `batch` rows of seq_len
    inputs whose targets are the next seq_len tokens; the tokens after the last whole chunk are
    dropped. Returns the rows as windows of seq_len + 1 tokens (overlapping by one)."""
    ids = [t for row in tokenizer.encode_batch(rows) for t in [tokenizer.bos_id] + row]
    n = (len(ids) - 1) // (batch * seq_len) * batch
    if n == 0:
        raise ValueError(f"WikiText: {len(ids)} tokens, fewer than one chunk of {batch} x "
                         f"sequence_len + 1 = {batch * seq_len + 1}")
    return [ids[i * seq_len:(i + 1) * seq_len + 1] for i in range(n)]
