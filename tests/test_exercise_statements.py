"""Each chapter page shows its exercises' statements, hints folded, answers never."""
import nbformat
import pytest

from infra_lab import book
from infra_lab.grading import notebooks


def exercise_notebook(folder, cells):
    notebook = nbformat.v4.new_notebook(cells=cells)
    notebooks.write(notebook, folder / "ch99_test.ipynb")


def test_statements_with_folded_hints(tmp_path):
    exercise_notebook(tmp_path, [
        nbformat.v4.new_markdown_cell("# Exercises\n\nIntro text."),
        nbformat.v4.new_markdown_cell("## Exercise 1 · Sum (easy)\n\nReturn the sum.\n\n"
                                      "**Hint.** Use a loop."),
        nbformat.v4.new_code_cell("def total(xs):\n    return sum(xs)  # the answer"),
    ])
    text = book.exercise_statements("ch99_test", url="https://example.org/r", folder=tmp_path)
    assert text.startswith("### Exercise 1 · Sum (easy)")
    assert "Return the sum." in text and "Intro text." not in text
    assert "<summary>Hint</summary>\n\nUse a loop.\n\n</details>" in text
    assert "the answer" not in text and "**Hint.**" not in text
    assert "https://example.org/r/blob/main/exercises/ch99_test.ipynb" in text


def test_without_the_repository_only_the_link_is_given(tmp_path):
    text = book.exercise_statements("ch99_test", url="https://example.org/r",
                                    folder=tmp_path / "absent")
    assert text.startswith("Solve them in") and "###" not in text


def test_a_notebook_without_exercises_is_named(tmp_path):
    exercise_notebook(tmp_path, [nbformat.v4.new_markdown_cell("# Nothing here")])
    with pytest.raises(ValueError, match="no markdown cell starts with '## Exercise'"):
        book.exercise_statements("ch99_test", url="https://example.org/r", folder=tmp_path)


@pytest.mark.parametrize("path", sorted(book.REPO_ROOT.glob("exercises/ch*.ipynb")),
                         ids=lambda p: p.stem)
def test_every_chapter_has_statements_and_a_hint_for_each(path):
    text = book.exercise_statements(path.stem)
    count = text.count("\n### Exercise") + text.startswith("### Exercise")
    assert count >= 3, path
    assert text.count("<summary>Hint</summary>") == count, path
    for cell in notebooks.read(path).cells:  # the page's text comes from the student copy
        assert notebooks.BEGIN not in cell.source
