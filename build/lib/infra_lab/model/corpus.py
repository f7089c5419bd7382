"""The training corpus: Python's own standard library source, present on every machine.

Files are found through `sysconfig` and read in sorted order; tests, IDLE, lib2to3 and
turtledemo are left out (they repeat or are not library code). A fixed list of modules is held
out for validation.
"""
from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np

SKIPPED_PARTS = {"test", "tests", "idlelib", "lib2to3", "turtledemo", "site-packages", "__pycache__"}
VALIDATION = ("argparse.py", "difflib.py", "heapq.py", "textwrap.py", "fractions.py",
              "json/decoder.py", "json/encoder.py", "string.py", "shlex.py", "calendar.py")


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def source_files(root: Path | None = None) -> list[Path]:
    root = root or stdlib_root()
    files = [p for p in root.rglob("*.py") if not SKIPPED_PARTS & set(p.relative_to(root).parts)]
    if not files:
        raise FileNotFoundError(f"no Python source under {root}: is the standard library installed?")
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def load(root: Path | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(train, validation) byte arrays, (n,) uint8 each; files joined with a blank line."""
    root = root or stdlib_root()
    train, validation = [], []
    for path in source_files(root):
        data = path.read_bytes() + b"\n\n"
        (validation if path.relative_to(root).as_posix() in VALIDATION else train).append(data)
    return (np.frombuffer(b"".join(train), np.uint8).copy(),
            np.frombuffer(b"".join(validation), np.uint8).copy())


def unigram_bits_per_byte(train: np.ndarray, validation: np.ndarray) -> float:
    """The baseline: each byte coded by its frequency in the training set (add-one smoothed)."""
    counts = np.bincount(train, minlength=256).astype(np.float64) + 1
    probabilities = counts / counts.sum()
    return float(-np.log2(probabilities[validation]).mean())
