# Diagnostics (Sec. 3, Fig. 3): FLT at K = 12, small size, the first 2000 steps.
from config.diag import *

loops = 12
variant = "FLT"
out_dir = "out/diag_flt_k12"
