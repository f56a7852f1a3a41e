"""eval.json accumulates (flt/report.py, docs/evaluation.md): each eval.py run merges its results into
what the file holds by (K, metric), replacing only what it computed again; every entry names the run
that computed it, whose settings are kept; eval.md is rebuilt from everything the file holds; a file
that cannot be read is renamed aside, never overwritten; an --out that eval.py did not write is refused.
And the readers (scripts.plot) see it all."""
import json
import os
import re

import pytest

from flt import report
from scripts import plot

CHECKPOINT = "run/step_000010"


def run(path, time, results, modes, log=None, step=10, **settings):
    """One eval.py run's save into path: its results {K: {metric: value}} under the key `time`."""
    record = {"checkpoint": CHECKPOINT, "step": step, "settings": {"modes": modes, **settings}, "time": time}
    measured = {mode: {"tokens": 100} for mode in modes.split(",")}
    return report.write_results(str(path), record, results, measured, write=write, log=log or print)


def write(path, text):
    with open(path, "w") as f:
        f.write(text)


def saved(path):
    return json.loads(path.read_text())


def test_two_runs_with_different_modes_and_loops_keep_both(tmp_path):
    """The bpb sweep at K = 1..3, then samples at K = 1 and WikiText at K = 6: both runs' numbers stay,
    each entry names its run, and eval.md is the table of everything, as Table 1 prints it."""
    path = tmp_path / "eval.json"
    bpb = {K: {"val_bpb": 2.0 - 0.1 * K, "val_bpb_utf8": 2.1 - 0.1 * K} for K in (1, 2, 3)}
    run(path, "T1", bpb, "bpb", loops="1,2,3")
    run(path, "T2", {1: {"samples": ["The end"]}, 6: {"wiki_ppl": 40.0}}, "sample,wiki", loops="1,6")
    doc = saved(path)
    expected = {"1": bpb[1] | {"samples": ["The end"]}, "2": bpb[2], "3": bpb[3], "6": {"wiki_ppl": 40.0}}
    assert doc["results"] == expected and list(doc["results"]) == ["1", "2", "3", "6"]  # K in order
    assert doc["computed"] == {"1": {"val_bpb": "T1", "val_bpb_utf8": "T1", "samples": "T2"},
                               "2": {"val_bpb": "T1", "val_bpb_utf8": "T1"}, "3": {"val_bpb": "T1", "val_bpb_utf8": "T1"},
                               "6": {"wiki_ppl": "T2"}}
    assert doc["runs"] == {"T1": {"settings": {"modes": "bpb", "loops": "1,2,3"}, "measured": {"bpb": {"tokens": 100}}},
                           "T2": {"settings": {"modes": "sample,wiki", "loops": "1,6"},
                                  "measured": {"sample": {"tokens": 100}, "wiki": {"tokens": 100}}}}
    md = (tmp_path / "eval.md").read_text()
    assert md == doc["table"] == report.table({int(K): r for K, r in expected.items()})
    assert [line.split("|")[1:4] for line in md.splitlines()[2:]] == [
        [" 1 ", "  ", " 1.900 "], [" 2 ", "  ", " 1.800 "], [" 3 ", "  ", " 1.700 "], [" 6 ", " 40.00 ", "  "]]
    assert plot.read_eval(str(path)) == {int(K): r for K, r in expected.items()}  # what the plots and table read


def test_a_rerun_replaces_only_what_it_computes_again(tmp_path):
    """bpb at K = 1, 3, then again at K = 3 only (say, on more tokens): K = 3 is the new run's, K = 1
    the first's; once no entry is the first run's any more, its record goes too."""
    path = tmp_path / "eval.json"
    run(path, "T1", {1: {"val_bpb": 1.5}, 3: {"val_bpb": 1.4}}, "bpb", bpb_tokens=512)
    run(path, "T2", {3: {"val_bpb": 1.3}}, "bpb", bpb_tokens=4096)
    doc = saved(path)
    assert doc["results"] == {"1": {"val_bpb": 1.5}, "3": {"val_bpb": 1.3}}
    assert doc["computed"] == {"1": {"val_bpb": "T1"}, "3": {"val_bpb": "T2"}}
    assert {t: r["settings"]["bpb_tokens"] for t, r in doc["runs"].items()} == {"T1": 512, "T2": 4096}
    run(path, "T3", {1: {"val_bpb": 1.6}}, "bpb", bpb_tokens=4096)
    doc = saved(path)
    assert doc["results"] == {"1": {"val_bpb": 1.6}, "3": {"val_bpb": 1.3}} and sorted(doc["runs"]) == ["T2", "T3"]


def test_a_file_that_is_not_an_eval_json_is_set_aside_never_overwritten(tmp_path):
    path, lines = tmp_path / "eval.json", []
    path.write_text('{"results": {"1": {"val_bpb": 1.5}')  # cut off mid-write by another tool, say
    run(path, "2026-01-02T03:04:05.678+00:00", {1: {"val_bpb": 1.2}}, "bpb",
        log=lambda line, **kw: lines.append(line))
    aside = tmp_path / "eval.json.unreadable.2026-01-02T030405.678+0000"
    assert sorted(os.listdir(tmp_path)) == ["eval.json", aside.name, "eval.md"]
    assert aside.read_text() == '{"results": {"1": {"val_bpb": 1.5}'  # kept byte for byte
    assert saved(path)["results"] == {"1": {"val_bpb": 1.2}}
    assert len(lines) == 1 and lines[0].startswith(f"eval.py: {path}: not an eval.json of eval.py (JSONDecodeError")
    assert lines[0].endswith(f"kept it as {aside}, and {path} starts anew")


def test_a_key_the_user_added_to_eval_json_stays_through_later_runs(tmp_path):
    """A top-level key written into eval.json by hand (notes) is the user's: the next run's merge keeps it,
    and it keeps the results it did not compute again."""
    path = tmp_path / "eval.json"
    run(path, "T1", {1: {"val_bpb": 2.0}}, "bpb", loops="1")
    path.write_text(json.dumps(saved(path) | {"notes": "run on the old data"}))
    run(path, "T2", {3: {"val_bpb": 1.9}}, "bpb", loops="3")
    doc = saved(path)
    assert doc["notes"] == "run on the old data"
    assert doc["results"] == {"1": {"val_bpb": 2.0}, "3": {"val_bpb": 1.9}}

def test_another_checkpoints_results_are_set_aside_not_merged(tmp_path):
    path = tmp_path / "eval.json"
    run(path, "T1", {1: {"val_bpb": 1.5}}, "bpb", step=10)
    run(path, "T2", {1: {"val_bpb": 1.2}}, "bpb", step=20, log=lambda *a, **kw: None)  # --out shared by mistake
    assert saved(path)["results"] == {"1": {"val_bpb": 1.2}} and saved(path)["step"] == 20
    assert saved(tmp_path / "eval.json.other.T2")["results"] == {"1": {"val_bpb": 1.5}}


def test_an_eval_json_from_before_merging_is_one_run_of_it(tmp_path):
    """A file written before results accumulated (its settings and measured at the top) is read as one
    run, keyed by the file's time, and merged like any other."""
    path = tmp_path / "eval.json"
    path.write_text(json.dumps({"checkpoint": CHECKPOINT, "step": 10, "settings": {"modes": "bpb,wiki"},
                                "measured": {"bpb": {"tokens": 7}}, "table": "",
                                "results": {"1": {"val_bpb": 1.5, "wiki_ppl": 30.0}, "3": {"val_bpb": 1.4}}}))
    os.utime(path, (0, 0))
    old = report.read_results(str(path))
    then = next(iter(old["runs"]))
    assert old["computed"] == {"1": {"val_bpb": then, "wiki_ppl": then}, "3": {"val_bpb": then}}
    run(path, "T2", {3: {"val_bpb": 1.3}}, "bpb")
    doc = saved(path)
    assert doc["results"] == {"1": {"val_bpb": 1.5, "wiki_ppl": 30.0}, "3": {"val_bpb": 1.3}}
    assert doc["runs"][then] == {"settings": {"modes": "bpb,wiki"}, "measured": {"bpb": {"tokens": 7}}}


def test_results_under_another_choice_sit_beside_the_default_ones(tmp_path):
    """val bpb on fewer tokens than the protocol's (eval.py labels it val_bpb[bpb_tokens=512]) does not
    replace the protocol's: eval.md gives it a row of its own, plot's table reads the default, and its
    sweep may draw either by name."""
    path = tmp_path / "eval.json"
    run(path, "T1", {3: {"val_bpb": 1.4}}, "bpb")
    doc = run(path, "T2", {3: {"val_bpb[bpb_tokens=512]": 1.5}}, "bpb", bpb_tokens=512)
    assert doc["results"] == {"3": {"val_bpb": 1.4, "val_bpb[bpb_tokens=512]": 1.5}}
    assert [line.split("|")[1:3] for line in (tmp_path / "eval.md").read_text().splitlines()[2:]] == [
        [" 3 ", "  "], [" 3 [bpb_tokens=512] ", "  "]]
    assert report.by_label(doc["results"]["3"]) == {"": {"val_bpb": 1.4}, "bpb_tokens=512": {"val_bpb": 1.5}}
    assert report.values(plot.read_eval(str(path))[3])[1] == 1.4
    assert plot.metrics(plot.read_eval(str(path))) == {"val_bpb", "val_bpb[bpb_tokens=512]"}


def test_out_is_a_json_file_and_an_existing_one_an_eval_json_of_eval_py(tmp_path):
    """eval.py's --out (flt/eval_settings.py: check_out, from its command line on): a .json path; a
    file there already is merged into only if it is an eval.json eval.py wrote. A checkpoint's
    model.pt, a .md, lm_eval_flt's lm_eval.json (read_results reads its layout too, but its runs are
    not eval.py's), a user's JSON or one cut off are each refused in one line naming the file, before
    any work, and stay as they were."""
    import eval as ev
    from configurator import settings_of
    from flt import eval_settings
    step = tmp_path / "run" / "step_000020"
    step.mkdir(parents=True)
    (step / "model.pt").write_bytes(b"the weights")
    run(step / "eval.json", "T1", {1: {"val_bpb": 1.5}}, "bpb")
    lm_eval = report.merge(None, {"checkpoint": str(step), "step": 20, "time": "T1",
                                  "settings": {"run": str(step), "tasks": "hellaswag", "loops": [3]}},
                           {3: {"hellaswag": {"results": {"acc,none": 0.3}}}}, {3: {"seconds": 1.0}})
    (step / "lm_eval.json").write_text(json.dumps(lm_eval | {"table": "| task | metric | K=3 |\n"}))
    (step / "mine.json").write_text(json.dumps({"results": {"1": {"val_bpb": 1.0}}}))
    (step / "cut.json").write_text('{"results": {"1": ')
    (step / "notes.md").write_text("# notes\n")
    before = {name: (step / name).read_bytes() for name in os.listdir(step)}
    refused = {"model.pt": (ValueError, "not a .json path"), "notes.md": (ValueError, "give a .json path"),
               "lm_eval.json": (FileExistsError, "not an eval.json of eval.py"),
               "mine.json": (FileExistsError, "not an eval.json of eval.py"),
               "cut.json": (FileExistsError, "not an eval.json of eval.py")}
    for name, (error, message) in refused.items():
        with pytest.raises(error, match=re.escape(f"--out={step / name}: ") + ".*" + re.escape(message)) as e:
            eval_settings.check_out(str(step / name))
        assert "\n" not in str(e.value)
    for name in ("eval.json", "new.json"):
        eval_settings.check_out(str(step / name))
    # from eval.py's command line, before the checkpoint is read
    with pytest.raises(ValueError, match=re.escape(f"--out={step / 'model.pt'}: not a .json path")):
        eval_settings.read([str(step), f"--out={step / 'model.pt'}"], settings_of(vars(ev)), ev.__file__)
    assert {name: (step / name).read_bytes() for name in os.listdir(step)} == before


def test_a_run_stopped_between_its_two_writes_leaves_a_table_the_next_run_rewrites(tmp_path):
    """eval.json is written before eval.md: a run that stops in between leaves eval.md holding the
    table before it (eval.json's previous_table), still eval.py's own, so the next run rewrites it;
    a table edited by hand stays refused."""
    path, md = tmp_path / "eval.json", tmp_path / "eval.md"
    run(path, "T1", {3: {"val_bpb": 1.5}}, "bpb", loops="3")
    first = md.read_text()

    def json_only(p, text):
        if p.endswith(".md"):
            raise KeyboardInterrupt
        write(p, text)
    record = {"checkpoint": CHECKPOINT, "step": 10, "settings": {"modes": "wiki"}, "time": "T2"}
    with pytest.raises(KeyboardInterrupt):
        report.write_results(str(path), record, {3: {"wiki_ppl": 40.0}}, {"wiki": {}}, write=json_only)
    assert md.read_text() == first == saved(path)["previous_table"] != saved(path)["table"]
    run(path, "T3", {1: {"val_bpb": 1.9}}, "bpb", loops="1")
    assert md.read_text() == saved(path)["table"] == report.table({1: {"val_bpb": 1.9}, 3: {"val_bpb": 1.5,
                                                                                           "wiki_ppl": 40.0}})
    md.write_text(md.read_text() + "my note\n")
    with pytest.raises(FileExistsError, match="eval.md: not the table eval.py wrote beside"):
        run(path, "T4", {1: {"val_bpb": 1.8}}, "bpb", loops="1")
