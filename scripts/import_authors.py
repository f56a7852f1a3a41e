"""
Import a run trained with the paper authors' code (FuRuF-11/FullyLoopedTransformer) as a run of this
project (docs/operations.md, "Runs trained with the authors' code").

    python -m scripts.import_authors ~/.cache/nanochat/base_checkpoints/<tag> out/theirs
    python -m scripts.import_authors <their dir> out/theirs_4k --step=4000 --tokenizer=tok.json
    python eval.py out/theirs --loops=1,3,6,9,12

Their checkpoint dir (their base_train.py's: <tag> like FLT_L9_D12_END_attnfull) holds
model_<step>.pt and meta_<step>.json (their checkpoint_manager.py); the newest step is imported
unless --step picks one. The tokenizer is Qwen3's, as in their training:
--tokenizer gives a local tokenizer.json, else the copy the data pipeline keeps in data/ (downloaded
if missing). Everything is checked before anything is written; <out> appears whole, and an existing
one is replaced only with --force, only if this command wrote it and it holds nothing else (never a
training run, their dir, a folder holding it or the tokenizer, or an import holding eval.py's
results: move them out first). The imported run is evaluated, sampled and exported as any run
here; it is not trained further (their optimizer state is not read; train.py --resume refuses it).
"""
import argparse
import os
import sys

from flt import authors
from flt.errors import ArgumentParser, user_errors


def main(argv):
    p = ArgumentParser(prog="python -m scripts.import_authors", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", help="their checkpoint dir: model_<step:06d>.pt, meta_<step:06d>.json")
    p.add_argument("out", help="the run dir to write (it must not exist, unless --force)")
    p.add_argument("--step", type=int, default=None,
                   help="their step to import; default: the newest")
    p.add_argument("--tokenizer", default=None,
                   help="a local tokenizer.json (Qwen3's); default: the data pipeline's copy")
    p.add_argument("--force", action="store_true",
                   help="replace <out> if it is a previous import holding only its own files (never a "
                        "run, their dir or any other folder)")
    args = p.parse_args(argv)
    if not os.path.exists(args.src):
        raise FileNotFoundError(f"{args.src!r}: no such directory")
    if args.tokenizer and not os.path.isfile(args.tokenizer):
        raise FileNotFoundError(f"--tokenizer={args.tokenizer}: no such file")
    if args.step is not None and args.step < 0:
        raise ValueError(f"--step={args.step}: expected a step >= 0")
    return authors.import_run(args.src, args.out, args.step, args.tokenizer, args.force)


if __name__ == "__main__":
    with user_errors("scripts.import_authors"):  # input that does not map: its message and exit status 1, no traceback
        main(sys.argv[1:])
