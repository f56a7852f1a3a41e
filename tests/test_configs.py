"""Every file in config/ applies cleanly to train.py's real settings (so renaming a setting
breaks CI), and each experiment file sets what its name says. Nothing is trained."""
import ast
import math
import os
import re

import pytest

from configurator import configure
from model import GPTConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(f for f in os.listdir(os.path.join(ROOT, "config")) if f.endswith(".py"))
VARIANTS = {v.lower(): v for v in ("LT", "LT_i", "LT_ai", "FLT_res", "FLT")}


def train_defaults():
    """train.py's settings: its top-level assignments before `settings = configure(...)`,
    executed alone (importing train.py would start a training run)."""
    with open(os.path.join(ROOT, "train.py")) as f:
        tree = ast.parse(f.read())
    body = []
    for node in tree.body:
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "settings":
            break
        if isinstance(node, ast.Assign):
            body.append(node)
    namespace = {}
    exec(compile(ast.Module(body=body, type_ignores=[]), "train.py", "exec"), namespace)
    return {k: v for k, v in namespace.items() if not k.startswith("_")}


def apply(name, monkeypatch):
    """The settings train.py would run with for `python train.py config/<name>` from the root."""
    monkeypatch.chdir(ROOT)
    monkeypatch.syspath_prepend(ROOT)  # as for train.py: its directory is sys.path[0]
    return configure(train_defaults(), [os.path.join("config", name)])


def test_train_defaults_found():
    defaults = train_defaults()
    assert {"depth", "loops", "variant", "out_dir", "num_steps", "device_batch_size"} <= set(defaults)


@pytest.mark.parametrize("name", CONFIGS)
def test_config_applies(name, monkeypatch):
    s = apply(name, monkeypatch)
    n_head = math.ceil(64 * s["depth"] / 128)
    GPTConfig(sequence_len=s["sequence_len"], vocab_size=151680, n_layer=s["depth"], n_head=n_head,
              n_kv_head=n_head if s["n_kv_head"] == -1 else s["n_kv_head"], n_embd=64 * s["depth"], loops=s["loops"],
              variant=s["variant"], attn=s["attn"], kv_rank=s["kv_rank"],
              window_pattern=s["window_pattern"])  # validates the model settings
    for world_size in (1, 8) if s["dataset"] == "fineweb" else (1,):
        assert s["total_batch_size"] % (s["device_batch_size"] * s["sequence_len"] * world_size) == 0


@pytest.mark.parametrize("name", [n for n in CONFIGS if n not in ("paper.py", "diag.py", "cpu.py")])
def test_experiment_sets_what_its_name_says(name, monkeypatch):
    s, stem = apply(name, monkeypatch), name[:-3]
    assert s["out_dir"] == f"out/{stem}"  # one directory per run: runs never collide
    m = re.fullmatch(r"table1_(small|base)_(\w+)_k(\d+)", stem) or re.fullmatch(r"diag_(\w+)_k(\d+)", stem)
    if stem.startswith("table1_"):
        assert (s["depth"], s["variant"], s["loops"]) == ({"small": 6, "base": 12}[m[1]], VARIANTS[m[2]], int(m[3]))
        assert s["num_steps"] == -1
    elif stem.startswith("diag_"):
        assert (s["depth"], s["variant"], s["loops"], s["num_steps"]) == (6, VARIANTS[m[1]], int(m[2]), 2000)
    elif stem.startswith("cpu_diag_"):
        assert (s["dataset"], s["device"], s["variant"]) == ("embedded", "cpu", VARIANTS[stem[len("cpu_diag_"):]])
    else:  # flt_base, attn_*
        assert (s["dataset"], s["depth"], s["variant"]) == ("fineweb", 12, "FLT")


def test_paper_grid_is_complete():
    expected = {f"table1_{size}_{v}_k{k}.py" for size in ("small", "base") for v in ("lt", "lt_i", "lt_ai", "flt")
                for k in (3, 6, 9)}
    expected |= {f"diag_{v}_k{k}.py" for v in ("lt", "lt_i", "lt_ai", "flt_res", "flt") for k in (6, 9, 12)}
    assert expected <= set(CONFIGS)


def test_attention_variants(monkeypatch):
    full, gqa, mla, swa = (apply(f"attn_{a}.py", monkeypatch) for a in ("full", "gqa", "mla", "swa"))
    assert (gqa["n_kv_head"], mla["attn"], swa["window_pattern"]) == (3, "mla", "SSSL")
    for s, key in ((gqa, "n_kv_head"), (mla, "attn"), (swa, "window_pattern")):
        assert {k for k in s if s[k] != full[k]} == {key, "out_dir"}  # only its one setting differs
