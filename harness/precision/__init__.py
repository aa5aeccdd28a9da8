"""Precision: compare a target run with a golden, per module (compare.py), with tolerances resolved
per dtype / suite / backend / device generation (tolerance.py); localize and plot errors
(align.py); find the modules or ops that need higher precision or a fallback (bisect.py)."""
