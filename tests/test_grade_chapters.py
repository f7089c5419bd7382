"""Every chapter graded whole, as an instructor grades a class: the solutions score full marks and
the fresh exercises zero. No limit here is tight (they are not what is tested), so these run in
`make test`'s main pass beside other tests rather than alone with test_grader.py's timed ones.

The solutions are graded on the torch backend at quick sizes (the Colab path a learner takes;
the checks themselves run at their own sizes), the exercises on the default backend: so every
solution cell runs on torch once, and every check's 24/24 holds on it, without a third run of
the solutions beside the torch pass of the chapters (test_notebooks_on_torch.py)."""
from pathlib import Path

import pytest

from conftest import ON_TORCH
from infra_lab.grading import checks, grade, notebooks

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = sorted(p.name for p in (ROOT / "exercises").glob("*.ipynb"))
# A setup cell imports numba and torch, chapter 05's last check serves the real model and chapter
# 09's trains the MoE (40-70 s alone on 2 cores, up to twice that beside another worker)
WHOLE_CHAPTER = grade.Limits(submission_timeout_s=480, cell_timeout_s=240)


def scores(rows):
    return {row.exercise: (row.status, row.passed, row.points) for row in rows}


@pytest.mark.slow
@pytest.mark.parametrize("chapter", CHAPTERS)
def test_every_chapter_grades_solutions_full_and_fresh_exercises_zero(chapter, monkeypatch):
    assignment = notebooks.read(ROOT / "exercises" / chapter)
    names = list(notebooks.exercises(assignment))
    assert len(names) >= 2
    with monkeypatch.context() as on_torch:  # the grader's process inherits the environment
        for name, value in ON_TORCH.items():
            on_torch.setenv(name, value)
        full = scores(grade.grade_one(assignment, ROOT / "solutions" / chapter, WHOLE_CHAPTER))
    assert full == {name: ("ok", checks.cases(name), 1.0) for name in names}
    zero = scores(grade.grade_one(assignment, ROOT / "exercises" / chapter, WHOLE_CHAPTER))
    assert zero == {name: ("ok", 0, 0.0) for name in names}


@pytest.mark.slow
def test_a_solution_that_calls_the_packages_answer_scores_nothing_for_it(tmp_path):
    """Chapter 07's first exercise answered by the package's own function: all 24 cases pass,
    the status says so, and it earns no points; the other exercises grade as usual."""
    assignment = notebooks.read(ROOT / "exercises" / "ch07_speculative.ipynb")
    submission = notebooks.read(ROOT / "solutions" / "ch07_speculative.ipynb")
    cell = submission.cells[notebooks.exercises(submission)["ch07.expected_tokens"].solution_index]
    cell.source = ("from infra_lab.serving import speculative\n\n\n"
                   "def expected_tokens(alpha, gamma):\n    return speculative.expected_tokens(alpha, gamma)\n")
    notebooks.write(submission, tmp_path / "lazy.ipynb")
    got = scores(grade.grade_one(assignment, tmp_path / "lazy.ipynb", WHOLE_CHAPTER))
    assert got.pop("ch07.expected_tokens") == ("reference", 24, 0.0)
    assert got == {name: ("ok", 24, 1.0) for name in got}
