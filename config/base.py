# Paper size "base": depth 12 (d_model 768, 6 heads), 318M parameters with the Qwen3 vocabulary.
from config.paper import *

depth = 12
