"""The synthetic reasoning tasks (flt/tasks.py) and their accuracy (tasks.accuracy):
every answer recomputed by the plain solver, the held-out split, the seeded stream across ranks and
resumes, the one-pass K sweep against separate passes, the accuracy against a hand count, and
train.py -> eval.py end to end."""
import itertools
import json
import os
import re

import numpy as np
import pytest
import torch

import eval as evaluation
from conftest import config_for_depth
from flt import checkpoint, planning, tasks
from model import GPT, VARIANTS
from test_train import python

SIZES = [("s3", 12, 32), ("s5", 5, 16), ("chains", 3, 40), ("chains", 1, 9)]


def task_of(name, difficulty, seq_len):
    return tasks.Task(name, difficulty, seq_len)


def text_of(task, tokens):
    """The symbols after bos, as the tokenizer writes them."""
    return tasks.tokenizer(task).decode(tokens[1:])


@pytest.mark.parametrize("name,difficulty,seq_len", SIZES)
def test_the_plain_solver_recomputes_every_answer_and_difficulty(name, difficulty, seq_len):
    task = task_of(name, difficulty, seq_len)
    tok = tasks.tokenizer(task)
    items = [task.train_item(7, i) for i in range(150)] + task.test_items(50)
    for tokens, targets, levels in items:
        assert len(tokens) == task.item_len and tokens[0] == tok.bos_id
        assert tok.encode(text_of(task, tokens)) == tokens[1:]
        assert tasks.solve(task, text_of(task, tokens)) == (targets, levels)
    # every difficulty occurs, each answer's level within the knob
    seen = {d for _, _, levels in items for d in levels if d >= 0}
    assert seen == set(task.levels)


def test_the_group_products_follow_the_group_law():
    """s3's running product g_1 g_2 ... g_n by the definition (p q)(k) = p(q(k)), each point's image
    followed through the permutations, independent of the generator's table and the solver's."""
    task = task_of("s3", 6, 8)
    for i in range(20):
        tokens, targets, _ = task.train_item(3, i)
        perms = [task.perms[t - 1] for t in tokens[1:]]
        for n in range(1, len(perms) + 1):
            image = []
            for k in range(3):
                # g_1 g_2 ... g_n applied to k: g_n first
                for p in reversed(perms[:n]):
                    k = p[k]
                image.append(k)
            assert task.perms[targets[n] - 1] == tuple(image)


def test_chains_assign_each_variable_once_and_before_it_is_read():
    task = task_of("chains", 4, 64)
    assert task.chains == 6
    for i in range(50):
        text = text_of(task, task.train_item(0, i)[0])
        assigned = set()
        for lhs, rhs in zip(text[::2], text[1::2]):
            assert lhs not in assigned and lhs not in tasks.DIGITS
            assert rhs in tasks.DIGITS or rhs in assigned
            assigned.add(lhs)


def test_test_items_never_occur_in_training():
    task = task_of("s3", 4, 16)
    # 6^4 = 1296 possible items: the streams cover the space, and still never meet
    train = {tuple(task.train_item(seed, i)[0]) for seed in (0, 1) for i in range(3000)}
    # drawn with replacement: a small space repeats its test items
    test = {tuple(item[0]) for item in task.test_items(300)}
    assert len(train) > 1000 and len(test) > 100 and len(train) + len(test) <= 6**4
    assert not train & test
    assert all(task.is_test(list(t)) for t in test)


def test_the_test_set_is_fixed_by_the_task_alone():
    a, b = task_of("chains", 3, 40), task_of("chains", 3, 40)
    assert a.test_items(20) == b.test_items(20)
    batches = a.batches(20 * a.item_len, 4)
    x = torch.cat([b_[0] for b_ in batches])
    assert x.shape == (20, 40)


def stream(task, seed, world, steps, B=3, state=None):
    """Each rank's batches, rank by rank, and the loaders' states after them."""
    loaders = [task.loader(B, r, world, "cpu", seed, state) for r in range(world)]
    batches = [[next(loader) for _ in range(steps)] for loader in loaders]
    return batches, [loader.state_dict() for loader in loaders]


def test_the_stream_is_the_same_on_any_number_of_ranks_and_after_a_resume():
    task = task_of("s3", 8, 20)
    (one,), _ = stream(task, 5, 1, 4)
    two, states = stream(task, 5, 2, 2)
    # one rank's 4 batches are the two ranks' 2 batches, interleaved step by step
    interleaved = [two[r][s] for s in range(2) for r in range(2)]
    for (x1, y1), (x2, y2) in zip(one, interleaved):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert states[0]["next_item"] == states[1]["next_item"] == 4 * 3 * task.per_row
    # resumed on one rank from the two ranks' states: the next batches of the one-rank stream
    (longer,), _ = stream(task, 5, 1, 6)
    (resumed,), _ = stream(task, 5, 1, 2, state=states)
    for (x1, _), (x2, _) in zip(longer[4:], resumed):
        assert torch.equal(x1, x2)
    (other,), _ = stream(task, 6, 1, 1)
    assert not torch.equal(other[0][0], one[0][0])


def test_rows_pack_whole_items_and_score_only_answers():
    task = task_of("s3", 4, 16)
    items = task.test_items(7)
    x, y, d = task.rows(items)
    assert task.per_row == 3 and x.shape == (3, 16)
    assert torch.equal(x[0, :5], torch.tensor(items[0][0]))
    assert torch.equal(y[1, 5:10], torch.tensor(items[4][1]))
    # bos and padding carry no loss; every element of an item carries one
    assert (y[:, 0] == -1).all() and (y[:, 15] == -1).all() and (y[2, 5:] == -1).all()
    assert int((y >= 0).sum()) == 7 * 4 and torch.equal(y >= 0, d >= 0)


def tiny_model(task, variant="FLT", loops=2):
    torch.manual_seed(0)
    vocab = tasks.tokenizer(task).vocab_size
    config = config_for_depth(1, sequence_len=task.T, vocab_size=vocab, loops=loops,
                              variant=variant)
    model = GPT(config).double()
    model.init_weights()
    # the default init's zero output projections make every K alike: give the blocks weights
    for p in model.transformer.parameters():
        p.data.normal_(0, 0.3)
    return model.double().eval()


@pytest.mark.parametrize("name, two_byte", [("s3", 0), ("s5", 120 - 84), ("chains", 0)])
def test_both_byte_tables_count_each_symbols_utf8_bytes(name, two_byte):
    """val_bpb and val_bpb_utf8 of a task: its symbols are characters, not byte-level BPE tokens, so
    each counts the bytes of its UTF-8 encoding (S5's past the 84th one-byte character: 2); bos 0."""
    task = tasks.Task(name, 4, 64)
    want = [0] + [len(symbol.encode("utf-8")) for symbol in task.symbols]
    for count in evaluation.BYTE_COUNTS:
        assert tasks.tokenizer(task).token_bytes(count).tolist() == want, count
    assert want.count(2) == two_byte


def test_accuracy_equals_a_hand_count():
    task = task_of("chains", 2, 20)
    model = tiny_model(task)
    batches = task.batches(13 * task.item_len, 5)
    results, answers = tasks.accuracy(model, batches, task.levels, [1, 3])
    for K in (1, 3):
        right, count = {d: 0 for d in task.levels}, {d: 0 for d in task.levels}
        for x, y, d in batches:
            with torch.no_grad():
                pred = model(x, loops=K).argmax(-1)
            for b, t in itertools.product(range(x.shape[0]), range(x.shape[1])):
                if y[b, t] >= 0:
                    count[int(d[b, t])] += 1
                    right[int(d[b, t])] += int(pred[b, t] == y[b, t])
        assert answers == {str(d): n for d, n in count.items()} and sum(count.values()) == 13 * 3 * 3
        by_level = {str(level): right[level] / count[level] for level in task.levels}
        assert results[K]["task_acc_by_difficulty"] == by_level
        overall = sum(right.values()) / sum(count.values())
        assert results[K]["task_acc"] == pytest.approx(overall, abs=1e-15)
    assert results[1] != results[3]


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_one_pass_K_sweep_equals_separate_passes(variant):
    task = task_of("s3", 6, 14)
    model = tiny_model(task, variant, loops=3)
    batches = task.batches(40 * task.item_len, 8)
    swept, _ = tasks.accuracy(model, batches, task.levels, [1, 2, 3, 6, 12])
    for K in (1, 2, 3, 6, 12):
        alone, _ = tasks.accuracy(model, batches, task.levels, [K])
        assert alone[K] == swept[K]


SETTINGS = dict(dataset="chains", task_difficulty=4, sequence_len=64, tokenizer="bpe",
                bpe_vocab_size=4096, bos_token="<|endoftext|>", sample_tokens=0)
DEFAULTS = SETTINGS | dict(dataset="embedded", task_difficulty=8, sample_tokens=64)


@pytest.mark.parametrize("change,words", [
    (dict(task_difficulty=40), "task_difficulty=40: a chains item of difficulty 40 needs 83 "
                               "tokens, more than sequence_len=64"),
    (dict(dataset="s3", task_difficulty=64), "needs 65 tokens, more than sequence_len=64"),
    (dict(task_difficulty=0), "task_difficulty=0: expected a positive integer"),
    # too few distinct items to hold one in TEST_BUCKET out (s3 at 2: none fell in the bucket)
    (dict(dataset="s3", task_difficulty=3), "task_difficulty=3: s3 has 216 distinct items of difficulty 3, "
                                            "too few to hold one in 8 out as a test set; use task_difficulty >= 4"),
    (dict(dataset="s5", task_difficulty=1), "s5 has 120 distinct items of difficulty 1, too few"),
    (dict(sample_tokens=64), "sample_tokens=64: dataset='chains' has no text to continue"),
    (dict(tokenizer="gpt2"), "tokenizer='gpt2' does nothing with dataset='chains'"),
    (dict(dataset="embedded", task_difficulty=3), "task_difficulty=3 does nothing unless"),
])
def test_bad_task_settings_name_the_setting(change, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        tasks.check_settings(SETTINGS | change, DEFAULTS)


def test_the_smallest_group_task_allowed_holds_out_a_test_set():
    """s3 at difficulty 4, the least allowed: of its 6^4 items, counted one by one, about one in
    TEST_BUCKET is held out, and the test stream finds as many as asked (repeats allowed)."""
    task = task_of("s3", 4, 16)
    every = [[0, *(1 + g for g in gs)] for gs in itertools.product(range(6), repeat=4)]
    held_out = sum(task.is_test(tokens) for tokens in every)
    assert len(every) / tasks.TEST_BUCKET / 2 < held_out < 2 * len(every) / tasks.TEST_BUCKET
    assert len(task.test_items(3 * held_out)) == 3 * held_out


def test_train_and_eval_a_task_end_to_end(tmp_path):
    """train.py on chains, then eval.py's tasks mode: accuracy by difficulty at K past training,
    merged into eval.json; an unknown task and a model of text get one line each."""
    out = tmp_path / "run"
    args = ["--device=cpu", "--dataset=chains", "--task_difficulty=2", "--sequence_len=20",
            "--depth=1", "--loops=2", "--device_batch_size=8", "--total_batch_size=160",
            "--num_steps=4", "--eval_interval=2", "--eval_tokens=400", "--final_eval_tokens=400",
            "--sample_tokens=0", f"--out_dir={out}"]
    p = python("train.py", *args)
    assert p.returncode == 0, p.stderr
    # the task's score, as training reports it: the share of the first 400 // item_len held-out
    # items' answers whose argmax, at the trained K, is right; counted here from model(x)'s logits
    model = checkpoint.load_model(str(out / "step_000004"), log=lambda *a: None)[0]
    task = task_of("chains", 2, 20)
    x, y, _ = task.rows(task.test_items(400 // task.item_len))
    with torch.no_grad():
        right = (model(x).argmax(-1) == y)[y >= 0]
    final = [json.loads(line) for line in open(out / "log.jsonl")][-1]
    assert final["final_val_acc"] == pytest.approx(right.double().mean().item(), abs=1e-12)
    assert f"final val bpb ({final['final_val_tokens']:,} tokens): {final['final_val_bpb']:.4f} | " \
           f"accuracy {final['final_val_acc']:.4f}\n" in p.stdout
    p = python("eval.py", str(out), "--modes=tasks", "--loops=1,2,4,8", "--task_items=30",
               "--device=cpu")
    assert p.returncode == 0, p.stderr
    assert "30 held-out chains items (30 distinct) of difficulty 2" in p.stdout
    with open(out / "step_000004" / "eval.json") as f:
        saved = json.load(f)["results"]
    assert set(saved) >= {"1", "2", "4", "8"}
    # task_items off its default: kept apart, labelled
    for K in ("1", "8"):
        by_level = saved[K]["task_acc_by_difficulty[task_items=30]"]
        assert set(by_level) == {"0", "1", "2"}
        assert all(0 <= a <= 1 for a in by_level.values())
    p = python("train.py", *args[:-1], "--dataset=s4", f"--out_dir={tmp_path / 'bad'}")
    assert p.returncode != 0 and p.stderr.strip().count("\n") == 0
    assert "dataset='s4'" in p.stderr and not os.path.exists(tmp_path / "bad")


def test_dry_run_plans_a_task_without_building_anything(tmp_path):
    s = dict(SETTINGS, dry_run=True)
    assert planning.planned_vocab(s) == 1 + 10 + 2 * 6 * 5
    assert planning.out_dir_of(dict(out_dir="", out_root="out", depth=2, variant="LT_i", loops=4,
                                 n_kv_head=-1, attn="full", window_pattern="L",
                                 loops_sampler="fixed", dataset="s3")) == "out/d2_lt_i_k4_s3"
    assert np.isfinite(task_of("s5", 3, 8).table).all()
