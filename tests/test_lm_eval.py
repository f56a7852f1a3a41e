"""lm_eval_flt.py: the lm-evaluation-harness adapter, on a tiny checkpoint that train.py writes.

Every score is compared with an independent computation: one unpadded `model(tokens, loops=K)`
forward per request (or per rolling window, written out by hand), and greedy decoding as a plain
argmax loop over full forwards, without the KV cache. The harness itself runs offline on the task
YAMLs of tests/lm_eval_tasks (local JSONL files), in-process and through the command line.

A 4-step checkpoint's blocks are still near the identity (c_proj starts at zero), so its loops give
the same logits at every K; the tests that must tell K apart use a copy with every weight redrawn.
"""
import ast
import glob
import json
import math
import os
import re
import shutil

import pytest

# the harness reads local JSONL files only: never a hub lookup (set before `datasets` is imported)
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
lm_eval = pytest.importorskip("lm_eval")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from conftest import run_module  # noqa: E402
from flt import checkpoint  # noqa: E402
import eval as evaluation  # noqa: E402
from scripts import lm_eval_flt  # noqa: E402
from test_eval import one_thread, randomize_  # noqa: E402, F401 (one_thread: test_eval's autouse fixture)
from test_train import python  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASKS = os.path.join(ROOT, "tests", "lm_eval_tasks")
LOOPS = [1, 2, 4]
EXIT = 2e-4  # nats: on the redrawn weights some positions exit at loop 3, the others run all 4
LONG = ("If the optional argument is given, the function returns a new list of the items in the order "
        "they were added, and raises an exception when the iterator is exhausted before the end.")


def quiet(*args, **kwargs):
    pass


@pytest.fixture(scope="module")
def run(tiny_run):
    """A run directory of train.py: depth 1, sequence_len 32, K=3, a 512-id BPE, 4 steps (conftest.py: TINY_RUN)."""
    return tiny_run


@pytest.fixture(scope="module")
def redrawn(run, tmp_path_factory):
    """run's checkpoint (config, settings, tokenizer) with every weight redrawn, saved by checkpoint.save."""
    model, meta = checkpoint.load_model(run, log=quiet)
    out = str(tmp_path_factory.mktemp("redrawn"))
    checkpoint.save(out, meta["step"], randomize_(model), {}, settings=meta["settings"], files={
        "tokenizer.json": lambda path: shutil.copy(os.path.join(meta["path"], "tokenizer.json"), path)})
    return out


def adapter(path, loops=LOOPS, device="cpu", **kwargs):
    return lm_eval_flt.load(path, loops, device, log=quiet, **kwargs)[0]


def requests(kind, *args):
    return [Instance(kind, {}, a if isinstance(a, tuple) else (a,), i) for i, a in enumerate(args)]


# ----------------------------------------------------------------------------- the independent computations
@torch.no_grad()
def forward_score(lm, tokens, n, K, exit_threshold=None):
    """(log p(tokens[-n:] | the tokens before), whether each is the argmax): one unpadded forward at K."""
    with lm.numerics:
        logits = lm.model(torch.tensor([tokens[:-1]]), loops=K, exit_threshold=exit_threshold)[0, -n:]
    target = torch.tensor(tokens[-n:])
    return F.log_softmax(logits, -1)[torch.arange(n), target].sum().item(), bool((logits.argmax(-1) == target).all())


def pair_tokens(lm, context, continuation):
    """The harness's tokenization of a request after BOS: (context + continuation) split at the context's
    tokens; an empty context is BOS alone. The last sequence_len + 1 tokens, and the continuation's length."""
    bos, enc = lm.tok.bos_id, lm.tok.encode
    ctx = [bos] + enc(context) if context else [bos]
    cont = ([bos] + enc(context + continuation))[len(ctx):] if context else enc(continuation)
    return (ctx + cont)[-33:], len(cont)


def rolling_score(lm, text, K):
    """log p(text) as the harness's rolling windows score it with a 32-token context, written out
    for the two lengths used here: one window (N <= 32 tokens) or three (64 < N <= 96)."""
    t, bos = lm.tok.encode(text), lm.tok.bos_id
    if len(t) <= 32:
        return forward_score(lm, [bos] + t, len(t), K)[0]
    assert 64 < len(t) <= 96, len(t)
    # [BOS] + t[:31] predicts t[:32]; t[31:63] predicts t[32:64]; the last 32 tokens before the end predict t[64:]
    windows = [([bos] + t[:32], 32), (t[31:64], 32), (t[len(t) - 33:], len(t) - 64)]
    return sum(forward_score(lm, tokens, n, K)[0] for tokens, n in windows)


@torch.no_grad()
def greedy(lm, context, until, max_gen_toks, K, exit_threshold=None):
    """Greedy decoding by full forwards (no KV cache): BOS + context cut to its last 32 - max_gen_toks
    tokens, an argmax a step until a stop string, BOS or max_gen_toks; cut before the first stop string."""
    bos = lm.tok.bos_id
    ids, new = ([bos] + lm.tok.encode(context))[-(32 - max_gen_toks):], []
    while len(new) < max_gen_toks and not any(u in lm.tok.decode(new) for u in until) and bos not in new:
        with lm.numerics:
            logits = lm.model(torch.tensor([ids + new]), loops=K, exit_threshold=exit_threshold)
        new.append(logits[0, -1].argmax().item())
    text = lm.tok.decode(new)
    for stop in until + [lm.tok.decode([bos])]:
        text = text.split(stop)[0]
    return text


# ----------------------------------------------------------------------------- scores
def test_loglikelihood_equals_a_forward_at_each_K(redrawn):
    lm = adapter(redrawn)
    pairs = [("The function returns", " a list of values."), ("", "Return a copy of the list."),
             (LONG, " None.")]  # the last is longer than the 32-token context: its oldest tokens go
    assert len(pair_tokens(lm, *pairs[2])[0]) == 33 < len(lm.tok.encode(LONG))
    for K in reversed(LOOPS):
        # and the model's own greedy next token at K, whose is_greedy is True
        [greedy_text] = lm.at(K).generate_until(requests("generate_until", ("The function", {"max_gen_toks": 1})))
        asked = pairs + [("The function", greedy_text)]
        got = lm.loglikelihood(requests("loglikelihood", *asked), disable_tqdm=True)
        for (ll, is_greedy), pair in zip(got, asked):
            want_ll, want_greedy = forward_score(lm, *pair_tokens(lm, *pair), K)
            assert ll == pytest.approx(want_ll, rel=1e-5, abs=1e-4) and is_greedy == want_greedy, (K, pair)
        assert got[-1][1] and pair_tokens(lm, *asked[-1])[1] == 1
    # and as eval.py's scoring gives them: the mean loss of the span times its length
    tokens, n = pair_tokens(lm, *pairs[0])
    mean, _ = evaluation.score_sequences(lm.model, [(tokens, len(tokens) - n)], [2], batch_size=1)[2]
    [(ll, _)] = lm.at(2).loglikelihood(requests("loglikelihood", pairs[0]))
    assert ll == pytest.approx(-mean.item() * n, rel=1e-6)


def test_loglikelihood_rolling_sums_the_windows(redrawn):
    lm = adapter(redrawn)
    docs = ["Return a copy of the list.", LONG]
    assert len(lm.tok.encode(docs[0])) <= 32 < 64 < len(lm.tok.encode(docs[1]))
    for K in reversed(LOOPS):
        got = lm.at(K).loglikelihood_rolling(requests("loglikelihood_rolling", *docs))
        assert got == pytest.approx([rolling_score(lm, d, K) for d in docs], rel=1e-5)
    # one window: the document's summed NLL after BOS, as loop_losses gives it at every K
    ids = [lm.tok.bos_id] + lm.tok.encode(docs[0])
    with lm.numerics:
        losses = evaluation.loop_losses(lm.model, torch.tensor([ids[:-1]]), torch.tensor([ids[1:]]), LOOPS)
    assert [lm.at(K).loglikelihood_rolling(requests("loglikelihood_rolling", docs[0]))[0] for K in LOOPS] == \
        pytest.approx([-losses[K][0].sum().item() for K in LOOPS], rel=1e-5)


@pytest.mark.parametrize("exit_threshold", [None, EXIT])
def test_one_pass_scores_every_K_as_a_fresh_pass_at_that_K(redrawn, exit_threshold, monkeypatch):
    pairs = [("The function returns", " a list."), ("The function returns", " None."), ("", "Import the module.")]
    docs = ["Return a copy of the list.", LONG]
    swept, forwards = adapter(redrawn, exit_threshold=exit_threshold), []
    # every forward of a sweep, the plain loop's or the exit rule's, is one loop_losses call at max K
    loop_losses = evaluation.loop_losses
    monkeypatch.setattr(evaluation, "loop_losses", lambda model, idx, targets, loops_list, *rest: (
        forwards.append(max(loops_list)) or loop_losses(model, idx, targets, loops_list, *rest)))
    scores = {}
    for K in reversed(LOOPS):
        scores[K] = (swept.at(K).loglikelihood(requests("loglikelihood", *pairs)),
                     swept.loglikelihood_rolling(requests("loglikelihood_rolling", *docs)))
        if K < max(LOOPS):
            assert forwards == [max(LOOPS)] * 2, "a smaller K ran a forward: its scores were not kept"
    for K in LOOPS:
        fresh = adapter(redrawn, loops=[K], exit_threshold=exit_threshold)
        (ll, rolling), fresh_ll = scores[K], fresh.loglikelihood(requests("loglikelihood", *pairs))
        assert [g for _, g in ll] == [g for _, g in fresh_ll]
        assert [v for v, _ in ll] == pytest.approx([v for v, _ in fresh_ll], rel=1e-6)
        assert rolling == pytest.approx(fresh.loglikelihood_rolling(requests("loglikelihood_rolling", *docs)),
                                        rel=1e-6)
    assert scores[1][1] != pytest.approx(scores[4][1], rel=1e-4)  # the budgets differ: K was not ignored
    if exit_threshold is not None:  # the rule changed the deepest scores: some positions exited early
        without = adapter(redrawn, loops=[4]).loglikelihood_rolling(requests("loglikelihood_rolling", *docs))
        assert scores[4][1] != pytest.approx(without, rel=1e-6)


@pytest.mark.parametrize("exit_threshold", [None, EXIT])
def test_greedy_generation_equals_an_uncached_argmax_loop(redrawn, exit_threshold):
    lm = adapter(redrawn, exit_threshold=exit_threshold).at(2)
    asks = [("The function returns", {"until": ["."], "max_gen_toks": 10}),
            ("If the argument is", {"until": ["\n", "e"], "max_gen_toks": 6}),
            ("Import the", {"until": "x", "max_gen_toks": 10, "do_sample": False}),  # 5 tokens, as the second
            (LONG, {"until": ["."], "max_gen_toks": 12})]  # cut on the left to 32 - 12 tokens
    got = lm.generate_until(requests("generate_until", *asks))
    want = [greedy(lm, ctx, [kw["until"]] if isinstance(kw["until"], str) else kw["until"], kw["max_gen_toks"], 2,
                   exit_threshold) for ctx, kw in asks]
    assert got == want and any(got)
    assert len(lm.tok_encode(asks[0][0])) != len(lm.tok_encode(asks[2][0]))  # one batch (max_gen_toks 10), padded


def test_generation_decodes_with_the_cache_slots_asked_for(redrawn, monkeypatch):
    """cache_slots (the loop slots per layer of flt/decoding.py: KVCache) reaches model.generate and the model's info."""
    lm, seen = adapter(redrawn, loops=[2, 4], cache_slots=1).at(4), []
    generate = lm.model.generate
    monkeypatch.setattr(lm.model, "generate", lambda *args, **kw: seen.append(kw["cache_slots"]) or generate(*args, **kw))
    lm.generate_until(requests("generate_until", ("The function returns", {"until": ["."], "max_gen_toks": 4})))
    assert seen == [1] and lm.get_model_info()["cache_slots"] == 1


# ----------------------------------------------------------------------------- the harness, offline
def test_harness_runs_the_offline_tasks_at_each_K(redrawn, monkeypatch):
    monkeypatch.chdir(ROOT)  # the task YAMLs' data_files are relative to the repository root
    lm, manager = adapter(redrawn), TaskManager(include_path=TASKS, include_defaults=False)
    results = {K: lm_eval.simple_evaluate(model=lm.at(K), tasks=["flt_mc", "flt_gen", "flt_ppl"], task_manager=manager,
                                          log_samples=False)["results"] for K in reversed(LOOPS)}
    rows = {name: [json.loads(line) for line in open(os.path.join(TASKS, f"{name}.jsonl"))]
            for name in ("flt_mc", "flt_gen", "flt_ppl")}
    for K in LOOPS:
        chosen = [max(range(len(r["choices"])),
                      key=lambda c: forward_score(lm, *pair_tokens(lm, r["query"], " " + r["choices"][c]), K)[0])
                  for r in rows["flt_mc"]]
        assert results[K]["flt_mc"]["acc,none"] == pytest.approx(
            sum(c == r["gold"] for c, r in zip(chosen, rows["flt_mc"])) / len(chosen))
        texts = [greedy(lm, r["question"], ["."], 6, K) for r in rows["flt_gen"]]
        assert results[K]["flt_gen"]["exact_match,none"] == pytest.approx(
            sum(t == " " + r["answer"] for t, r in zip(texts, rows["flt_gen"])) / len(texts))
        nll = -sum(rolling_score(lm, r["text"], K) for r in rows["flt_ppl"])
        words = sum(len(re.split(r"\s+", r["text"])) for r in rows["flt_ppl"])
        assert results[K]["flt_ppl"]["word_perplexity,none"] == pytest.approx(math.exp(nll / words), rel=1e-5)
    perplexity = {K: results[K]["flt_ppl"]["word_perplexity,none"] for K in LOOPS}
    assert perplexity[1] != pytest.approx(perplexity[4])  # the columns are the budgets


def test_command_prints_one_table_and_writes_one_json(run, tmp_path, monkeypatch):
    out = tmp_path / "results.json"
    args = ["--run", run, "--tasks", "flt_mc,flt_gen,flt_ppl", "--loops", "3,1", "--batch_size", "4", "--device", "cpu",
            "--include_path", TASKS, "--limit", "4", "--gen_kwargs", "max_gen_toks=2", "--output_path", str(out)]
    # the command's task manager, as it asks for it, without the index of the harness's own thousands of
    # tasks (none of them is named here; indexing them is most of the command's time on 3 small tasks)
    asked = []
    monkeypatch.setattr("lm_eval.tasks.TaskManager", lambda **kwargs: asked.append(kwargs) or TaskManager(
        **kwargs, include_defaults=False))
    status, stdout, stderr = run_module("scripts.lm_eval_flt", *args)  # `python -m scripts.lm_eval_flt`, in this process
    assert status == 0, stdout + stderr
    assert asked == [{"include_path": TASKS}]
    record = json.loads(out.read_text())
    assert list(record["results"]) == ["1", "3"] and record["checkpoint"].endswith("step_000004")
    # K=3 ran first and scored both budgets; the run at K=1 found every sequence scored
    assert re.search(r"K=3: scoring \d+ sequences at every K in \[1, 3\], in forwards at K=3", stdout)
    assert "K=1: scoring" not in stdout and "every one scored by an earlier pass" in stdout
    table = stdout[stdout.index("| task | metric | K=1 | K=3 |"):].splitlines()
    assert table[-1] == f"written to {out}" and table[1] == "| --- | --- | --- | --- |"
    rows = [line.strip("| ").split(" | ") for line in table[2:-1]]
    metrics = {"flt_mc": ("acc", "acc_norm"), "flt_gen": ("exact_match",),
               "flt_ppl": ("word_perplexity", "byte_perplexity", "bits_per_byte")}
    assert [(task, metric) for task, metric, *_ in rows] == [(t, m) for t, ms in metrics.items() for m in ms]
    for task, metric, *cells in rows:  # each cell is that K's number in the JSON
        assert cells == [f"{record['results'][K][task]['results'][f'{metric},none']:.4f}" for K in ("1", "3")]
    # by (K, task), each task's entry of the harness's sections; the rest under the run, per K
    [measured] = [r["measured"] for r in record["runs"].values()]
    for K in ("1", "3"):
        assert record["results"][K]["flt_mc"]["n-samples"]["effective"] == 4  # --limit
        assert record["results"][K]["flt_gen"]["configs"]["generation_kwargs"]["max_gen_toks"] == 2  # --gen_kwargs
        assert measured[K]["config"]["K"] == int(K) and measured[K]["seconds"] > 0


# ----------------------------------------------------------------------------- errors
@pytest.mark.parametrize("args, error, message", [
    (["--run", "no/such/run"], FileNotFoundError, "--run='no/such/run': no such directory"),
    (["--run", ".", "--loops", "1,0"], ValueError, "--loops='1,0': expected comma-separated integers >= 1"),
    (["--run", ".", "--loops", "2,a"], ValueError, "--loops='2,a': expected comma-separated integers >= 1"),
    (["--run", ".", "--batch_size", "0"], ValueError, "--batch_size=0: expected a positive integer"),
    (["--run", ".", "--include_path", "no/such/dir"], FileNotFoundError, "--include_path='no/such/dir': no such dir"),
    # generate_until's cache at every K: at most the smallest (flt/decoding.py: check_cache_slots)
    (["--run", ".", "--loops", "4,2", "--cache_slots", "3"], ValueError, "--cache_slots=3: expected an integer"),
])
def test_a_bad_argument_is_named(args, error, message):
    with pytest.raises(error, match=re.escape(message)):
        lm_eval_flt.parse(["--tasks", "flt_mc", *args])


def test_unknown_task_is_named_with_close_names():
    manager = TaskManager(include_path=TASKS, include_defaults=False)
    assert lm_eval_flt.task_names("flt_mc, flt_ppl", manager) == ["flt_mc", "flt_ppl"]
    with pytest.raises(ValueError, match=r"--tasks: unknown task 'flt_mcc' \(did you mean flt_mc"):
        lm_eval_flt.task_names("flt_ppl,flt_mcc", manager)


def test_generation_settings_for_tasks_that_only_score_are_refused(monkeypatch):
    """--cache_slots and --gen_kwargs are read by generate_until tasks only: with tasks that score
    loglikelihoods alone, each is refused by name before the model loads."""
    manager = TaskManager(include_path=TASKS, include_defaults=False)
    assert lm_eval_flt.generation_tasks(["flt_mc", "flt_ppl"], manager) == []
    assert lm_eval_flt.generation_tasks(["flt_mc", "flt_gen"], manager) == ["flt_gen"]

    def no_load(*args, **kwargs):
        raise AssertionError("the model loaded")
    monkeypatch.setattr(lm_eval_flt, "TaskManager", lambda include_path: manager)
    monkeypatch.setattr(lm_eval_flt, "load", no_load)
    for flag, value in (("--cache_slots", "1"), ("--gen_kwargs", "max_gen_toks=2")):
        shown = value if flag == "--cache_slots" else repr(value)
        with pytest.raises(ValueError, match=re.escape(f"{flag}={shown} does nothing for --tasks=flt_mc,flt_ppl: "
                                                       "only generate_until tasks read it")):
            lm_eval_flt.main(["--run", ".", "--tasks", "flt_mc,flt_ppl", "--loops", "1", flag, value])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error of a machine without CUDA")
def test_device_error_is_eval_pys(run):
    with pytest.raises(ValueError) as ours:
        adapter(run, device="cuda")
    with pytest.raises(ValueError) as theirs:
        evaluation.main([run, "--device=cuda", "--modes=bpb"])
    assert str(ours.value) == str(theirs.value) and "no CUDA device" in str(ours.value)


def test_bad_model_arguments_are_named(run):
    with pytest.raises(ValueError, match=r"loops=\[0, 2\]: expected a list of integers >= 1"):
        adapter(run, loops=[0, 2])
    with pytest.raises(ValueError, match=r"exit_threshold=-0.1: expected a KL threshold >= 0"):
        adapter(run, exit_threshold=-0.1)
    # at most the smallest K of loops (flt/decoding.py: check_cache_slots)
    with pytest.raises(ValueError, match=r"^cache_slots=2: expected an integer .*\b1\b"):
        adapter(run, cache_slots=2)
    lm = adapter(run)
    with pytest.raises(ValueError, match=r"K=3: not one of loops=\[1, 2, 4\]"):
        lm.at(3)
    with pytest.raises(ValueError, match="max_gen_toks=32: expected 1 to 31"):
        lm.generate_until(requests("generate_until", ("The", {"until": ["."], "max_gen_toks": 32})))
    with pytest.raises(ValueError, match="this model decodes greedily only"):
        lm.generate_until(requests("generate_until", ("The", {"until": ["."], "do_sample": True, "temperature": 1})))
    with pytest.raises(ValueError, match="a continuation of 40 tokens: at most 32"):
        lm._scored([(list(range(50)), 40)])


def test_the_default_code_path_never_imports_lm_eval(tmp_path):
    """lm-eval is optional: no module but lm_eval_flt imports it (or lm_eval_flt) at module level."""
    for path in glob.glob(os.path.join(ROOT, "*.py")) + glob.glob(os.path.join(ROOT, "[fs]*", "*.py")):
        if os.path.basename(path) == "lm_eval_flt.py":
            continue
        tree = ast.parse(open(path).read())
        names = [a.name for node in tree.body if isinstance(node, ast.Import) for a in node.names]
        names += [node.module or "" for node in tree.body if isinstance(node, ast.ImportFrom)]
        names += [a.name for node in tree.body if isinstance(node, ast.ImportFrom) for a in node.names]
        assert not [n for n in names if n.split(".")[0] in ("lm_eval", "lm_eval_flt")], path
    # a process of its own (forked from one that has imported train.py's and eval.py's modules, and no more)
    script = tmp_path / "imports.py"
    script.write_text("import sys, eval, data, model\nfrom flt import checkpoint\n"
                      "print(sorted(m for m in sys.modules if m.split('.')[0] in ('lm_eval', 'datasets')))\n")
    p = python(str(script))
    assert p.stdout.strip() == "[]", p.stdout + p.stderr
