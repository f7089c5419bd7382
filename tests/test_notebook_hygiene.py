"""Committed notebooks carry no images, HTML, widget state or execution counts: only the
expected text of check cells."""
import pytest

from infra_lab import book
from infra_lab.grading import notebooks

FOLDERS = ("book", "solutions", "exercises")


def all_notebooks(root):
    return sorted(p for folder in FOLDERS for p in (root / folder).glob("*.ipynb"))


def test_there_are_notebooks(root):
    assert len(all_notebooks(root)) >= 3


def test_only_check_cells_keep_text_outputs(root):
    for path in all_notebooks(root):
        notebook = notebooks.read(path)
        assert "widgets" not in notebook.metadata, path
        for cell in notebook.cells:
            if cell.cell_type != "code":
                continue
            if notebooks.CHECK_OUTPUT_MARK in cell.source:
                assert [o.output_type for o in cell.outputs] == ["stream"], path
                assert cell.execution_count is not None, path  # nbval needs it
            else:
                assert cell.outputs == [] and cell.execution_count is None, (path, cell.source[:60])


def test_check_cells_are_marked_for_nbval(root):
    for path in all_notebooks(root):
        for cell in notebooks.read(path).cells:
            if notebooks.check_name(cell):
                assert cell.source.startswith(notebooks.CHECK_OUTPUT_MARK), path


def test_first_code_cell_installs_from_the_configured_repository(root):
    url = book.repository_url(root / "_config.yml")
    for path in all_notebooks(root):
        first = book.first_code_cell(notebooks.read(path))
        assert first.source == book.setup_cell_source(url), f"run `infra-lab tidy {path}`"
        assert "backend.describe()" in first.source


def test_tidy_strips_outputs_and_writes_the_setup_cell(root, tmp_path):
    import nbformat

    notebook = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell("# title"),
        nbformat.v4.new_code_cell("1 + 1", execution_count=3,
                                  outputs=[nbformat.v4.new_output("execute_result", {"text/html": "<b>2</b>"})]),
    ])
    path = tmp_path / "n.ipynb"
    notebooks.write(notebook, path)
    url = book.repository_url(root / "_config.yml")
    assert book.tidy(path, url)
    tidied = notebooks.read(path)
    assert [c.cell_type for c in tidied.cells] == ["markdown", "code", "code"]
    assert tidied.cells[1].source == book.setup_cell_source(url)
    assert tidied.cells[2].outputs == [] and tidied.cells[2].execution_count is None
    assert not book.tidy(path, url)


def test_a_config_without_repository_url_is_named(tmp_path):
    config = tmp_path / "_config.yml"
    config.write_text("title: x\n")
    with pytest.raises(ValueError, match="set repository.url"):
        book.repository_url(config)


MAX_LINE = 88  # a notebook's code reads on the site's text column without a scroll bar


def test_notebook_code_lines_fit_the_page(root):
    for path in all_notebooks(root):
        for cell in notebooks.read(path).cells:
            if cell.cell_type == "code":
                long = [line for line in cell.source.splitlines() if len(line) > MAX_LINE]
                assert long == [], (path, long)


def ends_in_markdown(source: str) -> bool:
    """Whether the cell's last statement is a bare `Markdown(...)` (or `display(Markdown(...))`):
    a cell that formats its output, whose input the reader need not see."""
    import ast

    try:
        body = ast.parse(source).body
    except SyntaxError:
        return False
    if not body or not isinstance(body[-1], ast.Expr) or not isinstance(body[-1].value, ast.Call):
        return False
    call = body[-1].value
    if isinstance(call.func, ast.Name) and call.func.id == "display" and call.args:
        call = call.args[0] if isinstance(call.args[0], ast.Call) else call
    return isinstance(call.func, ast.Name) and call.func.id in ("Markdown", "HTML")


def test_cells_that_format_their_output_hide_their_input(root):
    for path in sorted((root / "book").glob("*.ipynb")):
        for cell in notebooks.read(path).cells:
            if cell.cell_type == "code" and ends_in_markdown(cell.source):
                tags = cell.metadata.get("tags", [])
                assert "remove-input" in tags, (path, cell.source[:80])


def test_setup_and_explorer_plumbing_is_folded_on_the_page(root):
    """A reader sees the setup cell's output (where it ran) and the explorer, with the code that
    installs the package or wires the widgets folded under "Show code"."""
    for path in sorted((root / "book").glob("ch*.ipynb")):
        cells = notebooks.read(path).cells
        plumbing = [book.first_code_cell(notebooks.read(path))] + [
            c for c in cells if c.cell_type == "code" and "import ipywidgets" in c.source]
        for cell in plumbing:
            tags = cell.metadata.get("tags", [])
            assert "hide-input" in tags or "remove-input" in tags, (path.name, cell.source[:60])


def test_the_markdown_rule_sees_what_a_reader_sees():
    assert ends_in_markdown("x = 1\nMarkdown(f'{x}')")
    assert ends_in_markdown("display(Markdown('a'))")
    assert not ends_in_markdown("Markdown('a')\nplt.show()")
    assert not ends_in_markdown("show(stack.idle_fraction)")
