# Table 1: FLT at K = 3, base size (depth 12, 318M).
from config.paper import *

depth = 12
loops = 3
variant = "FLT"
out_dir = "out/table1_base_flt_k3"
