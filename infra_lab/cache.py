"""The folder the package keeps what it fetched or measured once per machine: the pretrained
models' files, this machine's measured peaks, repository files of the installed commit."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$INFRA_LAB_CACHE, else $XDG_CACHE_HOME/infra_lab, else ~/.cache/infra_lab."""
    root = os.environ.get("INFRA_LAB_CACHE")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "infra_lab"
