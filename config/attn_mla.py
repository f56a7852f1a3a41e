# Attention variants: base-size FLT at K = 12 with multi-head latent attention (kv_rank 128,
# train.py's default); with injection the latent comes from the current stream.
from config.paper import *

depth = 12
loops = 12
variant = "FLT"
attn = "mla"
out_dir = "out/attn_mla"
