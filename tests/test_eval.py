"""Tests for eval.py and its support modules (flt/core.py: CORE's prompts; flt/modes.py: the modes;
flt/eval_settings.py: its settings): CORE prompts and scoring, bits per byte, WikiText perplexity,
the budget sweep, the bundle's errors, the settings and their checks, main's plan-then-run with
stand-in modes, and CLI runs end to end.

Scores are checked against models whose answers are known: `Oracle` puts all its probability
on the next token of sequences it was told, `Uniform` on nothing (loss ln V everywhere), and a
real tiny GPT with every weight redrawn is compared against separate `model(idx, loops=K)` runs.
A character tokenizer (one id per character, BOS = 0) and a word tokenizer with hand-numbered
words (WORD_IDS) make token spans writable by hand. CORE is also compared, example by example,
with `nanochat_example`, a plain re-implementation of nanochat's core_eval written for this test.
"""
import ast
import glob
import itertools
import json
import math
import os
import random
import re
import runpy
import shutil
import socket
import string
import sys
import time
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
import tokenizers

from flt import corpus
import data
import eval as ev
from flt import checkpoint
from flt import core
from flt import eval_settings
from flt import modes
from flt import report
from flt import runtime
from flt import tasks as tasks_module
from configurator import settings_of
from model import GPT, GPTConfig, Loops
import forkserver

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class CharTokenizer:
    """One id per character (BOS = 0, a special token of 0 bytes); 'é' is 2 UTF-8 bytes."""

    def __init__(self, alphabet=string.printable + "é"):
        self.chars, self.bos_id, self.vocab_size = alphabet, 0, len(alphabet) + 1

    def encode(self, text):
        return [self.chars.index(ch) + 1 for ch in text]

    def encode_batch(self, texts):
        return [self.encode(t) for t in texts]

    def decode(self, ids):
        return "".join(self.chars[i - 1] for i in ids if i > 0)

    def token_bytes(self):
        return torch.tensor([0] + [len(ch.encode()) for ch in self.chars])


TOK = CharTokenizer()
V = TOK.vocab_size


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny shapes run faster on one thread, and stay fast when other jobs share the CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class Oracle(torch.nn.Module):
    """A stand-in exposing loop_states/head/config: at loop K it puts logit 20 on the next token of
    whichever of known[K] (token lists) the input so far is a prefix of, and 0 on everything else.
    It records the loop count of every forward."""

    def __init__(self, known, seq_len=256, vocab=V):
        super().__init__()
        self.vocab = vocab
        self.dummy = torch.nn.Parameter(torch.zeros(()))  # eval.py finds the device from a parameter
        self.config = SimpleNamespace(sequence_len=seq_len)
        self.tables = {K: {tuple(s[:t]): s[t] for s in seqs for t in range(1, len(s))} for K, seqs in known.items()}
        self.calls = []

    def loop_states(self, idx, loops, exit_threshold=None):
        assert exit_threshold is None, "the Oracle has no exit rule"
        self.calls.append(loops)
        hs = []
        for K in range(1, loops + 1):
            table, z = self.tables.get(K, {}), torch.zeros(*idx.shape, self.vocab)
            for b, row in enumerate(idx.tolist()):
                for t in range(len(row)):
                    if (nxt := table.get(tuple(row[:t + 1]))) is not None:
                        z[b, t, nxt] = 20.0
            hs.append(z)
        return Loops(hs, resid_norms=None)  # eval.py reads the states only

    def head(self, h):
        return h


def uniform(seq_len=256):
    return Oracle({}, seq_len)  # knows nothing: zero logits, loss ln V on every token


# ----------------------------------------------------------------------------- a handmade bundle

MC = [{"query": "Question: What color is the sky?\nAnswer:", "choices": ["green", "blue", "red"], "gold": 1},
      {"query": "Question: How many legs has a cat?\nAnswer:", "choices": ["four", "two"], "gold": 0},
      {"query": "Question: Which is a fruit?\nAnswer:", "choices": ["rock", "car", "apple", "pen"], "gold": 2}]
SCHEMA = [{"context_options": ["The cup did not fit in the box because the cup",
                               "The cup did not fit in the box because the box"], "continuation": "was too big.", "gold": 0},
          {"context_options": ["Anna helped Mia because Anna", "Anna helped Mia because Mia"],
           "continuation": "needed help.", "gold": 1},
          {"context_options": ["Tom thanked Sam because Tom", "Tom thanked Sam because Sam"],
           "continuation": "had helped him.", "gold": 1}]
LM = [{"context": "The opposite of hot is ", "continuation": "cold"},
      {"context": "The opposite of up is", "continuation": "down"},
      {"context": "Two plus two is", "continuation": "four"}]
CORE_YAML = """icl_tasks:
- label: mc_task
  dataset_uri: qa/mc.jsonl
  num_fewshot: [1]
  icl_task_type: multiple_choice
  continuation_delimiter: ' '
- label: schema_task
  dataset_uri: schema.jsonl
  num_fewshot: [1, 5]
  icl_task_type: schema
- label: lm_task
  dataset_uri: lm.jsonl
  num_fewshot: [0]
  icl_task_type: language_modeling
"""
META_CSV = "Eval Task,Task Category,Random baseline\nmc_task,qa,25.0\nschema_task,schema,50.0\nlm_task,lm,0.0\n"


def make_bundle(root, core_yaml=CORE_YAML, meta=META_CSV, skip=()):
    root.mkdir(parents=True, exist_ok=True)
    files = {"core.yaml": core_yaml, "eval_meta_data.csv": meta,
             "eval_data/qa/mc.jsonl": MC, "eval_data/schema.jsonl": SCHEMA, "eval_data/lm.jsonl": LM}
    for name, content in files.items():
        if name in skip:
            continue
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content if isinstance(content, str) else "\n".join(json.dumps(x) for x in content) + "\n")
    return str(root)


@pytest.fixture
def tasks(tmp_path):
    return {t["label"]: t for t in corpus.load_bundle(make_bundle(tmp_path / "bundle"))}


def item_seqs(task, seq_len=256):
    items = corpus.load_items(task, -1)
    return items, [core.task_sequences(TOK, task, items, i, seq_len) for i in range(len(items))]


def oracle_for(task, pick):
    """The token sequence of option pick(i, item) of every item (the single one for LM)."""
    items, seqs = item_seqs(task)
    return [s[0 if task["type"] == "language_modeling" else pick(i, items[i])][0] for i, s in enumerate(seqs)]


# ----------------------------------------------------------------------------- a word tokenizer
# Words numbered by hand; any other character is 100 + its index in string.printable (" " = 194,
# "i" = 118, "4" = 104). " iron" is no word: BPE splits it into " ", "ir", "on", as real BPEs split
# rare words and leave the space alone.
WORD_IDS = {data.BOS: 0, " the": 1, " cat": 2, " sat": 3, " ran": 4, " dog": 5, " ice": 6, "ir": 7, "on": 8,
            " because": 9, " she": 10, " was": 11, " too": 12, " big": 13, " is": 14, " hot": 15, " cold": 16,
            "A": 17, ":": 18, "Q": 19, " 42": 20, "\n": 21}
SP = 194


def word_tokenizer():
    vocab = WORD_IDS | {ch: 100 + i for i, ch in enumerate(string.printable) if ch not in WORD_IDS}
    # ignore_merges: a whole word in the vocab is one token; other words are merged from characters
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, [("i", "r"), ("o", "n")], ignore_merges=True))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Split(  # GPT-2's split: a space starts the next word
        tokenizers.Regex(r" ?[A-Za-z]+| ?[0-9]+| ?[^A-Za-z0-9\s]+|\s+(?!\S)|\s+"), behavior="isolated")
    tok.add_special_tokens([tokenizers.AddedToken(data.BOS, special=True)])
    return data.Tokenizer(tok)


WTOK = word_tokenizer()


def spans(task_type, items, idx=0, fewshot=0, delimiter=" ", max_len=256):
    """[(kept tokens, scored span)] of item idx under eval.py, with the word tokenizer."""
    task = dict(label="t", type=task_type, fewshot=fewshot, delimiter=delimiter)
    return [(t, t[s:]) for t, s in core.task_sequences(WTOK, task, items, idx, max_len)]


# ----------------------------------------------------------------------------- prompts and spans


def test_load_bundle_reads_yaml_and_baselines(tasks):
    assert tasks["mc_task"]["fewshot"] == 1 and tasks["mc_task"]["delimiter"] == " "
    assert tasks["schema_task"]["fewshot"] == 1  # the first of num_fewshot
    assert tasks["schema_task"]["delimiter"] == " "  # the default when core.yaml has none
    assert [t["baseline"] for t in tasks.values()] == [25.0, 50.0, 0.0]


def test_prompts_rendered_exactly(tasks):
    shot = "Question: How many legs has a cat?\nAnswer: four\n\n"
    assert core.render(tasks["mc_task"], MC[0], [MC[1]]) == [
        shot + "Question: What color is the sky?\nAnswer: " + c for c in ("green", "blue", "red")]
    assert core.render(tasks["schema_task"], SCHEMA[0], [SCHEMA[1]]) == [
        "Anna helped Mia because Mia needed help.\n\nThe cup did not fit in the box because the cup was too big.",
        "Anna helped Mia because Mia needed help.\n\nThe cup did not fit in the box because the box was too big."]
    # LM: contexts stripped; `without` stripped as a whole, so its trailing delimiter goes too
    assert core.render(tasks["lm_task"], LM[0], [LM[1]]) == [
        "The opposite of up is down\n\nThe opposite of hot is", "The opposite of up is down\n\nThe opposite of hot is cold"]
    newline = dict(tasks["lm_task"], delimiter="\n")
    assert core.render(newline, {"context": " x ", "continuation": "y"}, []) == ["x", "x\ny"]


def test_fewshot_draw_matches_nanochat():
    for n, k in [(5, 1), (10, 3), (40, 10)]:
        for idx in range(n):
            expected = random.Random(1234 + idx).sample([i for i in range(n) if i != idx], k)
            assert core.fewshot_indices(idx, n, k) == expected


def test_mc_span_starts_after_the_prefix_common_to_all_choices():
    """Shared words are not scored: " the" (all three) and " cat" (the first two) are context."""
    item = {"query": "Q:", "choices": ["the cat sat", "the cat ran", "the dog"], "gold": 0}
    assert spans("multiple_choice", [item]) == [([0, 19, 18, 1, 2, 3], [2, 3]), ([0, 19, 18, 1, 2, 4], [2, 4]),
                                                ([0, 19, 18, 1, 5], [5])]
    item = {"query": "Q:", "choices": ["the cat sat", "the cat ran"], "gold": 0}
    assert [s for _, s in spans("multiple_choice", [item])] == [[3], [4]]


def test_mc_span_keeps_a_space_the_tokenizer_splits_off():
    """" iron" -> " ", "ir", "on" and " ice" -> " ice" differ at the space: it is scored. (Splitting
    at the separately tokenized "Q: " would have left the space out of the first span.)"""
    item = {"query": "Q:", "choices": ["iron", "ice"], "gold": 1}
    assert spans("multiple_choice", [item]) == [([0, 19, 18, SP, 7, 8], [SP, 7, 8]), ([0, 19, 18, 6], [6])]


def test_schema_span_is_the_suffix_common_to_all_sequences():
    """The common suffix reaches back into the contexts' shared words " because she"."""
    item = {"context_options": ["Q: the cat because she", "Q: the dog because she"],
            "continuation": "was too big", "gold": 0}
    assert spans("schema", [item]) == [([0, 19, 18, 1, 2, 9, 10, 11, 12, 13], [9, 10, 11, 12, 13]),
                                       ([0, 19, 18, 1, 5, 9, 10, 11, 12, 13], [9, 10, 11, 12, 13])]


def test_lm_span_follows_the_stripped_prompt():
    """The prompt without the continuation is stripped: a "\\n" delimiter becomes a scored token;
    a context's trailing space is dropped and " hot" is one scored token."""
    item = {"context": "Q: the cat is hot", "continuation": "A: cold"}
    assert spans("language_modeling", [item], delimiter="\n") == [([0, 19, 18, 1, 2, 14, 15, 21, 17, 18, 16],
                                                                   [21, 17, 18, 16])]
    item = {"context": "Q: the cat is ", "continuation": "hot"}
    assert spans("language_modeling", [item]) == [([0, 19, 18, 1, 2, 14, 15], [15])]


def test_lm_prompt_that_is_no_token_prefix_is_an_error():
    """"Q 4" + "2": " 4" alone is " ", "4", but " 42" is one word, so without is no prefix of with."""
    with pytest.raises(ValueError, match="item 0.*not a token prefix"):
        spans("language_modeling", [{"context": "Q 4", "continuation": "2"}], delimiter="")


def test_long_sequences_are_fed_whole_up_to_the_rope_table():
    """The authors' model has no max_seq_len, so their core_eval never crops: a prompt goes in whole.
    Longer than the model's RoPE table (max_len) is an error naming the task and the item."""
    item = {"query": "Q:", "choices": ["the cat sat", "the cat ran", "the dog"], "gold": 0}
    assert spans("multiple_choice", [item], max_len=6) == [([0, 19, 18, 1, 2, 3], [2, 3]), ([0, 19, 18, 1, 2, 4], [2, 4]),
                                                           ([0, 19, 18, 1, 5], [5])]
    with pytest.raises(ValueError, match="task 't' item 0: a prompt of 6 tokens is longer than the 5 positions"):
        spans("multiple_choice", [item], max_len=5)


@torch.no_grad()
def test_a_prompt_longer_than_sequence_len_is_scored_whole():
    """A 10-shot prompt of ~3 x sequence_len tokens: its span's loss is the loss of ONE forward over
    the whole sequence (no crop), as the authors' core_eval computes it."""
    model = randomize_(tiny_gpt(seq_len=16, vocab_size=WTOK.vocab_size))
    items = [{"query": f"Q: the cat {w}", "choices": ["sat", "ran"], "gold": i % 2}
             for i, w in enumerate(["is hot", "is cold", "was too big", "ran", "sat", "dog", "ice", "the", "she",
                                    "because", "42", "hot"])]
    task = dict(label="t", type="multiple_choice", fewshot=10, delimiter=" ")
    seqs = core.task_sequences(WTOK, task, items, 0, ev.longest_input(model))
    assert ev.longest_input(model) == 160 and all(40 < len(t) <= 160 for t, _ in seqs)
    scores = ev.score_sequences(model, seqs, [1, 3], batch_size=2)
    for K in (1, 3):
        for i, (toks, start) in enumerate(seqs):
            logits = model(torch.tensor([toks]), loops=K)[0]
            loss = F.cross_entropy(logits[start - 1:-1], torch.tensor(toks[start:]))
            assert scores[K][0][i].item() == pytest.approx(loss.item(), rel=1e-4)


def test_fewshot_examples_come_from_the_items_left_after_the_cut(tmp_path):
    """max_per_task=3 of 6 items: the shots are drawn from those 3, as nanochat cuts first."""
    items = [{"query": f"Q{i}", "choices": ["a", "b"], "gold": i % 2} for i in range(6)]
    (tmp_path / "mc.jsonl").write_text("".join(json.dumps(x) + "\n" for x in items))
    task = dict(label="t", type="multiple_choice", fewshot=1, delimiter=" ", path=str(tmp_path / "mc.jsonl"))
    shuffled = list(items)
    random.Random(1337).shuffle(shuffled)
    cut = corpus.load_items(task, 3)
    assert cut == shuffled[:3] and corpus.load_items(task, -1) == corpus.load_items(task, 0) == shuffled
    for idx in range(3):
        shot = cut[random.Random(1234 + idx).sample([j for j in range(3) if j != idx], 1)[0]]
        expected = [f"{shot['query']} {shot['choices'][shot['gold']]}\n\n{cut[idx]['query']} {c}" for c in "ab"]
        assert [t[1:] for t, _ in core.task_sequences(TOK, task, cut, idx, 256)] == [TOK.encode(p) for p in expected]
    with pytest.raises(ValueError, match="1-shot needs more than 1 items.*max_per_task=1"):
        corpus.load_items(task, 1)


def test_sequences_are_bos_then_the_prompt(tasks):
    for task in tasks.values():
        items = corpus.load_items(task, -1)
        for idx in range(len(items)):
            prompts = core.render(task, items[idx], [items[j] for j in core.fewshot_indices(idx, len(items), task["fewshot"])])
            with_continuation = prompts[1:] if task["type"] == "language_modeling" else prompts
            assert [t for t, _ in core.task_sequences(TOK, task, items, idx, 256)] == [
                [TOK.bos_id] + TOK.encode(p) for p in with_continuation]


def test_spans_with_a_real_bpe_tokenizer(tmp_path, tasks):
    """Byte-level BPE merges the delimiter into the next word ('Ġblue'): the span holds the answer."""
    tok = bpe_tokenizer(tmp_path)
    for task in tasks.values():
        items = corpus.load_items(task, -1)
        seqs = core.task_sequences(tok, task, items, 0, 256)
        answers = (items[0]["choices"] if task["type"] == "multiple_choice"
                   else [items[0]["continuation"]] * len(seqs))
        for (toks, start), answer in zip(seqs, answers):
            assert toks[0] == tok.bos_id and tok.decode(toks[start:]).strip() == answer
            assert tok.decode(toks[1:]).endswith(answer)


def bpe_tokenizer(tmp_path):
    text = " ".join(json.dumps(x) for x in MC + SCHEMA + LM) * 3
    corpus = tmp_path / "corpus.parquet"
    pq.write_table(pa.table({"text": [text, "The opposite of hot is cold. " * 20]}), corpus)
    return data.train_tokenizer([str(corpus)], 300, str(tmp_path / "tokenizer.json"))


# ----------------------------------------------------------------------------- CORE scoring


@pytest.mark.parametrize("label", ["mc_task", "schema_task", "lm_task"])
def test_oracle_scores_known_accuracy_per_loop(tasks, label):
    """K=1 knows a wrong option, K=2 the gold one, K=3 gold for 2 of 3 items: 0, 1, 2/3."""
    task = tasks[label]
    lm = task["type"] == "language_modeling"
    gold = oracle_for(task, lambda i, item: item["gold"])
    wrong = oracle_for(task, lambda i, item: (item["gold"] + 1) % len(item.get("choices") or item["context_options"]))
    if lm:  # a wrong continuation: the item's tokens with its last token changed
        wrong = [s[:-1] + [(s[-1] % (V - 1)) + 1] for s in gold]
    oracle = Oracle({1: wrong, 2: gold, 3: gold[:2] + wrong[2:]})
    acc = ev.evaluate_task(oracle, TOK, task, [1, 2, 3], batch_size=4)
    assert acc == {1: 0.0, 2: 1.0, 3: pytest.approx(2 / 3)}
    n_seqs = sum(len(s) for s in item_seqs(task)[1])
    assert oracle.calls == [3] * math.ceil(n_seqs / 4)  # one forward per batch, at the largest K


def test_batched_scoring_equals_one_at_a_time(tasks):
    model = randomize_(tiny_gpt(seq_len=256))
    seqs = [s for task in tasks.values() for item in item_seqs(task)[1] for s in item]
    one = ev.score_sequences(model, seqs, [1, 3], batch_size=1)
    many = ev.score_sequences(model, seqs, [1, 3], batch_size=8)
    for K in (1, 3):
        torch.testing.assert_close(one[K][0], many[K][0], atol=1e-5, rtol=1e-5)
        assert torch.equal(one[K][1], many[K][1])
    task = tasks["mc_task"]
    assert ev.evaluate_task(model, TOK, task, [1, 3], 1) == ev.evaluate_task(model, TOK, task, [1, 3], 8)


def test_centered_accuracy_and_core(tasks):
    assert ev.centered(0.5, 25.0) == pytest.approx(1 / 3)
    assert ev.centered(0.25, 25.0) == 0.0
    assert ev.centered(1.0, 50.0) == 1.0
    # K=2: MC 2/3 (baseline 25%), schema 3/3 (50%), LM 0/3 (0%)
    mc, schema = tasks["mc_task"], tasks["schema_task"]
    mc_gold = oracle_for(mc, lambda i, item: item["gold"])
    mc_wrong = oracle_for(mc, lambda i, item: (item["gold"] + 1) % len(item["choices"]))
    known = mc_gold[:2] + mc_wrong[2:] + oracle_for(schema, lambda i, item: item["gold"])
    results = ev.evaluate_core(Oracle({2: known}), TOK, list(tasks.values()), [2], 8, log=lambda *a: None)
    r = results[2]
    assert {k: t["accuracy"] for k, t in r["tasks"].items()} == pytest.approx(
        {"mc_task": 2 / 3, "schema_task": 1.0, "lm_task": 0.0})
    assert r["tasks"]["mc_task"]["centered"] == pytest.approx((2 / 3 - 0.25) / 0.75)
    assert r["CORE"] == pytest.approx(((2 / 3 - 0.25) / 0.75 + 1.0 + 0.0) / 3)


def test_max_per_task_scores_a_prefix_of_the_shuffled_items(tasks):
    task = tasks["mc_task"]
    items = corpus.load_items(task, 2)
    assert items == corpus.load_items(task, -1)[:2]
    seqs = [core.task_sequences(TOK, task, items, i, 256) for i in range(2)]
    gold, wrong = seqs[0][items[0]["gold"]][0], seqs[1][(items[1]["gold"] + 1) % len(items[1]["choices"])][0]
    assert ev.evaluate_task(Oracle({1: [gold, wrong]}), TOK, task, [1], 8, max_per_task=2) == {1: 0.5}


def test_ties_go_to_the_first_option_and_nan_as_python_min():
    """Uniform logits tie every option: the first is predicted. A choice whose tokens are all shared
    (" the cat" inside " the cat ran") has an empty span, mean NaN: Python's min (nanochat's rule)
    passes over a NaN that is not first and returns one that is first, where argmin takes any NaN."""
    task = dict(label="t", type="multiple_choice", fewshot=0, delimiter=" ")
    items = [{"query": "Q:", "choices": ["dog", "ice"], "gold": g} for g in (0, 1)]
    assert ev.item_correct(Oracle({}, vocab=WTOK.vocab_size), WTOK, task, items, range(2), [1], 8) == {1: [True, False]}
    items = [{"query": "Q:", "choices": ["the cat ran", "the cat", "the cat sat"], "gold": 2},
             {"query": "Q:", "choices": ["the cat", "the cat ran", "the cat sat"], "gold": 2}]
    assert [s for _, s in spans("multiple_choice", items)] == [[4], [], [3]]
    sat = [0, 19, 18, 1, 2, 3]  # the oracle knows " the cat sat": low loss there, high on " ran"
    assert ev.item_correct(Oracle({1: [sat]}, vocab=WTOK.vocab_size), WTOK, task, items, range(2), [1], 8) == {
        1: [True, False]}


# ----------------------------------------------------------------------------- CORE against nanochat's rules


def nanochat_example(model, tok, data, idx, task, K):
    """([(tokens, span start)] per option, whether item idx is right): the authors' core_eval
    rules re-implemented plainly, one item per forward with BOS as padding, as nanochat runs it;
    the authors' model has no max_seq_len, so nothing is cropped."""
    item, d, kind, k = data[idx], task["delimiter"], task["type"], task["fewshot"]
    shots = [data[i] for i in random.Random(1234 + idx).sample([i for i in range(len(data)) if i != idx], k)] if k else []
    if kind == "multiple_choice":
        head = "".join(s["query"] + d + s["choices"][s["gold"]] + "\n\n" for s in shots) + item["query"] + d
        texts = [head + c for c in item["choices"]]
    elif kind == "schema":
        head = "".join(s["context_options"][s["gold"]] + d + s["continuation"] + "\n\n" for s in shots)
        texts = [head + c + d + item["continuation"] for c in item["context_options"]]
    else:
        head = "".join(s["context"].strip() + d + s["continuation"] + "\n\n" for s in shots)
        head += item["context"].strip() + d
        texts = [head.strip(), head + item["continuation"]]
    seqs = [[tok.bos_id] + tok.encode(t) for t in texts]
    if kind == "language_modeling":
        without, seqs = seqs[0], seqs[1:]
        assert seqs[0][:len(without)] == without
        starts = [len(without)]
    else:
        n = min(len(s) for s in seqs)
        if kind == "multiple_choice":  # first position where the options part
            common = next((i for i in range(n) if len({s[i] for s in seqs}) > 1), n)
            starts = [common] * len(seqs)
        else:  # schema: the common tail, counted from the end
            common = next((i for i in range(n) if len({s[-1 - i] for s in seqs}) > 1), n)
            starts = [len(s) - common for s in seqs]
    ends = [len(s) for s in seqs]
    width = max(ends)
    ids = torch.tensor([s + [tok.bos_id] * (width - len(s)) for s in seqs])
    with torch.no_grad():
        logits = model(ids, loops=K)
    losses = F.cross_entropy(logits.flatten(0, 1), ids.roll(-1, 1).flatten(), reduction="none").view(ids.shape)
    preds = logits.argmax(-1)
    if kind == "language_modeling":
        s, e = starts[0], ends[0]
        right = bool((preds[0, s - 1:e - 1] == ids[0, s:e]).all())
    else:
        means = [losses[i, s - 1:e - 1].mean().item() for i, (s, e) in enumerate(zip(starts, ends))]
        right = means.index(min(means)) == item["gold"]
    return list(zip(seqs, starts)), right


def synthetic_bundle(root):
    """50 items over 5 tasks with the hard cases: MC choices that share words, split a space off
    (" iron"), or lie inside another (NaN); schema contexts with shared last words; LM contexts
    with trailing spaces and a "\\n" delimiter; prompts longer than the model's 24 tokens."""
    rng = random.Random(0)
    words = ["the", "cat", "sat", "ran", "dog", "ice", "iron", "because", "she", "was", "too", "big", "is", "hot",
             "cold", "zebra", "42"]

    def phrase(lo, hi):
        return " ".join(rng.choice(words) for _ in range(rng.randint(lo, hi)))
    choice_sets = [["the cat sat", "the cat ran", "the dog"], ["iron", "ice"], ["the cat ran", "the cat", "the cat sat"],
                   ["the cat", "the cat sat"], ["is hot", "is cold", "was too big"], ["42", "4", "zebra"],
                   ["ice", "iron", "irony"]]

    def mc(prefix):
        choices = rng.choice(choice_sets)
        return {"query": f"{prefix} {phrase(1, 7)}\nA:", "choices": choices, "gold": rng.randrange(len(choices))}

    def schema():
        tail = rng.choice(["because she", "the", "is"])
        contexts = [f"Q: {phrase(0, 3)} {w} {tail}".replace("  ", " ") for w in rng.sample(["cat", "dog", "ice", "iron"], 2)]
        return {"context_options": contexts, "continuation": rng.choice(["was too big", "is hot", "ran"]), "gold": rng.randrange(2)}
    tasks = {  # label: (type, shots, delimiter, items)
        "mc_space": ("multiple_choice", 1, " ", [mc("Q:") for _ in range(16)]),
        "mc_colon": ("multiple_choice", 0, ": ", [mc("Q") for _ in range(8)]),
        "schema": ("schema", 1, " ", [schema() for _ in range(10)]),
        "lm_space": ("language_modeling", 0, " ", [{"context": f"Q: {phrase(1, 6)}" + rng.choice([" ", "", "  "]),
                                                     "continuation": rng.choice(["hot", "the cat", "cold."])} for _ in range(8)]),
        "lm_newline": ("language_modeling", 1, "\n", [{"context": f"Q: {phrase(1, 6)}",
                                                       "continuation": f"A: {rng.choice(words)}"} for _ in range(8)])}
    (root / "eval_data").mkdir(parents=True)
    entries, meta = [], "Eval Task,Random baseline\n"
    for label, (kind, shots, delim, items) in tasks.items():
        (root / "eval_data" / f"{label}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in items))
        entries.append({"label": label, "dataset_uri": f"{label}.jsonl", "num_fewshot": [shots],
                        "icl_task_type": kind, "continuation_delimiter": delim})
        meta += f"{label},25.0\n"
    (root / "core.yaml").write_text(json.dumps({"icl_tasks": entries}))  # JSON is YAML
    (root / "eval_meta_data.csv").write_text(meta)
    return str(root)


@pytest.mark.parametrize("max_per_task", [-1, 5])
def test_core_matches_a_reimplementation_of_nanochat_example_by_example(tmp_path, max_per_task):
    """Every item of the synthetic bundle: the same tokens, span and decision at K = 1 and 2."""
    model = randomize_(tiny_gpt(seq_len=24, loops=2, vocab_size=WTOK.vocab_size))
    n_long = n_items = 0
    for task in corpus.load_bundle(synthetic_bundle(tmp_path / "bundle")):
        with open(task["path"]) as f:  # nanochat's loading: every line, shuffled with 1337, then cut
            data_ = [json.loads(line) for line in f]
        random.Random(1337).shuffle(data_)
        data_ = data_[:max_per_task] if max_per_task > 0 else data_
        items = corpus.load_items(task, max_per_task)
        got = ev.item_correct(model, WTOK, task, items, range(len(items)), [1, 2], batch_size=5)
        assert items == data_
        for idx in range(len(data_)):
            for K in (1, 2):
                seqs, right = nanochat_example(model, WTOK, data_, idx, task, K)
                assert core.task_sequences(WTOK, task, items, idx, 240) == seqs, (task["label"], idx)
                assert got[K][idx] == right, (task["label"], idx, K)
            n_long += any(len(t) > 24 for t, _ in seqs)
        n_items += len(items)
    assert n_items == (50 if max_per_task < 0 else 25) and n_long >= 5  # prompts longer than sequence_len, whole


# ----------------------------------------------------------------------------- bpb and perplexity


def test_bpb_of_uniform_logits_excludes_zero_byte_tokens():
    e, a, bos = TOK.encode("é")[0], TOK.encode("a")[0], TOK.bos_id
    x = torch.tensor([[a, a, a, a], [a, a, a, a]])
    y = torch.tensor([[a, bos, e, a], [e, e, -1, bos]])  # 5 targets with bytes: 1 + 2 + 1 + 2 + 2
    bpb, n = ev.evaluate_bpb(uniform(), [(x[:1], y[:1]), (x[1:], y[1:])], {"utf8": TOK.token_bytes()}, [1, 3])
    expected = 5 * math.log(V) / (math.log(2) * 8)
    assert bpb == {"utf8": {1: pytest.approx(expected), 3: pytest.approx(expected)}} and n == 7  # 7 targets >= 0


def test_bpb_by_both_byte_counts():
    """One pass, two byte tables: the authors' count (here "é" counted as 3 bytes, as U+FFFD would
    be, and BOS as 0) and the true UTF-8 count; the losses are the same, the denominators differ."""
    e, a, bos = TOK.encode("é")[0], TOK.encode("a")[0], TOK.bos_id
    x, y = torch.tensor([[a, a, a, a]]), torch.tensor([[a, bos, e, e]])
    theirs = TOK.token_bytes().clone()
    theirs[e] = 3
    bpb, n = ev.evaluate_bpb(uniform(), [(x, y)], {"authors": theirs, "utf8": TOK.token_bytes()}, [2])
    nats = 3 * math.log(V)  # BOS has 0 bytes in both: out of both sums
    assert bpb == {"authors": {2: pytest.approx(nats / (math.log(2) * 7))},
                   "utf8": {2: pytest.approx(nats / (math.log(2) * 5))}} and n == 4


def test_wiki_windows_layout():
    """BOS before every row (the empty one too), one stream: 0 a b 0 0 c \\n 0 d e (10 tokens).
    seq_len 2, batch 2: chunks of 5 tokens at a stride of 4 ((10 - 1) // 4 = 2 chunks), each two rows
    of 2 inputs with the next 2 tokens as targets. Tokens 1..8 are targets once; e is dropped."""
    a, b, c, d, e, nl = 11, 12, 13, 14, 15, 97  # CharTokenizer ids: 1 + index in string.printable
    assert TOK.encode("abcde\n") == [a, b, c, d, e, nl]
    assert data.wiki_windows(TOK, ["ab", "", "c\n", "de"], 2, 2) == [[0, a, b], [b, 0, 0], [0, c, nl], [nl, 0, d]]
    # batch 1, one more row: 0 a b 0 0 c \\n 0 d e 0 f: (12 - 1) // 2 = 5 chunks of 3 at a stride of 2; at
    # batch 2 the same stream gives 2 chunks of 5 (4 rows) and drops e 0 f: the batch decides what is scored
    rows = ["ab", "", "c\n", "de", "f"]
    f = TOK.encode("f")[0]
    assert data.wiki_windows(TOK, rows, 2, 1) == [[0, a, b], [b, 0, 0], [0, c, nl], [nl, 0, d], [d, e, 0]]
    assert data.wiki_windows(TOK, rows, 2, 2) == [[0, a, b], [b, 0, 0], [0, c, nl], [nl, 0, d]] and f not in sum(
        data.wiki_windows(TOK, rows, 2, 1), [])
    with pytest.raises(ValueError, match="fewer than one chunk of 2 x sequence_len"):
        data.wiki_windows(TOK, ["ab"], 2, 2)


@torch.no_grad()
def test_perplexity_is_exp_mean_nll_of_the_windows():
    model = randomize_(tiny_gpt(seq_len=8))
    rows = ["", " = Title = \n", "", " Some <unk> text , with 2 @-@ 3 tokens .\n", "", " More text here .\n"]
    stream = torch.tensor([t for row in rows for t in [0] + TOK.encode(row)])
    # the authors' loader: chunks of B*T + 1 = 17 tokens at a stride of 16, x and y viewed (2, 8)
    chunks = [stream[i:i + 17] for i in range(0, len(stream) - 16, 16)]
    assert len(stream) > 16 * len(chunks) + 1  # a remainder is dropped
    x, y = torch.cat([c[:-1].view(2, 8) for c in chunks]), torch.cat([c[1:].view(2, 8) for c in chunks])
    ppl = ev.evaluate_ppl(model, data.wiki_windows(TOK, rows, 8, 2), [1, 3], batch_size=3)
    for K in (1, 3):
        nll = F.cross_entropy(model(x, loops=K).flatten(0, 1), y.flatten())
        assert ppl[K] == pytest.approx(math.exp(nll.item()), rel=1e-5)


def test_load_rows_parquet_and_tokens_file(tmp_path):
    rows = ["", " = Title = \n", "", " Body <unk> line .\n"]
    pq.write_table(pa.table({"text": rows}), tmp_path / "w.parquet")
    assert corpus.load_rows(str(tmp_path / "w.parquet")) == rows
    (tmp_path / "wiki.test.tokens").write_text(" \n = Title = \n \n Body <unk> line .\n")  # blank lines hold a space
    assert corpus.load_rows(str(tmp_path / "wiki.test.tokens")) == rows
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match="no 'text' column"):
        corpus.load_rows(str(tmp_path / "bad.parquet"))


# ----------------------------------------------------------------------------- the one-pass sweep


def tiny_gpt(seq_len=32, loops=3, vocab_size=V):
    return GPT(GPTConfig(sequence_len=seq_len, vocab_size=vocab_size, n_layer=2, n_head=2, n_kv_head=2, n_embd=32,
                         loops=loops, variant="FLT"))


@torch.no_grad()
def randomize_(model, seed=0):
    """Every weight redrawn, c_proj included (init_weights zeroes it, making every block the identity)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        std = 1.0 if "wte" in name else (0.5 if "c_proj" in name else 1.0) / math.sqrt(p.shape[-1])
        p.copy_(torch.randn(p.shape, generator=g) * std)
    return model.eval()


@torch.no_grad()
def test_sweep_equals_separate_passes(tasks):
    model = randomize_(tiny_gpt())
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, V, (3, 32), generator=g), torch.randint(0, V, (3, 32), generator=g)) for _ in range(2)]
    token_bytes = TOK.token_bytes()
    swept = ev.evaluate_bpb(model, batches, {"t": token_bytes}, [1, 2, 3])[0]["t"]
    for K in (1, 2, 3):
        nats = sum(F.cross_entropy(model(x, loops=K).flatten(0, 1), y.flatten(), reduction="none")
                   [token_bytes[y.flatten()] > 0].sum() for x, y in batches)
        n_bytes = sum(token_bytes[y].sum() for _, y in batches)
        assert swept[K] == pytest.approx((nats / (math.log(2) * n_bytes)).item(), rel=1e-5)
    seqs = [s for item in item_seqs(tasks["mc_task"], seq_len=ev.longest_input(model))[1] for s in item]
    assert max(len(s) for s, _ in seqs) > 32  # longer than sequence_len: fed whole
    scores = ev.score_sequences(model, seqs, [1, 2, 3], batch_size=8)
    for K in (1, 2, 3):
        for i, (toks, start) in enumerate(seqs):  # one unpadded sequence, one pass at this K
            logits = model(torch.tensor([toks[:-1]]), loops=K)[0]
            loss = F.cross_entropy(logits[start - 1:], torch.tensor(toks[start:]))
            assert scores[K][0][i].item() == pytest.approx(loss.item(), rel=1e-4)
            assert scores[K][1][i].item() == bool((logits[start - 1:].argmax(-1) == torch.tensor(toks[start:])).all())
        assert ev.evaluate_task(model, TOK, tasks["mc_task"], [K], 8) == {
            K: ev.evaluate_task(model, TOK, tasks["mc_task"], [1, 2, 3], 8)[K]}


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize("missing", ["core.yaml", "eval_meta_data.csv", "eval_data/schema.jsonl"])
def test_bundle_missing_file_is_named(tmp_path, missing):
    bundle = make_bundle(tmp_path / "b", skip=(missing,))
    with pytest.raises(FileNotFoundError, match=missing.replace(".", r"\.")):
        corpus.load_bundle(bundle)


@pytest.mark.parametrize("name, bundle_files, match", [
    ("b", dict(core_yaml=CORE_YAML.replace("icl_task_type: schema", "icl_task_type: essay")),
     "schema_task.*'essay'.*multiple_choice"),
    ("c", dict(meta=META_CSV.replace("lm_task", "other")), "lm_task"),
    ("d", dict(core_yaml=CORE_YAML.replace("  dataset_uri: lm.jsonl\n", "")), "lacks.*dataset_uri"),
    ("e", dict(meta=META_CSV.replace("Random baseline", "Baseline")), "Random baseline")])
def test_unknown_task_type_and_missing_baseline_are_named(tmp_path, name, bundle_files, match):
    with pytest.raises(ValueError, match=match):
        corpus.load_bundle(make_bundle(tmp_path / name, **bundle_files))


def test_missing_checkpoint_and_bad_settings(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        ev.main([str(tmp_path / "nope")])
    with pytest.raises(ValueError, match="usage"):
        ev.main(["--loops=3"])
    with pytest.raises(ValueError, match="--modes.*bpb,wiki,core,sample"):
        ev.main([str(tmp_path), "--modes=bpb,ppl"])
    with pytest.raises(ValueError, match="--loops"):
        ev.main([str(tmp_path), "--loops=1,0"])


# ----------------------------------------------------------------------------- the CLI


def save_checkpoint(tmp_path, seq_len=64, **settings):
    """A tiny saved run (real BPE tokenizer) and a validation shard: (model, tokenizer, step dir)."""
    tok = bpe_tokenizer(tmp_path)
    model = randomize_(tiny_gpt(seq_len=seq_len, loops=2, vocab_size=tok.vocab_size))
    step = checkpoint.save(str(tmp_path / "run"), 10, model, {"world_size": 1},
                           settings={"dataset": "embedded", **settings}, files={"tokenizer.json": tok.save})
    step = type(tmp_path)(step)
    pq.write_table(pa.table({"text": ["Some validation text. " * 30] * 4}), tmp_path / "val.parquet")
    return model, tok, step


def test_cli_end_to_end(tmp_path):
    """A saved checkpoint through every mode: eval.json's numbers equal the functions called
    directly on the protocol's inputs, and eval.md's cells are those numbers as Table 1 prints them."""
    model, tok, step = save_checkpoint(tmp_path)
    (tmp_path / "wiki.test.tokens").write_text(" \n = Title = \n \n The opposite of hot is cold .\n" * 40)
    bundle = make_bundle(tmp_path / "bundle")
    ev.main([str(tmp_path / "run"), "--device=cpu", "--loops=2,1", "--batch_size=4", "--bpb_tokens=512",
             f"--val_files={tmp_path / 'val.parquet'}", f"--wiki_path={tmp_path / 'wiki.test.tokens'}",
             f"--bundle_dir={bundle}", "--sample_tokens=3", f"--data_dir={tmp_path / 'nodata'}"])
    saved = json.loads((step / "eval.json").read_text())
    assert saved["step"] == 10 and list(saved["results"]) == ["1", "2"]
    # one row group: the authors' layout (4 ranks x batch 4) would score rank 0's one chunk only, so
    # the 512 tokens asked for are scored in one stream: 2 chunks of 4 x 64
    chunks, n = data.protocol_chunks([str(tmp_path / "val.parquet")], tok, 64, 512, 1, 4)
    [run] = saved["runs"].values()
    assert n == 2 and run["measured"]["bpb"]["tokens"] == sum(int((y >= 0).sum()) for _, y in chunks) == 512
    bpb = ev.evaluate_bpb(model, chunks, {c: tok.token_bytes(c) for c in ("authors", "utf8")}, [1, 2])[0]
    ppl = ev.evaluate_ppl(model, data.wiki_windows(tok, corpus.load_rows(str(tmp_path / "wiki.test.tokens")), 64, 4),
                          [1, 2], 4)
    core = ev.evaluate_core(model, tok, corpus.load_bundle(bundle), [1, 2], 4, log=lambda *a: None)
    md = ("| K | Wiki2 ppl | val bpb | CORE | LMB | PIQA | Hella | OPQA | ARC-E | ARC-C | Avg |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|\n")
    for K in (1, 2):
        r = saved["results"][str(K)]
        # bpb on 512 tokens, not the authors' 40 x 2^19: kept under its label, a row of its own
        assert r["val_bpb[bpb_tokens=512]"] == pytest.approx(bpb["authors"][K], rel=1e-5)
        assert r["val_bpb_utf8[bpb_tokens=512]"] == pytest.approx(bpb["utf8"][K], rel=1e-5)
        assert r["wiki_ppl"] == pytest.approx(ppl[K]) and r["CORE"] == pytest.approx(core[K]["CORE"])
        assert len(r["samples"]) == len(modes.SAMPLE_PROMPTS) and r["samples"][0].startswith(modes.SAMPLE_PROMPTS[0])
        # the handmade bundle has none of Table 1's six tasks: their cells and Avg stay empty
        md += f"| {K} | {r['wiki_ppl']:.2f} |  | {100 * r['CORE']:.2f} |" + "  |" * 7 + "\n"
        md += f"| {K} [bpb_tokens=512] |  | {r['val_bpb[bpb_tokens=512]']:.3f} |" + "  |" * 8 + "\n"
    assert (step / "eval.md").read_text() == saved["table"] == md
    assert not (tmp_path / "nodata").exists()  # every input was local


def test_cli_failed_mode_keeps_the_modes_before_it(tmp_path):
    """wiki and core cannot download (offline: their host does not resolve): the plan says so at once,
    bpb still runs, eval.json holds its numbers, the run exits non-zero and says how to point at
    local files."""
    _, _, step = save_checkpoint(tmp_path)
    args = [str(tmp_path / "run"), "--device=cpu", "--loops=1", "--bpb_tokens=512", f"--val_files={tmp_path / 'val.parquet'}",
            f"--data_dir={tmp_path / 'data'}"]
    proc = forkserver.run(["eval.py", *args, "--modes=bpb,wiki,core",
                           "--wiki_url=http://no-such-host.invalid/test.parquet",
                           "--bundle_url=http://no-such-host.invalid/eval_bundle.zip"], ROOT,
                          os.environ | {"OMP_NUM_THREADS": "1"}, stderr_to_stdout=True)
    out = proc.stdout
    assert proc.returncode == 1 and "--wiki_path" in out and "--bundle_dir" in out
    assert "2 of 3 modes could not run" in out and "after 1 attempts" in out  # no retries for an unknown host
    assert out.index("plan wiki   cannot run") < out.index("plan core   cannot run") < out.index("val bpb: K=1")
    saved = json.loads((step / "eval.json").read_text())["results"]["1"]
    assert set(saved) == {"val_bpb[bpb_tokens=512]", "val_bpb_utf8[bpb_tokens=512]"}  # wiki and core failed
    assert sorted(os.listdir(step)) == ["eval.json", "eval.md", "model.pt", "rank0.pt", "tokenizer.json"]  # no temp file
    alone = ev.main(args + ["--modes=bpb", f"--out={tmp_path / 'bpb.json'}"])
    assert saved["val_bpb[bpb_tokens=512]"] == pytest.approx(alone[1]["val_bpb[bpb_tokens=512]"])


def test_samples_print_as_text_between_rules(tmp_path, capsys):
    """Each sample as it reads (its newlines kept, not a repr), after a rule naming its K, before a
    closing rule."""
    save_checkpoint(tmp_path)
    samples = ev.main([str(tmp_path / "run"), "--device=cpu", "--modes=sample", "--loops=1,2", "--sample_tokens=3"])
    out = capsys.readouterr().out
    for K in (1, 2):
        for text in samples[K]["samples"]:
            assert f"---- sample at K={K} {'-' * 53}\n{text.rstrip()}\n{'-' * 72}\n" in out


def test_the_sample_mode_continues_the_prompts_given(tmp_path, tiny_run, capsys):
    """--prompt, '|' between two prompts (commas are text): each is continued at each K, its sample
    the one runtime.sample gives for it, printed, and held in eval.json in the prompts' order."""
    run = shutil.copytree(tiny_run, tmp_path / "run")
    prompts = ["Hello, world", "def f(x):"]
    results = ev.main([str(run), "--device=cpu", "--modes=sample", "--loops=1,3", "--sample_tokens=4",
                       "--prompt=" + "|".join(prompts)])
    out = capsys.readouterr().out
    assert "plan sample 2 prompts x 4 tokens at each K in [1, 3]" in out
    model, meta = checkpoint.load_model(str(run), "cpu")
    model.eval()
    tok = checkpoint.run_tokenizer(meta)
    saved = json.loads((type(tmp_path)(meta["path"]) / "eval.json").read_text())["results"]
    for K in (1, 3):
        expected = [runtime.sample(model, tok, p, 4, loops=K, temperature=0.0) for p in prompts]
        assert [s[:len(p)] for s, p in zip(expected, prompts)] == prompts
        assert results[K]["samples"] == saved[str(K)]["samples"] == expected
        for text in expected:
            assert f"---- sample at K={K} {'-' * 53}\n{text.rstrip()}\n" in out


def test_prompts_are_split_at_bars_and_none_may_be_empty():
    """--prompt: "" is SAMPLE_PROMPTS, else the texts between its '|' as written; an empty prompt is
    refused with the rule, and so is a prompt in a run without the sample mode (READ_BY)."""
    assert modes.sample_prompts("") == modes.SAMPLE_PROMPTS
    assert modes.sample_prompts("One, two") == ("One, two",)
    assert modes.sample_prompts(" a, b |c") == (" a, b ", "c")
    assert read("--modes=sample", "--prompt=x|y").prompt == "x|y"
    for bad in ("a||b", "|a", "a|"):
        with pytest.raises(ValueError, match=re.escape(f"--prompt={bad!r}: an empty prompt; expected "
                                                       "one text, or several with '|' between two")):
            read("--modes=sample", f"--prompt={bad}")


def test_eval_py_runs_accumulate(tmp_path, capsys):
    """bpb at K = 1, 2, then samples at K = 1: eval.json keeps both runs' numbers (those the runs
    returned) and eval.md tables them; an eval.json that cannot be read is kept aside, saying so
    (docs/evaluation.md)."""
    _, _, step = save_checkpoint(tmp_path)
    args = [str(tmp_path / "run"), "--device=cpu"]
    sampling = ["--modes=sample", "--loops=1", "--sample_tokens=3"]
    bpb = ev.main(args + ["--modes=bpb", "--loops=1,2", "--bpb_tokens=512", f"--val_files={tmp_path / 'val.parquet'}"])
    samples = ev.main(args + sampling)
    merged = {1: bpb[1] | samples[1], 2: bpb[2]}
    saved = json.loads((step / "eval.json").read_text())
    assert saved["results"] == {str(K): r for K, r in merged.items()}
    assert (step / "eval.md").read_text() == saved["table"] == report.table(merged)
    (step / "eval.json").write_text("{")
    capsys.readouterr()
    ev.main(args + sampling)
    [aside] = [name for name in os.listdir(step) if name.startswith("eval.json.unreadable.")]
    assert (step / aside).read_text() == "{" and f"kept it as {step / aside}" in capsys.readouterr().err
    assert json.loads((step / "eval.json").read_text())["results"] == {"1": samples[1]}


def test_sample_mode_decodes_with_cache_slots(tmp_path, monkeypatch):
    """--cache_slots reaches every sample's model.generate (runtime.sample), at each K of --loops."""
    model, tok, _ = save_checkpoint(tmp_path)
    calls, sample = [], runtime.sample
    monkeypatch.setattr(runtime, "sample", lambda *args, **kw: calls.append((kw["loops"], kw["cache_slots"]))
                        or sample(*args, **kw))
    results = ev.main([str(tmp_path / "run"), "--device=cpu", "--loops=3,2", "--modes=sample", "--sample_tokens=4",
                       "--cache_slots=1"])
    assert calls == [(2, 1)] * len(modes.SAMPLE_PROMPTS) + [(3, 1)] * len(modes.SAMPLE_PROMPTS)
    assert results[3]["samples[cache_slots=1]"][0] == sample(model, tok, modes.SAMPLE_PROMPTS[0], 4, temperature=0,
                                                             loops=3, cache_slots=1)


def test_sample_mode_with_drafts_gives_the_samples_of_k_loop_decoding(tmp_path, capsys, monkeypatch):
    """--draft_loops: self-speculative decoding (model.generate(draft_loops=...)) at each K of --loops
    above it, greedy, so the samples are those of K-loop decoding; a K it cannot serve decodes without
    drafting, and the plan line says so. A draft no K can serve is refused, with the bound."""
    save_checkpoint(tmp_path)
    args = [str(tmp_path / "run"), "--device=cpu", "--loops=3,2,1", "--modes=sample", "--sample_tokens=6",
            f"--out={tmp_path / 'eval.json'}"]
    exact = ev.main(args)
    calls, sample = [], runtime.sample
    monkeypatch.setattr(runtime, "sample", lambda *a, **kw: calls.append((kw["loops"], kw["draft_loops"]))
                        or sample(*a, **kw))
    drafted = ev.main(args + ["--draft_loops=1", "--draft_len=3"])
    out = capsys.readouterr().out
    assert ("drafting 3 tokens a round with 1 loops, verified with all K; K=1 without drafting, which "
            "needs K > 1)") in out
    assert sorted(set(calls)) == [(1, None), (2, 1), (3, 1)]
    # kept apart from the exact samples, and equal to them
    assert drafted == {K: {"samples[draft_loops=1,draft_len=3]": r["samples"]} for K, r in exact.items()}
    saved = json.loads((tmp_path / "eval.json").read_text())["results"]
    assert saved == {str(K): exact[K] | drafted[K] for K in exact}
    # the bound: K_d loops draft for a K of at least K_d + 1 (flt/decoding.py: check_draft)
    for bad, message in ((["--draft_loops=3"], r"^--draft_loops=3: .*than K=3, so K_d loops need "
                                                r"K >= K_d \+ 1; allowed: an integer from 1 to 2$"),
                         (["--loops=1", "--draft_loops=1"], r"^--draft_loops=1: .*allowed: none: K=1"),
                         (["--draft_loops=1", "--draft_len=0"], r"^--draft_len=0: expected an integer >= 1"),
                         (["--draft_loops=1", "--cache_slots=1"], r"^--cache_slots=1 with --draft_loops=1: ")):
        with pytest.raises(ValueError, match=message) as refused:
            ev.main(args + bad)
        assert "draft_len" not in str(refused.value) or "--draft_len=0" in bad


def test_results_under_another_choice_are_kept_apart_and_the_table_shows_all_the_file_holds(tmp_path, capsys):
    """bpb (the authors' protocol), then samples exact, then with one loop slot: each run keeps what
    the others stored; the cache's samples go under samples[cache_slots=1], as the plan line says,
    and each run prints the table of everything eval.json then holds, not only its own columns."""
    _, _, step = save_checkpoint(tmp_path)
    args = [str(tmp_path / "run"), "--device=cpu", "--loops=1,2"]
    bpb = ev.main(args + ["--modes=bpb", f"--val_files={tmp_path / 'val.parquet'}"])
    exact = ev.main(args + ["--modes=sample", "--sample_tokens=3"])
    capsys.readouterr()
    cached = ev.main(args + ["--modes=sample", "--sample_tokens=3", "--cache_slots=1"])
    out = capsys.readouterr().out
    assert "exact cache" not in out and "kept apart in eval.json as <metric>[cache_slots=1]" in out
    saved = json.loads((step / "eval.json").read_text())["results"]
    assert saved == {str(K): bpb[K] | exact[K] | {"samples[cache_slots=1]": cached[K]["samples[cache_slots=1]"]}
                     for K in (1, 2)}
    table = out[out.index(f"{step / 'eval.json'} now holds:"):]
    for K in (1, 2):
        assert f"| {K} |  | {bpb[K]['val_bpb']:.3f} |" in table  # the first run's numbers, printed
    assert ("also held: val_bpb_utf8 at K=1,2; samples at K=1,2; samples[cache_slots=1] at K=1,2\n"
            f"written to {step / 'eval.json'}") in table


class Stop(Exception):
    pass


@pytest.mark.parametrize("settings, kwargs", [({}, {"bos": data.BOS}), ({"bos_token": data.BOS}, {"bos": data.BOS}),
                                              ({"bos_token": "<|bos|>"}, {"bos": "<|bos|>"})])
def test_tokenizer_loaded_with_the_checkpoint_bos_token(tmp_path, monkeypatch, settings, kwargs):
    """The document token the run trained with (its bos_token setting; older runs: data.BOS)."""
    save_checkpoint(tmp_path, **settings)
    calls = []

    def load_tokenizer(path, **kw):
        calls.append(kw)
        raise Stop
    monkeypatch.setattr(data, "load_tokenizer", load_tokenizer)
    with pytest.raises(Stop):
        ev.main([str(tmp_path / "run"), "--device=cpu"])
    assert calls == [kwargs]


# ----------------------------------------------------------------------------- the settings (flt/eval_settings.py)
DEFAULTS = settings_of(vars(ev))


def read(*argv, checkpoint="."):
    return eval_settings.read([checkpoint, *argv], dict(DEFAULTS), "eval.py")[1]


def test_settings_parse_modes_loops_and_thresholds_and_name_bad_values(tmp_path):
    run = str(tmp_path)
    path, settings = eval_settings.read([run, "--modes=exit, bpb,exit", "--loops=6,1,6,3",
                                         "--exit_thresholds=0.1,0"], dict(DEFAULTS), "eval.py")
    assert path == run and settings.batch_size == 8 and settings.loops == "6,1,6,3"  # as given
    assert eval_settings.chosen_modes(settings.modes) == ["bpb", "exit"]
    assert eval_settings.loop_budgets(settings.loops) == [1, 3, 6]
    assert eval_settings.exit_thresholds(settings.exit_thresholds) == [0.1, 0.0]
    assert ev.modes == "bpb,wiki,core,sample" and DEFAULTS == settings_of(vars(ev))  # eval.py keeps its defaults
    bad = {"--modes=bpb,ppl": "--modes='bpb,ppl': expected a comma-separated subset of "
                              "bpb,wiki,core,sample,exit,tasks",
           "--loops=1,0": "--loops='1,0': expected comma-separated integers >= 1",
           "--modes=exit": "--exit_thresholds='': the exit mode needs comma-separated thresholds >= 0",
           "--exit_thresholds=0.1": "--exit_thresholds='0.1' is read by the exit and tasks modes, not by",
           "--batch_size=0": "--batch_size=0: expected a positive integer"}
    for arg, message in bad.items():
        with pytest.raises(ValueError, match=re.escape(message)):
            read(arg, checkpoint=run)
    with pytest.raises(ValueError, match=re.escape("--exit_thresholds='0.1,x': the exit mode needs")):
        read("--modes=exit", "--exit_thresholds=0.1,x", checkpoint=run)
    with pytest.raises(ValueError, match="usage: python eval.py <checkpoint dir>"):
        eval_settings.read(["--loops=3"], dict(DEFAULTS), "eval.py")
    # the settings first, then the checkpoint: a missing one is named before any model loads
    with pytest.raises(FileNotFoundError, match=re.escape(f"{run}/nope: no such checkpoint directory")):
        read(checkpoint=f"{run}/nope")


# a value off the default for each setting only some modes read
OFF_DEFAULT = {"batch_size": 4, "bpb_tokens": 512, "protocol_ranks": 2, "protocol_batch": 2, "val_files": __file__,
               "data_dir": ".", "wiki_path": __file__, "wiki_url": "http://x", "bundle_dir": "x",
               "bundle_url": "http://x", "max_per_task": 5, "sample_tokens": 4, "prompt": "Once|Twice",
               "temperature": 0.5, "seed": 7,
               "cache_slots": 1, "draft_loops": 1, "draft_len": 2, "task_items": 30,
               "exit_rules": "kl,argmax", "exit_thresholds": "0.1", "argmax_counts": "2"}


def test_every_setting_a_chosen_mode_does_not_read_is_refused():
    """Each setting that only some modes read (eval_settings.READ_BY), given off its default: refused
    in a run of the other modes, naming the modes that read it, and taken by each of those."""
    assert OFF_DEFAULT.keys() == eval_settings.READ_BY.keys()
    # what each mode needs beside: exit its thresholds; seed a temperature, draft_len a draft
    needs = {"exit": ["--exit_thresholds=0.1"]}
    beside = {"seed": ["--temperature=0.5"], "draft_len": ["--draft_loops=1"],
              "exit_rules": ["--exit_thresholds=0.1"],
              "argmax_counts": ["--exit_rules=kl,argmax", "--exit_thresholds=0.1"]}
    for key, readers in eval_settings.READ_BY.items():
        given = f"--{key}={OFF_DEFAULT[key]}"
        for mode in modes.PLANS:
            args = [f"--modes={mode}", given, "--loops=2", *needs.get(mode, [])]
            if mode in readers:
                assert getattr(read(*args, *beside.get(key, [])), key) == OFF_DEFAULT[key]
                continue
            with pytest.raises(ValueError) as refused:
                read(*args)
            line = str(refused.value)
            assert line.startswith(f"--{key}={OFF_DEFAULT[key]!r} is read by the "), line
            assert line.endswith(f" mode{'s' if len(readers) > 1 else ''}, not by --modes='{mode}': remove it, "
                                 "or add a mode that reads it"), line
            assert [m for m in modes.PLANS if f" {m}" in line.split(", not by")[0]] == list(readers), line
    with pytest.raises(ValueError, match=re.escape("--seed=7 does nothing at --temperature=0")):
        read("--modes=sample", "--seed=7")
    with pytest.raises(ValueError, match=re.escape("--draft_len=2 does nothing without --draft_loops")):
        read("--modes=sample", "--draft_len=2")


def test_cache_slots_are_at_most_the_smallest_K():
    """Sampling at each K of --loops decodes with cache_slots loop slots per layer (flt/decoding.py: KVCache): 1 to
    the smallest K (flt/decoding.py: check_cache_slots)."""
    assert read("--modes=sample", "--loops=6,2", "--cache_slots=2").cache_slots == 2
    for args, bound in ((("--loops=6,2", "--cache_slots=3"), "2"), (("--cache_slots=0",), "1")):
        with pytest.raises(ValueError, match=rf"^--cache_slots={args[-1][-1]}: expected an integer .*{bound}"):
            read("--modes=sample", *args)
    # the bound is named as the smallest of the K typed, not as a loops setting of its own
    with pytest.raises(ValueError) as refused:
        read("--modes=sample", "--loops=6,2", "--cache_slots=3")
    assert str(refused.value) == ("--cache_slots=3: expected an integer 1 to 2, the smallest K of --loops=2,6 "
                                  "(K loops keep 1 to K slots a layer), or None (K slots at each K, exact)")
    # drafting at two K (2 and 6) needs the exact cache at both: the one advice that serves both is None
    with pytest.raises(ValueError) as refused:
        read("--modes=sample", "--loops=6,2", "--draft_loops=1", "--cache_slots=2")
    assert str(refused.value).endswith("--cache_slots unset (None, K slots at each K)")


def test_a_checkpoint_file_opens_its_folder(tmp_path):
    """step_*/model.pt (or any file beside it) stands for its step directory; a file elsewhere is named."""
    _, _, step = save_checkpoint(tmp_path)
    for name in ("model.pt", "tokenizer.json"):
        path, _ = eval_settings.read([str(step / name), "--modes=sample"], dict(DEFAULTS), "eval.py")
        assert path == str(step)
    stray = tmp_path / "val.parquet"
    with pytest.raises(FileNotFoundError, match=re.escape(f"{stray}: a file, not a checkpoint directory")):
        read(checkpoint=str(stray))
    results = ev.main([str(step / "model.pt"), "--device=cpu", "--modes=sample", "--loops=1",
                       "--sample_tokens=2"])
    assert results[1]["samples"] and (step / "eval.json").exists()


def test_the_tasks_mode_on_a_text_run_is_one_line(tmp_path):
    """A checkpoint trained on text cannot run the tasks mode: one error naming it and its dataset,
    before any mode plans; nothing written."""
    _, _, step = save_checkpoint(tmp_path)
    p = forkserver.run(["eval.py", str(tmp_path / "run"), "--modes=tasks", "--device=cpu"], ROOT,
                       os.environ | {"OMP_NUM_THREADS": "1"})
    assert (p.returncode, p.stdout) == (1, "")
    assert p.stderr == (f"eval.py: ValueError: --modes='tasks': the tasks mode scores a model trained on a task "
                        f"(s3, s5, chains), and {step} was trained on dataset='embedded'\n")
    assert sorted(os.listdir(step)) == ["model.pt", "rank0.pt", "tokenizer.json"]


# ----------------------------------------------------------------------------- main's plan-then-run
# eval.py's metrics as its main hands them to the modes
METRICS = modes.Metrics(sweep=ev.loop_losses, bpb=ev.evaluate_bpb, exit=ev.evaluate_exit, wiki=ev.evaluate_ppl,
                        core=ev.evaluate_core,
                        byte_counts=ev.BYTE_COUNTS)


def test_the_support_package_never_imports_eval_py():
    """Imports flow one way: eval.py hands its metrics to flt/modes.py (modes.Metrics), and no
    module of flt/ imports eval.py, not even inside a function."""
    importers = []
    for path in sorted(glob.glob(os.path.join(ROOT, "flt", "*.py"))):
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module]
            else:
                continue
            if "eval" in names:
                importers.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}")
    assert importers == []


def test_each_mode_runs_the_metric_eval_py_hands_it(tmp_path):
    """The modes hold no arithmetic: the bpb mode stores what its Metrics.bpb returns, by byte count
    (val_bpb, val_bpb_utf8), given the byte tables Metrics.byte_counts names and every K."""
    _, tok, step = save_checkpoint(tmp_path)
    settings = read("--modes=bpb", "--loops=1,2", "--bpb_tokens=512", f"--val_files={tmp_path / 'val.parquet'}",
                    checkpoint=str(step))
    model, meta = checkpoint.load_model(str(step), "cpu")
    calls = []

    def bpb(model, batches, tables, loops, progress):
        calls.append(({count: table.tolist() for count, table in tables.items()}, loops))
        return {"authors": {K: K / 10 for K in loops}, "utf8": {K: K / 100 for K in loops}}, 0
    job = modes.Job(settings, model.eval(), meta, runtime.setup("cpu"), [1, 2], {}, METRICS._replace(bpb=bpb))
    by_K, measured = modes.bpb_mode(settings, job).run()
    assert by_K == {1: {"val_bpb": 0.1, "val_bpb_utf8": 0.01}, 2: {"val_bpb": 0.2, "val_bpb_utf8": 0.02}}
    tables = {count: tok.token_bytes(count).tolist() for count in ("authors", "utf8")}
    assert calls == [(tables, [1, 2])] and measured["tokens"] > 0


class Numerics:
    """A context manager that counts how often it was entered."""
    entered = 0

    def __enter__(self):
        Numerics.entered += 1

    def __exit__(self, *exc):
        return False


def test_main_plans_first_runs_each_mode_and_saves_after_each(tmp_path, monkeypatch, capsys):
    """Stand-in modes: a mode whose plan raises and one whose run raises are reported; the others run
    in the numerics, each merged into eval.json by K after it; the estimate sees only the planned;
    the run ends with exit status 1 and a closing line with the hints that apply."""
    _, _, step = save_checkpoint(tmp_path)
    capsys.readouterr()
    calls, saved, Numerics.entered = [], [], 0

    def plan(mode, settings, defaults, job):
        calls.append(f"plan {mode}")
        if mode == "wiki":
            raise ConnectionError("wiki: no network")

        def run():
            calls.append(f"run {mode}")
            if mode == "core":
                raise RuntimeError("core broke")
            return {1: {mode: 1.0}, 2: {mode: 2.0}}, {"tokens": len(mode)}
        return modes.Plan(f"{mode} inputs", 2, run)
    write_results = report.write_results

    def write(*args, **kwargs):
        doc = write_results(*args, **kwargs)
        saved.append(json.loads(json.dumps(doc["results"])))
        return doc
    monkeypatch.setattr(ev, "plan", plan)
    monkeypatch.setattr(ev, "estimate", lambda settings, job, planned: {
        m: modes.Span(15.0 * p.forwards, 30.0 * p.forwards, 60.0 * p.forwards) for m, p in planned.items()})
    monkeypatch.setattr(report, "write_results", write)
    monkeypatch.setattr(ev, "shared_cpu", lambda device: None)
    monkeypatch.setattr(modes.Job, "__init__", lambda self, *args: setattr(self, "numerics", Numerics()))
    with pytest.raises(SystemExit) as ended:
        ev.main([str(tmp_path / "run"), "--device=cpu", "--modes=bpb,wiki,core,sample", "--loops=2,1"])
    out, err = capsys.readouterr()
    assert ended.value.code == 1
    assert calls == ["plan bpb", "plan wiki", "plan core", "plan sample", "run bpb", "run core", "run sample"]
    lines = out.splitlines()
    assert lines[1:5] == ["plan bpb    bpb inputs", "plan core   core inputs", "plan sample sample inputs",
                          "estimate (from timed forwards: at their mean, and at the fastest to the slowest): "
                          "bpb ~1.0 min (30 s to 2.0 min), core ~1.0 min (30 s to 2.0 min), sample ~1.0 min "
                          "(30 s to 2.0 min); in all ~3.0 min (1.5 min to 6.0 min)"]
    # each mode's time beside its estimate
    assert lines[5] == "bpb took 0 s (estimated ~1.0 min (30 s to 2.0 min))"
    assert lines[6].startswith("sample took 0 s (")
    # a bug keeps its traceback (flt/errors.py); the other modes still run
    assert err.startswith("plan wiki   cannot run: wiki: no network\neval.py: mode 'core' failed: core broke\n"
                          "Traceback (most recent call last):\n")
    assert Numerics.entered == 3
    # merged after bpb, then after sample
    assert saved == [{"1": {"bpb": 1.0}, "2": {"bpb": 2.0}},
                     {"1": {"bpb": 1.0, "sample": 1.0}, "2": {"bpb": 2.0, "sample": 2.0}}]
    assert err.endswith(f"eval.py: 2 of 4 modes could not run: wiki, core (why: above). Saved in "
                        f"{step / 'eval.json'}: ['bpb', 'sample']. Inputs are downloaded unless given; "
                        "without network point at local files: --wiki_path=<wikitext-2-v1 test parquet or "
                        "wiki.test.tokens>, --bundle_dir=<unpacked eval_bundle>\n")
    assert out.endswith(f"written to {step / 'eval.json'} and {step / 'eval.md'}\n")


# ----------------------------------------------------------------------------- torchrun


def shares(model):
    """Four text batches (x, y), and four task batches (x, y, difficulty): half the targets unscored,
    half of the rest the model's own argmax at K=3 (right at K=3, some right at K=1), the others random."""
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, V, (2, 32), generator=g), torch.randint(0, V, (2, 32), generator=g)) for _ in range(4)]
    task_batches = []
    for x, y in batches:
        with torch.no_grad():
            own = model(x, loops=3, all_loops=True)[-1].argmax(-1)
        y = torch.where(torch.rand(y.shape, generator=g) < 0.5, own, y)
        y = torch.where(torch.rand(y.shape, generator=g) < 0.5, y, -1)
        task_batches.append((x, y, torch.randint(1, 4, y.shape, generator=g)))
    return batches, task_batches


def _worker(rank, world, port, bundle, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    model = randomize_(tiny_gpt())
    batches, task_batches = shares(model)
    result = {"bpb": ev.evaluate_bpb(model, batches[rank::world], {"t": TOK.token_bytes()}, [1, 3])[0]["t"],
              "ppl": ev.evaluate_ppl(model, data.wiki_windows(TOK, ["hello world, " * 20], 32, 2), [1, 3], 2),
              "core": ev.evaluate_core(model, TOK, corpus.load_bundle(bundle), [1, 3], 2, log=lambda *a: None),
              "exit": ev.evaluate_exit(model, batches[rank::world], TOK.token_bytes(), 3, [0.0, 1e-3]),
              "tasks": tasks_module.accuracy(model, task_batches[rank::world], [1, 2, 3], [1, 3])[0]}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()  # no rank tears gloo down while the other still talks to it
    dist.destroy_process_group()


def test_distributed_shares_match_one_process(tmp_path):
    bundle = make_bundle(tmp_path / "bundle")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_worker, args=(2, port, bundle, str(tmp_path)), nprocs=2, start_method="forkserver")
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0 == r1  # every rank holds the all-reduced result
    model = randomize_(tiny_gpt())
    batches, task_batches = shares(model)
    bpb = ev.evaluate_bpb(model, batches, {"t": TOK.token_bytes()}, [1, 3])[0]["t"]
    ppl = ev.evaluate_ppl(model, data.wiki_windows(TOK, ["hello world, " * 20], 32, 2), [1, 3], 2)
    core = ev.evaluate_core(model, TOK, corpus.load_bundle(bundle), [1, 3], 2, log=lambda *a: None)
    exit_curve = ev.evaluate_exit(model, batches, TOK.token_bytes(), 3, [0.0, 1e-3])
    tasks = tasks_module.accuracy(model, task_batches, [1, 2, 3], [1, 3])[0]
    for K in (1, 3):
        assert r0["bpb"][str(K)] == pytest.approx(bpb[K], rel=1e-5)
        assert r0["ppl"][str(K)] == pytest.approx(ppl[K], rel=1e-5)
        assert r0["core"][str(K)]["CORE"] == pytest.approx(core[K]["CORE"])
        # a share of right answers: a count over a count, equal whatever the ranks' split
        assert r0["tasks"][str(K)] == tasks[K]
    assert 0 < tasks[1]["task_acc"] < tasks[3]["task_acc"] < 1
    for shared, whole in zip(r0["exit"], exit_curve, strict=True):
        assert shared["val_bpb"] == pytest.approx(whole["val_bpb"], rel=1e-5)
        assert shared["mean_loops"] == pytest.approx(whole["mean_loops"], rel=1e-12)


# ----------------------------------------------------------------------------- the protocol, the plan, progress


def write_val(path, texts, row_group_size=1):
    pq.write_table(pa.table({"text": texts}), path, row_group_size=row_group_size)
    return str(path)


VAL_TEXTS = [f"Document {i}: " + "the opposite of hot is cold, " * (3 + 5 * i) for i in range(6)]


@torch.no_grad()
def test_a_split_smaller_than_requested_is_scored_once(tmp_path):
    """bpb_tokens far beyond the split: every simulated rank's stream (its row groups r, r + 4, ...,
    BOS + tokens of each document) is scored to its end and no further, in the authors' chunks of
    B*T + 1 tokens, the last one partial. The hand sum below feeds each row alone, unpadded."""
    model, tok, step = save_checkpoint(tmp_path)
    val = write_val(tmp_path / "six.parquet", VAL_TEXTS)
    args = [str(tmp_path / "run"), "--device=cpu", "--modes=bpb", "--loops=1,2", f"--val_files={val}",
            "--bpb_tokens=1000000", "--protocol_ranks=4", "--protocol_batch=2", "--batch_size=3"]
    results = ev.main(args)
    saved = json.loads((step / "eval.json").read_text())
    B, T, theirs, utf8 = 2, 64, tok.token_bytes("authors"), tok.token_bytes("utf8")
    nats, n_bytes, n_utf8, n_targets, n_chunks = {1: 0.0, 2: 0.0}, 0, 0, 0, 0
    for r in range(4):
        stream = [t for text in VAL_TEXTS[r::4] for t in [tok.bos_id] + tok.encode(text)]
        for i in range(0, len(stream) - 1, B * T + 1):  # a chunk's first token is no target
            chunk, n_chunks = stream[i:i + B * T + 1], n_chunks + 1
            for j in range(0, len(chunk) - 1, T):
                x, y = torch.tensor([chunk[j:j + T]]), torch.tensor(chunk[j + 1:j + T + 1])
                x = x[:, :len(y)]
                for K in (1, 2):
                    loss = F.cross_entropy(model(x, loops=K)[0], y, reduction="none")
                    nats[K] += loss[theirs[y] > 0].sum().item()
                n_bytes, n_utf8, n_targets = n_bytes + theirs[y].sum().item(), n_utf8 + utf8[y].sum().item(), n_targets + len(y)
    assert n_targets == sum(len(tok.encode(t)) + 1 for t in VAL_TEXTS) - n_chunks > 5 * B * T  # each token once
    [run] = saved["runs"].values()
    assert run["measured"]["bpb"]["tokens"] == n_targets
    # a protocol other than the authors': kept apart, labelled by the settings that made it
    label = "[bpb_tokens=1000000,protocol_batch=2]"
    for K in (1, 2):
        assert results[K][f"val_bpb{label}"] == pytest.approx(nats[K] / (math.log(2) * n_bytes), rel=1e-5)
        assert results[K][f"val_bpb_utf8{label}"] == pytest.approx(nats[K] / (math.log(2) * n_utf8), rel=1e-5)


def test_protocol_chunks_do_not_depend_on_the_processes(tmp_path):
    """The simulated ranks' chunks, in order, whatever the number of processes sharing them."""
    tok = bpe_tokenizer(tmp_path)
    val = write_val(tmp_path / "six.parquet", VAL_TEXTS)
    whole, n = data.protocol_chunks([val], tok, 16, 16 * 2 * 3 * 5, 3, 2)
    assert n == 15 and len(whole) == 15  # 5 chunks of each of 3 simulated ranks
    for world in (2, 4, 16):
        shares = [data.protocol_chunks([val], tok, 16, 16 * 2 * 3 * 5, 3, 2, rank, world)[0] for rank in range(world)]
        flat = [c for share in shares for c in share]
        assert len(flat) == 15 and all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(flat, whole))
    stream1 = data.DataLoader([val], tok, 2, 16, 1, 3, cycle=False)
    assert all(torch.equal(next(stream1)[0], whole[5 + i][0]) for i in range(5))  # simulated rank 1's own stream


class LongSplit:
    """A validation split longer than any request: each simulated rank's loader cuts chunks forever
    (int8 zeros, cheap), and every loader made is recorded."""
    made = []

    def __init__(self, files, tokenizer, batch, seq_len, rank, ranks, cycle):
        LongSplit.made.append((rank, ranks, batch, seq_len, cycle))
        self.chunk = (torch.zeros(batch, seq_len, dtype=torch.int8),) * 2

    def __iter__(self):
        return itertools.repeat(self.chunk)


def test_default_settings_score_the_authors_eval_sh_tokens(tmp_path, monkeypatch, capsys):
    """eval.sh's layout at the paper's sequence_len 1024: 4 ranks x batch 4 x 1280 chunks of 1024
    tokens, 40 x 2^19 tokens in all, whatever batch_size runs them. Stopped after the plan."""
    save_checkpoint(tmp_path, seq_len=1024)
    monkeypatch.setattr(data, "DataLoader", LongSplit)
    LongSplit.made = []
    # the shard's name as eval.sh gives it; LongSplit stands in for its contents
    monkeypatch.chdir(tmp_path)
    (tmp_path / "shard_00249.parquet").touch()

    def stop(*args):
        raise Stop
    monkeypatch.setattr(ev, "estimate", stop)
    with pytest.raises(Stop):
        ev.main([str(tmp_path / "run"), "--device=cpu", "--modes=bpb", "--val_files=shard_00249.parquet"])
    assert LongSplit.made == [(r, 4, 4, 1024, False) for r in range(4)]
    assert 4 * 4 * 1280 * 1024 == 40 * 2**19 == 20_971_520
    plan = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("plan bpb"))
    assert plan == ("plan bpb    20,971,520 tokens of shard_00249.parquet (as the authors' 4 ranks x batch 4 cut it); "
                    "2,560 forwards of 8 x 1024 at K=12")


def slow_forwards(monkeypatch, seconds, log=None):
    """Both loops made slow, GPT.loop_states and decoding's (cached_loops: sampling, the exit rule),
    and (log) each forward recorded in the output."""
    import model
    from flt import decoding

    def slowed(run):
        def slow(*args, **kwargs):
            if log is not None:
                print(log, flush=True)
            time.sleep(seconds)
            return run(*args, **kwargs)
        return slow
    monkeypatch.setattr(model.GPT, "loop_states", slowed(model.GPT.loop_states))
    # each name that calls decoding's loop: model.py's forward, the decode step, eval.py's sweep
    cached_loops = slowed(decoding.cached_loops)
    for module in (model, decoding, ev):
        monkeypatch.setattr(module, "cached_loops", cached_loops)


def test_the_plan_comes_before_any_forward(tmp_path, monkeypatch, capsys):
    _, _, step = save_checkpoint(tmp_path)
    slow_forwards(monkeypatch, 0, log="FORWARD")
    bundle = make_bundle(tmp_path / "bundle")
    ev.main([str(tmp_path / "run"), "--device=cpu", "--loops=1,2", "--modes=bpb,core,sample", "--bpb_tokens=512",
             f"--val_files={tmp_path / 'val.parquet'}", f"--bundle_dir={bundle}", "--sample_tokens=2"])
    out = capsys.readouterr().out
    first = out.index("FORWARD")
    for mode in ("bpb", "core", "sample"):
        assert out.index(f"plan {mode}") < first
    assert "plan bpb    " in out and "forwards" in out.split("plan bpb")[1].split("\n")[0]
    assert first < out.index("estimate (from timed forwards: at their mean, and at the fastest to the slowest): "
                             "bpb ~") < out.index("val bpb: K=1")


class Recorder:
    """A model whose calls are recorded (their inputs and exit thresholds); the rest is the model's."""

    def __init__(self, model):
        self.model, self.calls = model, []

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, idx, **kwargs):
        self.calls.append((idx, kwargs.get("exit_threshold")))
        return self.model(idx, **kwargs)


def test_the_estimate_is_each_modes_forwards_times_the_calls_of_its_kind_timed(tmp_path, monkeypatch):
    """modes.estimate on a scripted clock (runtime.timed): each mode's forwards times the calls of its
    kind timed after one to warm up, at their mean, the fastest and the slowest (Span); the budget
    sweep timed once for bpb and wiki; a decoding step's time a generate call's after its first
    token, over its steps; the exit rule's forward on the first validation batch, at each threshold
    in turn. eval.py prints it as report.estimates writes it."""
    _, _, step = save_checkpoint(tmp_path)
    settings = read("--modes=bpb,wiki,sample,exit", "--exit_thresholds=0.1,0.01", "--bpb_tokens=512",
                    f"--val_files={tmp_path / 'val.parquet'}", checkpoint=str(step))
    model, meta = checkpoint.load_model(str(step), "cpu")
    job = modes.Job(settings, Recorder(model.eval()), meta, runtime.setup("cpu"), [1, 2], {"kl": [0.1, 0.01]}, METRICS)
    modes.validation(settings, job)
    # the sweep's calls, the decoding steps' (16 a call: 17 tokens after an 8-token prompt), the exit rule's
    clock = iter([100.0, 1.0, 2.0, 3.0, 4.0, 5.0] + [100.0, 16.0, 32.0, 16.0, 32.0, 16.0]
                 + [100.0, 2.0, 2.0, 2.0, 2.0, 7.0])

    def timed(work, device=None):
        work()
        return next(clock)
    monkeypatch.setattr(runtime, "timed", timed)
    planned = {mode: modes.Plan("", forwards, None) for mode, forwards in
               (("bpb", 10), ("wiki", 4), ("sample", 3), ("exit", 2))}
    spans = modes.estimate(settings, job, planned, calls=5)
    assert next(clock, None) is None  # three kinds, each timed six times
    assert spans == {"bpb": (10 * 1.0, 10 * 3.0, 10 * 5.0), "wiki": (4 * 1.0, 4 * 3.0, 4 * 5.0),
                     "sample": (3 * 1.0, pytest.approx(3 * 1.4), 3 * 2.0), "exit": (2 * 2.0, 2 * 3.0, 2 * 7.0)}
    assert all(idx is job.val.batches[0][0] for idx, _ in job.model.calls)
    assert [threshold for _, threshold in job.model.calls] == [0.1, 0.01] * 3
    line = ("estimate (from timed forwards: at their mean, and at the fastest to the slowest): bpb ~30 s "
            "(10 s to 50 s), exit ~6 s (4 s to 14 s); in all ~36 s (14 s to 1.1 min)")
    assert report.estimates({"bpb": spans["bpb"], "exit": spans["exit"]}) == line
    # a CPU loaded past its cores: said, since the time of a forward then changes several-fold
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    for load, shared in ((6.25, (6.25, 2)), (2.0, None)):
        monkeypatch.setattr(os, "getloadavg", lambda: (load, 1.0, 1.0))
        assert modes.shared_cpu("cpu") == shared and modes.shared_cpu("cuda:0") is None
    assert report.estimates({"bpb": spans["bpb"], "exit": spans["exit"]}, (6.25, 2)) == (
        line + "; this CPU is shared (load 6.2 on 2 cores), so the time may be several times more or less")


def test_the_sample_plan_counts_the_tokens_each_prompt_leaves_room_for(tmp_path):
    """The sample mode's forwards: each prompt's decoding steps at each K, sample_tokens or what
    sequence_len leaves after BOS and the prompt (runtime.sample), in steps at max(loops); a prompt
    that leaves no room is refused, named."""
    _, tok, step = save_checkpoint(tmp_path)
    model, meta = checkpoint.load_model(str(step), "cpu")
    prompts = ["Hello", "Once upon a time, " * 2]
    settings = read("--modes=sample", "--loops=1,2", "--sample_tokens=40", "--prompt=" + "|".join(prompts))
    job = modes.Job(settings, model.eval(), meta, runtime.setup("cpu"), [1, 2], {}, METRICS)
    room = [min(40, 64 - 1 - len(tok.encode(p))) for p in prompts]
    assert room[0] == 40 and room[1] < 40
    assert modes.sample_mode(settings, job).forwards == (1 + 2) * sum(room) / 2
    settings.prompt = "Hello|" + "word " * 70
    with pytest.raises(ValueError, match=r"^--prompt: 'word word .*\.\.\.' is \d+ tokens with its BOS, and the "
                                         r"model reads 64 \(sequence_len\): at most 63, so that a token can follow$"):
        modes.sample_mode(settings, job)


def test_progress_lines_on_a_slow_mode(tmp_path, monkeypatch, capsys):
    """Every mode reports done/total, rate and ETA while it runs (here at most every 0.05 s)."""
    _, _, step = save_checkpoint(tmp_path)
    slow_forwards(monkeypatch, 0.02)
    monkeypatch.setattr(corpus, "PROGRESS_SECONDS", 0.05)
    bundle = make_bundle(tmp_path / "bundle")
    (tmp_path / "wiki.test.tokens").write_text(" \n = Title = \n \n The opposite of hot is cold .\n" * 40)
    ev.main([str(tmp_path / "run"), "--device=cpu", "--loops=1,2", "--modes=bpb,wiki,core,sample,exit",
             "--bpb_tokens=4096", f"--val_files={write_val(tmp_path / 'six.parquet', VAL_TEXTS * 4)}",
             f"--bundle_dir={bundle}", "--sample_tokens=3", "--batch_size=1", "--exit_thresholds=0.1",
             f"--wiki_path={tmp_path / 'wiki.test.tokens'}"])
    out = capsys.readouterr().out
    for label, unit in (("val bpb", "forwards"), ("wikitext-2", "forwards"), ("CORE mc_task", "sequences"),
                        ("sample", "samples"), ("exit", "forwards")):
        lines = [line for line in out.splitlines() if line.startswith(f"{label}: ") and f" {unit} (" in line]
        assert len(lines) >= 2, (label, out)
        done, total = map(int, lines[-1].split(": ")[1].split(" ")[0].replace(",", "").split("/"))
        assert done == total and "/s" in lines[0] and "ETA" in lines[0], lines


# ----------------------------------------------------------------------------- device and dtype settings
NO_CUDA = f"but this torch ({torch.__version__}) sees no CUDA device; use --device=cpu"
DEVICES = "expected 'cpu', 'cuda', 'cuda:N' (one process), 'mps', or '' (cuda if there is one, else cpu)"
DTYPES = ("expected 'bf16' or 'fp32' (or 'auto' in train.py and bench.py: bf16 on CUDA, fp32 elsewhere; '' in "
          "eval.py: the checkpoint's)")
BAD_SETTINGS = [  # each script's error for the setting, written out
    ("--device=cuda", f"ValueError: device='cuda', {NO_CUDA}"),
    ("--device=cuda:1", f"ValueError: device='cuda:1', {NO_CUDA}"),
    ("--device=mps", f"ValueError: device='mps', but this torch ({torch.__version__}) sees no MPS device; "
                     "use --device=cpu"),
    ("--device=bogus", f"ValueError: device='bogus': {DEVICES}"),
    ("--device=cpu:0", f"ValueError: device='cpu:0': {DEVICES}"),  # a CPU has no index
    ("--dtype=fp16", f"ValueError: dtype='fp16': {DTYPES}"),
]
BENCH = ["--mode=memory_step", "--compile_mode=eager", "--depth=1", "--sequence_len=32", "--vocab_size=512"]


def available(setting):
    return ("cuda" in setting and torch.cuda.is_available()) or ("mps" in setting and torch.backends.mps.is_available())


def as_main(script, args, monkeypatch):
    """Run script's top level as `python script args` would, in this process: (the exception it
    ends with, or None)."""
    monkeypatch.setattr(sys, "argv", [script, *args])
    try:
        runpy.run_path(os.path.join(ROOT, script), run_name="__main__")
    except BaseException as e:
        return e


@pytest.mark.parametrize("setting, error", BAD_SETTINGS)
def test_a_bad_device_or_dtype_is_the_same_error_in_every_script(tmp_path, monkeypatch, capsys, setting, error):
    """eval.py and bench.py print the error alone on stderr, after their name, and exit with status 1
    (SystemExit: no traceback); train.py raises the same ValueError (its sys.excepthook prints it so:
    tests/test_errors.py), before it touches out_dir or data_dir."""
    if available(setting):
        pytest.skip("this machine has the device")
    _, _, step = save_checkpoint(tmp_path)
    capsys.readouterr()  # what saving it printed
    for script, program, args in (("eval.py", "eval.py", [str(step), "--modes=sample"]),
                                  ("scripts/bench.py", "scripts.bench", BENCH)):
        ended = as_main(script, [*args, setting], monkeypatch)
        assert isinstance(ended, SystemExit) and ended.code == 1, (script, ended)
        assert capsys.readouterr() == ("", f"{program}: {error}\n"), script
    ended = as_main("train.py", [f"--out_dir={tmp_path / 'out'}", f"--data_dir={tmp_path / 'data'}", setting],
                    monkeypatch)
    assert f"{type(ended).__name__}: {ended}" == error
    assert not (tmp_path / "out").exists() and not (tmp_path / "data").exists()


def test_the_command_line_says_it_without_a_traceback(tmp_path):
    """The real commands: eval.py and bench.py with --device=cuda on a machine without CUDA (a user's
    likely slip) print one line and exit 1; bf16 runs on the CPU (bench.py here, eval.py below)."""
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    _, _, step = save_checkpoint(tmp_path)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    commands = [["eval.py", str(step), "--device=cuda"], ["-m", "scripts.bench", *BENCH, "--device=cuda"],
                ["-m", "scripts.bench", *BENCH, "--dtype=bf16"]]
    procs = [forkserver.run(cmd, ROOT, env) for cmd in commands]  # processes forked from one that imported torch
    for p, program in zip(procs[:2], ("eval.py", "scripts.bench")):
        assert (p.returncode, p.stdout, p.stderr) == (1, "", f"{program}: ValueError: device='cuda', {NO_CUDA}\n")
    assert procs[2].returncode == 0 and json.loads(procs[2].stdout.splitlines()[-1])["step"] > 0, procs[2].stderr


def test_eval_runs_in_bf16_on_cpu_and_refuses_auto(tmp_path):
    """eval.py's dtype is the checkpoint's ("") or a precision, bf16 on the CPU too; "auto" is train.py's
    and bench.py's (bf16 on CUDA, fp32 elsewhere), refused here before the checkpoint is read."""
    _, _, step = save_checkpoint(tmp_path)
    args = [str(step), "--modes=sample", "--loops=1", "--sample_tokens=2", "--device=cpu", f"--out={tmp_path / 'e.json'}"]
    ev.main(args + ["--dtype=bf16"])
    [run] = json.load(open(tmp_path / "e.json"))["runs"].values()
    assert run["settings"]["dtype"] == "bf16"
    with pytest.raises(ValueError, match=re.escape(f"dtype='auto': {DTYPES}")):
        ev.main(args + ["--dtype=auto"])


@pytest.mark.parametrize("device", ["cpu:0", "cuda:", "cuda:x", "CUDA", "gpu"])
def test_a_device_is_a_type_and_only_cuda_takes_an_index(device):
    """The device setting is cpu, cuda, cuda:N, mps or "": a CPU has no index (torch would accept
    "cpu:1" and ignore it)."""
    with pytest.raises(ValueError, match=re.escape(f"device={device!r}: {DEVICES}")):
        runtime.setup(device)


@pytest.mark.parametrize("device, world, expected", [
    ("cuda", 1, "cuda:0"), ("", 1, "cuda:0"), ("cuda:2", 1, "cuda:2"), ("cuda", 4, "cuda:3"),  # LOCAL_RANK 3
    ("cuda:2", 4, "device='cuda:2' under torchrun: each rank uses the GPU of its LOCAL_RANK; use --device=cuda "
                  "(CUDA_VISIBLE_DEVICES chooses the GPUs)"),
    ("cuda:4", 1, "device='cuda:4': this machine has 4 CUDA device(s), cuda:0 .. cuda:3"),
])
def test_cuda_devices_with_and_without_an_index(monkeypatch, device, world, expected):
    """On a stand-in machine with 4 GPUs: "cuda" is the rank's LOCAL_RANK GPU, "cuda:N" is GPU N for
    one process, and an error under torchrun (where it would be overridden) or past the last GPU."""
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("LOCAL_RANK", "3" if world > 1 else "0")
    if expected.startswith("cuda:"):
        rt = runtime.setup(device)
        assert (rt.device, rt.device_type, chosen) == (expected, "cuda", [expected])
    else:
        with pytest.raises(ValueError, match=re.escape(expected)):
            runtime.setup(device)
        assert chosen == []


def test_missing_validation_or_wikitext_files_are_named_before_the_model_loads(tmp_path):
    save_checkpoint(tmp_path)
    run = str(tmp_path / "run")
    for setting in ("--val_files", "--wiki_path"):
        with pytest.raises(FileNotFoundError, match=rf"{setting}=nope.parquet: no such file"):
            ev.main([run, "--device=cpu", f"{setting}=nope.parquet"])
    assert not list((tmp_path / "run").rglob("eval.*"))
