# The diagnostic runs (Sec. 3, Figs. 2-4, 7, 8) as the authors' diagnostic script ran them:
# small size, 2000 steps, no warm-up, linear warm-down over the last 20%, every step logged.
#   torchrun --nproc_per_node=8 train.py config/diag.py --variant=LT --loops=12   # -> out/diag/small_lt_k12
from config.small import *

num_steps = 2000
warmdown_frac = 0.2
out_root = "out/diag"
divergence_window = 0          # the figures show the collapse, so nothing stops early
save_interval = 500
eval_interval = 200            # the authors' check.sh / base_check.py
log_clipped_norms = True       # grad_<module>_clipped, as the authors' diagnostic script logged them
