"""Every chapter notebook also runs with INFRA_LAB_BACKEND=torch: the path a Colab GPU takes,
here on torch's CPU build. The book build has run each chapter at full size on numba already
(the page); this run proves that the torch face of every cell works, so it runs at quick sizes
(INFRA_LAB_QUICK=1, infra_lab.sizes), and its first line says so. After each explorer, every
control is moved from Python and the live face must redraw (tests/_explorers.py), on this
repository's ipywidgets (the newest 8); test_colab_runtime.py does the same on Colab's 7.7.1.
The solution notebooks take the same path when test_grade_chapters.py grades them (torch, quick
sizes, full marks)."""
import datetime
import json
import sys
import time
import warnings
from pathlib import Path

import nbformat
import pytest
from _explorers import driven, with_drive_cells
from conftest import ON_TORCH

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "book" / "_ext"))
from patient_client import PatientClient  # noqa: E402 (shared with the book build's notebooks)

SLOW_S = 60  # a step over this is reported: at quick sizes only ch09's balancing check nears it
# each notebook's seconds (the whole run, the kernel's start and stop, each code cell) land here
TIMES = ROOT / "_build" / "torch_pass"
NOTEBOOKS = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "book").glob("*.ipynb"))


@pytest.mark.slow
@pytest.mark.parametrize("relative", NOTEBOOKS)
def test_notebook_runs_on_the_torch_backend(relative, monkeypatch):
    pytest.importorskip("torch")
    for name, value in ON_TORCH.items():
        monkeypatch.setenv(name, value)
    notebook = nbformat.read(ROOT / relative, as_version=4)
    explorers = with_drive_cells(notebook)
    steps = Steps()
    client = PatientClient(notebook, timeout=300, kernel_name="python3",
                           resources={"metadata": {"path": str((ROOT / relative).parent)}},
                           on_notebook_start=steps.hook("kernel ready"),
                           on_cell_execute=steps.hook("sent cell"),
                           on_cell_executed=steps.hook("cell replied"),
                           on_notebook_complete=steps.hook("kernel stopped"))
    client.execute()
    report_times(relative, notebook, steps, client.late)
    first = next(cell for cell in notebook.cells if cell.cell_type == "code")
    said = first.outputs[0]["text"]
    assert "infra_lab backend: torch on cpu" in said and "quick sizes" in said
    lines = driven(notebook)
    assert len(lines) == explorers and all("ipywidgets 8." in line for line in lines), lines


def cell_seconds(cell) -> float:
    """From the kernel going busy to going idle on this cell (nbclient records the times)."""
    times = cell.metadata.get("execution", {})
    if "iopub.status.busy" not in times or "iopub.status.idle" not in times:
        return 0.0
    busy, idle = (datetime.datetime.fromisoformat(times[key].replace("Z", "+00:00"))
                  for key in ("iopub.status.busy", "iopub.status.idle"))
    return (idle - busy).total_seconds()


class Steps:
    """The client's clock at each step nbclient names: when the kernel answered its first
    request, each cell's request sent and its reply received, and the kernel stopped. The gaps
    between them say which step a slow run spent its time in."""

    def __init__(self):
        self.start = time.perf_counter()
        self.marks = []  # (seconds since start, what happened)

    def hook(self, what: str):
        def mark(cell_index=None, **_):
            where = "" if cell_index is None else f" {cell_index}"
            self.marks.append((time.perf_counter() - self.start, what + where))
        return mark

    def gaps(self) -> list:
        """(seconds, 'from -> to') for each step, in order."""
        previous, out = (0.0, "launch"), []
        for mark in self.marks:
            out.append((mark[0] - previous[0], f"{previous[1]} -> {mark[1]}"))
            previous = mark
        return out


def report_times(relative: str, notebook, steps: Steps, late: int) -> None:
    """Writes the notebook's times to _build/torch_pass/ and warns (pytest's summary lists it)
    on any step over SLOW_S seconds: a run that once took 300 s for 10 s of work says where the
    time went."""
    total_s = time.perf_counter() - steps.start
    cells = {i: cell_seconds(cell) for i, cell in enumerate(notebook.cells) if cell.cell_type == "code"}
    TIMES.mkdir(parents=True, exist_ok=True)
    (TIMES / (relative.replace("/", "__") + ".json")).write_text(json.dumps(
        {"notebook": relative, "total_s": round(total_s, 2),
         "outside_cells_s": round(total_s - sum(cells.values()), 2),
         "cells_s": {str(i): round(s, 2) for i, s in cells.items()},
         "steps_s": [[round(s, 3), step] for s, step in steps.gaps()],
         "messages_found_late": late}, indent=1))
    slow = [f"{step} took {s:.0f} s" for s, step in steps.gaps() if s > SLOW_S]
    if slow:
        warnings.warn(f"{relative} on torch, {total_s:.0f} s in all: " + "; ".join(slow))
