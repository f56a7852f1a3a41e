# The headline run: the base-size Fully Looped Transformer at K = 9 (paper Table 1).
#   torchrun --nproc_per_node=8 train.py config/flt_base.py      # -> out/base_flt_k9
#   python eval.py out/base_flt_k9
from config.base import *

variant = "FLT"
loops = 9
