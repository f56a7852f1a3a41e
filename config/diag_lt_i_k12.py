# Diagnostics (Sec. 3, Fig. 3): LT_i at K = 12, small size, the first 2000 steps.
from config.diag import *

loops = 12
variant = "LT_i"
out_dir = "out/diag_lt_i_k12"
