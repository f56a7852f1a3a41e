# Diagnostics (Sec. 3, Fig. 3): LT at K = 6, small size, the first 2000 steps.
from config.diag import *

loops = 6
variant = "LT"
out_dir = "out/diag_lt_k6"
