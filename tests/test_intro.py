"""The book's first page: benchmarks/chapter_times.py reads the table of contents right, its
results say where and when they were measured, and the page's table of running times covers
every chapter in _toc.yml."""
import datetime
import importlib.util
import re
from pathlib import Path

import nbformat
import pytest
import yaml

from infra_lab import measured


ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def chapter_times():
    spec = importlib.util.spec_from_file_location(
        "chapter_times", ROOT / "benchmarks" / "chapter_times.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TOC = """
format: jb-book
root: book/intro
parts:
  - caption: Foundations
    chapters:
      - file: book/ch00_stack
        sections:
          - file: book/ch00_extra
      - url: https://example.org
  - caption: Inference engines
    chapters:
      - file: book/ch03_paged_kv
"""


def test_toc_files_follow_the_books_order_with_their_parts(chapter_times):
    found = chapter_times.toc_files(yaml.safe_load(TOC))
    assert found == [("Foundations", "book/ch00_stack"), ("Foundations", "book/ch00_extra"),
                     ("Inference engines", "book/ch03_paged_kv")]


def test_toc_files_without_parts(chapter_times):
    toc = {"format": "jb-book", "root": "book/intro",
           "chapters": [{"file": "book/a"}, {"file": "book/b"}]}
    assert chapter_times.toc_files(toc) == [("", "book/a"), ("", "book/b")]
    assert chapter_times.toc_files({"root": "book/intro"}) == []


@pytest.mark.parametrize("toc, named", [
    ({"format": "jb-book"}, "root"),
    ({"root": "x", "chapters": [{"glob": "book/*"}]}, "glob: book/*"),
    ({"root": "x", "chapters": [{"title": "no file"}]}, "needs `file`"),
    ({"root": "x", "chapters": "book/a"}, "must be a list"),
    ({"root": "x", "parts": [{"caption": "P"}]}, "needs `chapters`"),
])
def test_a_toc_it_cannot_read_is_named(chapter_times, toc, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        chapter_times.toc_files(toc)


def test_notebooks_to_time_are_each_chapter_then_its_solutions(chapter_times, tmp_path):
    (tmp_path / "_toc.yml").write_text(TOC)
    for folder, stems in (("book", ["intro", "ch00_stack", "ch03_paged_kv"]),
                          ("solutions", ["ch03_paged_kv"])):
        (tmp_path / folder).mkdir()
        for stem in stems:
            nbformat.write(nbformat.v4.new_notebook(), tmp_path / folder / f"{stem}.ipynb")
    (tmp_path / "book" / "ch00_extra.md").write_text("# A page, not a notebook\n")
    assert chapter_times.chapter_stems(tmp_path) == ["ch00_stack", "ch03_paged_kv"]
    assert [p.as_posix() for p in chapter_times.notebooks_to_time(tmp_path)] == [
        "book/ch00_stack.ipynb", "book/ch03_paged_kv.ipynb", "solutions/ch03_paged_kv.ipynb"]
    (tmp_path / "book" / "ch00_extra.md").unlink()
    with pytest.raises(ValueError, match="book/ch00_extra"):
        chapter_times.chapter_stems(tmp_path)


def test_the_results_say_machine_date_and_command():
    results = measured.load("chapter_times")
    assert results is not None
    assert results["machine"] and results["cores"] >= 1
    datetime.date.fromisoformat(results["measured_on"])
    assert results["command"].startswith(".venv/bin/python benchmarks/chapter_times.py")
    assert results["caches"] in ("warm", "cold")
    assert results["disk"]["venv_bytes"] > 0
    assert all(s > 0 for s in results["seconds"].values())


def test_every_notebook_in_the_toc_has_a_time(chapter_times, root):
    """Fails when a chapter joins _toc.yml (or fails to run) after the last timing run: rerun
    `.venv/bin/python benchmarks/chapter_times.py`."""
    results = measured.load("chapter_times")
    expected = [p.as_posix() for p in chapter_times.notebooks_to_time(root)]
    assert [p for p in expected if p not in results["seconds"]] == [], results["failed"]


@pytest.mark.slow
def test_the_intro_shows_a_time_row_for_every_chapter(chapter_times, root):
    """Run the first page as the build does and read its table of running times."""
    import nbclient

    notebook = nbformat.read(root / "book" / "intro.ipynb", as_version=4)
    nbclient.NotebookClient(notebook, timeout=120,
                            resources={"metadata": {"path": str(root / "book")}}).execute()
    shown = [output["data"]["text/markdown"] for cell in notebook.cells
             if cell.cell_type == "code" for output in cell.outputs
             if "text/markdown" in output.get("data", {})]
    times = next(text for text in shown if text.startswith("| chapter | the chapter (s)"))
    rows = [line for line in times.splitlines() if line.startswith("| [")]
    stems = chapter_times.chapter_stems(root)
    assert [re.search(r"\]\((\w+)\.ipynb\)", row).group(1) for row in rows] == stems
    results = measured.load("chapter_times")
    assert results["machine"] in times and results["measured_on"] in times
    svgs = [output for cell in notebook.cells if cell.cell_type == "code"
            for output in cell.outputs if "image/svg+xml" in output.get("data", {})]
    assert len(svgs) == 1  # the book's map


def test_the_results_file_fits_the_pages_code_column(root):
    """The first page shows the file in a code block, which must not scroll sideways."""
    text = (root / "benchmarks" / "results" / "chapter_times.json").read_text()
    assert [line for line in text.splitlines() if len(line) > 76] == []
