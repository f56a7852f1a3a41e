# CPU diagnostic (config/cpu.py): FLT_res at K = 12, depth 2, embedded corpus.
from config.cpu import *

variant = "FLT_res"
out_dir = "out/cpu_diag_flt_res"
