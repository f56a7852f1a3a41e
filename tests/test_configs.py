"""Every file in config/ applies cleanly to train.py's real settings (so renaming a setting
breaks CI), and each experiment file sets what its name says. Nothing is trained."""
import ast
import inspect
import subprocess
import sys
import os

import pytest

from configurator import configure, settings_of
from model import config_for_depth

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
        if isinstance(node, (ast.Assign, ast.Import, ast.ImportFrom)):  # a default may name a module's constant
            body.append(node)
    namespace = {}
    exec(compile(ast.Module(body=body, type_ignores=[]), "train.py", "exec"), namespace)
    return {k: v for k, v in namespace.items() if not k.startswith("_") and not inspect.ismodule(v) and not callable(v)}


def apply(name, monkeypatch):
    """The settings train.py would run with for `python train.py config/<name>` from the root."""
    monkeypatch.chdir(ROOT)
    monkeypatch.syspath_prepend(ROOT)  # as for train.py: its directory is sys.path[0]
    return configure(train_defaults(), [os.path.join("config", name)])


def test_train_defaults_found():
    defaults = train_defaults()
    assert {"depth", "loops", "variant", "out_dir", "num_steps", "device_batch_size"} <= set(defaults)


def test_config_dir_is_small():
    assert CONFIGS == ["base.py", "cpu_diag.py", "diag.py", "flt_base.py", "paper.py", "small.py"]


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("variant, loops, attention", [
    ("LT", 3, {}), ("FLT", 12, {"n_kv_head": 1}), ("LT_ai", 9, {"attn": "mla"}),
    ("FLT_res", 6, {"window_pattern": "SSSL"})])
def test_config_applies_with_any_variant_and_attention(name, variant, loops, attention, monkeypatch):
    s = apply(name, monkeypatch) | dict(variant=variant, loops=loops) | attention
    config_for_depth(s["depth"], sequence_len=s["sequence_len"], vocab_size=151680, loops=s["loops"],
                     variant=s["variant"], attn=s["attn"], kv_rank=s["kv_rank"], window_pattern=s["window_pattern"],
                     **({} if s["n_kv_head"] == -1 else {"n_kv_head": s["n_kv_head"]}))  # validates the model settings
    for world_size in (1, 8) if s["dataset"] == "fineweb" else (1,):
        assert s["total_batch_size"] % (s["device_batch_size"] * s["sequence_len"] * world_size) == 0


def test_recipes_say_what_their_names_say(monkeypatch):
    paper, small, base, flt, diag, cpu = (apply(f"{n}.py", monkeypatch)
                                          for n in ("paper", "small", "base", "flt_base", "diag", "cpu_diag"))
    assert (paper["dataset"], paper["total_batch_size"], paper["sequence_len"], paper["num_steps"]) == \
        ("fineweb", 2**19, 1024, -1)
    assert (paper["bos_token"], paper["final_eval_tokens"]) == ("<|im_start|>", 40 * 2**19)
    # the authors' data, tokenizer and in-training validation (run.sh, nanochat/tokenizer.py, base_train.py)
    assert (paper["num_shards"], paper["tokenizer"], paper["eval_interval"], paper["eval_tokens"]) == \
        (249, "Qwen/Qwen3-4B", 250, 20 * 2**19)
    assert diag["eval_interval"] == 200  # check.sh's base_check.py
    assert (small["depth"], base["depth"]) == (6, 12)
    assert (flt["depth"], flt["variant"], flt["loops"], flt["out_dir"]) == (12, "FLT", 9, "")
    # the authors' diagnostic script: 2000 steps, no warm-up, linear warm-down over the last 20%
    assert (diag["depth"], diag["num_steps"], diag["warmdown_frac"], diag["out_root"]) == (6, 2000, 0.2, "out/diag")
    assert (cpu["dataset"], cpu["device"], cpu["loops"], cpu["out_root"]) == ("embedded", "cpu", 12, "out/cpu_diag")


@pytest.mark.parametrize("script", ["train.py", "eval.py", "bench.py"])
def test_help_lists_every_setting_with_its_default_and_comment(script):
    p = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    namespace = train_defaults() if script == "train.py" else None
    with open(os.path.join(ROOT, script)) as f:
        source = f.read()
    seen = set()
    for line in source.splitlines():  # every setting's line (its first assignment) and its comment
        name, _, rest = line.partition(" = ")
        if name.isidentifier() and name.islower() and "#" in rest and f"--{name}=" in p.stdout and name not in seen:
            seen.add(name)
            shown = next(l for l in lines if l.startswith(f"  --{name}="))
            assert rest.partition("#")[2].strip()[:30] in shown, (name, shown)
    if namespace:
        assert sum(l.startswith("  --") for l in lines) == len(settings_of(namespace))
        assert "  --loops=3 " in p.stdout and "  --variant='FLT' " in p.stdout
        order = [l.split("=")[0].strip() for l in lines if l.startswith("  --")]
        assert order.index("--out_dir") < order.index("--dataset") < order.index("--depth") < order.index("--seed")
        assert lines[lines.index(next(l for l in lines if l.startswith("  --dataset"))) - 1] == "data"  # its group
