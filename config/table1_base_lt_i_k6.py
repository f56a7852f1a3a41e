# Table 1: LT_i at K = 6, base size (depth 12, 318M).
from config.paper import *

depth = 12
loops = 6
variant = "LT_i"
out_dir = "out/table1_base_lt_i_k6"
