# Attention variants: base-size FLT at K = 12 with grouped-query attention as the authors ran
# it: 3 key/value heads, each shared by 2 of the 6 query heads (n_head = ceil(768 / 128) = 6).
from config.paper import *

depth = 12
loops = 12
variant = "FLT"
n_kv_head = 3
out_dir = "out/attn_gqa"
