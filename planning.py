"""Support for train.py: run planning and settings checks, kept out of the tutorial's way.

What a run will cost before it starts (the memory estimate, accelerators' peak FLOP/s, the
--dry_run plan), and train.py's settings checks (values, settings that would do nothing, what a
resumed run may change, the run directory's name, the horizon).
"""

# ---------------------------------------------------------------------------- memory and accelerators


# ---------------------------------------------------------------------------- train.py's settings
