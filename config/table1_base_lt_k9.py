# Table 1: LT at K = 9, base size (depth 12, 318M).
from config.paper import *

depth = 12
loops = 9
variant = "LT"
out_dir = "out/table1_base_lt_k9"
