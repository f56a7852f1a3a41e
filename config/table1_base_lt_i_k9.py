# Table 1: LT_i at K = 9, base size (depth 12, 318M).
from config.paper import *

depth = 12
loops = 9
variant = "LT_i"
out_dir = "out/table1_base_lt_i_k9"
