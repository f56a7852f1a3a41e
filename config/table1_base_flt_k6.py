# Table 1: FLT at K = 6, base size (depth 12, 318M).
from config.paper import *

depth = 12
loops = 6
variant = "FLT"
out_dir = "out/table1_base_flt_k6"
