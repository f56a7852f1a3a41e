"""Every entry point checks its inputs before its first expensive step (flt/errors.py): a bad path,
a count out of range, a setting its mode does not read, a git revision, each answered with ONE line
on stderr that names it, exit status 1, in the time the program takes to start (no model loaded, no
forward, no download), and nothing written. Each bad value is walked alone, as a user types it
(processes forked from one that has imported torch: tests/forkserver.py)."""
import os
import pathlib
import time

import pytest

import forkserver
from test_eval import save_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Seconds a refused command may take: its imports and checks. The work each check saves (a model
# loaded and measured, a corpus built, a download) takes longer, and a step of training more still.
START_S = 20


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A saved tiny run and a validation shard (test_eval's), and a plain file to pass as a folder."""
    where = tmp_path_factory.mktemp("tiny")
    save_checkpoint(where)
    (where / "a_file").write_text("not a folder\n")
    return where


def cases(t):
    """{program: [(argv, what the line must name)]}; t is the tiny run's folder, w a fresh empty
    folder each command may not write into. Paths a command would write all lie under w."""
    run, w, file = t / "run", "{w}", t / "a_file"
    return {
        "train.py": [
            ([f"--out_dir={w}/run", f"--data_dir={w}/data", "--warmdown_frac=2"], "warmdown_frac=2.0"),
            ([f"--out_dir={w}/run", f"--data_dir={w}/data", "--matrix_lr=0"], "matrix_lr=0.0"),
            ([f"--out_dir={w}/run", f"--data_dir={w}/data", "--grad_clip=0"], "grad_clip=0.0"),
            ([f"--out_dir={w}/run", f"--data_dir={w}/data", "--sample_tokens=-1"], "sample_tokens=-1"),
            ([f"--out_dir={w}/run", f"--data_dir={w}/data", "--log_interval=0"], "log_interval=0"),
            ([f"--out_dir={w}/run", f"--data_dir={w}/data", "--log_interval=-5"], "log_interval=-5"),
            ([f"--out_dir={w}/run", f"--data_dir={w}/data", f"--tokenizer={w}/nope.json"],
             f"tokenizer='{w}/nope.json'"),
            ([f"--out_dir={w}/run", f"--data_dir={file}"], f"data_dir={file}"),
            # the model's shape, before the run directory and the corpus
            ([f"--out_dir={w}/run", f"--data_dir={w}/data", "--aspect_ratio=33"], "aspect_ratio=33"),
            ([f"--out_dir={w}/run", f"--data_dir={w}/data", "--n_kv_head=5"], "n_kv_head=5"),
            ([f"--out_dir={w}/run", "--dataset=s4"], "dataset='s4'"),
            ([f"--out_dir={w}/run", "--dataset=chains", "--sample_tokens=0", "--sequence_len=16"],
             "task_difficulty=8: a chains item of difficulty 8 needs 19 tokens"),
        ],
        "eval.py": [
            ([f"{w}/nope"], f"{w}/nope: no such checkpoint"),
            ([str(run), f"--out={w}/no/eval.json"], f"--out={w}/no/eval.json"),
            ([str(run), "--batch_size=0"], "--batch_size=0"),
            ([str(run), "--modes=core", "--max_per_task=0"], "--max_per_task=0"),
            ([str(run), "--modes=sample", "--temperature=-1"], "--temperature=-1"),
            ([str(run), "--modes=sample", "--draft_len=2"], "--draft_len=2"),
            ([str(run), "--modes=bpb", f"--val_files={w}/nope.parquet"], f"--val_files={w}/nope.parquet"),
            ([str(run), "--modes=bpb", "--protocol_ranks=0"], "--protocol_ranks=0"),
            ([str(run), f"--data_dir={file}"], f"--data_dir={file}"),
            # settings the chosen modes do not read, drafting's bounds, a file given for a folder
            ([str(run), "--modes=sample", "--batch_size=4"], "--batch_size=4 is read by the bpb, wiki"),
            ([str(run), "--modes=bpb", "--sample_tokens=4"], "--sample_tokens=4 is read by the sample mode"),
            ([str(run), "--modes=sample", "--seed=7"], "--seed=7 does nothing at --temperature=0"),
            ([str(run), "--modes=sample", "--loops=1", "--draft_loops=1"], "--draft_loops=1: "),
            ([str(run), "--modes=sample", "--draft_loops=1", "--cache_slots=1"],
             "--cache_slots=1 with --draft_loops=1"),
            ([str(file)], f"{file}: a file, not a checkpoint directory"),
        ],
        "-m scripts.bench": [
            (["--mode=nope"], "mode='nope': expected one of ratios, train, memory, loader, syncs, lmeval, hf, cache, "
                              "speculative"),
            (["--repeats=0"], "--repeats=0"),
            (["--mode=loader", "--seconds=0"], "--seconds=0.0"),
            (["--mode=ratios", f"--plot={w}/x.png"], f"--plot='{w}/x.png' does nothing"),
            (["--mode=hf", f"--run={w}/nope"], f"--run={w}/nope"),
            (["--mode=cache", f"--run={run},{w}/nope"], f"--run: {w}/nope"),
            (["--mode=speculative", f"--run={run}", f"--plot={w}/no/x.png"], f"--plot={w}/no/x.png"),
            (["--mode=cache", f"--run={run}", "--baseline=nosuchcommit"], "--baseline=nosuchcommit"),
            (["--mode=loader", "--depth=2"], "--depth=2 does nothing in --mode=loader"),
            (["--mode=hf", "--sequence_len=32"], "--sequence_len=32 does nothing in --mode=hf"),
            (["--mode=syncs", "--steps=3"], "--steps=3 does nothing in --mode=syncs"),
            (["--mode=decode", "--batch_size=4"], "--batch_size=4 does nothing in --mode=decode"),
        ],
        "-m scripts.export_hf": [
            ([f"{w}/nope", f"{w}/hf"], f"run '{w}/nope'"),
            ([str(run), f"{w}/hf", "--loops=0"], "--loops=0"),
            ([str(run), str(t)], f"{t} already exists"),
        ],
        "-m scripts.import_authors": [
            ([f"{w}/nope", f"{w}/theirs"], f"'{w}/nope'"),
            ([str(t), f"{w}/theirs", f"--tokenizer={w}/nope.json"], f"--tokenizer={w}/nope.json"),
            ([str(t), f"{w}/theirs", "--step=-1"], "--step=-1"),
        ],
        "-m scripts.lm_eval_flt": [
            ([f"--run={w}/nope", "--tasks=piqa"], f"FileNotFoundError: --run='{w}/nope': no such directory"),
            ([f"--run={run}", "--tasks=piqa", "--limit=0"], "--limit=0.0"),
            ([f"--run={run}", "--tasks=piqa", "--cache_slots=3", "--loops=2"], "--cache_slots=3"),
            ([f"--run={run}", "--tasks=piqa", f"--output_path={w}/no/x.json"], f"--output_path={w}/no/x.json"),
        ],
        "-m scripts.plot": [
            (["loss", f"{w}/nope", "-o", f"{w}/x.png"], f"{w}/nope: no such run"),
            (["loss", str(run), "-o", f"{w}/no/x.png"], f"--out={w}/no/x.png"),
            (["resid", str(run), "--loops", "0", "-o", f"{w}/x.png"], "--loops=0"),
            (["loss", str(run), "--labels", "a", "b", "-o", f"{w}/x.png"], "--labels: 2 given for 1 runs"),
        ],
        "-m scripts.gpu_check": [
            (["--tiny", "--device=cpu", "--parts=nope"], "--parts=nope"),
            (["--tiny", "--device=cpu", f"--out={w}/no/x.json"], f"--out={w}/no/x.json"),
            (["--tiny", "--device=cpu", "--steps=0", f"--out={w}/x.json"], "--steps=0"),
            (["--tiny", "--device=cpu", "--compile=maybe", f"--out={w}/x.json"], "--compile=maybe"),
            (["--tiny", "--device=cpu", f"--data_dir={file}", f"--out={w}/x.json"], f"--data_dir={file}"),
            (["--tiny", "--device=cpu", "--parts=decode", "--steps=5"], "--steps=5 does nothing with --parts=decode"),
            (["--tiny", "--device=cpu", "--parts=numerics", "--compile=off"], "--compile='off' does nothing"),
        ],
        "-m flt.corpus": [
            (["--download", "0", f"--data_dir={w}/data"], "--download=0"),
            (["--embedded", f"--data_dir={file}"], f"--data_dir={file}"),
        ],
    }


def refused(program, argv, w):
    """Runs `python [-m] program argv` with {w} in argv as the folder w: (exit status, stderr, seconds)."""
    argv = [a.replace("{w}", str(w)) for a in argv]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    t0 = time.monotonic()
    p = forkserver.run([*program.split(), *argv], ROOT, env, timeout=120)
    return p.returncode, p.stderr, time.monotonic() - t0


PROGRAMS = ("train.py", "eval.py", "-m scripts.bench", "-m scripts.export_hf", "-m scripts.import_authors",
            "-m scripts.lm_eval_flt", "-m scripts.plot", "-m scripts.gpu_check", "-m flt.corpus")


def test_every_entry_point_is_walked():
    assert tuple(cases(pathlib.Path(ROOT))) == PROGRAMS


@pytest.mark.parametrize("program", PROGRAMS)
def test_each_bad_input_is_one_line_naming_it_before_any_work(tiny, tmp_path, program):
    prefix = program.removeprefix("-m ")
    for argv, named in cases(tiny)[program]:
        w = tmp_path / "w"
        w.mkdir()
        code, err, seconds = refused(program, argv, w)
        named = named.replace("{w}", str(w))
        lines = err.splitlines()
        assert code == 1 and len(lines) == 1, (argv, err[-2000:])
        assert lines[0].startswith(f"{prefix}: ") and named in lines[0], (argv, lines[0])
        assert seconds < START_S, (argv, seconds)
        assert os.listdir(w) == [], (argv, os.listdir(w))  # nothing written, not even a folder
        os.rmdir(w)
    assert sorted(os.listdir(tiny / "run")) == ["step_000010"]
