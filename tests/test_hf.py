"""scripts/export_hf.py: a run exported as a Hugging Face transformers folder, offline (no test reaches the hub).

Every check compares the folder, loaded by transformers (AutoModelForCausalLM, trust_remote_code), with the
run as the project computes it: the logits of model.py on the checkpoint's weights (every variant; MHA, GQA,
MLA, sliding window; K as saved and K at call time), greedy decoding by a full forward per token, the
project's own generate, each prompt of a left-padded batch alone, lm_eval_flt's loglikelihoods; and, in a
subprocess with transformers alone (outside the repository), logits saved from the run.

One tiny run (conftest.py: tiny_run, depth 1, sequence_len 32, a 512-id BPE, 4 steps) has its weights
redrawn (a 4-step model is still near the identity, the same at every K) and it is exported once, by the
command. The per-variant checks save checkpoints of randomised models with the run's tokenizer.
"""
import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap

import pytest

for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):  # before transformers is imported
    os.environ[key] = "1"
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from conftest import run_module  # noqa: E402
import data  # noqa: E402
from flt import checkpoint  # noqa: E402
from flt.decoding import ExitGate  # noqa: E402
from flt.exit_gate import write_gate  # noqa: E402
from model import VARIANTS, GPTConfig  # noqa: E402
from scripts import export_hf  # noqa: E402
from test_eval import one_thread  # noqa: E402, F401 (test_eval's autouse fixture: one thread)
from test_lm_eval import quiet  # noqa: E402
from test_model import greedy_by_full_forward, make_model, randomize_  # noqa: E402
from test_nothing_lost import tree  # noqa: E402
from test_padded_generate import left_padded  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
         "modeling_flt.py", "configuration_flt.py", "model.py", "decoding.py",
         "run.json"}
TEXTS = ["The function returns", "If the optional argument is given, the list", "Import"]


@pytest.fixture(scope="module")
def run(tiny_run, tmp_path_factory):
    """train.py's tiny run (conftest.py: TINY_RUN), its weights redrawn and saved again with its config, settings
    and tokenizer."""
    model, meta = checkpoint.load_model(tiny_run, log=quiet)
    return save_run(randomize_(model), meta, str(tmp_path_factory.mktemp("hf") / "run"))


def save_run(model, meta, out):
    checkpoint.save(out, meta["step"], model, {}, settings=meta["settings"], files={
        "tokenizer.json": lambda path: shutil.copy(os.path.join(meta["path"], "tokenizer.json"), path)})
    return out


def command(*argv):
    """`python -m scripts.export_hf *argv`, run in this process (runpy): (exit status, stdout, stderr)."""
    return run_module("scripts.export_hf", *argv)


@pytest.fixture(scope="module")
def exported(run, tmp_path_factory):
    """The run exported by the documented command: python -m scripts.export_hf <run> <folder>."""
    out = str(tmp_path_factory.mktemp("export") / "d1_flt")
    status, stdout, stderr = command(run, out)
    assert status == 0 and stdout.endswith(f"to {out}\n"), stdout + stderr
    return out


@pytest.fixture(scope="module")
def loaded(run, exported):
    """(the run's GPT, the folder loaded by transformers, its tokenizer)."""
    return (checkpoint.load_model(run, log=quiet)[0].eval(), hf_model(exported),
            AutoTokenizer.from_pretrained(exported, trust_remote_code=True))


def hf_model(folder):
    return AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()


def prompts(tok, texts=TEXTS):
    return [torch.tensor(tok(text).input_ids) for text in texts]


def cut_at_document_end(tokens, bos):
    """tokens (B, n) as transformers' generate returns them when it stops at the document token (its EOS):
    each row's tokens up to the first document token, the pad id (the same token) after it."""
    out = tokens.clone()
    for row in out:
        ends = (row == bos).nonzero()
        if len(ends):
            row[ends[0, 0] + 1:] = bos
    return out


# ----------------------------------------------------------------------------- the folder
def umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_the_folder_holds_config_weights_tokenizer_and_code(run, exported):
    assert set(os.listdir(exported)) == FILES and not [n for n in os.listdir(os.path.dirname(exported)) if
                                                      n.startswith(".")]  # no temporary folder left
    mode = {name: stat.S_IMODE(os.stat(os.path.join(exported, name)).st_mode) for name in FILES}
    assert mode["model.safetensors"] == mode["config.json"] == 0o666 & ~umask()  # safetensors' own is 0600
    config = json.load(open(os.path.join(exported, "config.json")))
    gpt, meta = checkpoint.load_model(run, log=quiet)
    assert {k: config[k] for k in GPTConfig.__dataclass_fields__} == vars(gpt.config) and config["loops"] == 3
    assert config["auto_map"] == {"AutoConfig": "configuration_flt.FLTConfig",
                                  "AutoModelForCausalLM": "modeling_flt.FLTForCausalLM"}
    assert open(os.path.join(exported, "model.py")).read() == open(os.path.join(ROOT, "model.py")).read()
    copied = open(os.path.join(exported, "decoding.py")).read()
    assert copied == open(os.path.join(ROOT, "flt", "decoding.py")).read()
    assert "from .model import" in open(os.path.join(exported, "modeling_flt.py")).read()  # not a second copy
    ours = checkpoint.load_model(exported)[1]
    assert ours["step"] == meta["step"] and ours["settings"] == meta["settings"]
    tok = AutoTokenizer.from_pretrained(exported, trust_remote_code=True)
    project = data.load_tokenizer(os.path.join(meta["path"], "tokenizer.json"))
    bos = project.bos_id
    assert tok.bos_token_id == tok.eos_token_id == tok.pad_token_id == bos and tok.padding_side == "left"
    assert tok(TEXTS[1]).input_ids == [bos] + project.encode(TEXTS[1])  # the document token first, as in training
    assert tok.decode(project.encode(TEXTS[1])) == TEXTS[1]
    generation = json.load(open(os.path.join(exported, "generation_config.json")))
    assert generation["eos_token_id"] == bos


# ----------------------------------------------------------------------------- the same function
# every variant (model.VARIANTS), the attentions taken in turn; then FLT with each attention
KINDS = ["gqa", "mla", "window", "mla_gqa_window", "full"]
PAIRS = [(v, KINDS[i % len(KINDS)]) for i, v in enumerate(VARIANTS)]


@pytest.mark.parametrize("variant, attention", PAIRS + [("FLT", a) for a in KINDS if ("FLT", a) not in PAIRS])
def test_logits_equal_the_runs_for_every_variant_and_attention(run, variant, attention, tmp_path):
    """Every variant and every attention (MHA, GQA, MLA, sliding window), at K as saved (3) and K at call time."""
    meta = checkpoint.load_model(run, log=quiet)[1]
    gpt = make_model(variant, attention, vocab_size=512, loops=3)
    folder = export_hf.export(save_run(gpt, meta, str(tmp_path / "run")), str(tmp_path / "hf"), log=quiet)
    model, idx = hf_model(folder), torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(idx).logits, gpt(idx))  # fp32, the same code on the same weights: bit for bit
        for K in (1, 2, 5):
            assert torch.equal(model(idx, loops=K).logits, gpt(idx, loops=K)), K
        assert not torch.equal(gpt(idx, loops=1), gpt(idx, loops=3))  # K is not ignored


def test_a_default_K_chosen_at_export_and_the_exit_rule(run, loaded, tmp_path):
    gpt, _, _ = loaded
    model = hf_model(export_hf.export(run, str(tmp_path / "k5"), loops=5, log=quiet))
    idx = torch.randint(0, 512, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert model.config.loops == 5 and torch.equal(model(idx).logits, gpt(idx, loops=5))
        assert torch.equal(model(idx, exit_threshold=0.05).logits, gpt(idx, loops=5, exit_threshold=0.05))
        loss = model(idx, labels=idx).loss  # transformers' convention: the labels are the inputs, shifted inside
        assert torch.allclose(loss, gpt(idx[:, :-1], idx[:, 1:], loops=5), atol=1e-6, rtol=0)


def test_the_learned_exit_gate_goes_with_the_export(run, tmp_path):
    """A run with an exit gate (flt/exit_gate.py) exports it: config.json's exit_gate, its weights under
    model.exit_gate.; read_export and transformers rebuild it, and exit_rule="gate" gives the run's logits."""
    gated = str(tmp_path / "run")
    shutil.copytree(run, gated)
    step_dir = checkpoint.list_checkpoints(gated)[-1][1]
    torch.manual_seed(0)
    gate = ExitGate(checkpoint.load_model(gated, log=quiet)[0].config.n_embd, hidden=8, margin=0.02)
    with torch.no_grad():
        for p in gate.parameters():
            p.normal_(0, 0.5)
    write_gate(step_dir, gate, {"steps": 0}, log=quiet)
    gpt = checkpoint.load_model(gated, log=quiet)[0].eval()
    folder = export_hf.export(gated, str(tmp_path / "hf"), log=quiet)
    assert json.load(open(os.path.join(folder, "config.json")))["exit_gate"] == {"hidden": 8, "margin": 0.02}
    ours = checkpoint.read_export(folder)[0].eval()
    assert ours.exit_gate.state_dict().keys() == gate.state_dict().keys()
    assert all(torch.equal(ours.exit_gate.state_dict()[k], v) for k, v in gate.state_dict().items())
    model = hf_model(folder)
    idx = torch.randint(0, 512, (2, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits = gpt(idx, exit_threshold=0.5, exit_rule="gate")
        exits = gpt(idx, exit_threshold=0.5, exit_rule="gate", return_loops=True)[1].exit_loops
        assert (exits < 3).any() and (exits == 3).any()  # the gate decides: some exit early, some do not
        assert torch.equal(ours(idx, exit_threshold=0.5, exit_rule="gate"), logits)
        assert torch.equal(model(idx, exit_threshold=0.5, exit_rule="gate").logits, logits)
    # a run without a gate exports none
    assert "exit_gate" not in json.load(open(os.path.join(export_hf.export(run, str(tmp_path / "plain"), log=quiet),
                                                          "config.json")))


# ----------------------------------------------------------------------------- generate
@pytest.mark.parametrize("loops", [None, 5])
def test_greedy_generate_uses_the_kv_cache_and_matches_every_other_way(loaded, loops):
    """A left-padded batch: each row's tokens are those of the project's generate on the prompt alone and of
    a full forward per token (up to the document token, where transformers stops)."""
    gpt, model, tok = loaded
    batch = tok(TEXTS, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=10, do_sample=False, loops=loops, return_dict_in_generate=True)
    K = loops or 3
    assert type(out.cache).__name__ == "KVCache" and len(out.cache.kv) == K * gpt.config.n_layer  # (loop, layer)
    assert out.cache.pad.tolist() == (1 - batch.attention_mask).sum(1).tolist()
    new = out.sequences[:, batch.input_ids.size(1):]
    for row, ids in enumerate(prompts(tok)):
        alone = torch.cat(list(gpt.generate(ids[None], 10, temperature=0, loops=K)), 1)
        assert torch.equal(alone, greedy_by_full_forward(gpt, ids[None], 10, K))
        assert torch.equal(new[row], cut_at_document_end(alone, tok.bos_token_id)[0]), row


def test_sampling_with_a_seed_matches_the_projects_generate(loaded):
    """'Matches': on the CPU in fp32, torch.manual_seed(s) before transformers' generate(do_sample=True,
    temperature=t, top_k=k) gives the token ids of GPT.generate(temperature=t, top_k=k, seed=s), up to each
    row's first document token: both draw torch.multinomial from the same generator state on equal logits."""
    gpt, model, tok = loaded
    ids, mask = left_padded(prompts(tok), pad_id=tok.pad_token_id)
    for seed, top_k in ((0, None), (1, 20)):
        ours = torch.cat(list(gpt.generate(ids, 12, temperature=0.8, top_k=top_k, seed=seed, attention_mask=mask)), 1)
        torch.manual_seed(seed)
        with torch.no_grad():
            theirs = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=True, temperature=0.8,
                                    top_k=top_k)[:, ids.size(1):]
        assert torch.equal(theirs, cut_at_document_end(ours, tok.bos_token_id)[:, :theirs.size(1)]), seed
    torch.manual_seed(0)
    with torch.no_grad():
        other = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=True, temperature=0.8)
    assert not torch.equal(other[:, ids.size(1):], model.generate(ids, attention_mask=mask, max_new_tokens=12,
                                                                  do_sample=False)[:, ids.size(1):])


def test_cache_slots_is_a_generate_keyword(loaded):
    """generate(cache_slots=m) decodes with model.py's KVCache of m loop slots per layer: the tokens of the
    project's generate(cache_slots=m) on the same left-padded batch; a value outside 1..K is refused by name."""
    gpt, model, tok = loaded
    ids, mask = left_padded(prompts(tok), pad_id=tok.pad_token_id)
    ours = torch.cat(list(gpt.generate(ids, 10, temperature=0, loops=4, attention_mask=mask, cache_slots=1)), 1)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, loops=4, cache_slots=1,
                             return_dict_in_generate=True)
    assert sorted(out.cache.kv) == [(0, layer) for layer in range(gpt.config.n_layer)]
    theirs = out.sequences[:, ids.size(1):]
    assert torch.equal(theirs, cut_at_document_end(ours, tok.bos_token_id)[:, :theirs.size(1)])
    with pytest.raises(ValueError, match="cache_slots=5: expected an integer 1 to loops=4"):
        model.generate(ids, attention_mask=mask, max_new_tokens=2, loops=4, cache_slots=5)


def test_right_padding_is_refused(exported, loaded):
    _, model, _ = loaded
    tok = AutoTokenizer.from_pretrained(exported, trust_remote_code=True, padding_side="right")
    batch = tok(TEXTS, return_tensors="pt", padding=True)
    with pytest.raises(ValueError, match="attention_mask: expected left padding"):
        model.generate(**batch, max_new_tokens=2)


# ----------------------------------------------------------------------------- transformers alone
def test_transformers_alone_outside_the_repository_gives_the_runs_logits(run, exported, loaded, tmp_path):
    gpt, _, tok = loaded
    ids = tok(TEXTS[1], return_tensors="pt").input_ids
    with torch.no_grad():
        want = {K: gpt(ids, loops=K)[0].tolist() for K in (1, 3)}
        want["generate"] = torch.cat(list(gpt.generate(ids, 6, temperature=0)), 1)[0].tolist()
    (tmp_path / "want.json").write_text(json.dumps(want))
    script = textwrap.dedent(f"""
        import importlib.util, json, torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        assert importlib.util.find_spec("flt") is None and importlib.util.find_spec("scripts") is None
        model = AutoModelForCausalLM.from_pretrained({exported!r}, trust_remote_code=True)
        tok = AutoTokenizer.from_pretrained({exported!r}, trust_remote_code=True)
        want, ids = json.load(open("want.json")), tok({TEXTS[1]!r}, return_tensors="pt").input_ids
        with torch.no_grad():
            for K in (1, 3):
                torch.testing.assert_close(model(ids, loops=K).logits[0], torch.tensor(want[str(K)]), atol=1e-5, rtol=0)
            new = model.generate(ids, max_new_tokens=6, do_sample=False)[0, ids.size(1):].tolist()
        assert new == want["generate"][:len(new)], (new, want["generate"])
        print("ok", type(model).__module__)
        """)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"HF_HOME": str(tmp_path / "hf_home")}
    p = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0 and p.stdout.startswith("ok transformers_modules."), p.stdout + p.stderr


# ----------------------------------------------------------------------------- back into the project
def test_eval_and_lm_eval_flt_read_the_folder_as_the_run(run, exported, loaded):
    gpt, _, _ = loaded
    model, meta = checkpoint.load_model(exported)
    assert meta["path"] == exported and meta["step"] == 4
    idx = torch.randint(0, 512, (1, 16))
    with torch.no_grad():
        assert torch.equal(model(idx, loops=2), gpt(idx, loops=2))
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance
    from scripts import lm_eval_flt
    asks = [Instance("loglikelihood", {}, ("The function", " returns a list"), 0)]
    scores = [lm_eval_flt.load(path, [1, 3], "cpu", log=quiet)[0].at(3).loglikelihood(asks) for path in (run, exported)]
    assert scores[0] == scores[1]


def test_hf_model_of_the_harness_gives_lm_eval_flts_loglikelihoods(exported, monkeypatch):
    """lm-eval's own `hf` model (HFLM) on the folder, at its default K, against lm_eval_flt at that K, sample by
    sample. HFLM encodes a loglikelihood_rolling text with special tokens and puts its prefix token before it,
    so the perplexity task runs with add_bos_token=False (docs/huggingface.md); the others with the default."""
    lm_eval = pytest.importorskip("lm_eval")
    pytest.importorskip("accelerate")
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager
    from scripts import lm_eval_flt
    monkeypatch.chdir(ROOT)  # the task YAMLs' data_files are relative to the repository root
    manager = TaskManager(include_path=os.path.join(ROOT, "tests", "lm_eval_tasks"), include_defaults=False)
    ours = lm_eval_flt.load(exported, [3], "cpu", log=quiet)[0]
    for tasks, kwargs in ((["flt_mc", "flt_gen"], {}), (["flt_ppl"], dict(add_bos_token=False))):
        theirs = HFLM(pretrained=exported, trust_remote_code=True, batch_size=4, device="cpu", **kwargs)
        results = [lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=manager, log_samples=True)
                   for lm in (ours, theirs)]
        for task in tasks:
            for a, b in zip(results[0]["samples"][task], results[1]["samples"][task], strict=True):
                if task == "flt_gen":
                    assert a["resps"] == b["resps"]
                else:  # [[(log-likelihood, is_greedy)], ...] or, rolling, [[log-likelihood]]
                    assert scores(a) == pytest.approx(scores(b), rel=1e-5), task
            assert results[0]["results"][task].keys() == results[1]["results"][task].keys()


def scores(sample):
    return [r[0][0] if isinstance(r[0], (tuple, list)) else r[0] for r in sample["resps"]]


# ----------------------------------------------------------------------------- the command's errors
def test_errors_name_the_path_and_leave_nothing_behind(run, exported, tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="run 'no/such/run': no such directory"):
        export_hf.main(["no/such/run", str(tmp_path / "x")])
    with pytest.raises(ValueError, match=f"{exported} already exists; choose another folder, or --force"):
        export_hf.main([run, exported])
    with pytest.raises(ValueError, match="--loops=0: expected an integer >= 1"):
        export_hf.main([run, str(tmp_path / "x"), "--loops=0"])

    def fail(*args, **kwargs):
        raise OSError("disk full")
    monkeypatch.setattr(export_hf, "save_file", fail)
    with pytest.raises(OSError, match="disk full"):
        export_hf.main([run, exported, "--force"])
    assert os.listdir(os.path.dirname(exported)) == ["d1_flt"]  # no temporary folder left
    assert set(os.listdir(exported)) == FILES  # the old folder is untouched
    assert command("no/such/run", str(tmp_path / "y")) == (
        1, "", "scripts.export_hf: FileNotFoundError: run 'no/such/run': no such directory\n")


def test_force_refuses_an_export_holding_files_it_did_not_write(run, exported, tmp_path):
    """eval.py's results (it evaluates an export folder in place), lm_eval.json, a model card: --force over an
    export holding them is refused in one line naming them, and the folder stays byte for byte; a clean earlier
    export is replaced, also one of the days when exports held drafting.py (now inside decoding.py)."""
    assert set(export_hf.WRITTEN) == FILES | {"drafting.py"}
    out = tmp_path / "hf"
    shutil.copytree(exported, out)
    (out / "eval.json").write_text('{"results": []}')
    (out / "README.md").write_text("# my model card\n")
    before = tree(tmp_path)
    status, stdout, stderr = command(run, str(out), "--force", "--loops=2")
    assert (status, stdout) == (1, "") and len(stderr.splitlines()) == 1, stderr
    assert stderr.startswith(f"scripts.export_hf: ValueError: {out}: holds README.md, eval.json, which the export "
                             "did not write"), stderr
    assert "move them out first, or export to another folder" in stderr, stderr
    assert tree(tmp_path) == before
    (out / "eval.json").unlink()
    (out / "README.md").unlink()
    (out / "drafting.py").write_text("# an earlier export's copy of flt/drafting.py\n")
    status, stdout, stderr = command(run, str(out), "--force", "--loops=2")
    assert status == 0 and stderr == "", stderr
    assert set(os.listdir(out)) == FILES and json.loads((out / "config.json").read_text())["loops"] == 2
