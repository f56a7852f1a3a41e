"""flt/inputs.py: train.py's data and tokenizer. The vocabulary that sizes the model is the
tokenizer's (a BPE's own count, which a small corpus may leave below bpe_vocab_size); --dry_run and
a BPE still to be trained on FineWeb's shards read it from the settings, building nothing."""
import os
import shutil

from flt import inputs
from test_configs import train_defaults

DEFAULTS = train_defaults()


def settings(data_dir, **changes):
    return DEFAULTS | {"data_dir": str(data_dir), "bpe_vocab_size": 512} | changes


def test_the_plan_and_a_bpe_for_fineweb_read_the_vocabulary_from_the_settings(tmp_path):
    assert inputs.vocab_size(settings(tmp_path, dry_run=True)) == 512
    assert inputs.vocab_size(settings(tmp_path, dataset="fineweb")) == 512
    assert os.listdir(tmp_path) == []  # nothing built, downloaded or trained


def test_the_embedded_corpus_and_its_bpe_size_the_model(tmp_path, built_data):
    shutil.copytree(built_data, tmp_path, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.lock"))
    s = settings(tmp_path)
    shards = inputs.shards(s, tokens=0)
    assert [os.path.basename(p) for p in shards] == [f"shard_{i:05d}.parquet" for i in range(5)]
    cached = os.path.join(os.path.dirname(shards[0]), "tokenizer_bpe512.json")  # trained beside them
    before = os.path.getmtime(cached)
    tok = inputs.tokenizer(s, shards[:-1])
    assert inputs.vocab_size(s) == tok.vocab_size == 512
    assert os.path.getmtime(cached) == before  # loaded, not trained again
    s = settings(tmp_path, bpe_vocab_size=600)  # no such BPE yet: trained on the training shards
    assert inputs.vocab_size(s) == inputs.tokenizer(s, shards[:-1]).vocab_size
    assert os.path.isfile(os.path.join(os.path.dirname(shards[0]), "tokenizer_bpe600.json"))


def test_a_named_tokenizer_is_loaded_whatever_the_data(tmp_path, built_data):
    path = os.path.join(built_data, "embedded", "tokenizer_bpe512.json")
    s = settings(tmp_path, tokenizer=path, dataset="fineweb")
    assert inputs.tokenizer(s, None).vocab_size == inputs.vocab_size(s) == 512
    assert os.listdir(tmp_path) == []  # no shard fetched for it
