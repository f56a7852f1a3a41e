# Table 1: LT at K = 9, small size (depth 6, 127M).
from config.paper import *

depth = 6
loops = 9
variant = "LT"
out_dir = "out/table1_small_lt_k9"
