"""Kernels with three faces each: a numpy reference, a numba CPU version and a torch version."""
