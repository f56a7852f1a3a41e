"""
Runs trained with the paper authors' code (FuRuF-11/FullyLoopedTransformer, built on nanochat),
brought into this project's checkpoint format. The command: scripts/import_authors.py; the manual:
docs/operations.md, "Runs trained with the authors' code".

Their layout, as their nanochat/checkpoint_manager.py (save_checkpoint) writes it:
    model_<step:06d>.pt          their GPT's state dict; keys may carry torch.compile's prefix;
                                 the embedding is bf16 when they trained on CUDA
    meta_<step:06d>.json         "model_config" (their GPTConfig's fields), "user_config", ...
    optim_<step:06d>_rank<r>.pt  their optimizer shards: not read
The imported run, flt/checkpoint.py's format:
    imported.json                where it came from: their meta, every model_config field, the
                                 mapping, the settings only their training used
    settings.json                train.py's settings that describe it (scripts/plot.py's labels)
    step_<step:06d>/model.pt     the weights as they were (names, dtypes, bits) and our config
    step_<step:06d>/tokenizer.json   the tokenizer they trained with (Qwen3's)

Their parameter names are ours, so no weight is renamed; the checks make the import safe: every
key and shape against the config, finite values, the vocabulary against the tokenizer. Both
forwards compute the same function of the weights (tests/test_import_authors.py checks it against
a float64 rewrite of theirs); what a checkpoint cannot carry is measured in the manual.
"""
import json
import os
import re
from dataclasses import asdict

import torch

import data
from flt import checkpoint, corpus
from flt.runtime import atomic_dir, atomic_write
from model import GPT, GPTConfig

# Their GPTConfig (nanochat/gpt.py), every field with its default: a field their meta lacks had
# this value in their run (their checkpoint_manager builds GPTConfig(**model_config)).
THEIR_CONFIG = dict(model_type="FLT", dropout=0.01, K=1, sequence_len=1024, vocab_size=50304,
                    n_layer=12, n_head=6, n_kv_head=6, n_embd=768, activation_offload=False,
                    activation_offload_keep_last=1, loss_type="END", attn_type="full",
                    kv_lora_rank=128, window_pattern="L")
# Their model_type -> our variant. LT_ia is the paper's LT_ai. FLT_rl's forward is FLT's (every
# loop from norm(e), attention injection in every layer); only its training (base_rl.py) differs.
VARIANTS = {"LT": "LT", "LT_i": "LT_i", "LT_ia": "LT_ai", "FLT_res": "FLT_res", "FLT": "FLT",
            "FLT_rl": "FLT"}
ATTNS = ("full", "mla")  # their attn_type: the same two names as ours
# Fields that change their training, never the logits: recorded in imported.json, not mapped.
# loss_type picks the loops their loss averages; dropout is not read by their gpt.py at all.
TRAINING_ONLY = ("loss_type", "dropout", "activation_offload", "activation_offload_keep_last")
COMPILED = "_orig_mod."  # torch.compile's prefix on the keys of a compiled model's state dict
QWEN3 = "Qwen/Qwen3-4B"  # their tokenizer (nanochat/tokenizer.py, get_tokenizer); config/paper.py's
MODEL_FILE = re.compile(r"model_(\d+)\.pt")


def find_step(src, step=None):
    """(step, model file, meta file) in their checkpoint dir: `step`, else the newest."""
    if not os.path.isdir(src):
        raise FileNotFoundError(f"{src}: no such directory (their checkpoint dir, holding "
                                f"model_<step>.pt and meta_<step>.json)")
    names = os.listdir(src)
    steps = sorted(int(m.group(1)) for name in names if (m := MODEL_FILE.fullmatch(name)))
    if not steps:
        raise FileNotFoundError(f"{src}: no model_<step:06d>.pt, the file their checkpoint_manager "
                                f"writes")
    if step is not None and step not in steps:
        raise FileNotFoundError(f"--step={step}: no model_{step:06d}.pt in {src}; its steps: "
                                f"{steps}")
    step = steps[-1] if step is None else step
    model_file = os.path.join(src, f"model_{step:06d}.pt")
    meta_file = os.path.join(src, f"meta_{step:06d}.json")
    if not os.path.isfile(meta_file):
        raise FileNotFoundError(f"{meta_file}: missing; it holds the model_config without which "
                                f"{os.path.basename(model_file)} cannot be read")
    return step, model_file, meta_file


def read_meta(path):
    """(their meta, their model_config with every field: their default where the meta lacks it)."""
    try:
        with open(path) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not readable JSON ({e})") from e
    given = meta.get("model_config") if isinstance(meta, dict) else None
    if not isinstance(given, dict):
        raise ValueError(f"{path}: no \"model_config\" object (their GPTConfig's fields)")
    if unknown := sorted(set(given) - set(THEIR_CONFIG)):
        raise ValueError(f"{path}: model_config.{unknown[0]} is not a field of their GPTConfig "
                         f"(nanochat/gpt.py): {list(THEIR_CONFIG)}")
    config = THEIR_CONFIG | given
    for key, default in THEIR_CONFIG.items():
        value = config[key]
        allowed = (int, float) if isinstance(default, float) else type(default)
        if not isinstance(value, allowed) or isinstance(value, bool) != isinstance(default, bool):
            raise ValueError(f"{path}: model_config.{key}={value!r}: expected type "
                             f"{type(default).__name__}, as in their GPTConfig")
    return meta, config


def our_config(theirs, path):
    """(GPTConfig, notes): their model_config in our names; the notes say where it is not 1:1."""
    if theirs["model_type"] not in VARIANTS:
        raise ValueError(f"{path}: model_config.model_type={theirs['model_type']!r} is not a type "
                         f"of their gpt.py that this project computes: expected one of "
                         f"{list(VARIANTS)}")
    if theirs["attn_type"] not in ATTNS:
        raise ValueError(f"{path}: model_config.attn_type={theirs['attn_type']!r}: this project "
                         f"has {list(ATTNS)}")
    notes = []
    window_pattern = theirs["window_pattern"].upper()  # their gpt.py upper-cases it too
    if theirs["model_type"] == "FLT_rl":
        notes.append("model_type 'FLT_rl' computes FLT's forward in their gpt.py: imported as FLT")
    if theirs["attn_type"] == "mla" and "S" in window_pattern:
        notes.append(f"window_pattern {window_pattern!r} with MLA: their MLA attention ignores the "
                     f"window (every layer sees the whole causal context): imported as 'L'")
        window_pattern = "L"
    try:
        config = GPTConfig(sequence_len=theirs["sequence_len"], vocab_size=theirs["vocab_size"],
                           n_layer=theirs["n_layer"], n_head=theirs["n_head"],
                           n_kv_head=theirs["n_kv_head"], n_embd=theirs["n_embd"],
                           loops=theirs["K"], variant=VARIANTS[theirs["model_type"]],
                           attn=theirs["attn_type"], kv_rank=theirs["kv_lora_rank"],
                           window_pattern=window_pattern)
    except ValueError as e:
        raise ValueError(f"{path}: model_config does not map to this project's: {e}") from e
    return config, notes


def load_tokenizer(path=None, data_dir=corpus.DEFAULT_DATA_DIR):
    """data.Tokenizer with their document token (<|im_start|>): the tokenizer.json at path, or
    (None) the Qwen3 tokenizer their training used, as the data pipeline gets it: data_dir's copy,
    else a download."""
    if path is not None and not os.path.isfile(path):
        raise FileNotFoundError(f"--tokenizer={path!r}: no such file; expected a local "
                                f"tokenizer.json")
    try:
        return data.load_tokenizer(path or QWEN3, cache_dir=data_dir, bos=data.QWEN3_BOS)
    except ConnectionError as e:  # offline, and no copy in data_dir
        raise FileNotFoundError(f"the Qwen3 tokenizer their training used ({QWEN3}) is not in "
                                f"{data_dir}/ and could not be downloaded; give a local copy of "
                                f"its tokenizer.json with --tokenizer=PATH") from e


def read_state(path, config):
    """Their state dict without the compile prefix, checked against config: the same keys and
    shapes (their names are ours), finite values. Tensors are kept as saved: dtype and bits."""
    state = checkpoint.load_file(path)
    if not isinstance(state, dict) or not all(torch.is_tensor(v) for v in state.values()):
        raise ValueError(f"{path}: not a state dict (a dict of tensors, as save_checkpoint writes)")
    state = {key.removeprefix(COMPILED): value for key, value in state.items()}
    with torch.device("meta"):  # the shapes only: no memory, no initialisation
        shapes = {key: p.shape for key, p in GPT(config).state_dict().items()}
    shape = (f"model_config (n_layer={config.n_layer}, n_embd={config.n_embd}, n_head="
             f"{config.n_head}, n_kv_head={config.n_kv_head}, attn_type={config.attn!r}, "
             f"vocab_size={config.vocab_size})")
    if missing := sorted(set(shapes) - set(state)):
        raise ValueError(f"{path}: no {missing[0]}, which a model of {shape} has")
    if extra := sorted(set(state) - set(shapes)):
        raise ValueError(f"{path}: {extra[0]} is not a parameter of a model of {shape}")
    for key, value in state.items():
        if value.shape != shapes[key]:
            raise ValueError(f"{path}: {key} has shape {tuple(value.shape)}, but {shape} gives "
                             f"{tuple(shapes[key])}")
        if not value.is_floating_point():
            raise ValueError(f"{path}: {key} is {value.dtype}, not a floating-point weight")
        if not torch.isfinite(value).all():
            bad = value.numel() - int(torch.isfinite(value).sum())
            raise ValueError(f"{path}: {key} has {bad} non-finite values (of {value.numel()}); a "
                             f"checkpoint is never saved with them")
    return state


def run_settings(config, tokenizer, embedding_dtype, source):
    """train.py's settings that describe the run: eval.py reads dtype and bos_token, plot.py the
    model's; their base_train.py trains in bf16 on CUDA, where it stores the embedding in bf16."""
    settings = dict(dataset="fineweb", tokenizer=tokenizer, bos_token=data.QWEN3_BOS,
                    n_kv_head=-1 if config.n_kv_head == config.n_head else config.n_kv_head,
                    sequence_len=config.sequence_len, loops=config.loops, variant=config.variant,
                    attn=config.attn, kv_rank=config.kv_rank, window_pattern=config.window_pattern,
                    dtype="bf16" if embedding_dtype == torch.bfloat16 else "fp32",
                    imported_from=source)
    if config.n_embd == 64 * config.n_layer and config.n_head == -(-config.n_embd // 128):
        settings["depth"] = config.n_layer  # the shape train.py (and their base_train.py) derive
    return settings


def written_files(out):
    """The files a previous import wrote in out (paths relative to it), read from its imported.json:
    that, settings.json, step_<step>/model.pt and its tokenizer.json; None if out has no readable
    imported.json of this import (its source and step)."""
    try:
        with open(os.path.join(out, checkpoint.IMPORTED)) as f:
            record = json.load(f)
        step = record["step"]
        source = record["source"]
    except (OSError, ValueError, TypeError, KeyError):
        return None
    if isinstance(step, bool) or not isinstance(step, int) or step < 0 or not isinstance(source, str):
        return None
    step_dir = checkpoint.step_name(step)
    return {checkpoint.IMPORTED, "settings.json", f"{step_dir}/model.pt", f"{step_dir}/tokenizer.json"}


def not_written(out, written):
    """What out holds that is not in `written` (its files, relative paths): each such file, and each
    folder holding none of them (with a trailing /), sorted."""
    folders = {os.path.dirname(path) for path in written} - {""}
    found = []
    for parent, dirs, files in os.walk(out):
        rel = os.path.relpath(parent, out)
        rel = "" if rel == "." else rel + "/"
        found += [rel + d + "/" for d in dirs if rel + d not in folders]
        dirs[:] = [d for d in dirs if rel + d in folders]  # a foreign folder is named, not entered
        found += [rel + name for name in files if rel + name not in written]
    return sorted(found)


def check_out(src, out, tokenizer, force):
    """A ValueError naming out, before any work, unless out is absent or, with force, a previous
    import holding only what it wrote (written_files): --force never replaces their checkpoint dir,
    a folder holding it or the tokenizer, a folder inside their dir, a training run, an import
    holding files put there since (eval.py's eval.json), or any other folder or file
    (scripts/export_hf.py's check_out is the same rule for an export)."""
    if not os.path.exists(out):
        return
    if not force:
        raise ValueError(f"{out} already exists; choose another directory or --force to replace it")
    real = os.path.realpath(out)
    # what is imported: in out or out itself, or (their dir) around out; links followed
    for what, path in (("their checkpoint dir", src), ("the tokenizer", tokenizer)):
        if path is not None and os.path.commonpath([os.path.realpath(path), real]) == real:
            raise ValueError(f"{out}: holds {what} being imported ({path}); --force never replaces it: "
                             f"choose another directory")
    if os.path.commonpath([os.path.realpath(src), real]) == os.path.realpath(src):
        raise ValueError(f"{out}: inside their checkpoint dir being imported ({src}); --force never "
                         f"replaces a folder there: choose another directory")
    if not os.path.isdir(out):
        raise ValueError(f"{out}: not a folder this import wrote (no {checkpoint.IMPORTED}): a file; --force "
                         f"replaces only a previous import: choose another directory, or move it")
    names = sorted(os.listdir(out))
    run = [name for name in ("model.pt", "log.jsonl") if name in names]
    run += [f"{d}/model.pt" for d in names
            if d.startswith("step_") and os.path.exists(os.path.join(out, d, "model.pt"))]
    written = written_files(out)
    if written is None and run:
        raise ValueError(f"{out}: holds a training run ({', '.join(run[:3])}); --force replaces only a "
                         f"previous import: choose another directory")
    if written is None:
        held = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        raise ValueError(f"{out}: not a folder this import wrote (no {checkpoint.IMPORTED}): it holds "
                         f"{held or 'nothing'}; --force replaces only a previous import: choose another "
                         f"directory, or move it")
    if foreign := not_written(out, written):
        raise ValueError(f"{out}: holds {', '.join(foreign)}, which the import did not write (results "
                         f"of the old weights, your files): move them out first, or import to another "
                         f"directory")


def import_run(src, out, step=None, tokenizer=None, force=False, data_dir=corpus.DEFAULT_DATA_DIR,
               log=print):
    """Write the run dir `out` from their checkpoint dir `src`; step: theirs (None: the newest);
    tokenizer: a tokenizer.json (None: Qwen3's). Everything is read and checked before anything is
    written, and `out` appears whole or not at all; force: replace a previous import at out, and
    nothing else (check_out). Returns (the step directory, the record)."""
    out = os.path.abspath(out)
    check_out(src, out, tokenizer, force)
    step, model_file, meta_file = find_step(src, step)
    meta, theirs = read_meta(meta_file)
    config, notes = our_config(theirs, meta_file)
    tok = load_tokenizer(tokenizer, data_dir)
    if tok.vocab_size != config.vocab_size:
        raise ValueError(f"{meta_file}: model_config.vocab_size={config.vocab_size}, but the "
                         f"tokenizer {tokenizer or QWEN3} has {tok.vocab_size} ids (their "
                         f"checkpoint_manager asserts equality): give the one they trained with")
    state = read_state(model_file, config)
    source = os.path.abspath(model_file)
    settings = run_settings(config, os.path.abspath(tokenizer) if tokenizer else QWEN3,
                            state["transformer.wte.weight"].dtype, source)
    record = dict(source=source, step=step, model_config=theirs, config=asdict(config),
                  defaults=sorted(set(THEIR_CONFIG) - set(meta["model_config"])), notes=notes,
                  training_only={key: theirs[key] for key in TRAINING_ONLY}, meta=meta)
    with atomic_dir(out) as tmp:
        step_tmp = os.path.join(tmp, checkpoint.step_name(step))
        os.makedirs(step_tmp)
        checkpoint.write_model_file(step_tmp, state, config, step, settings)
        tok.save(os.path.join(step_tmp, "tokenizer.json"))
        for name, content in ((checkpoint.IMPORTED, record), ("settings.json", settings)):
            atomic_write(os.path.join(tmp, name), json.dumps(content, indent=1) + "\n")
    step_dir = os.path.join(out, checkpoint.step_name(step))
    log(report(record, step_dir))
    return step_dir, record


def report(record, step_dir):
    """What an import did: the mapping, its notes, what was recorded, what was not read."""
    theirs, ours = record["model_config"], record["config"]
    mapped = [f"model_type {theirs['model_type']!r} -> variant {ours['variant']!r}",
              f"K {theirs['K']} -> loops {ours['loops']}",
              f"attn_type {theirs['attn_type']!r} -> attn {ours['attn']!r}",
              f"kv_lora_rank {theirs['kv_lora_rank']} -> kv_rank {ours['kv_rank']}",
              f"window_pattern {theirs['window_pattern']!r} -> {ours['window_pattern']!r}"]
    kept = ", ".join(f"{key} {ours[key]}" for key in
                     ("sequence_len", "vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd"))
    recorded = ", ".join(f"{key}={value!r}" for key, value in record["training_only"].items())
    return "\n".join([
        f"imported {record['source']} (step {record['step']}) -> {step_dir}",
        f"  mapped: {'; '.join(mapped)}; kept: {kept}",
        *(f"  note: {note}" for note in record["notes"]),
        f"  recorded in {checkpoint.IMPORTED}, unused here (their training only): {recorded}",
        "  not read: their optimizer shards (optim_*.pt): the run is evaluated, sampled and "
        "exported here, not trained further (train.py --resume refuses it)"])
