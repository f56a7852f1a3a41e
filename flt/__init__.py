"""Support code for the tutorial files at the repository root: settings checks and run planning
(planning), where a process runs (runtime), downloads and corpora (corpus), checkpoints
(checkpoint), cluster life (cluster), what training watches (diagnostics), reports (report),
eval.py's modes (modes) and CORE's prompts (core), experiment tracking (tracking), --help and a
script's settings (usage), and the one-line error for a user's mistake (errors). A reader of the
paper never needs to open it."""
