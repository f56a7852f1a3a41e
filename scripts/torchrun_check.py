"""
The headline command, `torchrun train.py config/flt_base.py`, checked on the machine at hand:
    python -m scripts.torchrun_check                         # one CUDA GPU, NCCL, the paper's batch
    python -m scripts.torchrun_check --tiny --device=cpu     # the same steps, tiny, 2 gloo ranks
The steps, each a process as a user would start it:
  train   torchrun train.py config/flt_base.py at 2**19 tokens a step (gradient accumulation makes
          up what the device batch does not), `steps` steps, a checkpoint halfway and at the end
  resume  a copy of that run at its first checkpoint, continued with --resume=auto: its next
          steps' losses against the uninterrupted run's
  eval    eval.py on the trained run (bf16 on CUDA): its bpb against training's last validation
  zero    optim.py's ZeRO path with the optimizers built as distributed on this world size (one
          GPU: a process group of one, so NCCL's reduce-scatter and all-gather run with their
          real dtypes and sizes): one step's parameters against the single-process optimizers'
Nothing is fetched: the data is the embedded corpus and its BPE in data_dir (built here if absent;
carry them to a machine without network). On CUDA the BPE is padded with ids no text produces up
to Qwen3's vocabulary, so the LM head has the paper's shape. It prints a table and writes it as
JSON (--out, default <out_dir>/torchrun_check.json) after every step. docs/testing.md has the table.
A rerun replaces the runs it wrote in out_dir (its .torchrun_check there says so); an out_dir that
holds other files, or an --out that is not its JSON, is refused before any work.
"""
import json
import os
import shutil
import subprocess
import sys
import time

import torch

import data
from configurator import configure
from flt import checkpoint, corpus, errors
from flt.errors import user_errors
from flt.runtime import atomic_write

device = "cuda"             # cuda; cpu only with --tiny
tiny = False                # a tiny model on 2 gloo ranks: what the test suite runs on CPU
steps = 4                   # the uninterrupted run's optimizer steps (even: a checkpoint halfway)
device_batch_size = 8       # sequences per forward on the GPU (config/paper.py's; --dry_run plans it)
data_dir = "data"           # the embedded corpus and its BPE (built here if absent)
out_dir = "out/torchrun_check"  # the runs, their consoles and the JSON
out = ""                    # the JSON's path; empty = <out_dir>/torchrun_check.json
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# every run's data: the embedded corpus with its BPE, whatever config/paper.py names
DATA = ["--dataset=embedded", "--bos_token=<|endoftext|>", "--core_interval=0",
        "--sample_tokens=0"]
# config/flt_base.py's K
LOOPS = 9
# the tiny size (train.py settings), on CPU in fp32 without compilation
TINY = ["--depth=1", "--sequence_len=32", "--device_batch_size=2", "--total_batch_size=256",
        "--device=cpu", "--dtype=fp32", "--compile=off"]


# In out_dir: the folder is this script's, and a rerun replaces the runs it wrote there
MARK = ".torchrun_check"


def claim(folder, path):
    """Make folder (out_dir) this script's, if it is new, empty or already its own (MARK); a
    FileExistsError naming it if it holds other files, whose runs (run/, resumed/) a rerun would
    replace, if its resumed/ holds a file no run wrote, or if the JSON's path holds a file that is
    not this script's JSON."""
    held = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    if held and MARK not in held:
        raise FileExistsError(f"--out_dir={folder}: holds files torchrun_check did not write "
                              f"({', '.join(held[:3])}), and a rerun replaces its runs there: choose "
                              "another --out_dir, or an empty one")
    # run/ is replaced by train.py's --overwrite, which keeps what it did not write; resumed/ is
    # deleted here: only a run's own files may be in it
    resumed = os.path.join(folder, "resumed")
    if os.path.isdir(resumed):
        others = sorted(set(os.listdir(resumed)) - set(checkpoint.run_files(resumed)) - {checkpoint.LOCK})
        if others:
            raise FileExistsError(f"{resumed}: holds {', '.join(others[:3])}, which a rerun would "
                                  "delete with the resumed run: move it, or choose another --out_dir")
        checkpoint.check_no_results(resumed, "a rerun of torchrun_check")
        checkpoint.check_settings_file(resumed)
    try:
        with open(path) as f:
            meta = json.load(f)["meta"]
        ours = isinstance(meta, dict) and "tiny" in meta
    except FileNotFoundError:
        ours = True
    except (OSError, ValueError, KeyError, TypeError):
        ours = False
    if not ours:
        raise FileExistsError(f"--out={path}: not a torchrun_check JSON, and it would be replaced: "
                              "choose another --out, or move the file")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, MARK), "w") as f:
        f.write("written by python -m scripts.torchrun_check: a rerun replaces its runs here\n")


def padded_tokenizer(bpe_path, path, size):
    """The BPE at bpe_path with ids up to `size` that no text produces (vocabulary entries no
    merge builds): the same tokens of every text, the paper's vocabulary size."""
    with open(bpe_path) as f:
        spec = json.load(f)
    vocab = spec["model"]["vocab"]
    taken = len(vocab) + len(spec.get("added_tokens", []))
    for i in range(size - taken):
        vocab[f"<|unused_{i}|>"] = taken + i
    atomic_write(path, json.dumps(spec))
    return path


def prepare_data():
    """train.py's tokenizer settings: the embedded corpus's BPE (built here once), padded to
    Qwen3's vocabulary on CUDA."""
    shards = corpus.embedded_corpus(data_dir)
    vocab = 512 if tiny else 4096
    data.get_tokenizer("bpe", os.path.dirname(shards[0]), shards[:-1], vocab)
    os.makedirs(out_dir, exist_ok=True)
    if tiny:
        return ["--tokenizer=bpe", f"--bpe_vocab_size={vocab}"]
    bpe = os.path.join(os.path.dirname(shards[0]), f"tokenizer_bpe{vocab}.json")
    path = os.path.join(out_dir, "tokenizer_qwen3_size.json")
    return [f"--tokenizer={padded_tokenizer(bpe, path, data.QWEN3_VOCAB)}"]


def torchrun(argv, console):
    """torchrun train.py config/flt_base.py argv, its output to `console`: the exit status."""
    nproc = 2 if tiny else torch.cuda.device_count() or 1
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", "train.py", "config/flt_base.py", *argv]
    with open(console, "w") as f:
        return subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT).returncode


def records(run):
    with open(os.path.join(run, "log.jsonl")) as f:
        return [json.loads(line) for line in f]


def losses(run):
    return {r["step"]: r["loss"] for r in records(run) if "loss" in r}


def tail(console, n=15):
    with open(console) as f:
        return f.read().splitlines()[-n:]


def train_step(common):
    run = os.path.join(out_dir, "run")
    console = os.path.join(out_dir, "train.txt")
    start = time.time()
    code = torchrun([*common, f"--out_dir={run}", f"--num_steps={steps}", "--overwrite"], console)
    result = {"exit": code, "seconds": round(time.time() - start), "console_tail": tail(console)}
    if code:
        return result
    logged = records(run)
    timed = [r for r in logged if "tok_per_s" in r][1:]  # the first step compiles
    result |= {"losses": losses(run), "run": run,
               "tok_per_s": [round(r["tok_per_s"]) for r in timed],
               "mfu": [round(r["mfu"], 4) for r in timed if r.get("mfu") is not None],
               "mem_gib": [round(r["mem_gib"], 2) for r in logged if "mem_gib" in r],
               "final_val_bpb": [r["final_val_bpb"] for r in logged if "final_val_bpb" in r][-1]}
    if not tiny:
        # the planner's memory estimate, against the first steps' peak above
        plan = subprocess.run([sys.executable, "train.py", "config/flt_base.py", *common,
                               "--dry_run", f"--out_dir={run}"], cwd=ROOT, capture_output=True,
                              text=True)
        result["dry_run_memory"] = [line.strip() for line in plan.stdout.splitlines()
                                    if "memory" in line]
    return result


def resume_step(common, trained):
    """The run's first checkpoint copied to a new directory and continued with --resume=auto."""
    first = f"step_{steps // 2:06d}"
    run = os.path.join(out_dir, "resumed")
    shutil.rmtree(run, ignore_errors=True)
    os.makedirs(run)
    shutil.copytree(os.path.join(trained["run"], first), os.path.join(run, first))
    shutil.copy(os.path.join(trained["run"], "settings.json"), run)
    console = os.path.join(out_dir, "resume.txt")
    code = torchrun([*common, f"--out_dir={run}", f"--num_steps={steps}", "--resume=auto"],
                    console)
    result = {"exit": code, "console_tail": tail(console)}
    if code:
        return result
    again = losses(run)
    before = trained["losses"]
    diffs = [abs(again[s] - before[s]) for s in again if s in before]
    result |= {"losses": again, "steps_compared": sorted(s for s in again if s in before),
               "max_abs_loss_diff": max(diffs) if diffs else None}
    return result


def final_tokens():
    """The final validation's tokens, which eval.py scores again."""
    return 4096 if tiny else 2**20


def eval_step(trained):
    """eval.py on the trained run at its K, with training's validation layout (its ranks, device
    batch and tokens): the bpb the log's final validation holds, recomputed."""
    console = os.path.join(out_dir, "eval.txt")
    json_path = os.path.join(out_dir, "eval.json")
    ranks = 2 if tiny else torch.cuda.device_count()
    batch = 2 if tiny else device_batch_size
    cmd = [sys.executable, "eval.py", trained["run"], "--modes=bpb", f"--loops={LOOPS}",
           f"--dtype={'fp32' if tiny else 'bf16'}", f"--data_dir={data_dir}", f"--out={json_path}",
           f"--device={'cpu' if tiny else 'cuda'}", f"--bpb_tokens={final_tokens()}",
           f"--protocol_ranks={ranks}", f"--protocol_batch={batch}", f"--batch_size={batch}"]
    with open(console, "w") as f:
        code = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT).returncode
    result = {"exit": code, "console_tail": tail(console)}
    if code == 0:
        with open(json_path) as f:
            at_K = json.load(f)["results"][str(LOOPS)]
        result["val_bpb"] = next(v for k, v in at_K.items() if k.startswith("val_bpb"))
        result["train_final_val_bpb"] = trained["final_val_bpb"]
    return result


def zero_step():
    """optim.py's collectives at this world size (scripts/zero_check.py)."""
    console = os.path.join(out_dir, "zero.txt")
    nproc = 2 if tiny else 1
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", "-m", "scripts.zero_check",
           f"--device={'cpu' if tiny else 'cuda'}", f"--tiny={tiny}"]
    with open(console, "w") as f:
        code = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT).returncode
    result = {"exit": code, "console_tail": tail(console)}
    found = [line for line in tail(console, 40) if line.startswith("zero_check ")]
    if found:
        result |= json.loads(found[-1][len("zero_check "):])
    return result


def main():
    if steps < 2 or steps % 2:
        raise ValueError(f"--steps={steps}: expected an even number >= 2 (a checkpoint halfway)")
    errors.positive("--device_batch_size", device_batch_size)
    if not tiny and not (device.startswith("cuda") and torch.cuda.is_available()):
        raise ValueError(f"--device={device}: the full check needs a CUDA GPU, and this torch "
                         f"({torch.__version__}) sees none; --tiny --device=cpu runs its steps "
                         "on the CPU at a tiny size")
    if tiny and device != "cpu":
        raise ValueError(f"--device={device}: --tiny runs on the CPU (--device=cpu)")
    if tiny and device_batch_size != 8:
        raise ValueError(f"--device_batch_size={device_batch_size} does nothing with --tiny (its "
                         "device batch is 2): remove it")
    errors.directory("--data_dir", data_dir)
    errors.directory("--out_dir", out_dir)
    if out:
        errors.output_file("--out", out)
    path = out or os.path.join(out_dir, "torchrun_check.json")
    # a folder of other files, or another file at --out: refused, before any work
    claim(out_dir, path)
    # the data first: nothing is written before it is there
    batch = TINY if tiny else [f"--device_batch_size={device_batch_size}"]
    common = [*DATA, *batch, *prepare_data(), f"--data_dir={data_dir}",
              f"--eval_tokens={final_tokens() // 2}", f"--final_eval_tokens={final_tokens()}",
              f"--save_interval={steps // 2}", f"--eval_interval={steps // 2}",
              "--keep_checkpoints=0"]
    where = torch.cuda.get_device_name() if not tiny else "cpu"
    results = {"meta": {"device": where, "torch": torch.__version__,
                        "date": time.strftime("%Y-%m-%d"), "tiny": tiny}}
    results["train"] = train_step(common)
    atomic_write(path, json.dumps(results, indent=1))
    if results["train"]["exit"] == 0:
        results["resume"] = resume_step(common, results["train"])
        atomic_write(path, json.dumps(results, indent=1))
        results["eval"] = eval_step(results["train"])
        atomic_write(path, json.dumps(results, indent=1))
    results["zero"] = zero_step()
    atomic_write(path, json.dumps(results, indent=1))
    print(table(results))
    print(f"written to {path}; the runs and their consoles are in {out_dir}")
    failed = [name for name, part in results.items() if part.get("exit")]
    if failed:
        raise SystemExit(f"torchrun_check: {', '.join(failed)} failed (exit status non-zero); "
                         f"their consoles are in {out_dir}")


def table(results):
    rows = [("device", results["meta"]["device"]), ("torch", results["meta"]["torch"])]
    train = results["train"]
    if train["exit"] == 0:
        rows += [("tokens/s (after the first step)", ", ".join(map(str, train["tok_per_s"]))),
                 ("MFU", ", ".join(f"{100 * m:.1f}%" for m in train["mfu"]) or "-"),
                 ("peak memory GiB (first steps)", ", ".join(map(str, train["mem_gib"])) or "-"),
                 ("--dry_run's estimate", "; ".join(train.get("dry_run_memory", [])) or "-"),
                 ("final validation bpb (training's log)", f"{train['final_val_bpb']:.4f}")]
    resume = results.get("resume", {})
    if resume.get("max_abs_loss_diff") is not None:
        rows.append((f"resume: steps {resume['steps_compared']} max |loss diff|",
                     f"{resume['max_abs_loss_diff']:.2g}"))
    evaluated = results.get("eval", {})
    if "val_bpb" in evaluated:
        diff = abs(evaluated["val_bpb"] - evaluated["train_final_val_bpb"])
        rows.append(("eval.py bpb on the same tokens", f"{evaluated['val_bpb']:.4f} (|diff| {diff:.2g})"))
    zero = results["zero"]
    for name, path in zero.get("paths", {}).items():
        measured = (f"{path['max_abs_param_diff']:.2g}, {path['collectives']} collectives "
                    f"in {', '.join(path['dtypes'])}")
        rows.append((f"ZeRO step vs one process ({name}): max |param diff|", measured))
    for name, part in results.items():
        if name != "meta" and part.get("exit"):
            rows.append((f"{name}: exit {part['exit']}", part["console_tail"][-1]
                         if part["console_tail"] else ""))
    width = max(len(a) for a, _ in rows)
    return "\n".join(f"{a:<{width}}  {b}" for a, b in rows)


if __name__ == "__main__":
    with user_errors("scripts.torchrun_check"):
        configure(globals(), sys.argv[1:])
        # the processes run in the repository root: the paths given, from where they were given
        data_dir, out_dir, out = (os.path.abspath(p) if p else p for p in (data_dir, out_dir, out))
        main()
