"""Each chapter page shows its exercises' statements, hints folded, answers never."""
import nbformat
import pytest
from test_origin import installed_as

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
    assert "colab" not in text.lower() and "binder" not in text.lower()  # not a GitHub repository


def test_the_notebook_opens_on_github_colab_and_binder_from_the_branch(tmp_path):
    text = book.exercise_statements("ch99_test", url="https://github.com/owner/repo",
                                    folder=tmp_path / "absent", branch="trunk")
    notebook = "exercises/ch99_test.ipynb"
    assert f"(https://github.com/owner/repo/blob/trunk/{notebook})" in text
    assert f"[Colab](https://colab.research.google.com/github/owner/repo/blob/trunk/{notebook})" in text
    assert f"[Binder](https://mybinder.org/v2/gh/owner/repo/trunk?urlpath=tree/{notebook})" in text


def test_the_repository_branch_and_launch_hosts_come_from_the_config(tmp_path, monkeypatch):
    (tmp_path / "_config.yml").write_text(
        "repository:\n  url: https://github.com/fork/book/\n  branch: publish\n"
        "launch_buttons:\n  colab_url: https://colab.example.org\n  binderhub_url: https://hub.example.org/\n",
        encoding="utf-8")
    monkeypatch.setattr(book, "REPO_ROOT", tmp_path)
    text = book.exercise_statements("ch99_test", folder=tmp_path / "absent")
    notebook = "exercises/ch99_test.ipynb"
    assert f"(https://github.com/fork/book/blob/publish/{notebook})" in text
    assert f"(https://colab.example.org/github/fork/book/blob/publish/{notebook})" in text
    assert f"(https://hub.example.org/v2/gh/fork/book/publish?urlpath=tree/{notebook})" in text


def test_a_config_without_a_branch_links_main(tmp_path, monkeypatch):
    (tmp_path / "_config.yml").write_text("repository:\n  url: https://github.com/fork/book\n",
                                          encoding="utf-8")
    monkeypatch.setattr(book, "REPO_ROOT", tmp_path)
    text = book.exercise_statements("ch99_test", folder=tmp_path / "absent")
    assert "https://github.com/fork/book/blob/main/exercises/ch99_test.ipynb" in text
    assert "https://mybinder.org/v2/gh/fork/book/main?urlpath=tree/exercises/ch99_test.ipynb" in text


def test_a_pip_install_without_the_config_names_the_file(tmp_path, monkeypatch):
    """On Colab the package is installed from git: no _config.yml beside it, no exercises/."""
    monkeypatch.setattr(book, "REPO_ROOT", tmp_path)
    text = book.exercise_statements("ch99_test", folder=tmp_path / "absent")
    assert text.startswith("Solve them in `exercises/ch99_test.ipynb`") and "](" not in text


def test_a_pip_install_from_github_links_the_repository_it_came_from(tmp_path, monkeypatch):
    """The setup cell installs from git: pip records the URL (PEP 610), and the links follow it."""
    monkeypatch.setattr(book, "REPO_ROOT", tmp_path)
    record = {"url": "https://github.com/fork/book.git", "vcs_info": {"vcs": "git", "commit_id": "0" * 40}}
    installed_as(monkeypatch, record)
    text = book.exercise_statements("ch99_test", folder=tmp_path / "absent")
    assert "(https://colab.research.google.com/github/fork/book/blob/main/exercises/ch99_test.ipynb)" in text
    for elsewhere in ({"url": "file:///home/me/book", "dir_info": {"editable": True}},
                      {"url": "file:///tmp/clone", "vcs_info": {"vcs": "git"}}):
        installed_as(monkeypatch, elsewhere)
        assert book.github_origin() is None


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
