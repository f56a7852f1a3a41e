# Table 1: FLT at K = 6, small size (depth 6, 127M).
from config.paper import *

depth = 6
loops = 6
variant = "FLT"
out_dir = "out/table1_small_flt_k6"
