"""Every file in config/ applies cleanly to train.py's real settings (so renaming a setting breaks
CI), and every train.py command that the configs, the README and docs/ show runs what they claim: it
passes train.py's checks, names the run directory that eval.py and scripts.plot are then given, splits
its batch over the GPUs it runs on, and has the size and horizon its config's comment states.
Nothing is trained."""
import ast
import inspect
import os
import re
import subprocess
import sys

import pytest
import torch

import data
from flt import planning
from configurator import configure, settings_of
from conftest import config_for_depth
from model import GPT
from test_train import python

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(f for f in os.listdir(os.path.join(ROOT, "config")) if f.endswith(".py"))


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
    settings = {k: v for k, v in namespace.items() if not k.startswith("_") and not inspect.ismodule(v) and not callable(v)}
    return settings | {"_ALSO_ACCEPTS": namespace["_ALSO_ACCEPTS"]}  # what configure reads: the settings, and the words they take


def apply(argv, monkeypatch):
    """The settings `python train.py <argv>` runs with from the repository root, checked as train.py
    checks them, with its run directory filled in."""
    monkeypatch.chdir(ROOT)
    monkeypatch.syspath_prepend(ROOT)  # as for train.py: its directory is sys.path[0]
    defaults = train_defaults()
    s = configure(dict(defaults), argv)
    planning.check_settings(s, defaults)
    return s | {"out_dir": planning.out_dir_of(s)}


def vocab(s):
    return data.QWEN3_VOCAB if "qwen3" in s["tokenizer"].lower() else s["bpe_vocab_size"]


# train.py's recipe arithmetic, written again from the paper for the tests (train.py's own is inline in
# the script; the dry-run tests of test_train.py and test_planning.py check it against the same numbers).
def model_config(s, vocab_size):
    """The GPTConfig of the settings: the paper's shape from depth (conftest.config_for_depth)."""
    return config_for_depth(s["depth"], sequence_len=s["sequence_len"], vocab_size=vocab_size, loops=s["loops"],
                            variant=s["variant"], attn=s["attn"], kv_rank=s["kv_rank"],
                            window_pattern=s["window_pattern"], loss_all_loops=s["loss_all_loops"],
                            checkpoint_loops=s["checkpoint_loops"],
                            **({} if s["n_kv_head"] == -1 else {"n_kv_head": s["n_kv_head"]}))


def grad_accum(s, world_size):
    """Forwards per rank and optimizer step; planning.check_grad_accum's ValueError unless they divide."""
    tokens_per_fwdbwd = s["device_batch_size"] * s["sequence_len"] * world_size
    planning.check_grad_accum(s["total_batch_size"], tokens_per_fwdbwd)
    return s["total_batch_size"] // tokens_per_fwdbwd


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("flags", [["--variant=LT", "--loops=3"], ["--loops=12", "--n_kv_head=1"],
                                   ["--variant=LT_ai", "--loops=9", "--attn=mla"],
                                   ["--variant=FLT_res", "--loops=6", "--window_pattern=SSSL"]])
def test_config_applies_with_any_variant_and_attention(name, flags, monkeypatch):
    s = apply([f"config/{name}", *flags], monkeypatch)
    model_config(s, vocab(s))  # validates the model settings
    for world_size in (1, 8) if s["dataset"] == "fineweb" else (1,):
        grad_accum(s, world_size)


# ----------------------------------------------------------------------------- the documented commands
def expand(text, cwd):
    """The python and torchrun commands a piece of shell runs, as argument lists, its loops and braces
    expanded by bash itself. Both only print their arguments; nothing else can run (no PATH), but
    for `python -c`, a value a page computes (the standard library's folder): it runs as written."""
    script = "torchrun() { printf '%s\\0' torchrun \"$@\"; echo; }\n"
    script += 'python() { if [ "$1" = -c ]; then "$PYTHON" "$@"; else printf \'%s\\0\' python "$@"; echo; fi; }\n'
    p = subprocess.run(["/bin/bash", "-c", script + text], env={"PATH": "/nonexistent", "PYTHON": sys.executable},
                       cwd=cwd, capture_output=True, text=True, timeout=30)
    return [line.split("\0")[:-1] for line in p.stdout.split("\n")[:-1]]


def documented(cwd):
    """{place: (its text, its commands)} of every place that shows a train.py command: a comment line
    of config/*.py, or, in the README and every page of docs/, a code block, an indented block, or a
    line with commands in inline code (a row of the table of experiments: train, evaluate, plot)."""
    places = {}
    for name in CONFIGS:
        with open(os.path.join(ROOT, "config", name)) as f:
            places |= {f"config/{name}:{i}": [line.lstrip("# ")] for i, line in enumerate(f, 1) if line.startswith("#")}
    pages = ["README.md"] + sorted(f"docs/{f}" for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md"))
    for page in pages:
        with open(os.path.join(ROOT, page)) as f:
            text = f.read()
        blocks = re.findall(r"```bash\n(.*?)```", text, re.S) + re.findall(r"\n\n((?:    \S.*\n)+)", text)
        places |= {f"{page} block {i}": [block] for i, block in enumerate(blocks)}
        places |= {f"{page}:{i}": re.findall(r"`([^`]+)`", line) for i, line in enumerate(text.splitlines(), 1)
                   if not line.startswith("    ")}
    found = {}
    for place, pieces in places.items():
        commands = [c for piece in pieces for c in expand(piece, cwd)]
        if any("train.py" in c for c in commands):
            found[place] = ("\n".join(pieces), commands)
    return found


def test_documented_commands_run_what_they_claim(tmp_path, monkeypatch):
    places = documented(tmp_path)
    assert any(p.startswith("README.md") for p in places) and any(p.startswith("docs/") for p in places)
    # among them, across the README and docs/: each config's command, the dry run, Table 1, the CPU
    # figures, the loop samplers, torchrun on CPU
    text = "\n".join(t for t, _ in places.values())
    for expected in ("config/flt_base.py --dry_run", "config/$s.py --variant=$v --loops=$k",
                     "config/cpu_diag.py --variant=$v", "--loops_sampler=lognormal_poisson --loops_max=24",
                     "--nproc_per_node=2 train.py --device=cpu", "config/diag.py --variant=LT --loops=12"):
        assert expected in text, expected
    assert sum("train.py" in c for _, commands in places.values() for c in commands) > 40
    for place, (text, commands) in places.items():
        runs = set()
        for argv in commands:
            nproc = next((int(a.split("=")[1]) for a in argv if a.startswith("--nproc_per_node=")), 1)
            argv = [f"{a.replace('.', '/')}.py" if argv[i - 1] == "-m" else a for i, a in enumerate(argv)]
            script = next((i for i, a in enumerate(argv) if a.endswith(".py")), len(argv))
            name, args = " ".join(argv[script:script + 1]), argv[script + 1:]
            if name == "train.py" and "--help" in args:  # lists the settings: test_help_lists_every_setting...
                continue
            if name == "train.py":
                s = apply(args, monkeypatch)
                model_config(s, vocab(s))
                # the batch splits over this command's processes, or the GPUs of a paper run (one node of 8)
                grad_accum(s, nproc if s["dataset"] != "fineweb" or nproc > 1 else 8)
                runs.add(s["out_dir"])
            elif name in ("eval.py", "scripts/plot.py"):  # it reads the runs trained above (globs aside)
                paths = {a for a in args if a.startswith("out/") and not set(a) & set("*[")}
                assert paths <= runs, (place, paths, runs)
        for claim in re.findall(r"# -> (\S+)", text):
            assert claim in runs, (place, claim, runs)


# ----------------------------------------------------------------------------- sizes and horizons
# Each config's first comment states the model it trains; checked here by arithmetic: d_model = 64 x
# depth, ceil(d / 128) heads, parameters 2 V d (untied embedding and LM head, V the vocabulary padded
# to a multiple of 64) + 12 L d^2 (attention 4 d^2 and MLP 8 d^2 per block), and the horizon of
# the paper's recipe: 20 tokens per parameter in steps of total_batch_size tokens.
SIZE = re.compile(r"depth (\d+) \(d_model (\d+)(?:, (\d+) heads)?\)(?:, (\d+)M parameters)?")


@pytest.mark.parametrize("name", CONFIGS)
def test_each_config_has_the_size_and_horizon_it_states(name, monkeypatch):
    s = apply([f"config/{name}"], monkeypatch)
    with open(os.path.join(ROOT, "config", name)) as f:
        header = f.read()
    V = -(-vocab(s) // 64) * 64
    d, L = 64 * s["depth"], s["depth"]
    n_all = 2 * V * d + 12 * L * d * d
    config = model_config(s, vocab(s))
    with torch.device("meta"):
        assert GPT(config).num_params() == n_all
    if size := SIZE.search(header):
        depth, d_model, heads, millions = size.groups()
        assert (int(depth), int(d_model)) == (s["depth"], d) == (config.n_layer, config.n_embd)
        assert heads is None or int(heads) == -(-d // 128) == config.n_head
        assert millions is None or round(n_all / 1e6) == int(millions)


def test_the_recipes_horizons_by_hand(monkeypatch):
    # Qwen3's 151,669 ids padded to 151,680; 2**19 tokens a step; 8 GPUs at device batch 8 x 1024
    V = 151680
    for name, d, L, want in (("small.py", 384, 6, 4848), ("base.py", 768, 12, 12127)):
        s = apply([f"config/{name}"], monkeypatch)
        assert (s["num_steps"], s["horizon_params"], s["total_batch_size"]) == (-1, "all", 2**19)  # the horizon
        assert 20 * (2 * V * d + 12 * L * d * d) // 2**19 == want
        assert grad_accum(s, 8) == 8  # device_batch_size 8 x 1024 tokens x 8 GPUs x 8 forwards
    # cpu_diag: "400 steps of 1024 tokens", "one forward of 8 sequences per step", evaluation in 8 forwards
    s = apply(["config/cpu_diag.py"], monkeypatch)
    assert (s["num_steps"], s["total_batch_size"]) == (400, 1024)
    assert grad_accum(s, 1) == 1 and s["eval_tokens"] // (s["device_batch_size"] * s["sequence_len"]) == 8


@pytest.mark.parametrize("script", ["train.py", "eval.py", "scripts/bench.py"])
def test_help_lists_every_setting_with_its_default_and_comment(script):
    command = ["-m", script[:-3].replace("/", ".")] if "/" in script else [script]
    p = python(*command, "--help")
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
        # the paper's settings, the model's and the optimizers' first, the operational ones last
        firsts = ["--variant", "--depth", "--matrix_lr", "--dataset", "--eval_interval", "--out_dir",
                  "--device"]
        assert sorted(firsts, key=order.index) == firsts
        dataset = lines.index(next(l for l in lines if l.startswith("  --dataset")))
        assert lines[dataset - 1].startswith("The data")  # its group
