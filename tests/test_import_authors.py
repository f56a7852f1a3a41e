"""scripts/import_authors.py (flt/authors.py): a run of the authors' code, opened here unchanged.

Their format is built by hand, as their nanochat/checkpoint_manager.py writes it: model_<step>.pt
(a state dict under their GPT's names, with torch.compile's `_orig_mod.` prefix and a bf16
embedding, as their CUDA training leaves it) and meta_<step>.json (model_config, user_config, ...).
After the import every parameter is the one they saved, and the imported model's logits equal those
of `their_forward`, a float64 rewrite of their nanochat/gpt.py forward (each model_type's own loop,
their Block and Block_res, attention and MLA, window sizes): the five variants, FLT_rl, GQA, MLA and
a sliding window. Every input that does not map is an error naming it, and nothing is written.
"""
import json
import math
import os
import re
import shutil

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

import data
from conftest import run_module
from flt import authors, checkpoint, corpus
from test_model import greedy_by_full_forward
from test_nothing_lost import tree
from test_train import python

VOCAB = 258  # the test tokenizer: 256 bytes, <|endoftext|>, <|im_start|> (their document token)
EPS32 = torch.finfo(torch.float32).eps
# Their config for the tests: a tiny model; each case overrides model_type, K and the attention.
BASE = dict(model_type="FLT", K=3, sequence_len=16, vocab_size=VOCAB, n_layer=3, n_head=2,
            n_kv_head=2, n_embd=32, activation_offload=False, loss_type="END", attn_type="full",
            kv_lora_rank=8, window_pattern="L")
ATTENTION = {"mha": {}, "gqa": dict(n_head=4, n_kv_head=2), "mla": dict(attn_type="mla"),
             "window": dict(window_pattern="SL"),
             "mla_window": dict(attn_type="mla", window_pattern="sl")}  # their MLA: no window
CASES = [(t, "mha") for t in ("LT", "LT_i", "LT_ia", "FLT_res", "FLT", "FLT_rl")] + \
    [(t, a) for t in ("LT_ia", "FLT_res", "FLT") for a in ("gqa", "mla", "window", "mla_window")]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """A byte-level tokenizer.json with their document token, <|im_start|>: VOCAB ids."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([data.BOS, data.QWEN3_BOS])
    path = str(tmp_path_factory.mktemp("tok") / "tokenizer.json")
    tok.save(path)
    return path


# ------------------------------------------------------------------------- their format, by hand
def their_state(c, seed=0):
    """A state dict of their GPT for model_config c, under their names (nanochat/gpt.py's __init__),
    every weight drawn at a scale that keeps every block far from the identity. The embedding is
    bf16, as their init_weights leaves it on CUDA; the rest fp32."""
    g = torch.Generator().manual_seed(seed)
    d, hd, padded = c["n_embd"], c["n_embd"] // c["n_head"], -(-c["vocab_size"] // 64) * 64

    def draw(rows, cols, scale=1.0):
        return torch.randn(rows, cols, generator=g) * scale / math.sqrt(cols)
    state = {"transformer.wte.weight": torch.randn(padded, d, generator=g).bfloat16()}
    for i in range(c["n_layer"]):
        p = f"transformer.h.{i}."
        state[p + "attn.c_q.weight"] = draw(c["n_head"] * hd, d)
        if c["attn_type"] == "mla":  # their MLACausalSelfAttention
            state[p + "attn.c_kv_down.weight"] = draw(c["kv_lora_rank"], d)
            state[p + "attn.c_k_up.weight"] = draw(c["n_kv_head"] * hd, c["kv_lora_rank"])
            state[p + "attn.c_v_up.weight"] = draw(c["n_kv_head"] * hd, c["kv_lora_rank"])
        else:
            state[p + "attn.c_k.weight"] = draw(c["n_kv_head"] * hd, d)
            state[p + "attn.c_v.weight"] = draw(c["n_kv_head"] * hd, d)
        state[p + "attn.c_proj.weight"] = draw(d, d, 0.5)
        state[p + "mlp.c_fc.weight"] = draw(4 * d, d)
        state[p + "mlp.c_proj.weight"] = draw(d, 4 * d, 0.5)
    state["lm_head.weight"] = draw(padded, d, 4.0)  # logits of a few units: the softcap matters
    return state


def write_theirs(folder, c, step=100, state=None, meta=None):
    """Their checkpoint dir: model_<step>.pt saved from a compiled model (`_orig_mod.` keys) and
    meta_<step>.json as their base_train.py writes it. Returns the state without the prefix."""
    state = their_state(c) if state is None else state
    os.makedirs(folder, exist_ok=True)
    compiled = {f"_orig_mod.{key}": value for key, value in state.items()}
    torch.save(compiled, os.path.join(folder, f"model_{step:06d}.pt"))
    meta = dict(step=step, val_bpb=1.23, model_config=c, user_config=dict(matrix_lr=0.02),
                device_batch_size=8, max_seq_len=c["sequence_len"]) if meta is None else meta
    with open(os.path.join(folder, f"meta_{step:06d}.json"), "w") as f:
        json.dump(meta, f)
    return state


# ------------------------------------------------------------------------- their forward, float64
def their_forward(W, c, idx):
    """(logits, logits before the softcap, h(K)) of their GPT.forward(idx) (nanochat/gpt.py) in
    float64, from their state dict W and model_config c. Their RoPE table is these fp32 values cast
    to bf16; here they stay fp32 (this project's table: the docs measure the cast)."""
    W = {k: v.double() for k, v in W.items()}
    B, T = idx.shape
    H, Hkv, hd = c["n_head"], c["n_kv_head"], c["n_embd"] // c["n_head"]
    freq = 1.0 / (10000 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    angle = torch.outer(torch.arange(T, dtype=torch.float32), freq)
    cos, sin = angle.cos().double()[None, :, None, :], angle.sin().double()[None, :, None, :]
    pattern = c["window_pattern"].upper()  # their _compute_window_sizes
    windows = [max(c["sequence_len"] // 4, 1) if pattern[i % len(pattern)] == "S" else -1
               for i in range(c["n_layer"])]
    windows[-1] = -1
    eps = torch.finfo(torch.float64).eps  # F.rms_norm's default eps for float64

    def norm(x):
        return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)

    def rotary(x):  # their apply_rotary_emb
        x1, x2 = x[..., :hd // 2], x[..., hd // 2:]
        return torch.cat([x1 * cos + x2 * sin, x1 * (-sin) + x2 * cos], dim=3)

    def attention(i, q, k, v):  # their CausalSelfAttention / MLACausalSelfAttention.forward
        p = f"transformer.h.{i}.attn."
        q = (q @ W[p + "c_q.weight"].T).view(B, T, H, hd)
        if c["attn_type"] == "mla":
            latent = norm(k @ W[p + "c_kv_down.weight"].T)
            k, v = latent @ W[p + "c_k_up.weight"].T, latent @ W[p + "c_v_up.weight"].T
        else:
            k, v = k @ W[p + "c_k.weight"].T, v @ W[p + "c_v.weight"].T
        q, k = norm(rotary(q)), norm(rotary(k.view(B, T, Hkv, hd)))
        k = k.repeat_interleave(H // Hkv, 2)  # enable_gqa: query head j reads kv head j // (H/Hkv)
        v = v.view(B, T, Hkv, hd).repeat_interleave(H // Hkv, 2)
        query, key = torch.arange(T)[:, None], torch.arange(T)[None, :]
        allowed = key <= query
        if c["attn_type"] != "mla" and windows[i] != -1:  # their MLA never reads window_size
            allowed = allowed & (query - key < windows[i])
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
        weights = scores.masked_fill(~allowed, -math.inf).softmax(-1)
        y = torch.einsum("bhqk,bkhd->bqhd", weights, v).reshape(B, T, H * hd)
        return y @ W[p + "c_proj.weight"].T

    def block(i, x, h=None):  # their Block, or Block_res when "res" is in model_type
        if h is None:
            x = x + attention(i, norm(x), norm(x), norm(x))
        elif "res" in c["model_type"]:
            x = norm(x + h)
            x = x + attention(i, norm(x), norm(x), norm(x))
        else:
            x = x + attention(i, norm(h), norm(x), norm(x))
        mlp = f"transformer.h.{i}.mlp."
        hidden = (norm(x) @ W[mlp + "c_fc.weight"].T).relu().square()
        return x + hidden @ W[mlp + "c_proj.weight"].T

    def layers(x, h=None, first_only=False):
        for i in range(c["n_layer"]):
            x = block(i, x, h if i == 0 or not first_only else None)
        return x

    x_0, K = W["transformer.wte.weight"][idx], c["K"]
    if c["model_type"] in ("FLT", "FLT_res", "FLT_rl"):  # K loops from norm(x_0), h from loop 2
        h = None
        for _ in range(K):
            h = norm(layers(norm(x_0), h))
    else:  # LT_ia, LT_i, LT: a plain first loop, then K - 1 more
        h = norm(layers(norm(x_0)))
        for _ in range(K - 1):
            if c["model_type"] == "LT_ia":
                h = norm(layers(norm(x_0), h, first_only=True))
            elif c["model_type"] == "LT_i":
                h = norm(layers(norm(x_0 + h)))
            else:
                h = norm(layers(h))
    z = (h @ W["lm_head.weight"].T)[..., :c["vocab_size"]]
    return 15 * torch.tanh(z / 15), z, h


def tokens(c, B=2, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, c["vocab_size"], (B, c["sequence_len"]), generator=g)


def imported(tmp_path, tokenizer, c):
    """Their checkpoint of config c, imported: (their state, our model in float64, its meta)."""
    state = write_theirs(str(tmp_path / "theirs"), c)
    authors.import_run(str(tmp_path / "theirs"), str(tmp_path / "run"), tokenizer=tokenizer,
                       log=lambda *a: None)
    model, meta = checkpoint.load_model(str(tmp_path / "run"), log=lambda *a: None)
    return state, model.double().eval(), meta


# ------------------------------------------------------------------------- what the import keeps
@pytest.mark.parametrize("model_type,attention", CASES)
def test_logits_equal_their_forward_in_float64(model_type, attention, tokenizer, tmp_path):
    """The imported model computes their forward: in float64 up to h(K) (what feeds the head), and
    to float32 rounding in the logits (the head casts to fp32 before the softcap, as theirs does):
    |error| <= eps32 * (|z| + 30) covers z's cast (eps32/2 |z|, passed on by tanh' <= 1) and fp32's
    /15, tanh and *15 (a few eps32/2 of 15)."""
    c = BASE | dict(model_type=model_type) | ATTENTION[attention]
    state, model, meta = imported(tmp_path, tokenizer, c)
    idx = tokens(c)
    logits, z, h = their_forward(state, c, idx)
    with torch.no_grad():
        ours_h = model.loop_states(idx).states[-1]
        ours = model(idx)
    assert ours_h.dtype == torch.float64 and model.config.loops == c["K"]
    # float64: a few thousand ulps of h's entries (|h| ~ 1 after the norm) for K * L blocks
    torch.testing.assert_close(ours_h, h, rtol=0, atol=2**12 * torch.finfo(torch.float64).eps)
    assert ((ours.double() - logits).abs() <= EPS32 * (z.abs() + 30)).all()
    assert logits.abs().max() > 2  # not a model whose logits are all near 0


def test_every_parameter_is_theirs_bit_for_bit(tokenizer, tmp_path):
    """model.pt holds their tensors under their names (without the prefix), dtype and bits kept;
    the model load_model builds holds the same values (the bf16 embedding exactly in fp32)."""
    c = BASE | dict(attn_type="mla", n_head=4, n_kv_head=1)
    state = write_theirs(str(tmp_path / "theirs"), c)
    step_dir, record = authors.import_run(str(tmp_path / "theirs"), str(tmp_path / "run"),
                                          tokenizer=tokenizer, log=lambda *a: None)
    saved = checkpoint.read_model_file(step_dir)["model"]
    assert saved.keys() == state.keys()
    for key, theirs in state.items():
        assert saved[key].dtype == theirs.dtype and torch.equal(saved[key], theirs), key
    assert saved["transformer.wte.weight"].dtype == torch.bfloat16
    model, _ = checkpoint.load_model(step_dir, log=lambda *a: None)
    for key, p in model.state_dict().items():
        assert torch.equal(p, state[key].to(p.dtype)), key
    assert record["meta"]["user_config"] == {"matrix_lr": 0.02} and record["step"] == 100


def test_settings_the_run_is_read_with(tokenizer, tmp_path):
    """The mapping (LT_ia is LT_ai, K is loops, kv_lora_rank is kv_rank), the settings eval.py
    reads (their document token; bf16, from the bf16 embedding), the training-only fields kept."""
    c = BASE | dict(model_type="LT_ia", K=4, loss_type="STEP", activation_offload=True)
    del c["window_pattern"]  # a field their meta lacks: their default
    _, model, meta = imported(tmp_path, tokenizer, c)
    config = model.config
    mapped = (config.variant, config.loops, config.kv_rank, config.window_pattern)
    assert mapped == ("LT_ai", 4, 8, "L")
    assert not config.loss_all_loops and not config.checkpoint_loops
    settings = meta["settings"]
    assert settings["bos_token"] == "<|im_start|>" and settings["dtype"] == "bf16"
    assert settings["variant"] == "LT_ai" and settings["loops"] == 4 and "depth" not in settings
    record = json.loads((tmp_path / "run" / checkpoint.IMPORTED).read_text())
    assert record["training_only"] == dict(loss_type="STEP", dropout=0.01, activation_offload=True,
                                           activation_offload_keep_last=1)
    assert record["defaults"] == ["activation_offload_keep_last", "dropout", "window_pattern"]
    assert json.loads((tmp_path / "run" / "settings.json").read_text()) == settings


def test_newest_step_by_default_and_step_picks_one(tokenizer, tmp_path):
    theirs = str(tmp_path / "theirs")
    write_theirs(theirs, BASE, step=50)
    write_theirs(theirs, BASE | dict(K=5), step=200)
    step_dir, _ = authors.import_run(theirs, str(tmp_path / "newest"), tokenizer=tokenizer,
                                     log=lambda *a: None)
    assert step_dir.endswith("step_000200") and checkpoint.load_model(step_dir)[0].config.loops == 5
    step_dir, _ = authors.import_run(theirs, str(tmp_path / "old"), step=50, tokenizer=tokenizer,
                                     log=lambda *a: None)
    assert sorted(os.listdir(tmp_path / "old")) == ["imported.json", "settings.json", "step_000050"]


def test_the_run_works_as_any_run_here(tokenizer, tmp_path):
    """load_model + generate (the exact cache: the greedy tokens of a full forward per token),
    train.py --resume refused before any work, and the Hugging Face export read back."""
    c = BASE | dict(model_type="FLT", window_pattern="SL")
    _, model, _ = imported(tmp_path, tokenizer, c)
    model = model.float()
    idx = tokens(c, B=1)[:, :6]
    generated = torch.cat(list(model.generate(idx, 6, temperature=0)), dim=1)
    assert torch.equal(generated, greedy_by_full_forward(model, idx, 6, c["K"]))
    for resume in (True, "auto"):
        with pytest.raises(ValueError, match="imported from the authors' code .* cannot be"):
            checkpoint.prepare_out_dir(str(tmp_path / "run"), resume=resume, overwrite=False)
    pytest.importorskip("safetensors")  # requirements/hf.txt
    from scripts import export_hf
    folder = export_hf.export(str(tmp_path / "run"), str(tmp_path / "hf"), log=lambda *a: None)
    exported, _ = checkpoint.load_model(folder)
    with torch.no_grad():
        assert torch.equal(exported(idx), model(idx))


def test_the_command_and_eval_py_open_it(tokenizer, tmp_path):
    """The command as a user runs it, then `python eval.py <run>` (samples: no download)."""
    c = BASE | dict(model_type="LT_ia", attn_type="mla", window_pattern="SSL", sequence_len=64)
    write_theirs(str(tmp_path / "theirs"), c)  # 64 positions: eval.py's prompts, byte by byte
    status, out, err = command(str(tmp_path / "theirs"), str(tmp_path / "run"),
                               f"--tokenizer={tokenizer}")
    assert status == 0 and err == "", err
    assert "model_type 'LT_ia' -> variant 'LT_ai'" in out
    assert "note: window_pattern 'SSL' with MLA" in out
    assert "unused here (their training only): loss_type='END', dropout=0.01" in out
    p = python("eval.py", str(tmp_path / "run"), "--modes=sample", "--loops=1,3", "--sample_tokens=4",
               "--device=cpu", timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "LT_ai, trained at K=3" in p.stdout and "---- sample at K=3 " in p.stdout


# ------------------------------------------------------------------------- what does not map
def command(*argv):
    """`python -m scripts.import_authors *argv` in this process: (exit status, stdout, stderr)."""
    return run_module("scripts.import_authors", *argv)


def broken_meta(**changes):
    return dict(step=100, model_config=BASE | changes)


def nan_embedding():
    state = their_state(BASE)
    state["transformer.wte.weight"][3, 1] = float("nan")
    return state


def without(key):
    state = their_state(BASE)
    del state[key]
    return state


def with_mla_latent():  # an MLA weight in a model whose model_config says attn_type "full"
    state = their_state(BASE)
    latent = torch.zeros(BASE["kv_lora_rank"], BASE["n_embd"])
    state["transformer.h.0.attn.c_kv_down.weight"] = latent
    return state


BAD = {  # what is wrong -> (write_theirs' state or meta, the error's message)
    "model_type": (dict(meta=broken_meta(model_type="FLT_v2")),
                   "model_config.model_type='FLT_v2' is not a type of their gpt.py"),
    "attn_type": (dict(meta=broken_meta(attn_type="linear")),
                  "model_config.attn_type='linear': this project has"),
    "unknown field": (dict(meta=broken_meta(rope_theta=5e5)),
                      "model_config.rope_theta is not a field of their GPTConfig"),
    "type": (dict(meta=broken_meta(K="3")), "model_config.K='3': expected type int"),
    "no model_config": (dict(meta=dict(step=100)), 'no "model_config" object'),
    "does not map": (dict(meta=broken_meta(n_kv_head=3)),
                     "does not map to this project's: GPTConfig.n_kv_head=3"),
    "shape": (dict(meta=broken_meta(n_embd=64)),
              r"transformer.wte.weight has shape \(320, 32\), but model_config \(.*n_embd=64"),
    "vocabulary": (dict(meta=broken_meta(vocab_size=300)),
                   "model_config.vocab_size=300, but the tokenizer"),
    "non-finite": (dict(state=nan_embedding()),
                   r"transformer.wte.weight has 1 non-finite values \(of 10240\)"),
    "missing key": (dict(state=without("lm_head.weight")),
                    "no lm_head.weight, which a model of model_config"),
    "extra key": (dict(state=with_mla_latent()),
                  "transformer.h.0.attn.c_kv_down.weight is not a parameter"),
}


@pytest.mark.parametrize("what", BAD)
def test_what_does_not_map_is_an_error_naming_it_and_nothing_is_written(what, tokenizer, tmp_path):
    files, message = BAD[what]
    write_theirs(str(tmp_path / "theirs"), BASE, **files)
    status, out, err = command(str(tmp_path / "theirs"), str(tmp_path / "run"),
                               f"--tokenizer={tokenizer}")
    assert status == 1 and out == "" and len(err.splitlines()) == 1, err
    assert err.startswith("scripts.import_authors: ValueError: ") and re.search(message, err), err
    assert os.listdir(tmp_path) == ["theirs"]  # no run, no temporary directory


def test_missing_files_an_existing_run_and_a_failed_write(tokenizer, tmp_path, monkeypatch):
    theirs, run = str(tmp_path / "theirs"), str(tmp_path / "run")
    with pytest.raises(FileNotFoundError, match="no such directory"):
        authors.import_run(theirs, run, tokenizer=tokenizer)
    os.makedirs(theirs)
    with pytest.raises(FileNotFoundError, match="no model_<step:06d>.pt"):
        authors.import_run(theirs, run, tokenizer=tokenizer)
    write_theirs(theirs, BASE)
    with pytest.raises(FileNotFoundError, match=r"--step=7: no model_000007.pt in .*: \[100\]"):
        authors.import_run(theirs, run, step=7, tokenizer=tokenizer)
    with pytest.raises(FileNotFoundError, match="--tokenizer='no/such.json': no such file"):
        authors.import_run(theirs, run, tokenizer="no/such.json")
    os.remove(os.path.join(theirs, "meta_000100.json"))
    with pytest.raises(FileNotFoundError, match="meta_000100.json: missing; it holds the model_"):
        authors.import_run(theirs, run, tokenizer=tokenizer)
    assert not os.path.exists(run)
    write_theirs(theirs, BASE)
    authors.import_run(theirs, run, tokenizer=tokenizer, log=lambda *a: None)
    write_theirs(theirs, BASE | dict(K=7))
    with pytest.raises(ValueError, match="already exists; choose another directory or --force"):
        authors.import_run(theirs, run, tokenizer=tokenizer)
    authors.import_run(theirs, run, tokenizer=tokenizer, force=True, log=lambda *a: None)
    assert checkpoint.load_model(run)[0].config.loops == 7

    def disk_full(*args, **kwargs):
        raise OSError("disk full")
    monkeypatch.setattr(checkpoint, "write_model_file", disk_full)
    write_theirs(theirs, BASE | dict(K=2))
    with pytest.raises(OSError, match="disk full"):
        authors.import_run(theirs, run, tokenizer=tokenizer, force=True)
    assert checkpoint.load_model(run)[0].config.loops == 7  # the run it would replace, whole
    assert sorted(os.listdir(tmp_path)) == ["run", "theirs"]  # no temporary directory


def refused(*argv):
    """The command's stderr line, asserting it failed in one line and printed nothing else."""
    status, out, err = command(*argv)
    assert (status, out) == (1, "") and len(err.splitlines()) == 1, (status, out, err)
    assert err.startswith("scripts.import_authors: ValueError: "), err
    return err


def test_force_never_replaces_a_training_run(tokenizer, tmp_path):
    """--force replaces a folder this import wrote, never a run of this project (step_*/model.pt,
    log.jsonl): refused in one line naming it and what it holds, byte for byte as it was."""
    theirs, run = tmp_path / "theirs", tmp_path / "run"
    write_theirs(str(theirs), BASE)
    (run / "step_000010").mkdir(parents=True)
    (run / "step_000010" / "model.pt").write_bytes(b"weights of a month of training")
    (run / "log.jsonl").write_text('{"step": 10, "loss": 3.2}\n')
    before = tree(tmp_path)
    err = refused(str(theirs), str(run), f"--tokenizer={tokenizer}", "--force")
    assert f"{run}: holds a training run (log.jsonl, step_000010/model.pt)" in err, err
    assert "choose another directory" in err, err
    assert tree(tmp_path) == before  # nothing changed, no temporary directory


def test_force_never_replaces_a_folder_holding_what_is_imported(tokenizer, tmp_path):
    """Their checkpoint dir inside <out> (or <out> itself), the tokenizer inside <out>, <out> inside
    their checkpoint dir: each refused with --force, even where <out> is a previous import."""
    ckpts = tmp_path / "ckpts"
    theirs = ckpts / "theirs"
    write_theirs(str(theirs), BASE)
    tok = ckpts / "tok" / "tokenizer.json"
    tok.parent.mkdir()
    tok.write_bytes(open(tokenizer, "rb").read())
    other = tmp_path / "other"  # their dir elsewhere: the tokenizer in <out> alone
    write_theirs(str(other), BASE)
    (tmp_path / "link").symlink_to(ckpts)  # the same folder by another name
    before = tree(tmp_path)
    for out in (ckpts, theirs):
        err = refused(str(theirs), str(out), f"--tokenizer={tokenizer}", "--force")
        assert f"{out}: holds their checkpoint dir being imported ({theirs})" in err, err
    err = refused(str(tmp_path / "link" / "theirs"), str(ckpts), f"--tokenizer={tokenizer}", "--force")
    assert f"{ckpts}: holds their checkpoint dir being imported" in err, err
    assert f"{ckpts}: holds the tokenizer being imported ({tok})" in refused(
        str(other), str(ckpts), f"--tokenizer={tok}", "--force")
    assert tree(tmp_path) == before
    # a previous import that came to hold what is imported: their dir, the tokenizer, or inside theirs
    run = tmp_path / "run"
    authors.import_run(str(theirs), str(run), tokenizer=str(tok), log=lambda *a: None)
    shutil.copytree(theirs, run / "theirs")
    shutil.copy(tok, run / "tokenizer.json")
    inside = theirs / "imported"
    authors.import_run(str(theirs), str(inside), tokenizer=str(tok), log=lambda *a: None)
    before = tree(tmp_path)
    assert refused(str(run / "theirs"), str(run), f"--tokenizer={tok}", "--force").count(
        f"{run}: holds their checkpoint dir being imported") == 1
    assert f"{run}: holds the tokenizer being imported" in refused(
        str(theirs), str(run), f"--tokenizer={run / 'tokenizer.json'}", "--force")
    assert f"{inside}: inside their checkpoint dir being imported ({theirs})" in refused(
        str(theirs), str(inside), f"--tokenizer={tok}", "--force")
    assert tree(tmp_path) == before


def test_force_replaces_a_previous_import_only_while_it_holds_nothing_else(tokenizer, tmp_path):
    """A previous import is replaced with --force (another step, another K); one holding files the
    import did not write (eval.py's results, a user's notes, a learned exit gate) is refused in one
    line naming them, and stays byte for byte."""
    theirs, run = tmp_path / "theirs", tmp_path / "run"
    write_theirs(str(theirs), BASE)
    authors.import_run(str(theirs), str(run), tokenizer=tokenizer, log=lambda *a: None)
    write_theirs(str(theirs), BASE | dict(K=5), step=200)
    (run / "step_000100" / "eval.json").write_text('{"results": []}')
    (run / "notes.md").write_text("# what I saw\n")
    (run / "plots").mkdir()
    before = tree(tmp_path)
    err = refused(str(theirs), str(run), f"--tokenizer={tokenizer}", "--force")
    assert (f"{run}: holds notes.md, plots/, step_000100/eval.json, which the import did not write" in err
            and "move them out first, or import to another directory" in err), err
    assert tree(tmp_path) == before
    for name in ("step_000100/eval.json", "notes.md"):
        os.remove(run / name)
    os.rmdir(run / "plots")
    status, out, err = command(str(theirs), str(run), f"--tokenizer={tokenizer}", "--force")
    assert status == 0 and err == "", err
    assert sorted(os.listdir(run)) == ["imported.json", "settings.json", "step_000200"]
    assert checkpoint.load_model(str(run), log=lambda *a: None)[0].config.loops == 5
    # the same folder without --force, a file, a folder of other files: refused as before
    err = refused(str(theirs), str(run), f"--tokenizer={tokenizer}")
    assert f"{run} already exists; choose another directory or --force" in err, err
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("import their run\n")
    (tmp_path / "file").write_text("mine\n")
    before = tree(tmp_path)
    for out, what in (("notes", "it holds todo.txt"), ("file", "a file")):
        err = refused(str(theirs), str(tmp_path / out), f"--tokenizer={tokenizer}", "--force")
        assert f"{tmp_path / out}: not a folder this import wrote (no imported.json): {what}" in err, err
    assert tree(tmp_path) == before


def test_without_tokenizer_the_pipelines_qwen3_or_a_clear_error(tokenizer, tmp_path, monkeypatch):
    """No --tokenizer: data_dir's copy of Qwen3's tokenizer.json, as the data pipeline keeps it;
    offline without one, an error saying to give --tokenizer (no test reaches the hub)."""
    def offline(url, path, **kwargs):
        if not os.path.exists(path):
            raise ConnectionError(f"download failed after 1 attempts: {url} -> {path}")
        return path
    monkeypatch.setattr(corpus, "download", offline)
    with pytest.raises(FileNotFoundError, match=r"\(Qwen/Qwen3-4B\) is not in .* --tokenizer=PATH"):
        authors.load_tokenizer(None, str(tmp_path))
    with open(tokenizer) as src, open(tmp_path / "Qwen--Qwen3-4B.tokenizer.json", "w") as dst:
        dst.write(src.read())
    assert authors.load_tokenizer(None, str(tmp_path)).bos_id == 257
