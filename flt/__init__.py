"""Support code for the tutorial files at the repository root: settings checks and run planning
(planning), where a process runs (runtime), downloads and corpora (corpus), train.py's data and
tokenizer (inputs), checkpoints (checkpoint), cluster life (cluster), the duties of a real run
that train.py's loop calls (guard), what training watches (diagnostics), reports (report),
eval.py's modes (modes) and CORE's prompts (core), experiment tracking (tracking), --help and a
script's settings (usage), and the one-line error for a user's mistake (errors). A reader of the
paper never needs to open it."""
