"""Nothing of yours is ever lost: every place that deletes, renames or overwrites a file, walked with
the bytes of the folders around it before and after. A command replaces only what it wrote itself
(eval.py's eval.md, scripts.plot's figures and tables, lm_eval_flt's lm_eval.json, an export, the
runs of torchrun_check, the embedded corpus, a downloaded zip); anything else there is refused in
one line that names the file and the way out (another path, move the file, or a flag), and stays
byte for byte as it was. And train.py's run directory: the lock before anything in it is touched
(a refused second run changes no byte), --overwrite keeping the old run until the new one has
saved, pruning deleting a checkpoint's files only, --resume=auto refusing another run's schedule, a
resumed log holding each step once, and a save's failure on a full disk one line."""
import json
import errno
import os
import shutil
import textwrap
import zipfile
from unittest.mock import patch

import pytest
import torch

from conftest import config_for_depth, run_module
from flt import checkpoint, corpus, errors, runtime
from model import GPT
from test_plot import write_run
from test_train import checkpoints, losses, runner, train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASKS = os.path.join(ROOT, "tests", "lm_eval_tasks")


def snapshot(folder):
    """{path relative to folder: its bytes} of every file below folder."""
    files = {}
    for parent, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(parent, name)
            with open(path, "rb") as f:
                files[os.path.relpath(path, folder)] = f.read()
    return files


@pytest.fixture
def run(tiny_run, tmp_path):
    """A copy of train.py's tiny run (conftest.py: TINY_RUN), free to be written into."""
    return str(shutil.copytree(tiny_run, tmp_path / "run"))


# ---- outputs: no file replaced that the command did not write

def test_eval_md_beside_out_is_not_replaced(run, tmp_path):
    """eval.py's table goes to the .md beside its JSON: a user's results.md beside --out=results.json
    is refused before any work, as is an --out that is itself a .md; its own eval.md is rewritten by
    a rerun, one edited by hand is refused, and one beside an unreadable eval.json goes aside with it."""
    import eval as ev
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "results.md").write_text("# my results, typed by hand\n")
    (notes / "notes.md").write_text("# notes\n")
    before = snapshot(notes)
    args = [run, "--modes=sample", "--loops=1", "--sample_tokens=2", "--device=cpu"]
    with pytest.raises(FileExistsError, match=f"{notes / 'results.md'}: not the table eval.py wrote beside "
                                              f"{notes / 'results.json'}, and eval.py would replace it: move"):
        ev.main(args + [f"--out={notes / 'results.json'}"])
    with pytest.raises(ValueError, match=f"--out={notes / 'notes.md'}: the JSON file, and eval.py writes its "
                                         "table to the .md beside it: give a .json path"):
        ev.main(args + [f"--out={notes / 'notes.md'}"])
    assert snapshot(notes) == before
    # its own eval.md (the default place, <step dir>/eval.md): a rerun merges and rewrites both
    step = os.path.join(run, "step_000004")
    ev.main(args)
    ev.main(args)
    with open(os.path.join(step, "eval.json")) as f:
        saved = json.load(f)
    assert len(saved["runs"]) == 1 and snapshot(step)["eval.md"] == saved["table"].encode()
    table = snapshot(step)["eval.md"]
    with open(os.path.join(step, "eval.md"), "a") as f:
        f.write("my note under the table\n")
    before = snapshot(step)
    with pytest.raises(FileExistsError, match="eval.md: not the table eval.py wrote beside"):
        ev.main(args)
    assert snapshot(step) == before
    # an eval.json that cannot be read: it and its table are kept aside, byte for byte
    with open(os.path.join(step, "eval.md"), "wb") as f:
        f.write(table)
    with open(os.path.join(step, "eval.json"), "w") as f:
        f.write("{")
    ev.main(args)
    kept = {name.split(".unreadable.")[0]: data for name, data in snapshot(step).items() if ".unreadable." in name}
    assert kept == {"eval.json": b"{", "eval.md": table}


def test_plot_replaces_only_files_it_wrote(tmp_path):
    """A figure or table at --out (or the default <runs' folder>/loss.png) that scripts.plot did not
    write is refused in one line before any work, unless --force; its own files (a figure naming it as
    Creator, its table) are replaced by a rerun without one."""
    pytest.importorskip("matplotlib")
    from scripts import plot
    run = write_run(tmp_path, "flt", [1.0, 0.9, 0.8])
    (tmp_path / "flt" / "step_000002").mkdir()
    (tmp_path / "flt" / "step_000002" / "eval.json").write_text(json.dumps(
        {"checkpoint": "x", "step": 2, "results": {"3": {"val_bpb": 1.0}}, "table": ""}))
    (run / "loss.png").write_bytes(b"\x89PNG\r\n\x1a\n a figure drawn by hand")
    (tmp_path / "table.md").write_text("| model | depth | K |\n| my own table |\n")
    before = snapshot(tmp_path)
    status, stdout, stderr = run_module("scripts.plot", "loss", str(run))
    assert (status, stdout) == (1, "") and stderr == (
        f"scripts.plot: FileExistsError: --out={run / 'loss.png'}: exists, and python -m scripts.plot did not "
        "write it: choose another --out, move the file, or add --force to replace it\n")
    with pytest.raises(FileExistsError, match="table.md: exists, and python -m scripts.plot did not write it"):
        plot.main(["table", str(run), "-o", str(tmp_path / "table.md")])
    assert snapshot(tmp_path) == before
    # --force replaces them; from then on they are the plot's own, and a rerun replaces them
    for argv in (["loss", str(run)], ["table", str(run), "-o", str(tmp_path / "table.md")]):
        plot.main(argv + ["--force"])
        plot.main(argv)
    assert plot.written_here(str(run / "loss.png")) and plot.written_here(str(tmp_path / "table.md"))
    assert snapshot(tmp_path)["flt/loss.png"] != before["flt/loss.png"]


def test_lm_eval_json_keeps_earlier_tasks_and_refuses_another_file(run, tmp_path, monkeypatch):
    """lm_eval_flt merges into its lm_eval.json by (K, task), as eval.py into eval.json: a run of
    another task keeps the first task's results whole. A file there that is not its own is refused in
    one line before the model runs, and stays as it was."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager
    from scripts import lm_eval_flt
    manager = TaskManager(include_path=TASKS, include_defaults=False)
    monkeypatch.setattr(lm_eval_flt, "TaskManager", lambda include_path: manager)
    out = tmp_path / "lm_eval.json"
    args = ["--run", run, "--loops", "1", "--batch_size", "4", "--device", "cpu", "--include_path", TASKS,
            "--limit", "2", "--output_path", str(out)]
    lm_eval_flt.main(args + ["--tasks", "flt_mc"])
    first = json.loads(out.read_text())
    lm_eval_flt.main(args + ["--tasks", "flt_ppl"])
    both = json.loads(out.read_text())
    assert "flt_mc" in out.read_text()
    assert both["results"]["1"]["flt_mc"] == first["results"]["1"]["flt_mc"]
    assert list(both["results"]["1"]) == ["flt_mc", "flt_ppl"] and len(both["runs"]) == 2
    assert "| flt_mc | acc |" in both["table"] and "| flt_ppl | bits_per_byte |" in both["table"]
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "lm_eval.json").write_text('{"results": [1, 2]}')
    before = snapshot(theirs)
    args[-1] = str(theirs / "lm_eval.json")
    monkeypatch.setattr(lm_eval_flt, "simple_evaluate", lambda **kwargs: pytest.fail("the harness ran"))
    with pytest.raises(FileExistsError) as e:
        lm_eval_flt.main(args + ["--tasks", "flt_mc"])
    assert str(e.value) == (f"{theirs / 'lm_eval.json'}: not an lm_eval.json of scripts.lm_eval_flt, and it would "
                            "be replaced: move the file, or give --output_path another file")
    assert snapshot(theirs) == before


def test_export_force_replaces_only_a_previous_export(run, tmp_path):
    """export_hf --force replaces a previous export, and nothing else: not the run being exported (or
    its step directory), not a folder holding another run, not a folder of other files."""
    pytest.importorskip("safetensors")
    from scripts import export_hf
    other = shutil.copytree(run, tmp_path / "other")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.json").write_text('{"model_type": "llama"}')
    (mine / "run.json").write_text("{}")
    before = {path: snapshot(path) for path in (run, other, mine)}
    step = os.path.join(run, "step_000004")
    refused = {run: "the run being exported", step: "holds a training run", str(other): "holds a training run",
               str(mine): "not a previous export"}
    for out, why in refused.items():
        status, stdout, stderr = run_module("scripts.export_hf", run, out, "--force")
        assert (status, stdout) == (1, "") and stderr.startswith(f"scripts.export_hf: ValueError: {out}: ")
        assert why in stderr and stderr.count("\n") == 1
    assert {path: snapshot(path) for path in (run, other, mine)} == before
    # a previous export is replaced
    hf = tmp_path / "hf"
    export_hf.export(run, hf, log=lambda *a: None)
    (hf / "run.json").write_text("{}")
    export_hf.export(run, hf, loops=2, force=True, log=lambda *a: None)
    assert json.loads((hf / "config.json").read_text())["loops"] == 2 and (hf / "run.json").read_text() != "{}"


def test_torchrun_check_leaves_a_folder_it_did_not_write(tmp_path):
    """torchrun_check deletes its runs in --out_dir before it writes them again: a folder holding
    files it did not write is refused in one line before any work; its own (its mark inside) is
    claimed again. An --out that is not its JSON is refused too."""
    from scripts import torchrun_check
    folder = tmp_path / "check"
    (folder / "resumed").mkdir(parents=True)
    (folder / "resumed" / "notes.txt").write_text("mine")
    (folder / "run" / "step_000001").mkdir(parents=True)
    (folder / "run" / "step_000001" / "model.pt").write_bytes(b"my weights")
    before = snapshot(folder)
    status, stdout, stderr = run_module("scripts.torchrun_check", "--tiny", "--device=cpu", "--steps=2",
                                        f"--data_dir={tmp_path / 'data'}", f"--out_dir={folder}")
    assert (status, stdout) == (1, "") and stderr == (
        f"scripts.torchrun_check: FileExistsError: --out_dir={folder}: holds files torchrun_check did not "
        "write (resumed, run), and a rerun replaces its runs there: choose another --out_dir, or an empty one\n")
    assert snapshot(folder) == before and not (tmp_path / "data").exists()
    # a folder of its own: claimed again; a file at --out that is not its JSON: refused
    own = tmp_path / "own"
    torchrun_check.claim(str(own), str(own / "torchrun_check.json"))
    (own / "torchrun_check.json").write_text(json.dumps({"meta": {"tiny": True}}))
    (own / "train.txt").write_text("a console")
    torchrun_check.claim(str(own), str(own / "torchrun_check.json"))
    (tmp_path / "results.json").write_text('{"my": "results"}')
    with pytest.raises(FileExistsError, match="results.json: not a torchrun_check JSON"):
        torchrun_check.claim(str(own), str(tmp_path / "results.json"))
    assert (tmp_path / "results.json").read_text() == '{"my": "results"}'
    # its own resumed run, which a rerun deletes: refused once it holds a file the run did not write,
    # beside it or in a checkpoint's folder; claimed again once that file is moved
    resumed = own / "resumed"
    (resumed / "step_000001").mkdir(parents=True)
    (resumed / "step_000001" / "model.pt").write_bytes(b"weights")
    (resumed / "log.jsonl").write_text('{"step": 0}\n')
    torchrun_check.claim(str(own), str(own / "torchrun_check.json"))
    refusals = {resumed / "notes.txt": f"{resumed}: holds notes.txt, which a rerun would delete",
                resumed / "step_000001" / "eval.json": "a rerun of torchrun_check would delete "
                                                       "step_000001/eval.json",
                resumed / "settings.json": "settings.json was not written by train.py"}
    for mine, refusal in refusals.items():
        mine.write_text("mine")
        with pytest.raises((FileExistsError, ValueError), match=refusal):
            torchrun_check.claim(str(own), str(own / "torchrun_check.json"))
        assert mine.read_text() == "mine"
        mine.unlink()
    torchrun_check.claim(str(own), str(own / "torchrun_check.json"))


def test_a_bundle_zip_put_there_by_hand_is_kept(tmp_path):
    """fetch_bundle unpacks <bundle_dir>.zip; it removes the zip after only if it downloaded it."""
    zip_path = tmp_path / "eval_bundle.zip"
    with zipfile.ZipFile(zip_path, "w") as z:
        z.writestr("eval_bundle/core.yaml", "icl_tasks: []\n")
    before = snapshot(tmp_path)
    bundle = corpus.fetch_bundle(str(tmp_path / "eval_bundle"), "http://127.0.0.1:9/unreachable")
    assert snapshot(tmp_path)["eval_bundle.zip"] == before["eval_bundle.zip"]
    assert open(os.path.join(bundle, "core.yaml")).read() == "icl_tasks: []\n"


@pytest.mark.parametrize("text", ['["shard_00000.parquet"]', '{"author": "me"}', "not json"])
def test_a_manifest_json_not_the_projects_is_refused_never_rewritten(embedded, tmp_path, text):
    """manifest.json vouches for a folder's shards; one of another shape (a user's, another tool's) is
    refused in one line naming it, by the reader and the writer alike, and keeps its bytes."""
    shutil.copy(embedded[0], tmp_path)
    (tmp_path / "manifest.json").write_text(text)
    before = snapshot(tmp_path)
    name = os.path.basename(embedded[0])
    message = f"{tmp_path / 'manifest.json'}: not this project's manifest.json"
    for call in (corpus.write_manifest, corpus.verify_manifest):
        with pytest.raises(ValueError, match=message) as e:
            call(str(tmp_path), [name])
        assert "\n" not in str(e.value)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("damage", ["another_file", "no_manifest"])
def test_the_embedded_corpus_rebuild_keeps_files_it_did_not_write(embedded, tmp_path, monkeypatch, damage):
    """A damaged embedded corpus is rebuilt beside its folder and put in its place, but only over the
    project's files: a folder that also holds a user's file, or shards no manifest vouches for and
    whose bytes are not the corpus's, is refused in one line naming the folder and those files."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    docs = [t for p in embedded for t in pq.read_table(p).column("text").to_pylist()]
    monkeypatch.setattr(corpus, "_embedded_documents", lambda: list(docs))
    cache = tmp_path / "embedded"
    shutil.copytree(os.path.dirname(embedded[0]), cache, ignore=shutil.ignore_patterns("*.lock"))
    if damage == "another_file":
        pq.write_table(pa.table({"text": ["my own documents"]}), cache / "mine.parquet")
        os.remove(cache / "shard_00002.parquet")
        foreign = "mine.parquet"
    else:
        os.remove(cache / corpus.MANIFEST)
        pq.write_table(pa.table({"text": ["my own documents"]}), cache / "shard_00002.parquet")
        foreign = ", ".join(f"shard_0000{i}.parquet" for i in range(5))
    before = snapshot(cache)
    with pytest.raises(FileExistsError) as e:
        corpus.embedded_corpus(str(tmp_path))
    assert str(e.value) == (f"embedded corpus: {cache} needs rebuilding, and holds files this project did not "
                            f"write: {foreign}; move them out of {cache} (or choose another data_dir), and the "
                            "corpus is rebuilt there")
    assert snapshot(cache) == before and sorted(os.listdir(tmp_path)) == ["embedded"]



def test_the_embedded_corpus_rebuild_keeps_a_tokenizer_file_under_another_name(embedded, tmp_path, monkeypatch,
                                                                               capsys):
    """A damaged corpus holding tokenizer_bpe<N>.json (data.py's cache, or a user's file of that name) is rebuilt
    with that file moved in beside the new shards, byte for byte, as <name>.before-rebuild: a new BPE is trained
    on the rebuilt shards, and nothing is deleted; a second rebuild numbers the next copy."""
    import pyarrow.parquet as pq
    docs = [t for p in embedded for t in pq.read_table(p).column("text").to_pylist()]
    monkeypatch.setattr(corpus, "_embedded_documents", lambda: list(docs))
    cache = tmp_path / "embedded"
    shutil.copytree(os.path.dirname(embedded[0]), cache, ignore=shutil.ignore_patterns("*.lock", "tokenizer*"))
    for text in ('{"my": "tokenizer"}', '{"my": "second tokenizer"}'):
        (cache / "tokenizer_bpe512.json").write_text(text)
        os.remove(cache / "shard_00002.parquet")
        paths = corpus.embedded_corpus(str(tmp_path))
        assert not corpus.verify_manifest(str(cache), [os.path.basename(p) for p in paths])
        assert "tokenizer_bpe512.json" not in os.listdir(cache)
        assert f"kept {cache / 'tokenizer_bpe512.json'} as tokenizer_bpe512.json.before-rebuild" in capsys.readouterr().out
    assert (cache / "tokenizer_bpe512.json.before-rebuild").read_text() == '{"my": "tokenizer"}'
    assert (cache / "tokenizer_bpe512.json.before-rebuild2").read_text() == '{"my": "second tokenizer"}'


# ---- train.py: the run directory, its checkpoints and its log

def tree(folder):
    """snapshot, and every directory below folder (as None): a folder made or removed shows too."""
    dirs = {os.path.relpath(os.path.join(parent, d), folder): None
            for parent, names, _ in os.walk(folder) for d in names}
    return snapshot(folder) | dirs


@pytest.fixture(scope="module")
def six_steps(tmp_path_factory, data_dir):
    """A finished 6-step run (checkpoints at steps 3 and 6), trained once per module as a template."""
    base = tmp_path_factory.mktemp("six")
    train(base / "template", data_dir, "--num_steps=6", "--save_interval=3", "--sample_tokens=0")
    return base / "template"


@pytest.fixture
def six(six_steps):
    """A copy of six_steps to change (out_dir is a setting a resume may change)."""
    out = six_steps.parent / "run"
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(six_steps, out)
    yield out
    shutil.rmtree(out, ignore_errors=True)


def test_a_refused_second_run_changes_no_byte_of_the_live_one(six, data_dir):
    # the live run: it holds the lock and is writing step 9's checkpoint
    (six / "tmp_step_000009").mkdir()
    (six / "tmp_step_000009" / "model.pt").write_bytes(b"half of a checkpoint")
    held = checkpoint.lock_out_dir(str(six))
    try:
        before = tree(six)
        for args in (["--overwrite"], ["--resume=auto"], ["--resume=True", "--num_steps=9"]):
            p = train(six, data_dir, "--num_steps=6", *args, check=False)
            assert p.returncode == 1 and "is in use by pid" in p.stderr, p.stderr
            assert len(p.stderr.strip().splitlines()) == 1  # one line, no traceback
            assert tree(six) == before, args
    finally:
        held.close()



def test_saving_a_step_again_keeps_what_the_earlier_one_held_besides_its_checkpoint(six, data_dir):
    """A run rolled back by removing step 6's weights (its eval.json and notes left there) saves step 6
    again: the earlier step_000006 is kept beside it under a name nothing holds, and a user's own
    step_000006.old, a backup, is not touched; a folder merely named tmp_step_* is not a half-written
    checkpoint, and stays."""
    for name in ("model.pt", "rank0.pt"):
        os.remove(six / "step_000006" / name)
    (six / "step_000006" / "notes.txt").write_text("why I rolled back")
    shutil.copytree(six / "step_000003", six / "step_000006.old")
    (six / "tmp_step_scratch").mkdir()
    (six / "tmp_step_scratch" / "a.txt").write_text("mine")
    backup = tree(six / "step_000006.old")
    p = train(six, data_dir, "--num_steps=6", "--save_interval=3", "--sample_tokens=0", "--resume")
    kept = six / "step_000006.old2"
    assert f"step 6 saved again: the earlier step_000006 is kept as {kept}, for notes.txt" in p.stdout
    assert (kept / "notes.txt").read_text() == "why I rolled back" and not (kept / "model.pt").exists()
    assert tree(six / "step_000006.old") == backup and (six / "tmp_step_scratch" / "a.txt").read_text() == "mine"
    assert checkpoint.list_checkpoints(str(six))[-1][1] == str(six / "step_000006")


def test_pruning_keeps_a_linked_step_and_a_step_it_cannot_delete(tmp_path):
    """prune deletes the checkpoint files of old steps in out_dir itself: a step directory that is a link
    (moved to an archive and linked back) is kept with its target's files, and one whose files cannot be
    deleted is named in a line, not an error that would stop training."""
    out, archive = tmp_path / "run", tmp_path / "archive"
    for step in (1, 2, 3, 4):
        (out / f"step_00000{step}").mkdir(parents=True)
        (out / f"step_00000{step}" / "model.pt").write_bytes(b"weights")
    shutil.move(out / "step_000001", archive)
    os.symlink(archive, out / "step_000001")
    lines = []
    real_remove = os.remove

    def failing_remove(path):
        if "step_000002" in str(path):
            raise PermissionError(1, "Operation not permitted", str(path))
        real_remove(path)
    with patch.object(os, "remove", failing_remove):
        checkpoint.prune(str(out), keep=1, log=lines.append)
    assert (archive / "model.pt").read_bytes() == b"weights"
    assert (out / "step_000002" / "model.pt").exists() and not (out / "step_000003").exists()
    assert lines == [f"kept {out / 'step_000001'}: a link (to {archive}), never pruned",
                     f"could not prune {out / 'step_000002'} (Operation not permitted); it stays, and training goes on"]


def test_a_stops_save_keeps_the_run_overwrite_set_aside_and_a_scheduled_save_deletes_it(six, capsys):
    """The run --overwrite moved to replaced_run/ outlives a checkpoint a stop asked for (a Ctrl-C in the first
    steps may be the user taking the --overwrite back), and goes with the next scheduled one."""
    model, meta = checkpoint.load_model(str(six), log=lambda *a: None)
    shutil.copytree(six / "step_000003", six / checkpoint.REPLACED / "step_000003")
    rank_state = torch.load(six / "step_000006" / "rank0.pt", weights_only=True)
    for stopping, kept in ((True, True), (False, False)):
        checkpoint.save(str(six), 7, model, rank_state, settings=meta["settings"], stopping=stopping)
        assert (six / checkpoint.REPLACED).is_dir() == kept
    out = capsys.readouterr().out
    assert f"kept {six / checkpoint.REPLACED}, the run --overwrite set aside: this save was a stop's" in out
    assert f"deleted {six / checkpoint.REPLACED}" in out


def test_a_resume_refuses_a_tokenizer_other_than_the_checkpoints(six, data_dir, tmp_path):
    """data_dir's BPE cache replaced (a rebuild, another machine's corpus): the same ids would be other text
    under the checkpoint's weights, so --resume is refused in one line naming both files, and the run is
    untouched."""
    data = tmp_path / "data"
    shutil.copytree(data_dir, data, ignore=shutil.ignore_patterns("*.lock"))
    cached = data / "embedded" / "tokenizer_bpe512.json"
    spec = json.loads(cached.read_text())
    vocab = spec["model"]["vocab"]
    a, b = [token for token, i in vocab.items() if i in (300, 301)]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    cached.write_text(json.dumps(spec))
    before = tree(six)
    p = train(six, data, "--num_steps=9", "--save_interval=3", "--sample_tokens=0", "--resume", check=False)
    saved = six / "step_000006" / "tokenizer.json"
    assert p.returncode == 1 and p.stderr == (
        f"train.py: ValueError: --resume: {six / 'step_000006'} trained with its tokenizer.json, and this run "
        f"read another one (tokenizer='bpe', data_dir='{data}'); copy {saved} over the BPE cached in data_dir, "
        "or resume with the data_dir and tokenizer the run trained with\n")
    assert tree(six) == before
    shutil.copy(saved, cached)
    train(six, data, "--num_steps=9", "--save_interval=3", "--sample_tokens=0", "--resume")


def test_a_disk_that_fails_to_read_the_newest_checkpoint_does_not_demote_it(six):
    """An I/O error reading step 6's model.pt says nothing about the file: the resume stops naming it
    (one line, an EIO: a disk error), and step 6 stays the newest checkpoint, not set aside as unreadable
    for the next run to train past; a truncated file is still skipped for the one before it."""
    newest = str(six / "step_000006" / "model.pt")
    real_load = torch.load

    def failing_load(path, *args, **kwargs):
        if str(path) == newest:
            raise OSError(errno.EIO, "Input/output error")
        return real_load(path, *args, **kwargs)
    before = tree(six)
    with patch.object(torch, "load", failing_load), pytest.raises(OSError) as e:
        checkpoint.load_newest(str(six), rank_files=True, log=lambda *a: None)
    assert e.value.errno == errno.EIO and str(e.value) == (
        f"[Errno 5] {newest}: could not be read (Input/output error); the file may be good: try again once the "
        "disk answers")
    assert errors.is_user_error(e.value) and tree(six) == before
    with open(newest, "r+b") as f:
        f.truncate(100)
    assert checkpoint.load_newest(str(six), log=lambda *a: None)[0] == str(six / "step_000003")

OVERWRITE_SEEN = textwrap.dedent("""
    import os
    from flt import checkpoint
    save = checkpoint.save
    def seen(out_dir, step, *args, **kwargs):
        with open(os.environ["SEEN"], "a") as f:  # what replaced_run holds as each save begins
            f.write(f"{step} {sorted(os.listdir(os.path.join(out_dir, 'replaced_run')))}\\n"
                    if os.path.isdir(os.path.join(out_dir, "replaced_run")) else f"{step} -\\n")
        return save(out_dir, step, *args, **kwargs)
    checkpoint.save = seen
""")


def test_overwrite_keeps_the_old_run_until_the_new_one_has_saved(six, data_dir, tmp_path, monkeypatch):
    old = tree(six)
    (six / "notes.txt").write_text("mine")  # not a run's file: never moved, never deleted
    # a new run that cannot start (a tokenizer it cannot have): the old run is back, byte for byte
    p = train(six, data_dir, "--overwrite", "--bos_token=<|nope|>", check=False)
    assert p.returncode == 1 and "the local 'bpe' tokenizer has" in p.stderr, p.stderr
    assert tree(six) == old | {"notes.txt": b"mine"}
    # a new run that starts: the old one stays aside, whole, until the new one's first checkpoint
    monkeypatch.setenv("SEEN", str(tmp_path / "seen"))
    train(six, data_dir, "--overwrite", "--num_steps=4", "--save_interval=2", "--sample_tokens=0",
          script=runner(tmp_path, OVERWRITE_SEEN))
    seen = (tmp_path / "seen").read_text().splitlines()
    assert seen[0] == "2 ['log.jsonl', 'settings.json', 'step_000003', 'step_000006']" and seen[1] == "4 -"
    assert checkpoints(six) == ["step_000002", "step_000004"] and not (six / "replaced_run").exists()
    assert sorted(losses(six)[0]) == [0, 1, 2, 3] and (six / "notes.txt").read_text() == "mine"


def test_pruning_deletes_a_checkpoints_files_and_nothing_else(tmp_path):
    said = []
    for step in (1, 2, 3, 4):
        d = tmp_path / checkpoint.step_name(step)
        d.mkdir()
        for name in ("model.pt", "rank0.pt", "rank1.pt", "tokenizer.json"):
            (d / name).write_bytes(b"x")
    (tmp_path / "step_000001" / "eval.json").write_text("{}")  # eval.py's results
    (tmp_path / "step_000001" / "eval.md").write_text("| K |")
    (tmp_path / "step_000002" / "lm_eval.json").write_text("{}")
    # a prune killed half-way: step 0's model.pt went, its rank file and a user's file did not
    (tmp_path / "step_000000").mkdir()
    (tmp_path / "step_000000" / "rank0.pt").write_bytes(b"x")
    (tmp_path / "step_000000" / "mine.txt").write_text("mine")
    checkpoint.prune(str(tmp_path), 1, log=said.append)
    assert sorted(os.listdir(tmp_path)) == ["step_000000", "step_000001", "step_000002", "step_000004"]
    assert sorted(os.listdir(tmp_path / "step_000000")) == ["mine.txt"]  # the half-pruned one finished
    assert sorted(os.listdir(tmp_path / "step_000001")) == ["eval.json", "eval.md"]
    assert os.listdir(tmp_path / "step_000002") == ["lm_eval.json"]
    assert len(os.listdir(tmp_path / "step_000004")) == 4  # the newest: whole
    assert [s for s, _ in checkpoint.list_checkpoints(str(tmp_path))] == [4]
    assert len(said) == 3 and "step_000001; the directory stays for eval.json, eval.md, which" in said[0]
    checkpoint.prune(str(tmp_path), 1, log=said.append)  # nothing left to prune: nothing said again
    assert len(said) == 3


def test_a_resumed_run_keeps_the_results_of_the_checkpoints_it_prunes(six, data_dir):
    (six / "step_000003" / "eval.json").write_text('{"3": {"bpb": 2.0}}')
    (six / "step_000006" / "eval.json").write_text('{"3": {"bpb": 1.9}}')
    p = train(six, data_dir, "--resume=True", "--num_steps=12", "--save_interval=3", "--sample_tokens=0")
    assert [s for s, _ in checkpoint.list_checkpoints(str(six))] == [9, 12]
    assert os.listdir(six / "step_000003") == ["eval.json"] and os.listdir(six / "step_000006") == ["eval.json"]
    assert (six / "step_000006" / "eval.json").read_text() == '{"3": {"bpb": 1.9}}'
    assert f"pruned the checkpoint in {six / 'step_000006'}; the directory stays for eval.json" in p.stdout


def test_resume_auto_refuses_a_run_of_another_schedule(six, data_dir):
    before = tree(six)
    p = train(six, data_dir, "--resume=auto", "--num_steps=12", check=False)
    assert p.returncode == 1 and len(p.stderr.strip().splitlines()) == 1
    assert "--resume=auto: num_steps=12 (the checkpoint's run: 6) differs" in p.stderr
    assert "--resume=True" in p.stderr and "--out_dir" in p.stderr
    assert tree(six) == before
    # on purpose: continued, and its log holds each step once
    train(six, data_dir, "--resume=True", "--num_steps=8", "--save_interval=4", "--sample_tokens=0")
    assert sorted(losses(six)[0]) == list(range(8))


def test_a_resumed_log_holds_each_step_once_and_keeps_the_replayed_lines(six, data_dir):
    shutil.rmtree(six / "step_000006")  # killed after step 5's line, before step 6's checkpoint was in
    first = (six / "log.jsonl").read_text().splitlines()
    p = train(six, data_dir, "--resume=auto", "--num_steps=6", "--save_interval=3", "--sample_tokens=0")
    _, records = losses(six)
    trained = [r["step"] for r in records if "loss" in r]
    assert trained == list(range(6))  # each step once, in order
    replayed = (six / "log.replayed.jsonl").read_text().splitlines()
    assert replayed == [line for line in first if json.loads(line)["step"] >= 3]
    assert "moved to log.replayed.jsonl" in p.stdout


@pytest.mark.parametrize("name, text, how", [
    ("settings.json", '{"lr": 0.1}', []), ("log.jsonl", "my own log\n", ["--resume=auto"]),
    ("log.replayed.jsonl", '{"epoch": 1}\n', ["--overwrite"]), ("wandb.json", "[]", ["--resume=auto"])])
def test_a_users_file_named_like_a_runs_is_refused_not_replaced(tmp_path, data_dir, name, text, how):
    """A folder holding the user's own settings.json, log.jsonl, log.replayed.jsonl or wandb.json (no
    checkpoint): a fresh run, --resume=auto (which clears a run that never saved) and --overwrite are each
    refused in one line naming the file, which stays byte for byte."""
    out = tmp_path / "mine"
    out.mkdir()
    (out / name).write_text(text)
    before = tree(out)
    p = train(out, data_dir, "--num_steps=2", *how, check=False)
    assert p.returncode == 1 and p.stderr == (f"train.py: ValueError: {out / name} was not written by train.py "
                                              f"(a run writes its {name} there): move it, or choose another "
                                              "--out_dir\n")
    assert tree(out) == before


FILLS_THE_DISK = textwrap.dedent("""
    import data
    save = data.Tokenizer.save
    def full(self, path):  # what the tokenizers library raises when the disk fills under it
        raise Exception("No space left on device (os error 28)")
    data.Tokenizer.save = full
""")


def test_a_disk_that_fills_during_a_save_is_one_line(tmp_path, data_dir):
    out = tmp_path / "full"
    p = train(out, data_dir, "--num_steps=4", "--save_interval=2", script=runner(tmp_path, FILLS_THE_DISK),
              check=False)
    assert p.returncode == 1 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "step 2: checkpoint step 2, which filled the disk while being written" in p.stderr
    assert "Last good checkpoint: none yet" in p.stderr
    assert sorted(os.listdir(out)) == ["log.jsonl", "run.lock", "settings.json"]  # no tmp_step_ left


def test_a_save_that_torch_cannot_finish_on_a_full_disk_is_a_disk_error(tmp_path, monkeypatch):
    """torch.save's zip writer raises a RuntimeError, not an OSError, when the disk fills under it."""
    model = GPT(config_for_depth(1, sequence_len=8, vocab_size=64, loops=2))
    model.init_weights()

    def fails(obj, path):
        raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 832 vs 768")
    checkpoint.save(str(tmp_path), 1, model, {}, settings={})
    before = tree(tmp_path)
    monkeypatch.setattr(checkpoint, "_save", fails)
    monkeypatch.setattr(runtime, "free_bytes", lambda path: 4096)
    monkeypatch.setattr(checkpoint, "checkpoint_bytes", lambda *args: 0)
    with pytest.raises(runtime.DiskSpaceError, match="which filled the disk while being written"):
        checkpoint.save(str(tmp_path), 2, model, {}, settings={})
    assert tree(tmp_path) == before
    monkeypatch.setattr(runtime, "free_bytes", lambda path: 2**40)  # not a full disk: the error as it is
    with pytest.raises(RuntimeError, match="unexpected pos"):
        checkpoint.save(str(tmp_path), 2, model, {}, settings={})


def test_resuming_twice_past_an_unreadable_checkpoint(tmp_path):
    said = []
    for attempt in (1, 2, 3):
        for step in (3, 6):
            (tmp_path / checkpoint.step_name(step)).mkdir(exist_ok=True)
            (tmp_path / checkpoint.step_name(step) / "model.pt").write_bytes(b"x")
        checkpoint.set_aside_newer(str(tmp_path), 3, log=said.append)
    assert sorted(os.listdir(tmp_path)) == ["step_000003", "step_000006.unreadable", "step_000006.unreadable2",
                                           "step_000006.unreadable3"]
    assert said[1].endswith("step_000006.unreadable2")


def test_a_ctrl_c_before_training_puts_an_overwritten_run_back(six, data_dir, tmp_path):
    """A Ctrl-C while the new run prepares its data: one line, exit 130, the old run back in place."""
    stop = "from flt import inputs\ndef stop(s):\n    raise KeyboardInterrupt\ninputs.vocab_size = stop\n"
    before = tree(six)
    p = train(six, data_dir, "--overwrite", script=runner(tmp_path, stop), check=False)
    assert p.returncode == 130 and p.stderr.strip() == "train.py: interrupted (Ctrl-C)", p.stderr
    assert tree(six) == before


def test_a_run_that_ends_on_a_failed_download_leaves_no_empty_data_dir(tmp_path):
    """A download that fails (here: made to) after making data_dir: the run's one line, and neither
    data_dir nor out_dir, which the run made, is left behind empty."""
    fails = textwrap.dedent("""
        import os
        from flt import corpus
        def offline(data_dir):
            os.makedirs(data_dir)
            raise ConnectionError("download failed: offline")
        corpus.embedded_corpus = offline
    """)
    p = train(tmp_path / "new" / "run", tmp_path / "new" / "data", script=runner(tmp_path, fails), check=False)
    assert p.returncode == 1 and p.stderr.strip() == "train.py: ConnectionError: download failed: offline"
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("weights", [True, False])
def test_replacing_a_run_never_deletes_results_or_notes_in_its_step_directories(tmp_path, weights):
    """--overwrite moves a run aside and deletes it once the new one saves; --resume=auto on a run
    with no checkpoint left (its weights removed to save disk) deletes what it wrote. Neither may
    take eval.py's results or a user's notes with it: both are refused, one line, nothing touched."""
    out = tmp_path / "run"
    step = out / "step_000020"
    step.mkdir(parents=True)
    if weights:
        (step / "model.pt").write_bytes(b"weights")
        (step / "rank0.pt").write_bytes(b"state")
    (step / "eval.json").write_text("{}")
    (step / "notes.txt").write_text("mine")
    (out / "log.jsonl").write_text('{"step": 0}\n')
    before = tree(out)
    doing = "--overwrite" if weights else r"--resume=auto \(no checkpoint to resume: starting afresh\)"
    resume, overwrite = (False, True) if weights else ("auto", False)
    with pytest.raises(ValueError, match=rf"^{doing} would delete step_000020/eval\.json, step_000020/notes\.txt "
                                         r"in out_dir=.*, which train\.py did not write"):
        checkpoint.prepare_out_dir(str(out), resume, overwrite, log=lambda *a: None)
    assert tree(out) == before


def test_a_write_that_fails_keeps_the_old_file_and_leaves_no_temp_file(tmp_path):
    path = tmp_path / "eval.json"
    path.write_text("the old results")

    def fills_the_disk(tmp):
        with open(tmp, "w") as f:
            f.write("half")
        raise OSError(errno.ENOSPC, "No space left on device")
    with pytest.raises(OSError):
        runtime.atomic_write(str(path), fills_the_disk)
    assert os.listdir(tmp_path) == ["eval.json"] and path.read_text() == "the old results"
