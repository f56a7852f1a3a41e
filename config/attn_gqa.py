# Attention variants: base-size FLT at K = 12 with grouped-query attention, 2 key/value heads
# shared by the 6 query heads (n_head = ceil(768 / 128) = 6).
from config.paper import *

depth = 12
loops = 12
variant = "FLT"
n_kv_head = 2
out_dir = "out/attn_gqa"
