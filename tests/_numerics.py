"""Tolerances for two computations that are equal in exact arithmetic, derived from their sizes
instead of guessed, so that they hold on any CPU: BLAS kernels, thread counts and vector widths
change the order of floating-point sums, and so their rounding, never their exact value.

A sum of n terms of magnitude at most s, in any order, is off by at most about n * eps * s
(Higham, "Accuracy and stability of numerical algorithms", 2002, section 4.2: (n - 1) u sum|terms|
with unit roundoff u = eps / 2, so two orders differ by at most about n eps s); rounding errors of
random signs add up to about sqrt(n) * eps * s, the statistical bound. A float32 kernel against
a float64 reference carries one such error; two float32 faces against each other, two.

Not a pytest plugin: tests import it by name (`from _numerics import fp32_tolerance`); pytest puts
tests/ on sys.path for the test modules and for the processes they spawn.
"""
from __future__ import annotations

import math

import numpy as np

EPS32 = float(np.finfo(np.float32).eps)  # 2**-23 ~ 1.19e-7: float32's spacing at 1
EPS64 = float(np.finfo(np.float64).eps)  # 2**-52 ~ 2.22e-16
# Two float64 computations equal in exact arithmetic, relative to the reference's largest
# magnitude. The deepest here (a transformer's weights after 5 AdamW steps on 4 processes) differ
# by 1.2e-13, some 550 eps64; 1e-10 (4.5e5 eps64) leaves a factor of 800 over that and is still
# 1000 times below float32's eps, so a tensor left in float32 on the way fails it too.
FP64_RELATIVE = 1e-10


def fp32_tolerance(terms: int, magnitude=1.0, statistical: bool = False, eps: float = EPS32):
    """The rounding error of a float32 sum of `terms` terms, each at most `magnitude` in size (a
    number, or an array of them, one per sum): worst case terms * eps * magnitude; `statistical`,
    sqrt(terms) * eps * magnitude. When `magnitude` is the sum of the terms' sizes instead, the
    worst case still holds (Higham's bound is in sum |terms|)."""
    if terms < 1 or np.any(np.asarray(magnitude) < 0):
        raise ValueError(f"need terms >= 1 and magnitudes >= 0; got {terms!r} terms")
    return (math.sqrt(terms) if statistical else terms) * eps * magnitude
