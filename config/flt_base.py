# The headline: base-size (depth 12, 318M) Fully Looped Transformer at K = 9 (paper Table 1).
#   torchrun --nproc_per_node=8 train.py config/flt_base.py
#   python eval.py out/flt_base
from config.paper import *

depth = 12
loops = 9
variant = "FLT"
out_dir = "out/flt_base"
