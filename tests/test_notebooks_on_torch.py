"""Every chapter and solution notebook also runs with INFRA_LAB_BACKEND=torch: the path a
Colab GPU takes, here on torch's CPU build. The book build has run each chapter at full size on
numba already (the page); this run proves that the torch face of every cell works, so it runs
at quick sizes (INFRA_LAB_QUICK=1, infra_lab.sizes), and its first line says so."""
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent
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
    NotebookClient(notebook, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str((ROOT / relative).parent)}}).execute()
    first = next(cell for cell in notebook.cells if cell.cell_type == "code")
    said = first.outputs[0]["text"]
    assert "infra_lab backend: torch on cpu" in said and "quick sizes" in said
