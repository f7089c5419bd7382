"""Every chapter graded whole, as an instructor grades a class: the solutions score full marks and
the fresh exercises zero. No limit here is tight (they are not what is tested), so these run in
`make test`'s main pass beside other tests rather than alone with test_grader.py's timed ones."""
from pathlib import Path

import pytest

from infra_lab.grading import grade, notebooks

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = sorted(p.name for p in (ROOT / "exercises").glob("*.ipynb"))
# A setup cell imports numba and torch, chapter 05's last check serves the real model and chapter
# 09's trains the MoE (40-70 s alone on 2 cores, up to twice that beside another worker)
WHOLE_CHAPTER = grade.Limits(submission_timeout_s=480, cell_timeout_s=240)


def scores(rows):
    return {row.exercise: (row.status, row.passed, row.points) for row in rows}


@pytest.mark.slow
@pytest.mark.parametrize("chapter", CHAPTERS)
def test_every_chapter_grades_solutions_full_and_fresh_exercises_zero(chapter):
    assignment = notebooks.read(ROOT / "exercises" / chapter)
    names = list(notebooks.exercises(assignment))
    assert len(names) >= 2
    full = scores(grade.grade_one(assignment, ROOT / "solutions" / chapter, WHOLE_CHAPTER))
    assert full == {name: ("ok", 24, 1.0) for name in names}
    zero = scores(grade.grade_one(assignment, ROOT / "exercises" / chapter, WHOLE_CHAPTER))
    assert zero == {name: ("ok", 0, 0.0) for name in names}
