"""Figures measured on hardware the book's build does not have, kept in benchmarks/results/.

A chapter built on a CPU shows what an H200 measured, labelled with the machine and the date,
and times live when a GPU is present. Each file names its `machine`, `measured_on` and the
`command` that produced it. A pip-installed package has no benchmarks/ folder beside it: where
pip installed it from a git repository (as every chapter's setup cell does on Colab), `load`
reads the file of that repository at that commit (infra_lab.origin); elsewhere it returns None
and the chapter says where the figures live.
"""
from __future__ import annotations

import json
from pathlib import Path

from infra_lab import origin

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
REQUIRED = ("machine", "measured_on", "command")


def load(name: str, folder: Path | None = None) -> dict | None:
    """The results file `name` (without .json) from `folder` (benchmarks/results/ beside the
    package, else that of the repository the package was installed from), or None where
    neither is at hand."""
    path = (folder or RESULTS) / f"{name}.json"
    if not path.parent.is_dir():
        path = None if folder else origin.repository_file(f"benchmarks/results/{name}.json")
        if path is None:
            return None
    elif not path.is_file():
        known = sorted(p.stem for p in path.parent.glob("*.json"))
        raise ValueError(f"no results named {name!r} in {path.parent}; there are {known}")
    results = json.loads(path.read_text(encoding="utf-8"))
    missing = [key for key in REQUIRED if key not in results]
    if missing:
        raise ValueError(f"{path.name} does not say its {', '.join(missing)}")
    return results


def label(results: dict, section: str | None = None) -> str:
    """'NVIDIA H200, measured 2026-11-29 by `python benchmarks/…`', for a caption: of the run that
    measured `section`, when given (run_of)."""
    run = run_of(results, section)
    return f"{run['machine']}, measured {run['measured_on']} by `{run['command']}`"


def run_of(results: dict, section: str | None = None) -> dict:
    """{"machine", "measured_on", "command"} of the run that measured `section` of a sectioned
    benchmark's results: a run of some sections only keeps the others from an earlier run,
    perhaps on another machine (`kept_runs`); without `section`, the file's own run."""
    kept = (results.get("kept_runs") or {}).get(section) if section else None
    if kept:
        return {key: kept[key] for key in REQUIRED}
    command = (results.get("kept_from_earlier") or {}).get(section) if section else None
    return {"machine": results["machine"], "measured_on": results["measured_on"],
            "command": command or results["command"]}
