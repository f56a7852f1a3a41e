"""train.py's data and tokenizer on text: the vocabulary the model is sized for, the shards, and
the tokenizer, chosen here and nowhere else (a synthetic task's: flt/tasks.py, where its
vocabulary's size is planning.planned_vocab's).

    vocab_size = inputs.vocab_size(settings)   # before the horizon
    shards = inputs.shards(settings, tokens)   # validation last
    tok = inputs.tokenizer(settings, shards[:-1])   # the training shards

The order is the recipe's: the vocabulary sizes the model, the model's size sets the horizon, and
the horizon sets how many FineWeb shards to fetch (num_shards=-1). So vocab_size comes first: it
builds the embedded corpus and trains its BPE (cached: tokenizer() then loads it), or loads a
named tokenizer; a BPE still to be trained on FineWeb's shards will have bpe_vocab_size ids. Under
dry_run it reads the size from the settings, or from your own data's BPE, trained in memory if no
run has cached it (planning.planned_vocab): nothing is written or fetched. Every rank calls these
before the process group exists (a download of many GB would outlast a collective's timeout); file
locks make one process do each piece of work.
"""
import functools
import os

import data
from flt import corpus, errors, owndata, planning, tasks


def vocab_size(s):
    """The tokenizer's vocabulary size, before the shards are known (see the module's docstring).
    Your own data (flt/owndata.py) is converted here, and what it holds printed with its tokens.
    The first to touch data_dir: a run that ends on a user's error leaves no empty one it made."""
    errors.on_user_error(functools.partial(errors.remove_empty, errors.missing(s["data_dir"])))
    bpe = s["tokenizer"] == "bpe"
    if s["dry_run"] or s["dataset"] in tasks.TASKS or (bpe and s["dataset"] == "fineweb"):
        return planning.planned_vocab(s)
    if owndata.is_own(s["dataset"]):
        tok = tokenizer(s, shards(s, 0)[:-1])
        print(owndata.describe(s["dataset"], s["val_dataset"], tok), flush=True)
        return tok.vocab_size
    train_files = corpus.embedded_corpus(s["data_dir"])[:-1] if bpe else None
    return tokenizer(s, train_files).vocab_size


def shards(s, tokens, data=None):
    """The shard paths, the validation shard last: the embedded corpus (built once, cached in
    data_dir), your own data's (converted once, cached in data_dir: flt/owndata.py; data: a
    checkpoint's record of them, owndata.run_shards), or the FineWeb-Edu shards that `tokens`
    training tokens need (num_shards)."""
    if s["dataset"] == "embedded":
        return corpus.embedded_corpus(s["data_dir"])
    if owndata.is_own(s["dataset"]):
        return owndata.run_shards(s, s["data_dir"], data)
    return corpus.download_shards(planning.training_shards(s, tokens), s["data_dir"])


def val_shard(trained, data_dir, data=None):
    """The validation shard a run held out (eval.py's): its own data's (data: the checkpoint's
    meta["data"]; owndata.run_shards: the folder it trained on, or the same documents converted
    again from its files; nothing downloaded), else corpus.val_shard's."""
    if owndata.is_own(trained.get("dataset", "embedded")):
        return owndata.run_shards(trained, data_dir, data, what="eval.py")[-1]
    return corpus.val_shard(trained, data_dir)


def tokenizer(s, train_files):
    """The run's tokenizer: tokenizer="bpe" is a byte-level BPE of bpe_vocab_size ids trained on
    train_files (the training shards), once, and cached beside them; any other value is a
    tokenizer.json path or a hub name (downloaded into data_dir)."""
    if s["tokenizer"] != "bpe":
        return data.load_tokenizer(s["tokenizer"], cache_dir=s["data_dir"], bos=s["bos_token"])
    return data.get_tokenizer("bpe", os.path.dirname(train_files[0]), train_files,
                              s["bpe_vocab_size"], bos=s["bos_token"])
