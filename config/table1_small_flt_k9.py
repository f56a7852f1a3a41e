# Table 1: FLT at K = 9, small size (depth 6, 127M).
from config.paper import *

depth = 6
loops = 9
variant = "FLT"
out_dir = "out/table1_small_flt_k9"
