"""Progress bars for long loops (tqdm.auto): shown to a live learner, never on the built site.

A bar is off when its caller says so or when TQDM_DISABLE is set, as `make book` sets it: a
notebook bar is a widget, and the static page has no kernel to draw it.
"""
from __future__ import annotations

import os
from collections.abc import Iterable


def disabled_by_environment() -> bool:
    return os.environ.get("TQDM_DISABLE", "").strip().lower() not in ("", "0", "false")


def bar(iterable: Iterable | None = None, *, show: bool = True, **kwargs):
    """A tqdm.auto bar over `iterable`; `show=False` or TQDM_DISABLE turns it off."""
    from tqdm.auto import tqdm

    return tqdm(iterable, disable=not show or disabled_by_environment(), **kwargs)
