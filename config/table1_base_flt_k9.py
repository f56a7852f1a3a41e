# Table 1: FLT at K = 9, base size (depth 12, 318M).
from config.paper import *

depth = 12
loops = 9
variant = "FLT"
out_dir = "out/table1_base_flt_k9"
