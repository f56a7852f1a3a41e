# CPU diagnostic (config/cpu.py): LT at K = 12, depth 2, embedded corpus.
from config.cpu import *

variant = "LT"
out_dir = "out/cpu_diag_lt"
