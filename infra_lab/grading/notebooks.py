"""Notebook structure for the classroom loop: which cells are exercises, and `assign`.

A solution cell holds its answer between nbgrader's markers `### BEGIN SOLUTION` and
`### END SOLUTION`; the check cell after it calls `check("chNN.name", obj)`. `assign` replaces
each marked region with `# YOUR CODE HERE` and a `raise NotImplementedError` naming the
exercise, stamps the exercise id into the cell's metadata (so the grader finds the student's
cell even if they edit around it), and keeps only the check cells' expected outputs.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import nbformat

BEGIN = "### BEGIN SOLUTION"
END = "### END SOLUTION"
STUB = "# YOUR CODE HERE"
CHECK_CALL = re.compile(r"""\bcheck\(\s*["']([A-Za-z0-9_.]+)["']""")
CHECK_OUTPUT_MARK = "# NBVAL_CHECK_OUTPUT"
METADATA_KEY = "infra_lab"


class NotANotebook(ValueError):
    """A path that is missing or does not hold a Jupyter notebook."""


@dataclass(frozen=True)
class Exercise:
    name: str  # "chNN.exercise", as the check cell names it
    solution_index: int  # cell index of the student's code
    check_index: int | None  # cell index of the check cell (None if the student deleted it)
    points: float


def read(path: str | Path) -> nbformat.NotebookNode:
    """The notebook at `path`, or NotANotebook with a one-line reason."""
    path = Path(path)
    if not path.is_file():
        raise NotANotebook(f"{path}: no such file")
    try:
        notebook = nbformat.read(path, as_version=4)
    except Exception as error:  # nbformat raises several kinds for non-notebooks
        raise NotANotebook(f"{path}: not a Jupyter notebook ({type(error).__name__})") from None
    if "cells" not in notebook:
        raise NotANotebook(f"{path}: not a Jupyter notebook (no cells)")
    return notebook


def write(notebook: nbformat.NotebookNode, path: str | Path) -> None:
    Path(path).write_text(dumps(notebook), encoding="utf-8")


def dumps(notebook: nbformat.NotebookNode) -> str:
    return nbformat.writes(notebook) + "\n"


def check_name(cell: nbformat.NotebookNode) -> str | None:
    """The exercise a check cell checks, or None for any other cell."""
    if cell.cell_type != "code":
        return None
    stamped = cell.metadata.get(METADATA_KEY, {}).get("check")
    if stamped:
        return stamped
    match = CHECK_CALL.search(cell.source)
    return match.group(1) if match else None


def _is_answer_cell(cell: nbformat.NotebookNode) -> bool:
    return cell.cell_type == "code" and (BEGIN in cell.source or STUB in cell.source)


def exercises(notebook: nbformat.NotebookNode) -> dict[str, Exercise]:
    """Exercise name -> where its solution and check cells are.

    A stamped cell (metadata infra_lab.exercise) wins; otherwise an answer cell belongs to the
    first check cell after it.
    """
    found: dict[str, Exercise] = {}
    checks = {check_name(cell): index for index, cell in enumerate(notebook.cells)
              if check_name(cell)}
    for index, cell in enumerate(notebook.cells):
        if cell.cell_type != "code" or check_name(cell):
            continue
        stamp = cell.metadata.get(METADATA_KEY, {})
        name = stamp.get("exercise")
        if name is None and _is_answer_cell(cell):
            later = [check_name(c) for c in notebook.cells[index + 1:] if check_name(c)]
            name = later[0] if later else None
        if name and name not in found:
            found[name] = Exercise(name, index, checks.get(name), float(stamp.get("points", 1)))
    return found


def _stub_region(source: str, exercise: str) -> str:
    lines, out, inside = source.split("\n"), [], False
    for line in lines:
        if line.strip() == BEGIN:
            inside = True
            indent = line[: len(line) - len(line.lstrip())]
            out.append(f"{indent}{STUB}")
            out.append(f'{indent}raise NotImplementedError("exercise {exercise}: your code here")')
        elif line.strip() == END:
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise ValueError(f"exercise {exercise}: {BEGIN} has no matching {END}")
    return "\n".join(out)


def strip_outputs(notebook: nbformat.NotebookNode) -> None:
    """Committed form: no outputs or execution counts, except check cells' expected text."""
    notebook.metadata.pop("widgets", None)
    for cell in notebook.cells:
        cell.metadata.pop("execution", None)
        if cell.cell_type != "code":
            cell.pop("outputs", None)
            cell.pop("execution_count", None)
            cell.pop("attachments", None)
            continue
        if CHECK_OUTPUT_MARK in cell.source:
            cell.outputs = [o for o in cell.outputs if o.get("output_type") == "stream"]
            cell.execution_count = 1 if cell.outputs else None
        else:
            cell.outputs = []
            cell.execution_count = None


def stamp(notebook: nbformat.NotebookNode) -> None:
    """Write each exercise and check cell's role into its metadata, so the grader still finds
    a student's cell after they edit its neighbours."""
    for exercise in exercises(notebook).values():
        notebook.cells[exercise.solution_index].metadata[METADATA_KEY] = {
            "exercise": exercise.name, "points": exercise.points}
        if exercise.check_index is not None:
            notebook.cells[exercise.check_index].metadata[METADATA_KEY] = {"check": exercise.name}


def to_assignment(solution: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """The student notebook for a solution notebook."""
    student = nbformat.from_dict(solution)
    stamp(student)
    for exercise in exercises(student).values():
        cell = student.cells[exercise.solution_index]
        if BEGIN in cell.source:
            cell.source = _stub_region(cell.source, exercise.name)
    strip_outputs(student)
    return student


def assign(solutions_dir: Path, exercises_dir: Path, write_files: bool = True) -> list[Path]:
    """Write exercises_dir/X.ipynb for every solutions_dir/X.ipynb; return the files that
    changed (or, with write_files=False, that would change)."""
    if not solutions_dir.is_dir():
        raise NotANotebook(f"{solutions_dir}: no such folder of solution notebooks")
    changed = []
    for source in sorted(solutions_dir.glob("*.ipynb")):
        target = exercises_dir / source.name
        text = dumps(to_assignment(read(source)))
        if not target.is_file() or target.read_text(encoding="utf-8") != text:
            changed.append(target)
            if write_files:
                exercises_dir.mkdir(parents=True, exist_ok=True)
                target.write_text(text, encoding="utf-8")
    return changed
