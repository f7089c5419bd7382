"""The book's configuration fails the build on a cell error and on a Sphinx warning."""
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.site


def build(tmp_path, notebook_cells):
    shutil.copy(ROOT / "_config.yml", tmp_path / "_config.yml")
    shutil.copytree(ROOT / "book" / "_ext", tmp_path / "book" / "_ext")
    shutil.copytree(ROOT / "book" / "_static", tmp_path / "book" / "_static")
    (tmp_path / "book" / "intro.md").write_text("# Intro\n")
    notebook = nbformat.v4.new_notebook(cells=notebook_cells)
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(notebook, tmp_path / "book" / "page.ipynb")
    (tmp_path / "_toc.yml").write_text("format: jb-book\nroot: book/intro\nchapters:\n  - file: book/page\n")
    jupyter_book = Path(sys.executable).parent / "jupyter-book"
    return subprocess.run([str(jupyter_book), "build", str(tmp_path), "--warningiserror", "--keep-going"],
                          capture_output=True, text=True, timeout=300)


def test_a_cell_error_fails_the_build(tmp_path):
    done = build(tmp_path, [nbformat.v4.new_markdown_cell("# Page"), nbformat.v4.new_code_cell("1 / 0")])
    assert done.returncode != 0
    assert "ZeroDivisionError" in done.stdout + done.stderr


def test_a_sphinx_warning_fails_the_build(tmp_path):
    done = build(tmp_path, [nbformat.v4.new_markdown_cell("# Page\n\nSee {ref}`no-such-label`.")])
    assert done.returncode != 0
    assert "no-such-label" in done.stdout + done.stderr
