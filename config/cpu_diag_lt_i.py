# CPU diagnostic (config/cpu.py): LT_i at K = 12, depth 2, embedded corpus.
from config.cpu import *

variant = "LT_i"
out_dir = "out/cpu_diag_lt_i"
