# Diagnostics (Sec. 3, Fig. 3): LT_i at K = 9, small size, the first 2000 steps.
from config.diag import *

loops = 9
variant = "LT_i"
out_dir = "out/diag_lt_i_k9"
