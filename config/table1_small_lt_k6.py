# Table 1: LT at K = 6, small size (depth 6, 127M).
from config.paper import *

depth = 6
loops = 6
variant = "LT"
out_dir = "out/table1_small_lt_k6"
