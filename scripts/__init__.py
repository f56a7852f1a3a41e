"""Scripts a user runs from the repository root: python -m scripts.bench, python -m scripts.plot,
python -m scripts.lm_eval_flt."""
