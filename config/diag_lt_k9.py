# Diagnostics (Sec. 3, Fig. 3): LT at K = 9, small size, the first 2000 steps.
from config.diag import *

loops = 9
variant = "LT"
out_dir = "out/diag_lt_k9"
