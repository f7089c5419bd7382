"""The Colab path as a fresh Colab runtime meets it. A virtual environment gets the packages a
Colab GPU runtime ships, at its versions (tests/colab_runtime.txt: IPython 7.34, ipywidgets 7.7.1,
a CUDA build of torch at a version other than the book's). Then infra-lab goes in exactly as a
chapter's setup cell installs it, by running that cell, pointed at a git+file:// clone of this
working tree. Nothing Colab shipped may change; every chapter's setup cell runs there; every
chapter runs end to end at quick sizes on the torch backend, from a folder outside the repository
as on Colab, with each explorer's controls moved from Python under ipywidgets 7.7.1."""
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from _explorers import driven, with_drive_cells
from conftest import ON_TORCH

from infra_lab import book

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ROOT / "tests" / "colab_runtime.txt"
NOTEBOOKS = sorted(p.name for p in (ROOT / "book").glob("*.ipynb"))
KERNEL = "colab-like"
sys.path.insert(0, str(ROOT / "book" / "_ext"))
from patient_client import PatientClient  # noqa: E402

pytestmark = pytest.mark.slow

INSTALLED = ("import importlib.metadata as m, json; print(json.dumps("
             "{d.metadata['Name']: d.version for d in m.distributions()}))")
RUN_CELLS = """import json, sys
from IPython.core.interactiveshell import InteractiveShell
shell = InteractiveShell.instance()
for source in json.load(open(sys.argv[1])):
    shell.run_cell(source).raise_error()
"""


def normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def colab_lists() -> tuple[dict[str, str], set[str]]:
    """({name: version} preinstalled here, names Colab ships that are not preinstalled)."""
    pinned, elsewhere = {}, set()
    for line in PACKAGES.read_text(encoding="utf-8").splitlines():
        if line.startswith("#~ "):
            elsewhere.add(normal(line[3:].split("==")[0]))
        elif line and not line.startswith("#"):
            name, version = line.split("#")[0].strip().split("==")
            pinned[normal(name)] = version
    return pinned, elsewhere


def installed(python: Path) -> dict[str, str]:
    # -I: not this checkout's folder, whose infra_lab.egg-info would count as installed
    out = subprocess.run([str(python), "-I", "-c", INSTALLED], capture_output=True, text=True, check=True)
    return {normal(name): version for name, version in json.loads(out.stdout).items()}


def clone_of_working_tree(folder: Path) -> Path:
    """A git repository holding this working tree as it is, edits not yet committed included."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=ROOT, capture_output=True, text=True, check=True).stdout
    for relative in filter(None, listed.split("\0")):
        source = ROOT / relative
        if source.is_file():
            (folder / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, folder / relative)
    git = ["git", "-c", "user.name=test", "-c", "user.email=test@localhost", "-C", str(folder)]
    for step in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "working tree"]):
        subprocess.run(git + step, check=True, capture_output=True)
    return folder


def run_cells(python: Path, sources: list[str], where: Path, timeout: int) -> subprocess.CompletedProcess:
    """The cells, in order, in one IPython shell of the runtime (as a kernel runs them)."""
    cells = where / "cells.json"
    cells.write_text(json.dumps(sources))
    return subprocess.run([str(python), "-c", RUN_CELLS, str(cells)], cwd=where, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "MPLBACKEND": "Agg"})


class Runtime:
    """The Colab-like environment, what it held before the setup cell and after."""

    def __init__(self, folder: Path):
        self.venv, self.content = folder / "venv", folder / "content"  # Colab's working folder
        self.content.mkdir()
        subprocess.run([sys.executable, "-m", "venv", str(self.venv)], check=True)
        self.python = self.venv / "bin" / "python"
        base = subprocess.run([str(self.python), "-m", "pip", "install", "-q", "--no-compile", "-r",
                               str(PACKAGES)], capture_output=True, text=True, timeout=1200)
        assert base.returncode == 0, f"Colab's packages did not install:\n{base.stderr[-3000:]}"
        self.before = installed(self.python)
        source = clone_of_working_tree(folder / "source")
        self.setup_cell = book.setup_cell_source(f"file://{source}")
        self.setup = run_cells(self.python, [self.setup_cell], self.content, timeout=600)
        self.after = installed(self.python)
        spec = folder / "jupyter" / "kernels" / KERNEL
        spec.mkdir(parents=True)
        (spec / "kernel.json").write_text(json.dumps({
            "argv": [str(self.python), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "Python 3 (Colab-like)", "language": "python"}))
        self.jupyter_path = folder / "jupyter"


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    folder = tmp_path_factory.mktemp("colab")
    try:
        yield Runtime(folder)
    finally:  # 5.5 GB, most of it torch's CUDA libraries: pytest would keep three runs' worth
        shutil.rmtree(folder, ignore_errors=True)


def test_the_setup_cell_installs_the_package_and_changes_nothing_colab_ships(runtime):
    assert runtime.setup.returncode == 0, runtime.setup.stderr[-3000:]
    assert "infra_lab backend:" in runtime.setup.stdout
    pinned, elsewhere = colab_lists()
    assert {name: runtime.before.get(name) for name in pinned} == pinned  # the runtime is Colab's
    changed = {name: f"{version} -> {runtime.after.get(name, 'removed')}"
               for name, version in runtime.before.items() if runtime.after.get(name) != version}
    assert changed == {}, f"installing infra-lab changed what the runtime had: {changed}"
    added = set(runtime.after) - set(runtime.before)
    assert "infra-lab" in added
    assert added & elsewhere == set(), (
        f"installing infra-lab adds {sorted(added & elsewhere)}, which Colab ships at other versions "
        f"than pip chose here: preinstall them in {PACKAGES.name} at Colab's versions")


def test_every_chapters_setup_cell_runs_there(runtime):
    url = book.repository_url()
    sources = []
    for name in NOTEBOOKS:
        cell = book.first_code_cell(nbformat.read(ROOT / "book" / name, as_version=4))
        assert cell.source == book.setup_cell_source(url), f"{name}: run `infra-lab tidy`"
        sources.append(cell.source)
    ran = run_cells(runtime.python, sources, runtime.content, timeout=600)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert ran.stdout.count("infra_lab backend: numba") == len(NOTEBOOKS), ran.stdout
    assert "Successfully installed" not in ran.stdout + ran.stderr  # installed once, by the first


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_each_chapter_runs_on_torch_and_its_explorers_move_under_ipywidgets_7(name, runtime, monkeypatch):
    for variable, value in ON_TORCH.items():
        monkeypatch.setenv(variable, value)
    monkeypatch.setenv("JUPYTER_PATH", str(runtime.jupyter_path))
    notebook = nbformat.read(ROOT / "book" / name, as_version=4)
    explorers = with_drive_cells(notebook)
    PatientClient(notebook, timeout=300, kernel_name=KERNEL,
                  resources={"metadata": {"path": str(runtime.content)}}).execute()
    said = book.first_code_cell(notebook).outputs[0]["text"]
    assert "infra_lab backend: torch on cpu" in said and "quick sizes" in said
    lines = driven(notebook)
    assert len(lines) == explorers and all("ipywidgets 7.7.1" in line for line in lines), lines
