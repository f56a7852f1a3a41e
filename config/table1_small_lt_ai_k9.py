# Table 1: LT_ai at K = 9, small size (depth 6, 127M).
from config.paper import *

depth = 6
loops = 9
variant = "LT_ai"
out_dir = "out/table1_small_lt_ai_k9"
