"""Tests for eval.py: CORE prompts and scoring, bits per byte, WikiText perplexity, the budget
sweep, the bundle's errors and download, the table, and a CLI run end to end.

Scores are checked against models whose answers are known: `Oracle` puts all its probability
on the next token of sequences it was told, `Uniform` on nothing (loss ln V everywhere), and a
real tiny GPT with every weight redrawn is compared against separate `model(idx, loops=K)` runs.
A character tokenizer (one id per character, BOS = 0) makes token spans readable by hand.
"""
import functools
import http.server
import json
import math
import os
import random
import socket
import string
import threading
import zipfile
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import data
import eval as ev
from model import GPT, GPTConfig, model_state


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

    def __init__(self, known, seq_len=256):
        super().__init__()
        self.dummy = torch.nn.Parameter(torch.zeros(()))  # eval.py finds the device from a parameter
        self.config = SimpleNamespace(sequence_len=seq_len)
        self.tables = {K: {tuple(s[:t]): s[t] for s in seqs for t in range(1, len(s))} for K, seqs in known.items()}
        self.calls = []

    def loop_states(self, idx, loops):
        self.calls.append(loops)
        hs = []
        for K in range(1, loops + 1):
            table, z = self.tables.get(K, {}), torch.zeros(*idx.shape, V)
            for b, row in enumerate(idx.tolist()):
                for t in range(len(row)):
                    if (nxt := table.get(tuple(row[:t + 1]))) is not None:
                        z[b, t, nxt] = 20.0
            hs.append(z)
        return hs

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
    return {t["label"]: t for t in ev.load_bundle(make_bundle(tmp_path / "bundle"))}


def item_seqs(task, seq_len=256):
    items, n = ev.load_items(task, -1)
    return items, [ev.task_sequences(TOK, task, items, i, seq_len) for i in range(n)]


def oracle_for(task, pick):
    """The token sequence of option pick(i, item) of every item (the single one for LM)."""
    items, seqs = item_seqs(task)
    return [s[0 if task["type"] == "language_modeling" else pick(i, items[i])][0] for i, s in enumerate(seqs)]


# ----------------------------------------------------------------------------- prompts


def test_load_bundle_reads_yaml_and_baselines(tasks):
    assert tasks["mc_task"]["fewshot"] == 1 and tasks["mc_task"]["delimiter"] == " "
    assert tasks["schema_task"]["fewshot"] == 1  # the first of num_fewshot
    assert tasks["schema_task"]["delimiter"] == " "  # the default when core.yaml has none
    assert [t["baseline"] for t in tasks.values()] == [25.0, 50.0, 0.0]


def test_prompts_rendered_exactly(tasks):
    fulls, prefix = ev.render(tasks["mc_task"], MC[0], [MC[1]])
    shot = "Question: How many legs has a cat?\nAnswer: four\n\n"
    assert prefix == shot + "Question: What color is the sky?\nAnswer: "
    assert fulls == [shot + "Question: What color is the sky?\nAnswer: " + c for c in ("green", "blue", "red")]
    fulls, suffix = ev.render(tasks["schema_task"], SCHEMA[0], [SCHEMA[1]])
    assert suffix == " was too big."
    assert fulls == ["Anna helped Mia because Mia needed help.\n\nThe cup did not fit in the box because the cup was too big.",
                     "Anna helped Mia because Mia needed help.\n\nThe cup did not fit in the box because the box was too big."]
    fulls, prefix = ev.render(tasks["lm_task"], LM[0], [LM[1]])  # contexts are stripped
    assert prefix == "The opposite of up is down\n\nThe opposite of hot is "
    assert fulls == ["The opposite of up is down\n\nThe opposite of hot is cold"]


def test_fewshot_draw_matches_nanochat():
    for n, k in [(5, 1), (10, 3), (40, 10)]:
        for idx in range(n):
            expected = random.Random(1234 + idx).sample([i for i in range(n) if i != idx], k)
            assert ev.fewshot_indices(idx, n, k) == expected


def test_sequences_are_bos_prompt_and_continuation_span(tasks):
    task = tasks["mc_task"]
    items, _ = ev.load_items(task, -1)
    order = list(range(len(MC)))
    random.Random(1337).shuffle(order)
    assert items == [MC[i] for i in order]  # the nanochat shuffle
    for idx in range(len(items)):
        examples = [items[j] for j in ev.fewshot_indices(idx, len(items), 1)]
        fulls, prefix = ev.render(task, items[idx], examples)
        seqs = ev.task_sequences(TOK, task, items, idx, 256)
        assert seqs == [([0] + TOK.encode(f), 1 + len(prefix)) for f in fulls]
    # schema: the span is the shared suffix " <continuation>"
    task = tasks["schema_task"]
    items, _ = ev.load_items(task, -1)
    for toks, start in ev.task_sequences(TOK, task, items, 0, 256):
        assert TOK.decode(toks[start:]) == " " + items[0]["continuation"]


def test_long_sequences_cropped_from_the_left(tasks):
    task = tasks["mc_task"]
    items, _ = ev.load_items(task, -1)
    full = ev.task_sequences(TOK, task, items, 0, 256)
    for (toks, start), (long, long_start) in zip(ev.task_sequences(TOK, task, items, 0, 20), full):
        crop = len(long) - 21
        assert toks == long[crop:] and start == long_start - crop  # 21 tokens: the model reads 20


def test_spans_with_a_real_bpe_tokenizer(tmp_path, tasks):
    """Byte-level BPE merges the delimiter into the next word ('Ġblue'): the span still holds
    exactly the choice, found from the common prefix of the two tokenizations."""
    tok = bpe_tokenizer(tmp_path)
    for task in tasks.values():
        items, _ = ev.load_items(task, -1)
        seqs = ev.task_sequences(tok, task, items, 0, 256)
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
    mc, schema, lm = tasks["mc_task"], tasks["schema_task"], tasks["lm_task"]
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
    items, n = ev.load_items(task, 2)
    assert n == 2 and len(items) == 3  # few-shot examples still come from all 3
    gold = oracle_for(task, lambda i, item: item["gold"])
    wrong = oracle_for(task, lambda i, item: (item["gold"] + 1) % len(item["choices"]))
    assert ev.evaluate_task(Oracle({1: gold[:1] + wrong[1:]}), TOK, task, [1], 8, max_per_task=2) == {1: 0.5}


# ----------------------------------------------------------------------------- bpb and perplexity


def test_bpb_of_uniform_logits_excludes_zero_byte_tokens():
    e, a, bos = TOK.encode("é")[0], TOK.encode("a")[0], TOK.bos_id
    x = torch.tensor([[a, a, a, a], [a, a, a, a]])
    y = torch.tensor([[a, bos, e, a], [e, e, -1, bos]])  # 5 targets with bytes: 1 + 2 + 1 + 2 + 2
    bpb = ev.evaluate_bpb(uniform(), [(x[:1], y[:1]), (x[1:], y[1:])], TOK.token_bytes(), [1, 3])
    expected = 5 * math.log(V) / (math.log(2) * 8)
    assert bpb == {1: pytest.approx(expected), 3: pytest.approx(expected)}


def test_perplexity_of_uniform_logits_is_vocab_size():
    assert ev.evaluate_ppl(uniform(seq_len=8), TOK, "hello world, " * 5, [1, 2], 3) == {
        1: pytest.approx(V), 2: pytest.approx(V)}


def test_perplexity_window_protocol():
    """Logit 20 on 'a' only: each target 'a' costs l_a, any other l_o. The expected mean follows
    the protocol: [BOS] + text, windows of seq_len + 1 = 9 tokens, targets = all but the first."""
    text = "ab" * 15  # 31 tokens with BOS: windows of 9, 9, 9, 4 -> 27 targets
    a = TOK.encode("a")[0]
    model = Oracle({1: [[]]}, seq_len=8)
    model.loop_states = lambda idx, loops: [torch.zeros(*idx.shape, V).index_fill_(-1, torch.tensor([a]), 20.0)]
    l_a, l_o = math.log(math.exp(20) + V - 1) - 20, math.log(math.exp(20) + V - 1)
    ids = [0] + TOK.encode(text)
    targets = [t for i in range(0, len(ids), 9) for t in ids[i + 1:i + 9]]
    assert len(targets) == 27
    expected = math.exp(sum(l_a if t == a else l_o for t in targets) / len(targets))
    assert ev.evaluate_ppl(model, TOK, text, [1], 2)[1] == pytest.approx(expected, rel=1e-5)


def test_load_text_parquet_rows_joined_and_raw_text(tmp_path):
    pq.write_table(pa.table({"text": ["", " = Title = \n", "", " Body line .\n"]}), tmp_path / "w.parquet")
    assert ev.load_text(str(tmp_path / "w.parquet")) == " = Title = \n Body line .\n"
    (tmp_path / "w.txt").write_text("raw\ntext\n")
    assert ev.load_text(str(tmp_path / "w.txt")) == "raw\ntext\n"
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match="no 'text' column"):
        ev.load_text(str(tmp_path / "bad.parquet"))


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
    swept = ev.evaluate_bpb(model, batches, token_bytes, [1, 2, 3])
    for K in (1, 2, 3):
        nats = sum(F.cross_entropy(model(x, loops=K).flatten(0, 1), y.flatten(), reduction="none")
                   [token_bytes[y.flatten()] > 0].sum() for x, y in batches)
        n_bytes = sum(token_bytes[y].sum() for _, y in batches)
        assert swept[K] == pytest.approx((nats / (math.log(2) * n_bytes)).item(), rel=1e-5)
    seqs = [s for item in item_seqs(tasks["mc_task"], seq_len=32)[1] for s in item]
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
        ev.load_bundle(bundle)


def test_unknown_task_type_and_missing_baseline_are_named(tmp_path):
    bundle = make_bundle(tmp_path / "b", core_yaml=CORE_YAML.replace("icl_task_type: schema", "icl_task_type: essay"))
    with pytest.raises(ValueError, match="schema_task.*'essay'.*multiple_choice"):
        ev.load_bundle(bundle)
    bundle = make_bundle(tmp_path / "c", meta=META_CSV.replace("lm_task", "other"))
    with pytest.raises(ValueError, match="lm_task"):
        ev.load_bundle(bundle)
    bundle = make_bundle(tmp_path / "d", core_yaml=CORE_YAML.replace("  dataset_uri: lm.jsonl\n", ""))
    with pytest.raises(ValueError, match="lacks.*dataset_uri"):
        ev.load_bundle(bundle)
    bundle = make_bundle(tmp_path / "e", meta=META_CSV.replace("Random baseline", "Baseline"))
    with pytest.raises(ValueError, match="Random baseline"):
        ev.load_bundle(bundle)


def test_missing_checkpoint_and_bad_settings(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        ev.main([str(tmp_path / "nope")])
    with pytest.raises(ValueError, match="usage"):
        ev.main(["--loops=3"])
    with pytest.raises(ValueError, match="--modes.*bpb,wiki,core,sample"):
        ev.main([str(tmp_path), "--modes=bpb,ppl"])
    with pytest.raises(ValueError, match="--loops"):
        ev.main([str(tmp_path), "--loops=1,0"])


# ----------------------------------------------------------------------------- download


def test_bundle_download_from_local_server(tmp_path, monkeypatch):
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    src = tmp_path / "src"
    make_bundle(src / "eval_bundle")
    served = tmp_path / "www"
    served.mkdir()
    with zipfile.ZipFile(served / "eval_bundle.zip", "w") as z:
        for path in (src / "eval_bundle").rglob("*"):
            z.write(path, path.relative_to(src))
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(served))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        target = tmp_path / "data" / "eval_bundle"
        url = f"http://127.0.0.1:{server.server_port}/eval_bundle.zip"
        assert ev.fetch_bundle(str(target), url) == str(target)
    finally:
        server.shutdown()
        server.server_close()
    assert [t["label"] for t in ev.load_bundle(str(target))] == ["mc_task", "schema_task", "lm_task"]
    leftovers = [n for n in os.listdir(tmp_path / "data") if n != "eval_bundle" and not n.endswith(".lock")]
    assert leftovers == []  # the zip is removed and no temporary directory is left
    assert ev.fetch_bundle(str(target), "http://127.0.0.1:9/unreachable") == str(target)  # present: no download


# ----------------------------------------------------------------------------- table and CLI


def test_table_layout_and_missing_columns():
    results = {3: {"wiki_ppl": 40.4712, "val_bpb": 0.89812, "CORE": 0.1537,
                   "tasks": {label: {"accuracy": a} for label, a in zip(ev.TABLE_TASKS.values(),
                                                                         [0.4, 0.6, 0.3, 0.2, 0.5, 0.25])}},
               9: {"val_bpb": 0.892, "tasks": {"piqa": {"accuracy": 0.7}}}}
    assert ev.table(results) == (
        "| K | Wiki2 ppl | val bpb | CORE | LMB | PIQA | Hella | OPQA | ARC-E | ARC-C | Avg |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|\n"
        "| 3 | 40.47 | 0.898 | 15.37 | 40.00 | 60.00 | 30.00 | 20.00 | 50.00 | 25.00 | 37.50 |\n"
        "| 9 |  | 0.892 |  |  | 70.00 |  |  |  |  |  |\n")


def test_cli_end_to_end(tmp_path):
    """A saved checkpoint (real BPE tokenizer) through every mode: the JSON and markdown agree
    with the functions called directly."""
    tok = bpe_tokenizer(tmp_path)
    model = randomize_(tiny_gpt(seq_len=64, loops=2, vocab_size=tok.vocab_size))
    step = tmp_path / "run" / "step_000010"
    step.mkdir(parents=True)
    torch.save(model_state(model, step=10, settings={"dataset": "embedded"}), step / "model.pt")
    tok.save(str(step / "tokenizer.json"))
    pq.write_table(pa.table({"text": ["Some validation text. " * 30] * 4}), tmp_path / "val.parquet")
    (tmp_path / "wiki.txt").write_text(" = Title = \n The opposite of hot is cold .\n" * 10)
    bundle = make_bundle(tmp_path / "bundle")
    results = ev.main([str(tmp_path / "run"), "--device=cpu", "--loops=2,1", "--batch_size=4", "--bpb_tokens=512",
                       f"--val_files={tmp_path / 'val.parquet'}", f"--wiki_path={tmp_path / 'wiki.txt'}",
                       f"--bundle_dir={bundle}", "--sample_tokens=3", f"--data_dir={tmp_path / 'nodata'}"])
    saved = json.loads((step / "eval.json").read_text())
    assert saved["step"] == 10 and list(saved["results"]) == ["1", "2"]
    ppl = ev.evaluate_ppl(model, tok, (tmp_path / "wiki.txt").read_text(), [1, 2], 4)
    core = ev.evaluate_core(model, tok, ev.load_bundle(bundle), [1, 2], 4, log=lambda *a: None)
    for K in (1, 2):
        r = saved["results"][str(K)]
        assert r["wiki_ppl"] == pytest.approx(ppl[K]) and r["CORE"] == pytest.approx(core[K]["CORE"])
        assert r["val_bpb"] > 0 and len(r["samples"]) == len(ev.SAMPLE_PROMPTS)
        assert r["samples"][0].startswith(ev.SAMPLE_PROMPTS[0])
    assert (step / "eval.md").read_text() == saved["table"] == ev.table(results)
    assert not (tmp_path / "nodata").exists()  # every input was local


# ----------------------------------------------------------------------------- torchrun


def _worker(rank, world, port, bundle, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    model = randomize_(tiny_gpt())
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, V, (2, 32), generator=g), torch.randint(0, V, (2, 32), generator=g)) for _ in range(4)]
    result = {"bpb": ev.evaluate_bpb(model, batches[rank::world], TOK.token_bytes(), [1, 3]),
              "ppl": ev.evaluate_ppl(model, TOK, "hello world, " * 20, [1, 3], 2),
              "core": ev.evaluate_core(model, TOK, ev.load_bundle(bundle), [1, 3], 2, log=lambda *a: None)}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()  # no rank tears gloo down while the other still talks to it
    dist.destroy_process_group()


def test_distributed_shares_match_one_process(tmp_path):
    bundle = make_bundle(tmp_path / "bundle")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(2, port, bundle, str(tmp_path)), nprocs=2)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0 == r1  # every rank holds the all-reduced result
    model = randomize_(tiny_gpt())
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, V, (2, 32), generator=g), torch.randint(0, V, (2, 32), generator=g)) for _ in range(4)]
    bpb = ev.evaluate_bpb(model, batches, TOK.token_bytes(), [1, 3])
    ppl = ev.evaluate_ppl(model, TOK, "hello world, " * 20, [1, 3], 2)
    core = ev.evaluate_core(model, TOK, ev.load_bundle(bundle), [1, 3], 2, log=lambda *a: None)
    for K in (1, 3):
        assert r0["bpb"][str(K)] == pytest.approx(bpb[K], rel=1e-5)
        assert r0["ppl"][str(K)] == pytest.approx(ppl[K], rel=1e-5)
        assert r0["core"][str(K)]["CORE"] == pytest.approx(core[K]["CORE"])
