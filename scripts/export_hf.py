"""
Export a trained run as a Hugging Face transformers model folder (docs/huggingface.md).

    pip install -r requirements/hf.txt
    python -m scripts.export_hf out/d3_flt_k3 hf/d3_flt_k3                   # the run's newest readable checkpoint
    python -m scripts.export_hf out/d3_flt_k3/step_002000 hf/d3_k6 --loops=6  # a step directory; default K = 6

The folder loads offline, anywhere, with transformers alone:
    AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True); AutoTokenizer.from_pretrained(folder)
and eval.py and lm_eval_flt read it as they read a run. It holds:
    config.json              every GPTConfig setting (loops: the default K) and auto_map, which names the code below
                             (and exit_gate: {hidden, margin} if the run has a learned exit gate)
    model.safetensors        the weights, in fp32 (tensors only: loading them runs no code);
                             the exit gate's (flt/exit_gate.py) under model.exit_gate.
    tokenizer.json           the run's tokenizer; encoding with special tokens puts the document token (BOS) first
    tokenizer_config.json    BOS = EOS = PAD = the document token; padding on the left (model.py's padding)
    generation_config.json   decoding stops at the document token (a new document would begin)
    modeling_flt.py, configuration_flt.py   the transformers wrapper (flt/hf_remote/), around
    model.py                 this repository's model.py itself, imported by the wrapper
    decoding.py              flt/decoding.py, model.py's KV cache, exit rule and drafting, which it imports
    run.json                 the checkpoint exported, its step and training settings
It is written under a temporary name beside <out> and renamed into place: <out> is whole or absent.
--force replaces a previous export only: never the run exported, a folder holding a run, or another folder;
nor an export holding files it did not write (eval.py's eval.json, a model card): move them out first.
"""
import json
import os
import shutil
import sys
from dataclasses import asdict

from safetensors.torch import save_file
from tokenizers.processors import TemplateProcessing

import data
from flt import checkpoint
from flt.errors import ArgumentParser, user_errors
from flt.runtime import atomic_dir
from model import GPTConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CODE = [os.path.join(ROOT, "flt", "hf_remote", name) for name in ("configuration_flt.py", "modeling_flt.py")]
CODE += [os.path.join(ROOT, "model.py")]
CODE += [os.path.join(ROOT, "flt", "decoding.py")]
# every file an export writes (export): what --force may replace; anything else in <out> is the user's.
# drafting.py: an earlier export's copy of flt/drafting.py, since merged into decoding.py
WRITTEN = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
           "run.json", "drafting.py", *(os.path.basename(path) for path in CODE))
AUTO_MAP = {"AutoConfig": "configuration_flt.FLTConfig", "AutoModelForCausalLM": "modeling_flt.FLTForCausalLM"}


def write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def check_out(run, out, force):
    """A ValueError naming out, before any work, unless out is absent or, with force, a previous export
    (config.json of model_type "flt" and run.json) holding only files an export writes (WRITTEN): --force never
    replaces the run being exported, a folder that holds a run (model.pt, log.jsonl, a step_*/model.pt), files
    put in an export since (eval.py's eval.json, a model card), or any other folder or file."""
    if not os.path.exists(out):
        return
    if not force:
        raise ValueError(f"{out} already exists; choose another folder, or --force to replace it")
    # the run, a file or folder in out, or out itself (links followed)
    if os.path.commonpath([os.path.realpath(run), os.path.realpath(out)]) == os.path.realpath(out):
        raise ValueError(f"{out}: the run being exported ({run}) or a folder holding it; --force never "
                         "replaces it: choose another folder")
    if os.path.isdir(out):
        held = [name for name in ("model.pt", "log.jsonl") if os.path.exists(os.path.join(out, name))]
        held += [f"{d}/model.pt" for d in sorted(os.listdir(out)) if d.startswith("step_")
                 and os.path.exists(os.path.join(out, d, "model.pt"))]
        if held:
            raise ValueError(f"{out}: holds a training run ({', '.join(held[:3])}); --force replaces only a "
                             "previous export: choose another folder")
    try:
        with open(os.path.join(out, "config.json")) as f:
            exported = json.load(f).get("model_type") == "flt" and os.path.isfile(os.path.join(out, "run.json"))
    except (OSError, ValueError, AttributeError):
        exported = False
    if not exported:
        raise ValueError(f"{out}: not a previous export (config.json of model_type 'flt' and run.json); "
                         "--force replaces only an export: choose another folder, or move it")
    # what eval.py (eval.json, eval.md), lm_eval_flt or the user put there since: refused, never deleted
    foreign = [name + "/" if os.path.isdir(os.path.join(out, name)) else name for name in sorted(os.listdir(out))
               if name not in WRITTEN or os.path.isdir(os.path.join(out, name))]
    if foreign:
        raise ValueError(f"{out}: holds {', '.join(foreign)}, which the export did not write (results of the old "
                         "weights, your files): move them out first, or export to another folder")


def export(run, out, loops=None, force=False, log=print):
    """Write the folder `out` for the newest readable checkpoint at `run` (a run's out_dir or a step directory);
    loops: the default K of the export (None: the run's). force: replace a previous export at out, and
    nothing else (check_out). Returns out's absolute path."""
    out = os.path.abspath(out)
    check_out(run, out, force)
    model, meta = checkpoint.load_model(run, log=log)
    settings = meta.get("settings", {})
    config = asdict(GPTConfig(**asdict(model.config) | ({} if loops is None else {"loops": loops})))
    # the learned exit gate (flt/exit_gate.py), if the run has one: its weights go with the model's
    gate = getattr(model, "exit_gate", None)
    if gate is not None:
        config["exit_gate"] = {k: v for k, v in checkpoint.gate_config(gate).items() if k != "n_embd"}
    tok = data.load_tokenizer(os.path.join(meta["path"], "tokenizer.json"), bos=settings.get("bos_token", data.BOS))
    bos = tok.tok.id_to_token(tok.bos_id)
    with atomic_dir(out) as tmp:  # <out> is whole or absent
        write_json(os.path.join(tmp, "config.json"), {
            "architectures": ["FLTForCausalLM"], "model_type": "flt", "auto_map": AUTO_MAP, **config,
            "bos_token_id": tok.bos_id, "eos_token_id": tok.bos_id, "pad_token_id": tok.bos_id,
            "tie_word_embeddings": False, "use_cache": True, "dtype": "float32"})
        state = {f"model.{k}": v.detach().float().contiguous() for k, v in model.state_dict().items()}
        save_file(state, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        # safetensors creates its file 0600: readable as every other file here (config.json's mode, the umask's)
        shutil.copymode(os.path.join(tmp, "config.json"), os.path.join(tmp, "model.safetensors"))
        # transformers encodes with special tokens by default: BOS first, as every training document began
        tok.tok.post_processor = TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B:1",
                                                    special_tokens=[(bos, tok.bos_id)])
        tok.save(os.path.join(tmp, "tokenizer.json"))
        write_json(os.path.join(tmp, "tokenizer_config.json"), {
            "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": bos, "pad_token": bos,
            "padding_side": "left", "model_max_length": config["sequence_len"], "clean_up_tokenization_spaces": False,
            "split_special_tokens": True})  # the document token's text inside a text is text, as in training
        write_json(os.path.join(tmp, "generation_config.json"), {
            "bos_token_id": tok.bos_id, "eos_token_id": tok.bos_id, "pad_token_id": tok.bos_id})
        for path in CODE:
            shutil.copy(path, tmp)
        write_json(os.path.join(tmp, "run.json"), {"checkpoint": os.path.abspath(meta["path"]),
                                                   "step": meta.get("step"), "format": checkpoint.FORMAT,
                                                   "settings": settings})
    log(f"exported {meta['path']} (step {meta.get('step')}, {config['variant']}, default K={config['loops']}) "
        f"to {out}")
    return out


def main(argv):
    p = ArgumentParser(prog="python -m scripts.export_hf", description=__doc__.split("\n\n")[1].strip())
    p.add_argument("run", help="a run's out_dir (its newest readable step_*) or a step directory")
    p.add_argument("out", help="the folder to write (it must not exist, unless --force)")
    p.add_argument("--loops", type=int, default=None, help="the default K of the export; default: the run's")
    p.add_argument("--force", action="store_true", help="replace <out> if it is a previous export holding only its own "
                   "files (never a run or any other folder)")
    args = p.parse_args(argv)
    if not os.path.exists(args.run):
        raise FileNotFoundError(f"run {args.run!r}: no such directory")
    if args.loops is not None and args.loops < 1:
        raise ValueError(f"--loops={args.loops}: expected an integer >= 1")
    return export(args.run, args.out, args.loops, args.force)


if __name__ == "__main__":
    with user_errors("scripts.export_hf"):  # a bad path or setting: one line and exit status 1
        main(sys.argv[1:])
