# Table 1: LT_i at K = 3, small size (depth 6, 127M).
from config.paper import *

depth = 6
loops = 3
variant = "LT_i"
out_dir = "out/table1_small_lt_i_k3"
