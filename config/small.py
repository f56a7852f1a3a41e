# Paper size "small": depth 6 (d_model 384, 3 heads), 127M parameters with the Qwen3 vocabulary.
from config.paper import *

depth = 6
