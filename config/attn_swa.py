# Attention variants: base-size FLT at K = 12 with sliding-window attention: three layers of
# window sequence_len // 4 = 256, then one full layer, tiled (the last layer is always full).
from config.paper import *

depth = 12
loops = 12
variant = "FLT"
window_pattern = "SSSL"
out_dir = "out/attn_swa"
