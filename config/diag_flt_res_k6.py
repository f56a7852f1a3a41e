# Diagnostics (Sec. 3, Fig. 3): FLT_res at K = 6, small size, the first 2000 steps.
from config.diag import *

loops = 6
variant = "FLT_res"
out_dir = "out/diag_flt_res_k6"
