# Attention variants (paper Sec. 5): base-size FLT at K = 12 with full multi-head attention,
# the reference for attn_gqa.py, attn_mla.py and attn_swa.py.
from config.paper import *

depth = 12
loops = 12
variant = "FLT"
out_dir = "out/attn_full"
