# Diagnostics (Sec. 3, Fig. 3): LT_ai at K = 12, small size, the first 2000 steps.
from config.diag import *

loops = 12
variant = "LT_ai"
out_dir = "out/diag_lt_ai_k12"
