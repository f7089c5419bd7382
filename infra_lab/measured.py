"""Figures measured on hardware the book's build does not have, kept in benchmarks/results/.

A chapter built on a CPU shows what an H200 measured, labelled with the machine and the date,
and times live when a GPU is present. Each file names its `machine`, `measured_on` and the
`command` that produced it. A pip-installed package (Colab) has no benchmarks/ folder; `load`
then returns None and the chapter says where the figures live.
"""
from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
REQUIRED = ("machine", "measured_on", "command")


def load(name: str, folder: Path = RESULTS) -> dict | None:
    """The results file `name` (without .json), or None where the repository is not at hand."""
    path = folder / f"{name}.json"
    if not folder.is_dir():
        return None
    if not path.is_file():
        known = sorted(p.stem for p in folder.glob("*.json"))
        raise ValueError(f"no results named {name!r} in {folder}; there are {known}")
    results = json.loads(path.read_text(encoding="utf-8"))
    missing = [key for key in REQUIRED if key not in results]
    if missing:
        raise ValueError(f"{path.name} does not say its {', '.join(missing)}")
    return results


def label(results: dict) -> str:
    """'NVIDIA H200, measured 2026-11-29 by `python benchmarks/…`', for a caption."""
    return f"{results['machine']}, measured {results['measured_on']} by `{results['command']}`"
