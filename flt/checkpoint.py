"""
Checkpoints and run directories: how a multi-day run never loses work.

    out_dir/
        run.lock            held (flock) by the run writing here; the file itself means nothing
        settings.json       the run's settings (train.py)
        log.jsonl           one JSON line per step (train.py); log.replayed.jsonl: the lines a
                            resumed run replaced (the steps after its checkpoint, run again)
        imported.json       only in a run imported from the authors' code (flt/authors.py): never resumed
        replaced_run/       only while a run started with --overwrite has not saved yet: the old run
        step_000500/        model.pt: weights, config, step, settings, format
                            rank0.pt ... rankN.pt: each rank's optimizer shard, loader position, RNG
                            tokenizer.json: the tokenizer the weights were trained with
                            eval.json, eval.md, ...: results (eval.py), never pruned
                            exit_gate.pt: the learned exit gate (flt/exit_gate.py), never pruned;
                            load_model attaches it as model.exit_gate
        step_001000/

The rules, each one a test in tests/test_train.py or tests/test_nothing_lost.py:
- A checkpoint is written into tmp_step_N and renamed to step_N once every rank has written its
  part, so a kill at any moment leaves the previous checkpoint whole.
- A checkpoint the disk cannot hold is refused before it is written (its size: the newest one's), and
  a write that fails on any rank makes every rank raise: nothing of it stays, no older one is pruned.
- Non-finite parameters are never saved; the newest checkpoint is never pruned, and pruning
  deletes a checkpoint's own files only: results and a user's files in its directory stay.
- Nothing in out_dir is moved or deleted before the run holds its lock, and only what a run wrote:
  a refused second run changes nothing; --overwrite deletes the old run only once the new one saved.
- Everything is loaded with torch.load(weights_only=True): a checkpoint holds tensors, numbers,
  strings, lists and dicts, so loading one from someone else runs none of their code.
- model.pt carries a format number; weights of an older format compute different logits under
  this code and are refused with a message, never loaded silently.
- Only directories named step_<digits> holding model.pt are checkpoints, ordered by their number.
  An unreadable one is reported and skipped: resume and eval fall back to the newest readable one.
"""
import errno
import fcntl
import functools
import json
import math
import os
import re
import shutil
import socket
from dataclasses import asdict, fields

import torch

import data
from model import GPT, GPTConfig
from flt import errors, owndata, runtime
from flt.files import unused_name
from flt.decoding import ExitGate

# 2: RoPE rotates in nanochat's direction (y1 = x1 cos + x2 sin, y2 = -x1 sin + x2 cos), as the
# authors' code does. Format-1 weights were trained with the opposite rotation.
FORMAT = 2
_STEP = re.compile(r"step_(\d+)")


class FormatError(ValueError):
    """A checkpoint of another format: never skipped past as if it were merely unreadable."""


def step_name(step):
    return f"step_{step:06d}"


def list_checkpoints(out_dir):
    """[(step, path)] of the checkpoint directories in out_dir, oldest first (by number)."""
    if not os.path.isdir(out_dir):
        return []
    found = [(int(m.group(1)), os.path.join(out_dir, d)) for d in os.listdir(out_dir)
             if (m := _STEP.fullmatch(d)) and os.path.isfile(os.path.join(out_dir, d, "model.pt"))]
    return sorted(found)


def load_file(path, device="cpu"):
    """torch.load with weights_only=True; a file that cannot be read as a checkpoint becomes a
    ValueError naming it (the next older checkpoint is then tried). The disk or the device failing
    (an OSError such as EIO, out of memory) is no judgement on the file: it is raised as such, so that
    a good checkpoint is never set aside as unreadable for it."""
    try:
        return torch.load(path, map_location=device, weights_only=True)
    except (FileNotFoundError, torch.OutOfMemoryError):
        raise
    except OSError as e:
        raise OSError(e.errno, f"{path}: could not be read ({e.strerror or e}); the file may be good: "
                      "try again once the disk answers") from e
    except Exception as e:  # truncated zip, foreign pickle, a crafted file: never executed
        raise ValueError(f"{path}: not a readable checkpoint file ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''})") from e


def read_model_file(step_dir, device="cpu"):
    """The dict in step_dir/model.pt, checked for its format."""
    path = os.path.join(step_dir, "model.pt")
    meta = load_file(path, device)
    if not isinstance(meta, dict) or "model" not in meta or "config" not in meta:
        raise ValueError(f"{path}: not a model checkpoint (expected a dict with 'model' and 'config')")
    if meta.get("format", 1) != FORMAT:
        raise FormatError(f"{path} has checkpoint format {meta.get('format', 1)}, this code reads format "
                         f"{FORMAT}: format-1 weights were trained with RoPE rotating the other way "
                         f"and would give different logits here; retrain, or use the code they came from")
    return meta


def candidates(path):
    """Step directories to try, newest first: `path` itself if it is one, else its checkpoints."""
    if os.path.isfile(os.path.join(path, "model.pt")):
        return [path]
    found = [p for _, p in reversed(list_checkpoints(path))]
    if not found:
        raise FileNotFoundError(f"no checkpoint in {path!r}: expected model.pt or step_NNNNNN/ directories")
    return found


def load_newest(path, device="cpu", rank_files=False, log=print):
    """(step_dir, meta) of the newest readable checkpoint at path (a step dir or a run's out_dir).
    With rank_files (to resume), a checkpoint also needs the rank file of every rank that saved it
    (any number of ranks: load_rank_states reshards). An unreadable
    checkpoint is reported and the next older one tried; only if none is readable is it an error."""
    errors = []
    for step_dir in candidates(path):
        try:
            meta = read_model_file(step_dir, device)
            if rank_files:
                for r in range(saved_world(step_dir, meta)):
                    rank_file = os.path.join(step_dir, f"rank{r}.pt")
                    if not os.path.isfile(rank_file) or os.path.getsize(rank_file) == 0:
                        raise ValueError(f"{rank_file}: missing or empty")
        except FormatError:
            raise
        except ValueError as e:
            errors.append(str(e))
            log(f"skipping {step_dir}: {e}")
            continue
        if errors:
            log(f"using {step_dir}, the newest readable checkpoint")
        return step_dir, meta
    raise ValueError(f"no readable checkpoint in {path!r}:\n  " + "\n  ".join(errors))


def load_model(path, device="cpu", log=print):
    """(model, meta) from a step directory or a run's out_dir (its newest readable checkpoint), or from a
    folder scripts/export_hf.py wrote (read_export); meta holds the step, the settings and `path`, the
    step directory (or folder) used, where its tokenizer.json is."""
    if os.path.isfile(os.path.join(path, "model.safetensors")):
        return read_export(path, device)
    step_dir, meta = load_newest(path, device, log=log)
    model = GPT(GPTConfig(**meta.pop("config")))
    model.load_state_dict(meta.pop("model"))
    attach_gate(model, step_dir, device)
    meta["path"] = step_dir
    return model.to(device), meta


# The learned exit gate a step directory may hold beside its checkpoint (flt/exit_gate.py writes it)
GATE_FILE = "exit_gate.pt"


def gate_config(gate):
    """ExitGate's settings, {n_embd, hidden, margin}: what exit_gate.pt and an export's config.json
    record. The margin is stored in float32 (its buffer); 7 digits give back the number chosen."""
    return {"n_embd": gate.fc.in_features // 2, "hidden": gate.fc.out_features,
            "margin": float(f"{gate.margin.item():.7g}")}


def attach_gate(model, step_dir, device="cpu"):
    """model.exit_gate (flt/decoding.py: ExitGate) from step_dir/exit_gate.pt, if there is one:
    the exit rule "gate" then runs. A gate file that cannot be read, or was trained for another
    width, is a ValueError naming it."""
    path = os.path.join(step_dir, GATE_FILE)
    if not os.path.isfile(path):
        return
    saved = load_file(path, device)
    try:
        config = saved["config"]
        if config["n_embd"] != model.config.n_embd:
            raise ValueError(f"n_embd {config['n_embd']}, the model's is {model.config.n_embd}")
        gate = ExitGate(**config)
        gate.load_state_dict(saved["gate"])
    # a file that is no gate's dict, or one of another shape: never half loaded
    except (KeyError, IndexError, TypeError, AttributeError, ValueError, RuntimeError) as e:
        raise ValueError(f"{path}: not an exit gate of this model ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''}); train it again with "
                         f"python -m flt.exit_gate {step_dir}") from e
    model.exit_gate = gate.eval()


def run_tokenizer(meta):
    """The tokenizer a checkpoint's weights were trained with (load_model's meta): the
    tokenizer.json beside them, with the run's document token."""
    bos = meta.get("settings", {}).get("bos_token", data.BOS)
    return data.load_tokenizer(os.path.join(meta["path"], "tokenizer.json"), bos=bos)


def load_run(path, device="cpu", log=print):
    """(model, tokenizer, meta) of a run (its newest readable checkpoint), a step directory or an
    exported folder: what your own code needs to turn a prompt into text (docs/own-data.md)."""
    model, meta = load_model(path, device, log)
    return model.eval(), run_tokenizer(meta), meta


def _read_json(path):
    with open(path) as f:
        return json.load(f)


def read_export(folder, device="cpu"):
    """(model, meta) of an exported Hugging Face folder, read without transformers: the GPTConfig fields
    of config.json, the weights of model.safetensors (tensors only: reading them runs no code) and
    run.json's step and training settings. Needs safetensors (requirements/hf.txt)."""
    from safetensors.torch import load_file  # imported here: only exported folders need it
    files = {name: os.path.join(folder, name) for name in ("config.json", "run.json", "model.safetensors")}
    try:
        config, run = (_read_json(files[name]) for name in ("config.json", "run.json"))
        state = load_file(files["model.safetensors"], device=str(device))
    except (OSError, ValueError) as e:  # a missing file, JSON or safetensors that cannot be read
        raise ValueError(f"{folder}: not a readable exported model ({type(e).__name__}: {e})") from e
    if config.get("model_type") != "flt" or run.get("format") != FORMAT:
        raise FormatError(f"{folder}: model_type {config.get('model_type')!r}, checkpoint format {run.get('format')}"
                          f": this code reads model_type 'flt' exported from checkpoint format {FORMAT}")
    model = GPT(GPTConfig(**{f.name: config[f.name] for f in fields(GPTConfig) if f.name in config}))
    # the learned exit gate, exported with the model (scripts/export_hf.py)
    if config.get("exit_gate"):
        model.exit_gate = ExitGate(model.config.n_embd, **config["exit_gate"])
    model.load_state_dict({name.removeprefix("model."): tensor for name, tensor in state.items()})
    return model.to(device), {"step": run.get("step"), "settings": run.get("settings", {}), "path": folder}


def saved_world(step_dir, meta):
    """The world size that saved a checkpoint (recorded since world sizes may change; older ones:
    their rank files, counted)."""
    if "world_size" in meta:
        return meta["world_size"]
    return sum(1 for name in os.listdir(step_dir) if re.fullmatch(r"rank\d+\.pt", name))


def load_rank_states(step_dir, meta, rank, world_size, device="cpu"):
    """[this rank's own state] when the run saved with world_size ranks; else every saved rank's
    state, in rank order, on the CPU: load_optimizer and data.DataLoader continue from them."""
    saved = saved_world(step_dir, meta)
    if saved == world_size:
        return [load_file(os.path.join(step_dir, f"rank{rank}.pt"), device)]
    return [load_file(os.path.join(step_dir, f"rank{r}.pt")) for r in range(saved)]


def full_optimizer_state(opt, states):
    """{parameter index: {key: value}}: the whole state of `opt` (optim.AdamW or Muon) from the
    state_dicts every rank of one run saved, in rank order. AdamW's flat slices are joined in rank
    order; a Muon matrix's momentum comes whole from the one rank that owned it."""
    saved = [(s.get("world_size"), s.get("rank")) for s in states]
    if saved != [(len(states), r) for r in range(len(states))]:
        raise ValueError(f"optimizer states of (world_size, rank) {saved}: expected every rank of "
                         "the saved run, in rank order")
    pieces, params = {}, opt.parameters()
    for s in states:
        for i, state in s["state"].items():
            for key, value in state.items():
                pieces.setdefault(i, {}).setdefault(key, []).append(value)
    return {i: {key: torch.cat([v.cpu().view(-1) for v in values]).view(params[i].shape)
                if torch.is_tensor(values[0]) else values[0] for key, values in state.items()}
            for i, state in pieces.items()}


def load_optimizer(opt, states):
    """Load load_rank_states' optimizer states into opt: this rank's own, or every rank's of a run
    saved with another world size, resharded exactly (the pieces this rank now keeps of the whole)."""
    if len(states) == 1 and (states[0].get("world_size"), states[0].get("rank")) == (opt.world_size, opt.rank):
        return opt.load_state_dict(states[0])
    params = opt.parameters()
    mine = {i: {k: opt.piece(params[i], v) if torch.is_tensor(v) else v for k, v in state.items()}
            for i, state in full_optimizer_state(opt, states).items() if opt.owns(params[i])}
    opt.load_state_dict({"state": mine, "param_groups": states[0]["param_groups"],
                         "world_size": opt.world_size, "rank": opt.rank})


def rank_state(optimizers, loader, monitor, cuda):
    """What one rank saves beside the model (its rank<r>.pt): its optimizers' states, in the order
    given, its loader's position, its RNG states (CUDA's if cuda) and the divergence monitor."""
    return dict(optimizers=[o.state_dict() for o in optimizers], loader=loader.state_dict(),
                rng=torch.get_rng_state(), cuda_rng=torch.cuda.get_rng_state() if cuda else None, monitor=monitor)


def restore_rank_state(states, optimizers, rank, cuda):
    """Continue from load_rank_states' states (this rank's own, or every saved rank's): the optimizers
    (in rank_state's order, resharded if need be) and this rank's RNG states are loaded; returns
    (every state's loader position, for data.DataLoader, this rank's divergence monitor)."""
    for i, opt in enumerate(optimizers):
        load_optimizer(opt, [s["optimizers"][i] for s in states])
    own = states[rank % len(states)]
    torch.set_rng_state(own["rng"].cpu())
    if cuda and own["cuda_rng"] is not None:
        torch.cuda.set_rng_state(own["cuda_rng"].cpu())
    return [s["loader"] for s in states], own["monitor"]


def resharded(path, step, saved_world, world_size, skipped_documents, log=print):
    """None if the checkpoint at path was saved by world_size ranks; else, said through log, the record
    train.py logs when another number of ranks resumes it: the optimizer state is resharded exactly
    (load_optimizer), the data skips the documents no rank had reached (data.DataLoader)."""
    if saved_world == world_size:
        return None
    log(f"{saved_world} ranks saved {path}, {world_size} resume it: the optimizer state is resharded "
        f"exactly; the data continues after the furthest row group any rank had begun, skipping "
        f"{skipped_documents:,} documents no rank had reached")
    return {"step": step, "saved_world_size": saved_world, "skipped_documents": skipped_documents}


def set_aside_newer(out_dir, step, log=print):
    """Rename the checkpoints newer than `step` (those load_newest skipped as unreadable) to
    <name>.unreadable: they must not outrank the ones a resumed run writes."""
    for s, path in list_checkpoints(out_dir):
        if s > step:
            aside = unused_name(path + ".unreadable")
            os.replace(path, aside)
            log(f"moved the unreadable {path} aside to {aside}")


def _save(obj, path):
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())  # on disk before the directory is renamed into place


def write_model_file(step_dir, state, config, step, settings, **extra):
    """step_dir/model.pt, this format's one layout: the weights (a state dict), the GPTConfig, the
    step, the settings and the format number; extra: more keys (save's world_size)."""
    # a learned exit gate attached by load_model has its own file (GATE_FILE), never model.pt's
    state = {k: v for k, v in state.items() if not k.startswith("exit_gate.")}
    meta = dict(model=state, config=asdict(config), step=step, settings=settings, format=FORMAT)
    _save(meta | extra, os.path.join(step_dir, "model.pt"))


# Free space a checkpoint asks for beyond its estimate: a fraction, and bytes for the files whose
# size is known only once written (tokenizer.json: Qwen3's is 11 MB) and the filesystem's overhead.
SPACE_MARGIN, SPACE_SLACK = 0.05, 16 * 2**20


def _tensor_bytes(obj):
    """Bytes torch.save writes for the tensors in obj (nested dicts, lists, tuples): every storage
    once and whole, as torch.save stores it (a view saves its whole storage)."""
    storages = {}

    def walk(o):
        if torch.is_tensor(o):
            storages[(o.device, o.untyped_storage().data_ptr())] = o.untyped_storage().nbytes()
        elif isinstance(o, dict):
            list(map(walk, o.values()))
        elif isinstance(o, (list, tuple)):
            list(map(walk, o))
    walk(obj)
    return sum(storages.values())


def checkpoint_bytes(out_dir, state, rank_state, world_size):
    """Free bytes the next checkpoint in out_dir needs: the size of the newest one there (every file
    in it), else model.pt's tensors plus world_size times this rank's (the ranks' shards of the
    optimizer state are about equal); with SPACE_MARGIN and SPACE_SLACK to spare. The whole
    checkpoint, on every rank: all ranks write into one directory, so its disk must hold all parts."""
    found = list_checkpoints(out_dir)
    if found:
        size = sum(e.stat().st_size for e in os.scandir(found[-1][1]) if e.is_file())
    else:
        size = _tensor_bytes(state) + world_size * _tensor_bytes(rank_state)
    return math.ceil(size * (1 + SPACE_MARGIN)) + SPACE_SLACK


def filled_disk(e, free):
    """Whether the write that raised e failed for want of space: an OSError of a full disk, or
    what torch.save's zip writer ("unexpected pos") and the tokenizer's Rust writer ("os error
    28") raise instead, told apart from other failures by the disk left nearly empty."""
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return "os error 28" in str(e) or free < SPACE_SLACK


# How a rank's part of a checkpoint went, as the ranks tell each other (save)
WRITTEN, NO_SPACE, DISK_FULL, FAILED = range(4)
PUBLISH = "rename it into place or prune the older checkpoints"


def save(out_dir, step, model, rank_state, *, settings, rank=0, keep=2, keep_every=0, files=None,
         stopping=False):
    """Write checkpoint `step` atomically (every rank calls this; rank 0 owns the directory), then
    prune (see prune). files: {name: writer(path)} for rank 0 (the tokenizer). The run --overwrite
    set aside (REPLACED) is deleted by the new run's first checkpoint, but not by one a stop asked
    for (stopping: a Ctrl-C in the first steps may be the user taking the --overwrite back).
    Refuses non-finite parameters: a checkpoint of a diverged model would replace a good one.

    Every rank first checks that the disk of out_dir has room for the whole checkpoint
    (checkpoint_bytes), then writes its part into tmp_step_N; the ranks then agree (an all-reduce,
    the collective that also keeps them in step) whether every part was written. If any rank could
    not, rank 0 removes tmp_step_N and every rank raises: a DiskSpaceError (an OSError) naming the
    path, the bytes needed and free, with the same message on every rank, when a disk was too full;
    else the failing rank its own error and the others a RuntimeError naming it. Either way nothing
    of step N is kept and the earlier checkpoints are untouched (not pruned, not renamed)."""
    state = model.state_dict()
    bad = [k for k, v in state.items() if v.is_floating_point() and not torch.isfinite(v).all()]
    if bad:
        raise ValueError(f"step {step}: non-finite parameters {bad[:3]}; not saving over a good checkpoint")
    final, tmp = (os.path.join(out_dir, p + step_name(step)) for p in ("", "tmp_"))
    # where an earlier step_N goes while the new one is put in: a name nothing else holds (a
    # user's step_N.old is not touched); kept there if it holds results or a user's files
    old = unused_name(final + ".old")
    world = runtime.rank_world()[1]
    needed = checkpoint_bytes(out_dir, state, rank_state, world)
    hint = (f"nothing of {os.path.basename(final)} was kept and the earlier checkpoints are untouched; free "
            "some space, lower keep_checkpoints, or choose another out_dir")

    def what(r):
        return f"checkpoint step {step}" + (f" (rank {r} of {world})" if world > 1 else "")

    def agree(work, doing="write its part"):
        """work() on this rank, then every rank learns how every rank's part went, and raises if any failed."""
        error, report = None, [WRITTEN, needed, 0]
        try:
            work()
        except runtime.DiskSpaceError as e:
            error, report = e, [NO_SPACE, needed, e.free]
        except Exception as e:
            free = runtime.free_bytes(out_dir)
            error, report = e, [DISK_FULL if filled_disk(e, free) else FAILED, needed, free]
        reports = torch.zeros(world, 3, dtype=torch.long, device=next(model.parameters()).device)
        reports[rank] = torch.tensor(report)
        runtime.all_reduce_sum(reports)  # each rank filled its own row
        failed = [(r, *row) for r, row in enumerate(reports.tolist()) if row[0] != WRITTEN]
        if not failed:
            return
        if rank == 0:  # nothing half-written stays, and a replaced step_N comes back
            shutil.rmtree(tmp, ignore_errors=True)
            if os.path.isdir(old) and not os.path.isdir(final):
                os.replace(old, final)
        r, kind, r_needed, r_free = failed[0]
        if kind == FAILED:
            if error is not None:
                raise error
            raise RuntimeError(f"{what(r)}: could not {doing} (that rank's own error says why)"
                               + (f"; {hint}" if doing != PUBLISH else ""))
        filled = ", which filled the disk while being written" if kind == DISK_FULL else ""
        raise runtime.DiskSpaceError(what(r) + filled, out_dir, r_needed, r_free, hint) from (
            None if isinstance(error, runtime.DiskSpaceError) else error)

    def first_part():  # every rank checks the space; rank 0 writes the directory, model.pt, the files
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # left by a run killed while saving: its space is free
        runtime.check_free_space(out_dir, needed, what(rank), hint)
        if rank == 0:
            os.makedirs(tmp)
            # data: your own files' documents (owndata.data_of), which a resume and eval.py check
            data = owndata.data_of(settings)
            write_model_file(tmp, state, model.config, step, settings, world_size=world,
                             **({"data": data} if data else {}))
            for name, write in (files or {}).items():
                write(os.path.join(tmp, name))

    def publish():  # rank 0: step_N appears whole, then the old ones go
        if rank == 0:
            if os.path.isdir(final):  # the same step saved again: the old copy goes only after the new is in
                os.replace(final, old)
            os.replace(tmp, final)
            others = sorted(set(os.listdir(old)) - set(checkpoint_files(old))) if os.path.isdir(old) else []
            if others:
                print(f"step {step} saved again: the earlier {os.path.basename(final)} is kept as {old}, "
                      f"for {', '.join(others)}, which training did not write", flush=True)
            else:
                shutil.rmtree(old, ignore_errors=True)
            prune(out_dir, keep, keep_every)
            if not stopping:
                drop_replaced(out_dir)
            elif os.path.isdir(os.path.join(out_dir, REPLACED)):
                print(f"kept {os.path.join(out_dir, REPLACED)}, the run --overwrite set aside: this save "
                      "was a stop's; the next scheduled save deletes it", flush=True)

    agree(first_part)
    agree(lambda: _save(rank_state, os.path.join(tmp, f"rank{rank}.pt")))
    agree(publish, PUBLISH)
    return final


def check_same_tokenizer(step_dir, tok, settings):
    """A ValueError unless tok, the tokenizer a resumed run read (the BPE cached in data_dir, a
    file, a task's vocabulary), is the one the checkpoint in step_dir trained with, its
    tokenizer.json: under other ids the weights would read other text."""
    saved = os.path.join(step_dir, "tokenizer.json")
    if os.path.isfile(saved) and _read_json(saved) != json.loads(tok.tok.to_str()):
        where = "the BPE cached in data_dir" if settings["tokenizer"] == "bpe" else "the file"
        raise ValueError(f"--resume: {step_dir} trained with its tokenizer.json, and this run read "
                         f"another one (tokenizer={settings['tokenizer']!r}, data_dir="
                         f"{settings['data_dir']!r}); copy {saved} over {where}, or resume with the "
                         "data_dir and tokenizer the run trained with")


def check_keep(keep):
    """keep_checkpoints: train.py checks it before a run starts, prune whenever it deletes."""
    if keep < 0:
        raise ValueError(f"keep_checkpoints={keep}: expected >= 1, or 0 to keep every checkpoint")


# The files a checkpoint consists of (save writes them, prune deletes them): anything else in a step
# directory (eval.py's eval.json and eval.md, lm_eval.json, a user's notes) is not the checkpoint's.
CHECKPOINT_FILE = re.compile(r"model\.pt|rank\d+\.pt|tokenizer\.json")


def prune(out_dir, keep, keep_every=0, log=print):
    """Delete all but the newest `keep` checkpoints (0 = keep all); the newest always stays, and so
    do steps that are multiples of keep_every (> 0), e.g. the points of a curve over training.
    Only a checkpoint's own files go (CHECKPOINT_FILE); a step directory that also holds results or
    a user's files stays with them, said through log. A step directory a kill left half-pruned (no
    model.pt, some checkpoint files) is finished here."""
    check_keep(keep)
    if keep == 0:
        return
    found = list_checkpoints(out_dir)
    old = [path for step, path in found[:-keep] if not (keep_every and step % keep_every == 0)]
    complete = {path for _, path in found}
    half = [os.path.join(out_dir, name) for name in sorted(os.listdir(out_dir))
            if _STEP.fullmatch(name) and os.path.join(out_dir, name) not in complete]
    for path in old + [p for p in half if os.path.isdir(p) and checkpoint_files(p)]:
        if os.path.islink(path):  # a step moved elsewhere and linked back: its files are not ours to delete
            log(f"kept {path}: a link (to {os.path.realpath(path)}), never pruned")
            continue
        try:
            remove_checkpoint(path, log)
        except OSError as e:  # a failed delete costs disk, not the run: training goes on
            log(f"could not prune {path} ({e.strerror or e}); it stays, and training goes on")


def checkpoint_files(step_dir):
    return [name for name in os.listdir(step_dir) if CHECKPOINT_FILE.fullmatch(name)]


def remove_checkpoint(step_dir, log=print):
    """The checkpoint in step_dir deleted: model.pt first (from then on it is no checkpoint: nothing
    loads it), then its other files; the directory too if that leaves it empty."""
    model_file = os.path.join(step_dir, "model.pt")
    if os.path.exists(model_file):
        os.remove(model_file)
    for name in checkpoint_files(step_dir):
        os.remove(os.path.join(step_dir, name))
    kept = sorted(os.listdir(step_dir))
    if not kept:
        os.rmdir(step_dir)
        return
    log(f"pruned the checkpoint in {step_dir}; the directory stays for {', '.join(kept)}, "
        f"which training did not write")


# ------------------------------------------------------------------------------------
# The run directory: one run at a time, and a fresh run never mixes with an old one.

# wandb.json: tracking.py's W&B run id. imported.json: a run the authors' code trained, brought in
# by scripts/import_authors.py (flt/authors.py) without their optimizer state: never resumed.
# log.replayed.jsonl: the lines a resumed run took out of log.jsonl (diagnostics.Log).
IMPORTED = "imported.json"
SETTINGS = "settings.json"
RUN_FILES = ("log.jsonl", "log.replayed.jsonl", SETTINGS, "wandb.json", IMPORTED)
# What a run writes besides them: its checkpoints, half-written ones, and ones set aside
RUN_DIRS = re.compile(r"(tmp_)?step_\d+(\.old\d*|\.unreadable\d*)?")
# The lock a live run holds on its out_dir (claim_out_dir)
LOCK = "run.lock"
# Where --overwrite moves the run it replaces, until the new run's first checkpoint is written
REPLACED = "replaced_run"


def run_files(out_dir):
    """The names in out_dir that a run wrote (RUN_FILES, RUN_DIRS), sorted; nothing else is a run's."""
    return sorted(name for name in os.listdir(out_dir) if name in RUN_FILES or RUN_DIRS.fullmatch(name))


def check_no_results(out_dir, doing):
    """A ValueError naming them if a run's step directories hold files train.py did not write
    (eval.py's eval.json and eval.md, a gate, lm_eval.json, notes): `doing` would delete them."""
    foreign = [os.path.join(name, f) for name in run_files(out_dir) if os.path.isdir(os.path.join(out_dir, name))
               for f in sorted(os.listdir(os.path.join(out_dir, name))) if not CHECKPOINT_FILE.fullmatch(f)]
    if foreign:
        shown = ", ".join(foreign[:4]) + (f" and {len(foreign) - 4} more" if len(foreign) > 4 else "")
        raise ValueError(f"{doing} would delete {shown} in out_dir={out_dir!r}, which train.py did not "
                         "write (results of the old run, or your files): move them out first, or choose "
                         "another --out_dir")


# What each of a run's files holds, as train.py writes it: JSON objects with these keys (a log: its
# first line, or nothing yet)
RUN_FILE_KEYS = {SETTINGS: {"variant", "loops"}, "log.jsonl": {"step"}, "log.replayed.jsonl": {"step"},
                 "wandb.json": {"project", "id"}}


def check_settings_file(out_dir):
    """settings.json, log.jsonl, log.replayed.jsonl and wandb.json in out_dir must be the ones a run
    wrote (RUN_FILE_KEYS): a user's file of such a name is refused, never replaced or deleted."""
    for name, keys in RUN_FILE_KEYS.items():
        path = os.path.join(out_dir, name)
        if not os.path.isfile(path):
            continue
        try:
            with open(path) as f:
                first = f.read() if name.endswith(".json") else f.readline()
            saved = json.loads(first) if first.strip() or name.endswith(".json") else dict.fromkeys(keys)
        except (OSError, ValueError):
            saved = None
        if not (isinstance(saved, dict) and keys <= saved.keys()):
            raise ValueError(f"{path} was not written by train.py (a run writes its {name} there): "
                             "move it, or choose another --out_dir")


def prepare_out_dir(out_dir, resume, overwrite, log=print):
    """Check out_dir, which this process has locked (claim_out_dir): writable; resume=True needs a
    checkpoint, of this code's (an imported run has no optimizer state: IMPORTED); a fresh run
    refuses a directory holding another run unless overwrite=True, which moves that run's files
    aside to REPLACED (deleted once the new run saves: drop_replaced; put back if it cannot start:
    restore_replaced). Returns the REPLACED path when it moved a run there, else None.
    resume="auto" (a job's first submission and every requeue): resume if out_dir holds a checkpoint,
    else start fresh, deleting what a run that never saved one wrote (its log, its settings).
    Only a run's own files (run_files) are ever moved or deleted."""
    try:
        probe = os.path.join(out_dir, f".write_test{os.getpid()}")
        open(probe, "w").close()
        os.remove(probe)
    except OSError as e:
        raise ValueError(f"out_dir={out_dir!r} is not writable: {e.strerror}") from e
    check_settings_file(out_dir)
    steps = [os.path.basename(p) for _, p in list_checkpoints(out_dir)]
    found = steps + [f for f in RUN_FILES if os.path.exists(os.path.join(out_dir, f))]
    replaced = os.path.join(out_dir, REPLACED)
    if resume == "auto" and not steps:
        check_no_results(out_dir, "--resume=auto (no checkpoint to resume: starting afresh)")
        remove_run_files(out_dir)
        return None
    if resume:
        if not steps:
            raise FileNotFoundError(f"--resume: no checkpoint (step_NNNNNN/model.pt) in out_dir={out_dir!r}")
        if os.path.isfile(os.path.join(out_dir, IMPORTED)):  # a fresh optimizer: another run
            raise ValueError(f"--resume: out_dir={out_dir!r} holds a run imported from the authors'"
                             f" code ({IMPORTED}) without their optimizer state, so it cannot be "
                             f"continued here; evaluate or export it, or train a new run elsewhere")
    elif found and not overwrite:
        raise ValueError(f"out_dir={out_dir!r} already holds a run ({', '.join(found[-3:])}): continue it "
                         f"with --resume, choose another --out_dir, or replace it with --overwrite")
    elif found and os.path.isdir(replaced) and steps:
        raise ValueError(f"out_dir={out_dir!r} holds a run with checkpoints and {replaced}, a run "
                         f"--overwrite set aside: delete one of them by hand, then run again")
    elif found:
        # deleted now, or moved aside and deleted once this run saves: nothing in it may be anyone else's
        check_no_results(out_dir, "--overwrite")
        if os.path.isdir(replaced):
            # an earlier --overwrite whose new run never saved: that run's files go, the replaced one stays
            remove_run_files(out_dir)
            log(f"{replaced} still holds the run an earlier --overwrite replaced; it stays until this "
                f"run saves its first checkpoint")
        else:
            os.makedirs(replaced)
            for name in run_files(out_dir):
                os.replace(os.path.join(out_dir, name), os.path.join(replaced, name))
            log(f"--overwrite: moved the run in {out_dir} to {replaced}; it is deleted once this run "
                f"has saved its first checkpoint")
            return replaced
    for name in os.listdir(out_dir):  # half-written checkpoints of a killed run (tmp_step_N exactly)
        if re.fullmatch(r"tmp_step_\d+", name):
            shutil.rmtree(os.path.join(out_dir, name), ignore_errors=True)
    return None


def remove_run_files(out_dir):
    """Delete what a run wrote in out_dir (run_files) and nothing else."""
    for name in run_files(out_dir):
        path = os.path.join(out_dir, name)
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)


def restore_replaced(out_dir, log=print):
    """The run --overwrite moved to REPLACED back in its place (a new run that could not start):
    what the new run wrote meanwhile goes first."""
    replaced = os.path.join(out_dir, REPLACED)
    remove_run_files(out_dir)
    for name in os.listdir(replaced):
        os.replace(os.path.join(replaced, name), os.path.join(out_dir, name))
    os.rmdir(replaced)
    log(f"the run --overwrite had moved to {replaced} is back in {out_dir}")


def drop_replaced(out_dir, log=print):
    """Delete REPLACED, the run --overwrite set aside, once the new run has a checkpoint (save)."""
    replaced = os.path.join(out_dir, REPLACED)
    if os.path.isdir(replaced):
        shutil.rmtree(replaced)
        log(f"deleted {replaced}, the run --overwrite replaced: this run has its first checkpoint")


def claim_out_dir(out_dir, resume, overwrite, log=print):
    """Lock out_dir (lock_out_dir), then prepare_out_dir: nothing in it is moved or deleted before
    this process holds the lock, so a second run refused by the lock changes nothing. Returns the
    lock, to be kept while the run lives. If the run ends on a user's error (a download refused, a
    tokenizer that does not load), a run --overwrite set aside is put back, and the directories this
    call created are removed again while they hold nothing but the lock."""
    made = errors.missing(out_dir)
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        raise ValueError(f"out_dir={out_dir!r} is not writable: {e.strerror}") from e
    lock_path = os.path.join(out_dir, LOCK)
    before = open(lock_path, "rb").read() if os.path.isfile(lock_path) else None
    lock = lock_out_dir(out_dir)
    # the paths only: holding the lock here would keep it from being released with the run
    errors.on_user_error(functools.partial(release, made, lock_path, before))
    if prepare_out_dir(out_dir, resume, overwrite, log):
        errors.on_user_error(functools.partial(restore_replaced, out_dir, log))
    return lock


def release(made, lock_path, before):
    """Undo what claiming a run directory wrote: the lock's file as it was (`before`: its bytes, or
    None: removed), then the directories `made` (innermost first) if that leaves them empty. The
    lock is still held: the process is ending, and the kernel releases it then."""
    if before is None:
        os.remove(lock_path)
    else:
        with open(lock_path, "wb") as f:
            f.write(before)
    errors.remove_empty(made)


def lock_out_dir(out_dir):
    """Hold an exclusive lock on out_dir/run.lock for the life of the process (the kernel drops it
    when the process ends, however it ends). A second run on the same out_dir is refused."""
    path = os.path.join(out_dir, LOCK)
    try:
        f = open(path, "a+")
    except OSError as e:
        raise ValueError(f"out_dir={out_dir!r} is not writable: {e.strerror}") from e
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        owner = f.read().strip() or "another process"
        f.close()
        raise ValueError(f"out_dir={out_dir!r} is in use by {owner} (lock {path}): wait for that run, "
                         f"or choose another --out_dir") from None
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on host {socket.gethostname()}\n")
    f.flush()
    return f  # keep a reference: closing it releases the lock
