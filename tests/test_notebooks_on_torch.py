"""Every chapter and solution notebook also runs with INFRA_LAB_BACKEND=torch: the path a
Colab GPU takes, here on torch's CPU build. The book build has run each chapter at full size on
numba already (the page); this run proves that the torch face of every cell works, so it runs
at quick sizes (INFRA_LAB_QUICK=1, infra_lab.sizes), and its first line says so."""
import datetime
import json
import time
import warnings
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent
SLOW_S = 60  # a step of one notebook over this is reported: at quick sizes none takes half of it
# each notebook's seconds (the whole run, the kernel's start and stop, each code cell) land here
TIMES = ROOT / "_build" / "torch_pass"
NOTEBOOKS = sorted(p.relative_to(ROOT).as_posix() for folder in ("book", "solutions")
                   for p in (ROOT / folder).glob("*.ipynb"))


@pytest.mark.slow
@pytest.mark.parametrize("relative", NOTEBOOKS)
def test_notebook_runs_on_the_torch_backend(relative, monkeypatch):
    pytest.importorskip("torch")
    monkeypatch.setenv("INFRA_LAB_BACKEND", "torch")
    monkeypatch.setenv("INFRA_LAB_QUICK", "1")
    # One thread per kernel: this pass proves that cells run, and beside the other worker's
    # processes two threads each oversubscribe two cores (a run of chapter 07 once took 308 s
    # for its 10 s alone)
    for threads in ("OMP_NUM_THREADS", "NUMBA_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.setenv(threads, "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    notebook = nbformat.read(ROOT / relative, as_version=4)
    start = time.perf_counter()
    NotebookClient(notebook, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str((ROOT / relative).parent)}}).execute()
    report_times(relative, notebook, time.perf_counter() - start)
    first = next(cell for cell in notebook.cells if cell.cell_type == "code")
    said = first.outputs[0]["text"]
    assert "infra_lab backend: torch on cpu" in said and "quick sizes" in said


def cell_seconds(cell) -> float:
    """From the kernel going busy to going idle on this cell (nbclient records the times)."""
    times = cell.metadata.get("execution", {})
    if "iopub.status.busy" not in times or "iopub.status.idle" not in times:
        return 0.0
    busy, idle = (datetime.datetime.fromisoformat(times[key].replace("Z", "+00:00"))
                  for key in ("iopub.status.busy", "iopub.status.idle"))
    return (idle - busy).total_seconds()


def report_times(relative: str, notebook, total_s: float) -> None:
    """Writes the notebook's times to _build/torch_pass/ and warns (pytest's summary lists it)
    on any cell, or on the kernel's start and stop, that took over SLOW_S seconds: a run that
    once took 300 s for 10 s of work says where the time went."""
    cells = {i: cell_seconds(cell) for i, cell in enumerate(notebook.cells) if cell.cell_type == "code"}
    outside = total_s - sum(cells.values())  # the kernel's start and stop, and nbclient's own work
    TIMES.mkdir(parents=True, exist_ok=True)
    (TIMES / (relative.replace("/", "__") + ".json")).write_text(json.dumps(
        {"notebook": relative, "total_s": round(total_s, 2), "outside_cells_s": round(outside, 2),
         "cells_s": {str(i): round(s, 2) for i, s in cells.items()}}, indent=1))
    slow = [f"cell {i} took {s:.0f} s" for i, s in cells.items() if s > SLOW_S]
    if outside > SLOW_S:
        slow.append(f"the kernel's start and stop took {outside:.0f} s")
    if slow:
        warnings.warn(f"{relative} on torch, {total_s:.0f} s in all: " + "; ".join(slow))
