# CPU diagnostic (config/cpu.py): FLT at K = 12, depth 2, embedded corpus.
from config.cpu import *

variant = "FLT"
out_dir = "out/cpu_diag_flt"
