# Diagnostics (Sec. 3, Fig. 3): FLT_res at K = 9, small size, the first 2000 steps.
from config.diag import *

loops = 9
variant = "FLT_res"
out_dir = "out/diag_flt_res_k9"
