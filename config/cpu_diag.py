# The diagnostic experiment at CPU scale on the embedded corpus (docs/recipe.md, "A CPU-scale rerun"):
# depth 2 (d_model 128), K = 12 by default, 400 steps of 1024 tokens: 4 to 7 minutes on 2 cores.
#   python train.py config/cpu_diag.py --variant=LT        # -> out/cpu_diag/d2_lt_k12
device = "cpu"
depth = 2
loops = 12                  # the paper's unstable regime for LT
sequence_len = 128
total_batch_size = 1024     # one forward of 8 sequences per step: more steps beat bigger batches here
num_steps = 400
warmdown_frac = 0.0         # constant LR, like the first 2000 steps of a paper run
momentum_warmup_steps = 60  # the paper's 300-step warm-up, scaled to the shorter run
eval_interval = 50
eval_tokens = 2**13         # 8 forwards: about a second per evaluation
final_eval_tokens = 2**15
out_root = "out/cpu_diag"
divergence_window = 0
log_clipped_norms = True    # grad_<module>_clipped, as the authors' diagnostic script logged them
