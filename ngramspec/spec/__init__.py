"""Model-free n-gram drafting. Pure Python (plus optional numba); no torch except in verify.py."""
