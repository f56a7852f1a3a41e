# The diagnostic runs (Sec. 3, Fig. 3): small size (depth 6), the first 2000 steps. The small
# model's full horizon is 2626 steps, flat LR until step 2100, so no warm-down here: these
# 2000 steps are exactly the start of a full run. Each diag_*.py adds loops and variant.
from config.paper import *

depth = 6
num_steps = 2000
warmdown_frac = 0.0
