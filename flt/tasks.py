"""Synthetic reasoning tasks whose difficulty is depth: train.py's dataset="s3" | "s5" | "chains",
eval.py's tasks mode (docs/beyond.md, "Reasoning that needs depth").

Two families, each with a difficulty knob, task_difficulty (D):
- s3, s5: state tracking. An item is [bos] g_1 ... g_D, elements of the permutation group S3 (6)
  or S5 (120); the target at g_i is the running product g_1 g_2 ... g_i. Difficulty: the prefix
  length i. S3 is a solvable group, so a fixed-depth network may find a shortcut for it; S5 is
  not, and likely has none (Merrill et al.): its depth must grow with i. A loop can carry it:
  each loop, every position composes its left neighbour's estimate with its own element, which
  settles one more position.
- chains: multi-hop look-up (Depo-like, Physics of LMs 4.1). An item is [bos] and c chains of D+1
  assignments "x y" (x takes y's value), interleaved at random, each variable assigned once and
  before it is used; a chain's first assignment is a digit. The target at each right-hand side is
  the digit the left-hand variable holds. Difficulty: hops, the look-ups from the variable to its
  digit (0..D). c fills the sequence: (sequence_len - 1) // (2 (D + 1)).

Which tokens carry the loss: every labelled position (each element of s3/s5, each right-hand side
of chains); the others (bos, padding, chains' left-hand sides) have target -1. Every answer is a
function of the input up to its position, so the supervision is dense and nothing is predicted from
the future.

Items are generated from a seed: item i of a run is the first draw of rng([seed, i, attempt]),
attempt = 0, 1, ..., outside the test bucket, so every rank and a resumed run see the same stream
(the loader's state is the next item's index). The held-out test set is fixed by the task alone, and
disjoint from training by construction: an item whose hash falls in the test bucket (one in
TEST_BUCKET) is never a training item, and only such items are test items. A group task needs
MIN_ITEMS distinct items for such a set (S3: difficulty >= 4, S5: >= 2); chains have far more.
A bucket smaller than task_items repeats its items (eval.py's plan says how many are distinct).
Each symbol is one character of a byte-level alphabet, and the vocabulary is a tokenizers
WordLevel tokenizer, saved with each checkpoint as its tokenizer.json: eval.py loads it like any.
`solve` recomputes every answer from the tokens alone, in plain Python (the tests compare).

A task run, from generation to score: this file, and train.py.
- the items: `Task.item` draws one from an rng (`Task.train_item`: training's); `Task.rows` packs
  items into rows, where y[i] is the answer at x[i] itself, not the next token;
- the training (train.py, as for text): `task_of(settings)` is train.py's `task`; it has no files,
  and train.py's `tok` is `tokenizer(task)` below; `Task.loader` stands where data.DataLoader
  would, and `model(x, y)` takes the loss of text: the cross-entropy at position i against y[i],
  -1 skipped, which for a task is the answer at x[i] itself (model.py's loss says so);
- the score (train.py's validate): on `Task.batches(n_tokens, ...)`, the first test items with
  each answer's difficulty, `accuracy` below compares the argmax at position i with y[i] at the
  trained K: its share right is the record's val_acc. The same batches are scored in bits per byte
  too, as text is (an answer's bytes are its symbol's UTF-8 bytes: 2 for S5's past the 84th), and
  val_tokens counts the answers scored.

After the run, `eval.py RUN --modes=tasks` scores the same at any K, by difficulty and under exit
rules (flt/modes.py: tasks_mode): `accuracy` on `Task.test_items(task_items)`, and `exit_accuracy`.
"""
import hashlib
import itertools
import math
import string

import numpy as np
import tokenizers
import torch

import data
from flt import runtime

TASKS = ("s3", "s5", "chains")
# one item in TEST_BUCKET is held out (by its hash)
TEST_BUCKET = 8
# a group task's distinct items (n!^D), at least: about MIN_ITEMS / TEST_BUCKET are held out
MIN_ITEMS = 1000
# the stream of test candidates (train streams: rng([seed, i, attempt]) with the run's seed)
TEST_STREAM = 0x7E57
DIGITS = string.digits
# one-character symbols outside the digits: letters first, then the rest of ByteLevel's alphabet
NAMES = sorted(set(tokenizers.pre_tokenizers.ByteLevel.alphabet()) - set(DIGITS),
               key=lambda ch: (ch not in string.ascii_letters, ch))


class Task:
    """A task fixed by its settings: name, difficulty D, sequence_len T. Items pack whole into rows
    of T tokens (padded with bos, target -1). A ValueError names the setting if they cannot."""

    def __init__(self, name, difficulty, seq_len):
        self.name, self.D, self.T = name, difficulty, seq_len
        if difficulty < 1:
            raise ValueError(f"task_difficulty={difficulty}: expected a positive integer")
        if name == "chains":
            self.chains = (seq_len - 1) // (2 * (difficulty + 1))
            self.item_len = 1 + 2 * self.chains * (difficulty + 1)
            # twice the variables an item uses, so names carry no position
            n_names = 2 * self.chains * (difficulty + 1)
            if n_names > len(NAMES):
                raise ValueError(f"sequence_len={seq_len}: chains of difficulty {difficulty} would "
                                 f"need more than {len(NAMES)} variable names; use sequence_len <= "
                                 f"{len(NAMES) + 1}")
            self.symbols = list(DIGITS) + NAMES[:n_names]
            self.levels = list(range(difficulty + 1))
            need = 1 + 2 * (difficulty + 1)
        else:
            n = int(name[1])
            self.perms = list(itertools.permutations(range(n)))
            self.table = product_table(self.perms)
            self.item_len = 1 + difficulty
            self.symbols = NAMES[:len(self.perms)]
            self.levels = list(range(1, difficulty + 1))
            need = self.item_len
            if len(self.perms) ** difficulty < MIN_ITEMS:
                least = math.ceil(math.log(MIN_ITEMS, len(self.perms)))
                raise ValueError(f"task_difficulty={difficulty}: {name} has "
                                 f"{len(self.perms) ** difficulty} distinct items of difficulty "
                                 f"{difficulty}, too few to hold one in {TEST_BUCKET} out as a test "
                                 f"set; use task_difficulty >= {least}")
        if need > seq_len:
            raise ValueError(f"task_difficulty={difficulty}: a {name} item of difficulty "
                             f"{difficulty} needs {need} tokens, more than sequence_len={seq_len}")
        self.per_row = seq_len // self.item_len

    def item(self, rng):
        """([bos, ...] token ids, targets, difficulty of each position (-1: unscored))."""
        return chains_item(rng, self) if self.name == "chains" else group_item(rng, self)

    def is_test(self, tokens):
        digest = hashlib.blake2b(np.asarray(tokens, np.int32).tobytes(), digest_size=8).digest()
        return int.from_bytes(digest, "little") % TEST_BUCKET == 0

    def train_item(self, seed, i):
        """Item i of the training stream of `seed`: the first draw of rng([seed, i, attempt])
        that is not a test item."""
        for attempt in itertools.count():
            item = self.item(np.random.default_rng([seed, i, attempt]))
            if not self.is_test(item[0]):
                return item

    def test_items(self, n):
        """The first n test items: candidates rng([TEST_STREAM, j]) kept when in the test bucket."""
        items = []
        for j in itertools.count():
            if len(items) == n:
                return items
            item = self.item(np.random.default_rng([TEST_STREAM, j]))
            if self.is_test(item[0]):
                items.append(item)

    def rows(self, items):
        """(x, y, difficulty), each (rows, T) long: per_row items a row, the rest bos / -1. y[i] is
        the answer at x[i] itself (not the next token), as the module docstring's targets."""
        n_rows = math.ceil(len(items) / self.per_row)
        x = torch.zeros(n_rows, self.T, dtype=torch.long)
        y = torch.full((n_rows, self.T), -1, dtype=torch.long)
        d = torch.full((n_rows, self.T), -1, dtype=torch.long)
        for k, (tokens, targets, levels) in enumerate(items):
            r, start = divmod(k, self.per_row)
            span = slice(start * self.item_len, (start + 1) * self.item_len)
            x[r, span] = torch.tensor(tokens)
            y[r, span] = torch.tensor(targets)
            d[r, span] = torch.tensor(levels)
        return x, y, d

    def batches(self, n_tokens, batch_size, rank=0, world_size=1):
        """batches_of the first test items, about n_tokens tokens in all."""
        items = self.test_items(max(1, n_tokens // self.item_len))
        return self.batches_of(items, batch_size, rank, world_size)

    def batches_of(self, items, batch_size, rank=0, world_size=1):
        """This rank's share of the items' rows (every world_size-th), as (x, y, difficulty)
        batches of batch_size rows: eval.py's evaluate_bpb reads (x, y), accuracy all three."""
        x, y, d = self.rows(items)
        mine = [t[rank::world_size].split(batch_size) for t in (x, y, d)]
        return list(zip(*mine))

    def loader(self, batch_size, rank, world_size, device, seed, state=None):
        return Loader(self, batch_size, rank, world_size, device, seed, state)


def product_table(perms):
    """table[a, b] = the index of perms[a] composed with perms[b] (apply b, then a), numpy."""
    p = np.array(perms)
    composed = np.take_along_axis(p[:, None, :].repeat(len(p), 1), p[None, :, :].repeat(len(p), 0),
                                  axis=2)
    n = p.shape[1]
    weights = n ** np.arange(n - 1, -1, -1)
    codes = p @ weights
    # itertools.permutations is in lexicographic order, so the codes are sorted
    return np.searchsorted(codes, composed @ weights)


def group_item(rng, task):
    elements = rng.integers(len(task.perms), size=task.D)
    running = [int(elements[0])]
    for g in elements[1:]:
        running.append(int(task.table[running[-1], g]))
    tokens = [0] + [1 + int(g) for g in elements]
    return tokens, [-1] + [1 + s for s in running], [-1] + list(range(1, task.D + 1))


def chains_item(rng, task):
    c, length = task.chains, task.D + 1
    names = rng.choice(len(task.symbols) - len(DIGITS), size=c * length, replace=False)
    names = (names + 1 + len(DIGITS)).reshape(c, length)
    roots = 1 + rng.integers(len(DIGITS), size=c)
    # the chains interleaved at random, each in its own order
    order = rng.permutation(np.repeat(np.arange(c), length))
    tokens, targets, hops, done = [0], [-1], [-1], [0] * c
    for j in order:
        h = done[j]
        done[j] += 1
        rhs = roots[j] if h == 0 else names[j, h - 1]
        tokens += [int(names[j, h]), int(rhs)]
        targets += [-1, int(roots[j])]
        hops += [-1, h]
    return tokens, targets, hops


def solve(task, text):
    """(targets, difficulty) of one item's text (its symbols after bos), in plain Python."""
    ids = {ch: i + 1 for i, ch in enumerate(task.symbols)}
    if task.name == "chains":
        value, hops, targets, levels = {}, {}, [-1], [-1]
        for lhs, rhs in zip(text[::2], text[1::2]):
            value[lhs] = rhs if rhs in DIGITS else value[rhs]
            hops[lhs] = 0 if rhs in DIGITS else hops[rhs] + 1
            targets += [-1, ids[value[lhs]]]
            levels += [-1, hops[lhs]]
        return targets, levels
    state = tuple(range(len(task.perms[0])))
    targets = [-1]
    for ch in text:
        g = task.perms[ids[ch] - 1]
        state = tuple(state[g[k]] for k in range(len(g)))
        targets.append(task.perms.index(state) + 1)
    return targets, [-1] + list(range(1, len(text) + 1))


class Loader:
    """Training batches (x, y) of a task: batch n of rank r holds items start + (n W + r) B p ...,
    B rows of p items. state_dict() is the next batch's first item, the same on every rank, so a
    run resumes exactly and on any number of ranks."""

    def __init__(self, task, batch_size, rank, world_size, device, seed, state=None):
        self.task, self.B, self.rank, self.world = task, batch_size, rank, world_size
        self.device, self.seed = torch.device(device), seed
        # a list: every rank's state, saved by another number of ranks (all equal)
        state = state[0] if isinstance(state, list) else state
        self.next_item = state["next_item"] if state else 0
        # what data.DataLoader reports after a resume on other ranks (checkpoint.resharded): a task
        # resumes at its next item, exactly, and skips no document
        self.skipped_documents = 0

    def state_dict(self):
        return {"next_item": self.next_item, "rank": self.rank, "world_size": self.world}

    def __iter__(self):
        return self

    def __next__(self):
        n = self.B * self.task.per_row
        first = self.next_item + self.rank * n
        items = [self.task.train_item(self.seed, i) for i in range(first, first + n)]
        self.next_item += n * self.world
        x, y, _ = self.task.rows(items)
        return x.to(self.device), y.to(self.device)


# ----------------------------------------------------------------------------- the score
@torch.no_grad()
def accuracy(model, batches, levels, loops_list, progress=None):
    """({K: eval.json's {"task_acc", "task_acc_by_difficulty"}}, {difficulty: answers}): the share
    of the answers (y >= 0) whose argmax at position i is y[i], pooled and at each difficulty in
    `levels`, every K from one forward, on batches_of(items, ...). All-reduced."""
    device = next(model.parameters()).device
    # per K, the right answers at each difficulty; and the answers at each difficulty
    n = max(levels) + 1
    right = torch.zeros(len(loops_list), n, dtype=torch.float64, device=device)
    answers = torch.zeros(n, dtype=torch.float64, device=device)
    for x, y, d in batches:
        x, y, d = x.to(device), y.to(device), d.to(device)
        scored = y >= 0
        # h(1) ... h(K_max): the head reads h(K) at the scored positions only
        hs = model.loop_states(x, max(loops_list)).states
        for i, K in enumerate(loops_list):
            pred = model.head(hs[K - 1][scored]).argmax(dim=-1)
            is_right = (pred == y[scored]).double()
            right[i] += torch.bincount(d[scored], weights=is_right, minlength=n)
        answers += torch.bincount(d[scored], minlength=n)
        if progress:
            progress()
    runtime.all_reduce_sum(right, answers)
    answers = answers.tolist()
    results = {K: {"task_acc": sum(r) / sum(answers),
                   "task_acc_by_difficulty": {str(d): r[d] / answers[d] for d in levels}}
               for K, r in zip(loops_list, right.tolist())}
    return results, {str(d): int(answers[d]) for d in levels}


@torch.no_grad()
def exit_accuracy(model, batches, levels, loops, exit_rule, thresholds, progress=None):
    """[{threshold, acc, mean_loops, acc_by_difficulty, loops_by_difficulty}] on accuracy's
    batches, with exit_rule at each threshold and at most `loops` loops: the per-answer accuracy and
    loops run, pooled and by difficulty. One forward per threshold. All-reduced."""
    device = next(model.parameters()).device
    # per threshold, the right answers and the loops run at each difficulty; the answers at each
    n = max(levels) + 1
    right = torch.zeros(len(thresholds), n, dtype=torch.float64, device=device)
    loops_run = torch.zeros_like(right)
    answers = torch.zeros(n, dtype=torch.float64, device=device)
    for x, y, d in batches:
        x, y, d = x.to(device), y.to(device), d.to(device)
        scored = y >= 0
        for i, t in enumerate(thresholds):
            logits, looped = model(x, loops=loops, exit_threshold=t, exit_rule=exit_rule,
                                   return_loops=True)
            is_right = (logits.argmax(-1) == y)[scored].double()
            right[i] += torch.bincount(d[scored], weights=is_right, minlength=n)
            ran = looped.exit_loops[scored].double()
            loops_run[i] += torch.bincount(d[scored], weights=ran, minlength=n)
            if progress:
                progress()
        answers += torch.bincount(d[scored], minlength=n)
    runtime.all_reduce_sum(right, loops_run, answers)
    answers = answers.tolist()
    return [{"threshold": t, "acc": sum(r) / sum(answers), "mean_loops": sum(ran) / sum(answers),
             "acc_by_difficulty": {str(d): r[d] / answers[d] for d in levels},
             "loops_by_difficulty": {str(d): ran[d] / answers[d] for d in levels}}
            for t, r, ran in zip(thresholds, right.tolist(), loops_run.tolist())]


def task_of(settings):
    """The task train.py's settings name, or None for a text dataset."""
    if settings["dataset"] not in TASKS:
        return None
    return Task(settings["dataset"], settings["task_difficulty"], settings["sequence_len"])


def tokenizer(task):
    """The task's vocabulary as a data.Tokenizer: bos (id 0), then one id per symbol."""
    vocab = {data.BOS: 0} | {ch: i + 1 for i, ch in enumerate(task.symbols)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token=None))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Split(tokenizers.Regex("."), "isolated")
    tok.decoder = tokenizers.decoders.Fuse()
    tok.add_special_tokens([data.BOS])
    return data.Tokenizer(tok, name=f"the {task.name} task's vocabulary")


def check_settings(s, defaults):
    """ValueErrors naming the setting: a task that cannot fit, or a text setting it would ignore."""
    if s["dataset"] not in TASKS:
        if s["task_difficulty"] != defaults["task_difficulty"]:
            raise ValueError(f"task_difficulty={s['task_difficulty']} does nothing unless dataset "
                             f"is a task ({', '.join(TASKS)})")
        return
    # the task's own checks: a difficulty its items can hold in sequence_len
    task_of(s)
    if s["sample_tokens"]:
        raise ValueError(f"sample_tokens={s['sample_tokens']}: dataset={s['dataset']!r} has no "
                         "text to continue; set sample_tokens=0 (config/reasoning.py does)")
    for key in ("tokenizer", "bpe_vocab_size", "bos_token"):
        if s[key] != defaults[key]:
            raise ValueError(f"{key}={s[key]!r} does nothing with dataset={s['dataset']!r}, which "
                             "has its own vocabulary: remove it")
