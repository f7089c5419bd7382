"""Experiment sizes: full for the page, quick for a run that only proves every cell works.

The book build runs each chapter at full size; that run is the page. A second run of every
chapter on the torch backend (the Colab path, tested on torch's CPU build) exists to show that
the torch face of each cell runs, which needs a few steps, not a full experiment. With
INFRA_LAB_QUICK=1 in the environment, `sized(full, quick)` gives the quick size, and
`backend.describe()` says "quick sizes" on the first line of every output, so a quick run
can never pass for the page (`make book` unsets the variable; the site test looks for it).
"""
from __future__ import annotations

import os
from typing import TypeVar

ENVIRONMENT = "INFRA_LAB_QUICK"
T = TypeVar("T")


def is_quick() -> bool:
    """True when INFRA_LAB_QUICK asks for quick sizes ("1", "true", "yes"; "", "0", "false" do not)."""
    value = os.environ.get(ENVIRONMENT, "").strip().lower()
    if value in ("", "0", "false", "no"):
        return False
    if value in ("1", "true", "yes"):
        return True
    raise ValueError(f"{ENVIRONMENT}={value!r}: allowed are 1, true, yes (quick sizes) or 0, false, no, unset (full)")


def sized(full: T, quick: T) -> T:
    """`full` for the page, `quick` when INFRA_LAB_QUICK is set: the size of one experiment."""
    return quick if is_quick() else full
