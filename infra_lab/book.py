"""Authoring helpers for the book's notebooks: the Colab setup cell and the committed form.

The repository URL is set once, in `_config.yml` (`repository.url`). Every notebook's first
code cell installs infra_lab from there when it is missing (as on a fresh Colab runtime) and
prints where kernels run. `tidy` rewrites that cell and strips outputs for committing.
"""
from __future__ import annotations

from pathlib import Path

import nbformat
import yaml

from infra_lab import origin
from infra_lab.grading import notebooks

REPO_ROOT = Path(__file__).resolve().parent.parent
SETUP_MARK = "# Setup: installs infra_lab"
EXERCISE_HEADING = "## Exercise"
HINT_MARK = "**Hint.**"


def repository_url(config_path: Path = REPO_ROOT / "_config.yml") -> str:
    config = yaml.safe_load(config_path.read_text(encoding="utf-8"))
    try:
        return config["repository"]["url"].rstrip("/")
    except (KeyError, TypeError, AttributeError):
        raise ValueError(f"{config_path}: set repository.url, the book's one repository URL") from None


def github_origin() -> str | None:
    """The https repository pip installed this package from (as the setup cell does), or None."""
    installed = origin.installed_from()
    return installed.url if installed and installed.url.startswith("https://") else None


def setup_cell_source(url: str) -> str:
    return (
        f"{SETUP_MARK} when it is missing (a fresh Colab runtime),\n"
        "# sets the book's figure style and says where kernels run.\n"
        "import importlib.util, subprocess, sys\n"
        'if importlib.util.find_spec("infra_lab") is None:\n'
        f'    package = "infra-lab @ git+{url}"\n'
        '    subprocess.run([sys.executable, "-m", "pip", "install", "-q", package], check=True)\n'
        "from infra_lab import backend, figures\n"
        "figures.book_style()  # SVG figures, fonts of at least 9 pt\n"
        "print(backend.describe())"
    )


def first_code_cell(notebook: nbformat.NotebookNode) -> nbformat.NotebookNode | None:
    return next((cell for cell in notebook.cells if cell.cell_type == "code"), None)


def tidy(path: Path, url: str, write: bool = True) -> bool:
    """Put `path` in committed form; return whether anything changed."""
    notebook = notebooks.read(path)
    before = notebooks.dumps(notebook)
    cell = first_code_cell(notebook)
    if cell is None or not cell.source.startswith(SETUP_MARK):
        at = notebook.cells.index(cell) if cell is not None else len(notebook.cells)
        cell = nbformat.v4.new_code_cell("")
        notebook.cells.insert(at, cell)
    cell.source = setup_cell_source(url)
    notebooks.stamp(notebook)
    notebooks.strip_outputs(notebook)
    after = notebooks.dumps(notebook)
    if write and after != before:
        path.write_text(after, encoding="utf-8")
    return after != before


def exercise_statements(stem: str, url: str | None = None,
                        folder: Path = REPO_ROOT / "exercises", branch: str | None = None) -> str:
    """The chapter's exercises as Markdown for its page: each statement, its hint folded.

    The statements are the `## Exercise` cells of exercises/`stem`.ipynb (written from
    solutions/ by `infra-lab assign`, so no answer can leak). A paragraph that starts with
    HINT_MARK folds under a "Hint" summary. The closing sentence links the notebook on GitHub
    and, for a GitHub repository, opens it in Colab or on Binder as the page's launch buttons
    do: the repository's `url` and `branch` come from _config.yml (branch main unless it says
    otherwise). Where the notebook is not at hand (a pip install), only the sentence is given;
    without _config.yml (a pip install, as on Colab) the repository is the one pip installed
    the package from, and where that is unknown the sentence names the file without links.
    """
    config = REPO_ROOT / "_config.yml"
    settings = (yaml.safe_load(config.read_text(encoding="utf-8")) or {}) if config.is_file() else {}
    url = url or (repository_url(config) if settings else github_origin())
    branch = branch or (settings.get("repository") or {}).get("branch") or "main"
    launch, notebook = settings.get("launch_buttons") or {}, f"exercises/{stem}.ipynb"
    if url is None:
        where = f"Solve them in `{notebook}` of the book's repository, where their checks run."
    else:
        where = f"Solve them in [`{notebook}`]({url}/blob/{branch}/{notebook})"
        if url.startswith("https://github.com/"):
            github = url.removeprefix("https://github.com/")
            colab = launch.get("colab_url", "https://colab.research.google.com").rstrip("/")
            binder = launch.get("binderhub_url", "https://mybinder.org").rstrip("/")
            where += (f" (open it in [Colab]({colab}/github/{github}/blob/{branch}/{notebook}) or on "
                      f"[Binder]({binder}/v2/gh/{github}/{branch}?urlpath=tree/{notebook}))")
        where += f" and check yourself with `pytest --nbval-lax {notebook}`."
    path = folder / f"{stem}.ipynb"
    if not folder.is_dir():
        return where
    cells = [cell.source for cell in notebooks.read(path).cells
             if cell.cell_type == "markdown" and cell.source.startswith(EXERCISE_HEADING)]
    if not cells:
        raise ValueError(f"{path}: no markdown cell starts with {EXERCISE_HEADING!r}")
    parts = []
    for source in cells:
        for paragraph in source.split("\n\n"):
            if paragraph.startswith(EXERCISE_HEADING):
                parts.append("#" + paragraph)  # one level below the page's Exercises heading
            elif paragraph.startswith(HINT_MARK):
                hint = paragraph[len(HINT_MARK):].strip()
                parts.append(f'<details style="margin-bottom:1em"><summary>Hint</summary>'
                             f"\n\n{hint}\n\n</details>")
            else:
                parts.append(paragraph)
    return "\n\n".join([*parts, where])
