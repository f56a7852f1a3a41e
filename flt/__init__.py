"""Support code for the tutorial files at the repository root, one job a module: settings checks and
run planning (planning), where a process runs (runtime), files written whole (files), downloads and
corpora (corpus), your own text as a dataset (owndata), train.py's data and tokenizer (inputs), the
loader's argument checks and resume (loader_state), checkpoints (checkpoint), cluster life
(cluster), the duties of a real run that train.py's loop calls (guard), what training records
(diagnostics), eval.py's settings (eval_settings), its modes (modes) and what it reports, formatted
(report), CORE's prompts (core), experiment tracking (tracking), --help and a script's settings
(usage), the one-line error for a user's mistake (errors), and a run of the authors' code read into
this format (authors). hf_remote/ is the transformers wrapper a Hugging Face export ships.

A reader of the paper needs none of it. Three modules go beyond the paper and are worth
reading: decoding's KV cache of loop slots, the exit rules and drafting with fewer loops
(decoding), which model.py's loop and generate call, with the learned exit gate trained on a
frozen run (exit_gate); and the synthetic reasoning tasks whose difficulty is depth (tasks), which
train.py trains on and scores, as eval.py's tasks mode does at every K.

The user scripts built on it are in scripts/: bench (speed and memory), gpu_check (the recipe on
one GPU), torchrun_check (the headline torchrun command on the machine at hand), zero_check
(optim.py's ZeRO path against one process), plot (the paper's figures and tables), lm_eval_flt
(lm-evaluation-harness at every K), export_hf (a run as a Hugging Face folder) and import_authors
(a run of the authors' code)."""
