"""Weights & Biases tracking (tracking.py), offline: train.py's records and settings in the run's
history and config, a resume continuing the same run id, eval.py's results in the same run; and
without wandb, a clear error, while the default run never imports it."""
import glob
import json
import textwrap

import pytest

from test_train import losses, python, runner, train
from flt import tracking

wandb = pytest.importorskip("wandb")  # optional for users; .ci/run installs requirements/wandb.txt


def wandb_records(path):
    """The protobuf records of an offline run's .wandb file, read here without wandb's reader: after a
    7-byte file header (":W&B", 0xBEE1, version), 32 KiB blocks of chunks, each with a 7-byte header
    (crc32, length, type: 1 full, 2 first, 3 middle, 4 last; a block's tail under 7 bytes is padding)."""
    from wandb.proto import wandb_internal_pb2 as pb
    data, block = open(path, "rb").read(), 32768
    assert data[:4] == b":W&B", data[:7]
    pos, pending, records = 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if left < 7 or kind == 0:
            pos += left
            continue
        pending, pos = pending + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            records.append(pb.Record.FromString(pending))
            pending = b""
    return records


def offline_run(path):
    """(run id, project, config, {step: history}, summary) of one offline run file."""
    run, config, history, summary = None, {}, {}, {}
    for r in wandb_records(path):
        kind = r.WhichOneof("record_type")
        if kind == "run":
            run = r.run
            config.update({i.key: json.loads(i.value_json) for i in r.run.config.update})
        elif kind == "config":
            config.update({i.key: json.loads(i.value_json) for i in r.config.update})
        elif kind in ("history", "summary"):
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                     for i in (r.history.item if kind == "history" else r.summary.update)}
            if kind == "history":
                history.setdefault(items["_step"], {}).update(items)
            else:
                summary.update(items)
    return run.run_id, run.project, config, history, summary


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """W&B offline, its files under tmp_path/wandb_dir: returns the run files written, oldest first."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    (tmp_path / "wandb_dir").mkdir()
    return lambda: sorted(glob.glob(str(tmp_path / "wandb_dir" / "wandb" / "offline-run-*" / "run-*.wandb")))


def test_train_logs_its_records_and_settings_and_a_resume_continues_the_run(tmp_path, data_dir, offline):
    out, args = tmp_path / "run", ["--save_interval=2", "--eval_interval=2", "--wandb_project=flt_test"]
    train(out, data_dir, "--num_steps=4", *args)
    [first] = offline()
    run_id, project, config, history, _ = offline_run(first)
    assert json.loads((out / "wandb.json").read_text()) == {"project": "flt_test", "id": run_id}
    assert project == "flt_test" and config["loops"] == 3 and config["wandb_project"] == "flt_test"
    _, records = losses(out)
    expected = {}
    for record in records:  # every number of every log.jsonl line, by step (lists as key/1, key/2, ...)
        expected.setdefault(record["step"], {}).update(tracking.flat(record))
    assert "resid_norms/3" in expected[1] and "val_bpb" in expected[4] and "final_val_bpb" in expected[4]
    assert {s: {k: h[k] for k in expected[s]} for s, h in history.items()} == expected

    train(out, data_dir, "--num_steps=6", "--resume", *args)
    assert len(offline()) == 2
    resumed_id, _, config, history, _ = offline_run(offline()[1])
    assert resumed_id == run_id and config["num_steps"] == 6  # the same run, its config updated
    assert sorted(history) == [4, 5, 6] and history[6]["final_val_bpb"] == losses(out)[1][-1]["final_val_bpb"]

    p = python("eval.py", str(out), "--modes=bpb", "--loops=1,3", "--bpb_tokens=512", "--device=cpu", "--wandb=True")
    assert p.returncode == 0, p.stderr
    eval_id, _, _, history, summary = offline_run(offline()[2])
    results = json.loads((out / "step_000006" / "eval.json").read_text())["results"]
    assert eval_id == run_id and summary["eval/step"] == 6
    # bpb_tokens off eval.py's default: its results are labelled, in eval.json and W&B alike
    label = "val_bpb[bpb_tokens=512]"
    assert summary[f"eval/{label}/K1"] == results["1"][label] and summary[f"eval/{label}/K3"] == results["3"][label]


NO_WANDB = "import sys\nsys.modules['wandb'] = None  # as if not installed: `import wandb` fails\n"


def test_without_wandb_the_setting_is_a_clear_error_and_the_default_never_imports_it(tmp_path, data_dir):
    p = train(tmp_path / "o", data_dir, "--wandb_project=flt", script=runner(tmp_path, NO_WANDB), check=False)
    assert p.returncode == 1 and p.stderr.rstrip().endswith(
        "ValueError: wandb_project='flt' needs the wandb package, which is not installed: "
        "pip install -r requirements/wandb.txt"), p.stderr[-2000:]
    assert not (tmp_path / "o").exists()  # found before the run directory, data or model
    mark = tmp_path / "imported"
    watch = textwrap.dedent(f"""
        import atexit, sys
        atexit.register(lambda: open({str(mark)!r}, "w").write(str("wandb" in sys.modules)))
    """)
    train(tmp_path / "plain", data_dir, "--num_steps=1", "--sample_tokens=0", script=runner(tmp_path, watch))
    assert mark.read_text() == "False"
    script = tmp_path / "eval_without_wandb.py"
    script.write_text(NO_WANDB + "import runpy\nsys.argv[0] = 'eval.py'\n"
                      "runpy.run_path('eval.py', run_name='__main__')\n")
    p = python(str(script), "nowhere", "--wandb=True")
    assert p.returncode == 1 and "ValueError: --wandb=True needs the wandb package" in p.stderr, p.stderr[-2000:]
