# Table 1: LT_ai at K = 3, base size (depth 12, 318M).
from config.paper import *

depth = 12
loops = 3
variant = "LT_ai"
out_dir = "out/table1_base_lt_ai_k3"
