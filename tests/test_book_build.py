"""The book's configuration fails the build on a cell error and on a Sphinx warning, and builds
pages that need no network: MathJax from the site itself, no widget state, no progress bars."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.site


def build(tmp_path, notebook_cells, env=None, more_pages=None):
    """A one-page book (`more_pages`: name -> cells, for more) built with the repository's
    configuration and extensions."""
    shutil.copy(ROOT / "_config.yml", tmp_path / "_config.yml")
    shutil.copytree(ROOT / "book" / "_ext", tmp_path / "book" / "_ext")
    shutil.copytree(ROOT / "book" / "_static", tmp_path / "book" / "_static")
    (tmp_path / "book" / "intro.md").write_text("# Intro\n")
    pages = {"page": notebook_cells, **(more_pages or {})}
    for name, cells in pages.items():
        notebook = nbformat.v4.new_notebook(cells=cells)
        notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
        nbformat.write(notebook, tmp_path / "book" / f"{name}.ipynb")
    (tmp_path / "_toc.yml").write_text("format: jb-book\nroot: book/intro\nchapters:\n"
                                       + "".join(f"  - file: book/{name}\n" for name in pages))
    jupyter_book = Path(sys.executable).parent / "jupyter-book"
    return subprocess.run([str(jupyter_book), "build", str(tmp_path), "--warningiserror", "--keep-going"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path,  # its jupyter-cache
                          env={**os.environ, **(env or {})})


def test_a_cell_error_fails_the_build(tmp_path):
    done = build(tmp_path, [nbformat.v4.new_markdown_cell("# Page"), nbformat.v4.new_code_cell("1 / 0")])
    assert done.returncode != 0
    assert "ZeroDivisionError" in done.stdout + done.stderr


def page_printing(name):
    return [nbformat.v4.new_markdown_cell(f"# {name}"),
            nbformat.v4.new_code_cell(f"import os\nprint('{name} ran on', os.environ.get('NUMBA_NUM_THREADS'), "
                                      "'numba thread(s)')")]


def test_notebooks_executed_two_at_a_time_make_the_same_pages(tmp_path):
    """INFRA_LAB_BOOK_JOBS=2 (book/_ext/parallel_execution.py): both pages are executed ahead,
    one thread each, and myst-nb renders them from the cache without running them again."""
    done = build(tmp_path, page_printing("first"), env={"INFRA_LAB_BOOK_JOBS": "2"},
                 more_pages={"second": page_printing("second")})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "executing 2 notebooks, 2 at a time" in done.stdout
    assert done.stdout.count("executed ahead") == 2 and "Executing notebook" not in done.stdout
    for name, page in (("first", "page"), ("second", "second")):
        html = (tmp_path / "_build" / "html" / "book" / f"{page}.html").read_text()
        assert f"{name} ran on 1 numba thread(s)" in html


def test_a_cell_error_fails_a_build_two_at_a_time(tmp_path):
    """A notebook that fails ahead is not cached: myst-nb runs it again and fails the build with
    its traceback."""
    done = build(tmp_path, [nbformat.v4.new_code_cell("1 / 0")], env={"INFRA_LAB_BOOK_JOBS": "2"},
                 more_pages={"second": page_printing("second")})
    assert done.returncode != 0
    assert "failed ahead of the read" in done.stdout and "ZeroDivisionError" in done.stdout + done.stderr


def test_a_bad_job_count_is_refused_by_name(tmp_path):
    done = build(tmp_path, page_printing("first"), env={"INFRA_LAB_BOOK_JOBS": "two"})
    assert done.returncode != 0
    assert "INFRA_LAB_BOOK_JOBS='two': allowed is a whole number of at least 1" in done.stdout + done.stderr


def test_a_sphinx_warning_fails_the_build(tmp_path):
    done = build(tmp_path, [nbformat.v4.new_markdown_cell("# Page\n\nSee {ref}`no-such-label`.")])
    assert done.returncode != 0
    assert "no-such-label" in done.stdout + done.stderr


def test_a_page_needs_no_network_and_ships_no_widget_state(tmp_path):
    """MathJax from _static, no off-site script, no widget state or widget-only output, and
    the kernel sees the TQDM_DISABLE that `make book` sets."""
    cells = [nbformat.v4.new_markdown_cell("# Page\n\nMath: $E = mc^2$ and\n\n$$\\sum_i x_i$$"),
             nbformat.v4.new_code_cell("import ipywidgets\nipywidgets.IntSlider()"),
             nbformat.v4.new_code_cell("import os\n"
                                       "print('TQDM_DISABLE =', os.environ.get('TQDM_DISABLE'))")]
    done = build(tmp_path, cells, env={"TQDM_DISABLE": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    html = (tmp_path / "_build" / "html" / "book" / "page.html").read_text()
    scripts = re.findall(r'<script[^>]*src="([^"]+)"', html)
    assert [s for s in scripts if "mathjax" in s.lower()] == [
        next(s for s in scripts if s.startswith("../_static/mathjax/tex-svg-full.js"))]
    assert (tmp_path / "_build" / "html" / "_static" / "mathjax" / "tex-svg-full.js").is_file()
    assert [s for s in scripts if "://" in s or s.startswith("//")] == []
    assert "application/vnd.jupyter.widget-state+json" not in html
    assert "IntSlider(" not in html and "widget-view" not in html  # a widget with no static face
    assert "TQDM_DISABLE = 1" in html  # the kernel inherits the build's environment


def test_make_book_builds_with_progress_bars_off():
    dry = subprocess.run(["make", "-n", "book"], cwd=ROOT, capture_output=True, text=True)
    # ... and with INFRA_LAB_QUICK unset: the page is the full-size run (infra_lab.sizes)
    assert re.search(r"^env -u INFRA_LAB_QUICK INFRA_LAB_BOOK_JOBS=1 TQDM_DISABLE=1 \\\n\s*\S*jupyter-book build ", dry.stdout, re.M), dry.stdout
