"""Your own text as train.py's dataset (flt/owndata.py): a folder, a file or a glob of .txt, .md,
.jsonl and .parquet; validation held out by each document's hash (or --val_dataset), no document
on both sides; the user's files only read; a changed corpus gets new shards and a BPE of its own;
--dry_run counts the run's tokens, writing nothing; eval.py scores min(bpb_tokens, all) of the
held-out tokens, whatever the row groups."""
import hashlib
import json
import os
import re
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import data
from flt import inputs, owndata, planning
from test_nothing_lost import tree
from test_train import ROOT, losses, python


def document(i):
    """A document of its own: its number in words and some text, distinct from every other."""
    return f"Document {i}: " + " ".join(f"word{(i * 7 + j) % 97}" for j in range(40 + i % 13)) + ".\n"


def held_out_by_hand(text):
    return int(hashlib.sha256(text.encode("utf-8")).hexdigest()[:8], 16) % 20 == 0


@pytest.fixture
def mixed(tmp_path):
    """A folder of 120 documents in every format: 30 .txt, 10 .md in a sub-folder, 40 in a .jsonl,
    40 in a .parquet of 3 row groups; and a hidden file, which is not read."""
    folder = tmp_path / "mine"
    (folder / "notes").mkdir(parents=True)
    for i in range(30):
        (folder / f"doc{i:02d}.txt").write_text(document(i))
    for i in range(30, 40):
        (folder / "notes" / f"note{i}.md").write_text(document(i))
    (folder / "more.jsonl").write_text("".join(json.dumps({"text": document(i), "id": i}) + "\n"
                                               for i in range(40, 80)) + "\n")
    pq.write_table(pa.table({"text": [document(i) for i in range(80, 120)]}), folder / "rest.parquet",
                   row_group_size=16)
    (folder / ".DS_Store").write_bytes(b"\x00\x01")
    return folder


def test_every_format_is_read_and_the_split_follows_the_hash(mixed):
    train_docs, val_docs, counts = owndata.split(str(mixed), "")
    everything = [document(i) for i in range(120)]
    assert counts["files"] == 30 + 10 + 2 and sorted(train_docs + val_docs) == sorted(everything)
    assert val_docs == [d for d in sorted(everything, key=everything.index) if held_out_by_hand(d)]
    assert not set(train_docs) & set(val_docs) and val_docs  # no document on both sides


def test_a_held_out_dataset_and_a_document_in_both(mixed, tmp_path):
    val = tmp_path / "val.jsonl"
    val.write_text(json.dumps({"text": document(3)}) + "\n" + json.dumps({"text": "held out only"}) + "\n")
    train_docs, val_docs, counts = owndata.split(str(mixed), str(val))
    assert val_docs == [document(3), "held out only"]
    assert document(3) not in train_docs and len(train_docs) == 119 and counts["dropped"] == 1


@pytest.mark.parametrize("make, error", [
    (lambda f: (f / "a.txt").write_text("x") and (f / "b.pdf").write_bytes(b"%PDF"),
     r"1 files of other kinds there \(e\.g\. .*/bad/b\.pdf; \.pdf\); a folder is read for .*give a glob"),
    (lambda f: (f / "a.jsonl").write_text('{"text": "fine"}\n{"body": "no text"}\n'),
     r"a\.jsonl:2: expected a JSON object with a string field 'text'"),
    (lambda f: (f / "a.txt").write_bytes(b"\xff\xfe caf\xe9"), r"a\.txt: not UTF-8 text"),
    (lambda f: (f / "a.txt").write_text("only one document"), r"1 documents leave none for"),
    (lambda f: None, r"no \.txt, \.md, \.jsonl, \.parquet files there"),
])
def test_what_cannot_be_read_is_one_line_naming_it(tmp_path, make, error):
    folder = tmp_path / "bad"
    folder.mkdir()
    make(folder)
    owndata.split.cache_clear()
    with pytest.raises(ValueError, match=error):
        owndata.split(str(folder), "")


def test_json_lines_are_split_at_newlines_only_and_a_byte_order_mark_is_no_text(tmp_path):
    """U+2028 and U+0085 may stand raw inside a JSON string (json.dumps(ensure_ascii=False) writes
    them so); a file saved with a BOM (Windows editors) reads as without one."""
    docs = [document(i) + "\u2028line\u0085next" for i in range(40)]
    lines = "".join(json.dumps({"text": d}, ensure_ascii=False) + "\r\n" for d in docs)
    (tmp_path / "a.jsonl").write_bytes(b"\xef\xbb\xbf" + lines.encode("utf-8"))
    (tmp_path / "b.txt").write_bytes(b"\xef\xbb\xbf" + document(99).encode("utf-8"))
    train_docs, val_docs, _ = owndata.split(str(tmp_path), "")
    assert sorted(train_docs + val_docs) == sorted(docs + [document(99)])


def test_a_path_that_exists_is_read_as_itself_not_as_a_glob(tmp_path):
    folder = tmp_path / "texts [v1]"
    folder.mkdir()
    for i in range(40):
        (folder / f"d{i}.txt").write_text(document(i))
    literal = tmp_path / "lines[1].jsonl"
    literal.write_text("".join(json.dumps({"text": document(i)}) + "\n" for i in range(40)))
    assert owndata.files_of(str(literal)) == [str(literal)]
    assert len(owndata.files_of(str(folder))) == 40
    assert owndata.name_of(str(folder)) == "texts__v1_" != owndata.name_of(str(tmp_path / "texts [v2]"))
    with pytest.raises(ValueError, match=r"dataset=.*/nothing\*\.txt: the glob matches no file"):
        owndata.files_of(str(tmp_path / "nothing*.txt"))


def test_a_symlinked_folder_is_read_once_and_a_loop_of_links_ends(tmp_path):
    elsewhere, folder = tmp_path / "elsewhere", tmp_path / "mine"
    elsewhere.mkdir()
    folder.mkdir()
    for i in range(3):
        (elsewhere / f"e{i}.txt").write_text(document(i))
    (folder / "a.txt").write_text(document(9))
    (folder / "linked").symlink_to(elsewhere)
    (elsewhere / "back").symlink_to(folder)  # a cycle: mine/linked/back is mine
    assert [os.path.basename(p) for p in owndata.files_of(str(folder))] == ["a.txt", "e0.txt", "e1.txt", "e2.txt"]


def test_the_held_out_files_and_the_cache_are_named_as_such(tmp_path, mixed):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    owndata.split.cache_clear()
    with pytest.raises(ValueError, match=r"^val_dataset=.*empty\.txt: its files hold no document$"):
        owndata.split(str(mixed), str(empty))
    with pytest.raises(FileNotFoundError, match=r"^val_dataset='.*/nope': no such file or folder \(expected a folder, file"):
        owndata.split(str(mixed), str(tmp_path / "nope"))
    with pytest.raises(ValueError, match=r"each of its 120 documents is also in val_dataset="):
        owndata.split(str(mixed), str(mixed))
    with pytest.raises(ValueError, match=r"^data_dir=.*/mine/cache is inside dataset=.*/mine, which this"):
        owndata.check_data_dir(str(mixed), str(mixed / "cache"))
    owndata.check_data_dir(str(mixed), str(tmp_path / "mine_cache"))  # a sibling named alike is outside


def test_a_glob_reads_files_of_any_kind_as_text(tmp_path):
    for i in range(40):
        (tmp_path / f"m{i}.py").write_text(document(i))
    train_docs, val_docs, counts = owndata.split(str(tmp_path / "*.py"), "")
    assert counts["files"] == 40 and sorted(train_docs + val_docs) == sorted(map(document, range(40)))
    assert owndata.name_of(str(tmp_path / "*.py")) == tmp_path.name
    assert owndata.name_of(str(tmp_path / "src" / "**" / "*.py")) == "src"
    assert owndata.name_of(str(tmp_path / "corpus.jsonl")) == "corpus"
    assert owndata.name_of(str(tmp_path / "lib" / "python3.11" / "*.py")) == "python3.11"


def test_a_changed_corpus_gets_new_shards_and_the_same_one_finds_its_own(mixed, tmp_path):
    data_dir = str(tmp_path / "data")
    first = owndata.prepare(str(mixed), "", data_dir)
    assert owndata.prepare(str(mixed), "", data_dir) == first  # cached: found again
    assert os.path.basename(os.path.dirname(first[0])).startswith("mine-")
    names = [pq.read_table(p).column("text").to_pylist() for p in first]
    assert sorted(sum(names, [])) == sorted(map(document, range(120))) and names[-1] == owndata.split(str(mixed), "")[1]
    (mixed / "doc00.txt").write_text("an edited document\n")
    owndata.split.cache_clear()
    second = owndata.prepare(str(mixed), "", data_dir)
    assert os.path.dirname(second[0]) != os.path.dirname(first[0])  # and so is its BPE's path


def test_a_run_on_your_folder_reads_it_only_and_its_dry_run_counts_the_same_tokens(mixed, tmp_path):
    """--dry_run writes nothing (no data_dir made, your folder untouched) and prints the files,
    documents and tokens the run then prints: before the run, with the BPE it would train (trained
    in memory); after it, with the BPE the run cached, and that data_dir stays byte for byte."""
    before = tree(mixed)
    root, own_dir = tmp_path / "out", tmp_path / "own_data_dir"
    args = [f"--dataset={mixed}", f"--out_root={root}", f"--data_dir={own_dir}",
            "--num_steps=4", "--save_interval=4", "--sample_tokens=0"]

    def your_data(stdout):
        [line] = [line for line in stdout.splitlines() if f"your data: {mixed}: " in line]
        return line[line.index("your data: "):]
    p = python("train.py", *TINY_NO_DATA, *args, "--dry_run")
    assert p.returncode == 0, p.stderr
    trained = r"\(tokens of the BPE the run would train, \d+ ids on the \d+ training documents: "
    assert re.search(trained + "trained here in memory, not saved", p.stdout)
    planned = your_data(p.stdout)
    assert f"your data: {mixed}: 42 files" in planned and " tokens; validation " in planned
    assert not own_dir.exists() and tree(mixed) == before  # a dry run writes nothing
    params = re.search(r"parameters  ([\d,]+) all", p.stdout).group(1)
    p = python("train.py", *TINY_NO_DATA, *args)
    assert p.returncode == 0, p.stderr
    assert your_data(p.stdout) == planned  # the same files, documents and tokens of each side
    assert f"3 loops, {params} parameters" in p.stdout  # the BPE's vocabulary sized both models
    out = root / "d1_flt_k3_mine"  # the run's name carries the dataset's
    assert tree(mixed) == before  # not a byte changed, nothing added or removed
    n_val = sum(map(held_out_by_hand, map(document, range(120))))
    assert f"training {120 - n_val} documents, " in p.stdout and f"validation (1 in 20 by hash) {n_val} documents, " in p.stdout
    written = tree(own_dir)
    p = python("train.py", *TINY_NO_DATA, *args, "--dry_run")
    assert p.returncode == 0, p.stderr
    assert your_data(p.stdout) == planned and "(tokens of the run's BPE, cached: " in p.stdout
    assert tree(own_dir) == written and tree(mixed) == before
    assert sorted(losses(out)[0]) == [0, 1, 2, 3]
    # eval.py scores the same held-out documents: the conversion's val.parquet
    p = python("eval.py", str(out), "--modes=bpb", "--loops=3", "--bpb_tokens=512", "--device=cpu")
    assert p.returncode == 0, p.stderr
    measured = json.loads((out / "step_000004" / "eval.json").read_text())
    held = [json.dumps(v) for v in measured.values()]
    assert any("val.parquet" in h for h in held), measured
    meta = torch.load(out / "step_000004" / "model.pt", weights_only=True, map_location="cpu")
    assert any(meta["data"] + "/val.parquet" in h for h in held)  # the folder it trained on

    # Your files edited after the run: a resume is refused, one line, the run untouched ...
    (mixed / "doc00.txt").write_text("an edited document\n")
    run = tree(out)
    p = python("train.py", *TINY_NO_DATA, *args, "--num_steps=6", "--resume=True")
    assert p.returncode == 1 and len(p.stderr.splitlines()) == 1, p.stderr
    assert f"dataset={mixed} no longer holds the documents this run trained on (they were {meta['data']}" in p.stderr
    assert tree(out) == run
    # ... and eval.py still scores the documents the run held out, from the folder it trained on;
    # that folder gone, it refuses to score others
    owndata.split.cache_clear()
    trained = meta["settings"]
    assert inputs.val_shard(trained, str(own_dir), meta["data"]) == str(own_dir / "own" / meta["data"] / "val.parquet")
    os.rename(own_dir / "own" / meta["data"], tmp_path / "moved")
    with pytest.raises(ValueError, match=f"eval.py: dataset={mixed} no longer holds the documents .* restore the "
                                         f"files as they were, or the folder {own_dir}/own/{meta['data']}"):
        inputs.val_shard(trained, str(own_dir), meta["data"])


def test_the_dry_runs_bpe_is_the_one_the_run_trains(mixed, tmp_path):
    """planning.own_tokenizer's BPE, trained in memory on the training documents, writes nothing and
    has the ids, and gives the tokens, of the BPE a run trains on their shards (data.get_tokenizer),
    at a vocabulary the corpus fills (300) and one it cannot (512: fewer ids); once a run has cached
    its BPE, a dry run counts with that."""
    s = {"dataset": str(mixed), "val_dataset": "", "data_dir": str(tmp_path / "data"),
         "tokenizer": "bpe", "bos_token": data.BOS}
    planned = {v: planning.own_tokenizer(s | {"bpe_vocab_size": v}) for v in (300, 512)}
    assert not os.path.exists(s["data_dir"])
    train_docs = owndata.split(str(mixed), "")[0]
    shards = owndata.prepare(str(mixed), "", s["data_dir"])[:-1]
    for vocab, (tok, source) in planned.items():
        assert "trained here in memory, not saved" in source
        run = data.get_tokenizer("bpe", os.path.dirname(shards[0]), shards, vocab)
        assert tok.vocab_size == run.vocab_size
        # 512 is more than this corpus has merges for
        assert (tok.vocab_size < vocab) == (vocab == 512)
        assert tok.encode_batch(train_docs) == run.encode_batch(train_docs)
        cached, source = planning.own_tokenizer(s | {"bpe_vocab_size": vocab})
        assert source.startswith("the run's BPE, cached: ")
        assert cached.encode_batch(train_docs) == run.encode_batch(train_docs)


TINY_NO_DATA = ["--device=cpu", "--depth=1", "--sequence_len=32", "--device_batch_size=4",
                "--total_batch_size=128", "--bpe_vocab_size=512", "--eval_interval=2", "--eval_tokens=256",
                "--final_eval_tokens=256", "--momentum_warmup_steps=5"]


def test_bpb_tokens_means_tokens_whatever_the_row_groups(tmp_path):
    """One row group: the authors' 4 ranks give it all to rank 0, which scores a quarter of
    bpb_tokens; eval.py then scores bpb_tokens of it in one stream, as the same documents in many
    row groups are scored by the authors' layout; the message says which."""
    import eval as ev
    from test_eval import save_checkpoint
    _, tok, step = save_checkpoint(tmp_path)
    docs = [document(i) for i in range(60)]
    measured = {}
    for name, size in (("one", 60), ("many", 2)):
        pq.write_table(pa.table({"text": docs}), tmp_path / f"{name}.parquet", row_group_size=size)
        ev.main([str(tmp_path / "run"), "--device=cpu", "--loops=2", "--modes=bpb", "--bpb_tokens=4096",
                 f"--val_files={tmp_path / name}.parquet", f"--out={tmp_path / name}.json"])
        [run] = json.loads((tmp_path / f"{name}.json").read_text())["runs"].values()
        measured[name] = run["measured"]["bpb"]
    chunks, _ = data.protocol_chunks([str(tmp_path / "one.parquet")], tok, 64, 4096, 4, 4)
    assert sum(int((y >= 0).sum()) for _, y in chunks) == 1024  # the authors' layout: rank 0's quarter
    assert (measured["one"]["tokens"], measured["one"]["ranks"]) == (4096, 1)
    assert (measured["many"]["tokens"], measured["many"]["ranks"]) == (4096, 4)


def test_the_python_snippet_of_docs_own_data_runs_as_shown(tiny_run):
    """docs/own-data.md's Python block, run as written from the repository root, on the tests' tiny
    run in place of the page's: it loads the run with its tokenizer and turns prompts into text."""
    page = open(os.path.join(ROOT, "docs", "own-data.md")).read()
    [snippet] = re.findall(r"```python\n(.*?)```", page, re.S)
    run = re.search(r'load_run\("([^"]+)"\)', snippet).group(1)
    p = subprocess.run([sys.executable, "-c", snippet.replace(run, str(tiny_run))], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0].startswith("step ") and " K=" in lines[0] and lines[1].startswith("def main(")
