# CPU-scale rerun of the diagnostic experiment (Sec. 3, Fig. 3) on the embedded corpus, the
# shared recipe of cpu_diag_*.py (each sets the variant). About 3 min a run on 2 cores; then
#   python plot.py diag out/cpu_diag_lt out/cpu_diag_lt_i out/cpu_diag_flt_res out/cpu_diag_flt
# (train.py's own defaults are already the CPU smoke test: python train.py --device=cpu)
device = "cpu"
depth = 2                   # d_model 128, 1 head: 2 unique blocks, run 12 times each
loops = 12                  # the paper's unstable regime for LT
sequence_len = 128
total_batch_size = 1024     # one forward of 8 sequences per step: more steps beat bigger batches here
num_steps = 400
warmdown_frac = 0.0         # constant LR, like the paper's first 2000 steps of a longer run
momentum_warmup_steps = 60  # the paper's 300-step warm-up, scaled to the shorter run
eval_interval = 50
eval_tokens = 2**13         # 8 forwards: about a second per evaluation
