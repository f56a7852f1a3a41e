"""Support for train.py and eval.py: where this process runs, its numerics, and small shared chores.

    rt = runtime.setup(device)        # torchrun's rank/world, the device (errors name the setting or the torch)
    runtime.init_group(rt, timeout)   # the process group (eval.py; train.py writes it out)
    dtype = runtime.resolve_dtype(dtype, rt.device_type)   # "auto" = bf16 on CUDA, fp32 elsewhere
    autocast = runtime.precision(model, rt.device_type, dtype)   # eval.py; train.py writes it out
    runtime.print0(...)               # rank 0 only
    runtime.atomic_write(path, text)  # readers never see half a file (flt/files.py, torch-free)
    runtime.check_free_space(path, n, "what", "hint")  # DiskSpaceError unless n bytes fit there
    with runtime.Timer(device) as took: work()   # took.seconds; runtime.timed(work, device) the same
    with runtime.evaluating(model, autocast): ...   # train.py's evaluations: eval mode, eager
    text = runtime.sample(model, tokenizer, "The", 64, loops=3)
    print(runtime.framed("sample", text))  # a sample as text, between two rules
"""
import contextlib
import errno
import os
import re
import shutil
import sys
import tempfile
import time
from datetime import timedelta
from types import SimpleNamespace

import torch
import torch.distributed as dist

from flt.files import atomic_write, temp_path  # noqa: F401 (runtime.atomic_write, as ever)
from optim import COLLECTIVES


# The collectives optim.py's sharded optimizers call (optim.py: collectives): torch 2.13's names, or
# the same operations under the names torch 2.0 to 2.12 give them. A torch with neither would fail at
# the first optimizer step of a multi-rank run, after the downloads and compilation. Every run needs
# torch 2.6's NEEDED (evaluation's set_stance, the static cache's autocast dtype); the tests run 2.13.
TORCH_NEEDED = "2.6"
NEEDED = ("torch.compiler.set_stance", "torch.get_autocast_dtype")


def check_torch(world=1):
    """ValueError naming the torch to install unless this one has NEEDED and, for a world of more
    than one process, one pair of COLLECTIVES."""
    install = (f"install torch>={TORCH_NEEDED} (requirements.txt pins torch==2.13.0; a CUDA node: the "
               "install line in docs/recipe.md)")
    for name in NEEDED:
        found = torch
        for part in name.split(".")[1:]:
            found = getattr(found, part, None)
        if found is None:
            raise ValueError(f"this torch ({torch.__version__}) has no {name}, which this code calls: "
                             f"{install}")
    if world > 1 and not any(all(hasattr(dist, name) for name in pair) for pair in COLLECTIVES):
        names = " or ".join(f"torch.distributed.{a} and .{b}" for a, b in COLLECTIVES)
        raise ValueError(f"this torch ({torch.__version__}) has neither {names}, which optim.py calls: "
                         f"{install}")


def setup(device=""):
    """This process's place under torchrun (RANK, LOCAL_RANK, WORLD_SIZE; one process without it)
    and its device: "" = cuda if there is one, else cpu; "cuda" = this rank's GPU (LOCAL_RANK);
    "cuda:N" = GPU N, for one process only (under torchrun each rank takes its LOCAL_RANK's: choose
    the GPUs with CUDA_VISIBLE_DEVICES); "mps"; "cpu" (no index: there is one CPU device). A device
    this torch cannot use is a ValueError naming the setting, and so is a torch older than 2.6 or,
    under torchrun, one without optim.py's collectives (check_torch).
    No process group yet: train.py prepares data first, which may outlast a collective's timeout."""
    rank, local_rank, world = (int(os.environ.get(k, d)) for k, d in (("RANK", 0), ("LOCAL_RANK", 0),
                                                                       ("WORLD_SIZE", 1)))
    # one process skips every collective (optim.py): then only NEEDED is checked
    check_torch(world)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if not re.fullmatch(r"cpu|mps|cuda(:\d+)?", device):
        raise ValueError(f"device={device!r}: expected 'cpu', 'cuda', 'cuda:N' (one process), 'mps', or '' "
                         "(cuda if there is one, else cpu)")
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"device={device!r}, but this torch ({torch.__version__}) sees no CUDA device; "
                             "use --device=cpu")
        index = int(device[5:]) if ":" in device else local_rank
        if ":" in device and world > 1:
            raise ValueError(f"device={device!r} under torchrun: each rank uses the GPU of its LOCAL_RANK; use "
                             "--device=cuda (CUDA_VISIBLE_DEVICES chooses the GPUs)")
        if index >= torch.cuda.device_count():
            raise ValueError(f"device={device!r}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                             f"cuda:0 .. cuda:{torch.cuda.device_count() - 1}")
        device = f"cuda:{index}"
        torch.cuda.set_device(device)
    if device == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device='mps', but this torch ({torch.__version__}) sees no MPS device; use --device=cpu")
    return SimpleNamespace(device=device, device_type=device.split(":")[0], rank=rank, local_rank=local_rank,
                           world=world, ddp=world > 1, master=rank == 0)


def init_group(rt, timeout_seconds=1800):
    """The process group of a torchrun job (NCCL on CUDA, gloo on CPU); nothing for one process."""
    if rt.ddp:
        cuda = rt.device_type == "cuda"
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=timeout_seconds),
                                device_id=torch.device(rt.device) if cuda else None)


def finish(rt):
    """End the job's process group: a barrier first, so no rank tears it down under another."""
    if rt.ddp and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def rank_world():
    """(rank, world size) of the process group; (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_reduce_sum(*tensors):
    """Sum each tensor over the process group's ranks, in place, in one collective (several are
    flattened into one float64 buffer and copied back); nothing without a group."""
    if rank_world()[1] == 1:
        return
    if len(tensors) == 1:
        dist.all_reduce(tensors[0])
        return
    flat = torch.cat([t.reshape(-1).double() for t in tensors])
    dist.all_reduce(flat)
    for t, summed in zip(tensors, flat.split([t.numel() for t in tensors])):
        t.copy_(summed.view(t.shape))


def rank0_first(rt, fetch):
    """fetch() on rank 0 first; the other ranks then find its file in place. If rank 0 failed, every
    rank raises (rank 0 its error), so all ranks agree on what could be fetched."""
    path = error = None
    if rt.rank == 0:
        try:
            path = fetch()
        except Exception as e:
            error = e
    ok = torch.tensor(float(error is None), device=rt.device)
    all_reduce_sum(ok)  # every other rank adds 1
    if ok.item() < rt.world:
        raise error or RuntimeError("rank 0 could not fetch an input (its message says why)")
    return path or fetch()


def print0(*args, **kwargs):
    """print on rank 0 only (torchrun's RANK), flushed."""
    if int(os.environ.get("RANK", 0)) == 0:
        print(*args, **kwargs, flush=True)


def stop(rt, message, code):
    """End every rank the same way (they all saw the same all-reduced numbers): message on rank 0,
    on stderr unless code is 0, then exit with code."""
    print0(message, file=sys.stderr if code else sys.stdout)
    if rt.ddp and dist.is_initialized():
        dist.destroy_process_group()
    sys.exit(code)


def dtype_bytes(dtype):
    """Bytes per element of a precision setting, "bf16" or "fp32": the one check of dtype."""
    if dtype not in ("bf16", "fp32"):
        raise ValueError(f"dtype={dtype!r}: expected 'bf16' or 'fp32' (or 'auto' in train.py and bench.py: "
                         f"bf16 on CUDA, fp32 elsewhere; '' in eval.py: the checkpoint's)")
    return 2 if dtype == "bf16" else 4


def resolve_dtype(dtype, device_type):
    """The precision a setting runs at: "auto" = bf16 on CUDA, fp32 elsewhere (bf16 runs on CPU too)."""
    dtype = ("bf16" if device_type == "cuda" else "fp32") if dtype == "auto" else dtype
    dtype_bytes(dtype)
    return dtype


def precision(model, device_type, dtype):
    """Set the model's numerics and return the autocast context to run it in: the one place
    training and evaluation take them from, so both compute the same function. "bf16" stores the
    token embedding in bf16 (as the authors' base_train.py) and autocasts matmuls to bf16; "fp32"
    runs everything in fp32.
    The embedding's dtype is part of the function (x0 = norm(e) is rounded to it). CPU bf16 autocast is
    not CUDA's policy: CUDA runs model.py's norm (F.rms_norm) in fp32 and returns fp32, CPU returns bf16
    (computed in fp32), so CPU and GPU logits differ slightly. train.py writes the same two
    lines itself (store_embedding, then torch.autocast), where a reader of the recipe sees them."""
    store_embedding(model, dtype)
    return torch.autocast(device_type, dtype=torch.bfloat16, enabled=dtype_bytes(dtype) == 2)


def store_embedding(model, dtype):
    """The token embedding's storage dtype, part of the function the model computes: bf16 under
    "bf16" (as the authors' base_train.py), else fp32."""
    model.transformer.wte.to(torch.bfloat16 if dtype_bytes(dtype) == 2 else torch.float32)


@contextlib.contextmanager
def atomic_dir(path):
    """A directory written whole or not at all: yields a new temporary directory beside path, which
    replaces path (if it exists: the caller has decided it may) when the block ends, and is removed
    if the block raises. Readers see the old directory or the new one, never half of one."""
    path = os.path.abspath(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.", dir=os.path.dirname(path))
    try:
        yield tmp
        os.chmod(tmp, 0o755)  # mkdtemp's 0700 is for the name, not the directory
        if os.path.exists(path):  # the old one set aside, the new one renamed in, the old removed
            os.rename(path, tmp + ".old")
        os.rename(tmp, path)
        shutil.rmtree(tmp + ".old", ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


class DiskSpaceError(OSError):
    """Too little free disk space for what is about to be written. An OSError with errno ENOSPC, the
    one the write itself would raise, so `except OSError` serves both; it carries path, needed and
    free (bytes) and its message names them."""

    def __init__(self, what, path, needed, free, hint):
        super().__init__(f"{what}: needs {size_text(needed)} in {path}, but its disk has only "
                         f"{size_text(free)} free; {hint}")
        self.errno, self.path, self.needed, self.free = errno.ENOSPC, path, needed, free


def size_text(n):
    """Bytes as people read them, and exactly: "1.24 GB (1,240,000,000 bytes)"."""
    return (f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB") + f" ({n:,} bytes)"


def free_bytes(path):
    """Bytes this process may still write on the filesystem of path (of its nearest existing parent
    while path does not exist yet): the one reading of free space, which tests replace."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return shutil.disk_usage(path).free


def check_free_space(path, needed, what, hint):
    """DiskSpaceError(what, ...) unless the disk of path has `needed` bytes free; returns the free bytes."""
    free = free_bytes(path)
    if free < needed:
        raise DiskSpaceError(what, path, needed, free, hint)
    return free


class Timer:
    """The one timer of the project: wall-clock seconds of a block, `with Timer(device) as took:`,
    then took.seconds. On a CUDA device the queued kernels are drained before the clock starts and
    before it stops: CUDA runs them asynchronously, and without the sync a block's time would be the
    time of its launches. Other devices (and device=None) need no sync. The training step's clock
    (flt/diagnostics.py: StepTimer) is the one other: it must never sync, so it leans on the step's
    one host read instead."""

    def __init__(self, device=None):
        self.device = device
        self.cuda = device is not None and torch.device(device).type == "cuda"
        self.seconds = None

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def __enter__(self):
        self.sync()
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.sync()
        self.seconds = self.elapsed()
        return False

    def elapsed(self):
        """Seconds since the block started, while it runs (no sync)."""
        return time.perf_counter() - self.start


def timed(work, device=None):
    """Seconds one call of work() takes (Timer)."""
    with Timer(device) as took:
        work()
    return took.seconds


@contextlib.contextmanager
def evaluating(model, autocast):
    """train.py's evaluations: the model in eval mode, in its autocast context and eager (an evaluation's
    shapes, CORE's prompt lengths, would fill the compile cache training's graphs need), then in train
    mode again."""
    model.eval()
    try:
        with autocast, torch.compiler.set_stance("force_eager"):
            yield
    finally:
        model.train()


def sample(model, tokenizer, prompt, max_new_tokens, **generate_kwargs):
    """prompt + up to max_new_tokens generated after BOS + prompt (model.generate's cached decoding;
    generate_kwargs: temperature, top_k, seed, loops, exit_threshold), decoded whole."""
    ids = [tokenizer.bos_id] + tokenizer.encode(prompt)
    n = min(max_new_tokens, model.config.sequence_len - len(ids))
    device = next(model.parameters()).device
    new = [t.item() for t in model.generate(torch.tensor([ids], device=device), n, **generate_kwargs)]
    return tokenizer.decode(ids[1:] + new)  # decoded whole: no split characters


def framed(title, text, width=72):
    """A sample as it reads (its newlines kept, not a repr), between a rule naming it and a closing rule."""
    return f"{f'---- {title} ':-<{width}}\n{text.rstrip()}\n{'-' * width}"
