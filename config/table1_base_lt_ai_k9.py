# Table 1: LT_ai at K = 9, base size (depth 12, 318M).
from config.paper import *

depth = 12
loops = 9
variant = "LT_ai"
out_dir = "out/table1_base_lt_ai_k9"
