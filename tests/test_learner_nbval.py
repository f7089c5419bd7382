"""The command a learner checks their exercises with, `pytest --nbval-lax exercises/<chapter>`,
run as they run it: on chapter 00's solutions it passes (each check cell prints its stored
"PASS name 24/24"), on the fresh exercises it fails and names the check cells. Every chapter's
checks against its solutions are held by grading each chapter whole (test_grade_chapters.py:
full marks for solutions/, zero for exercises/), so nbval runs once here, not over every
chapter."""
import subprocess
import sys
from pathlib import Path

import pytest

from infra_lab.grading import notebooks

ROOT = Path(__file__).resolve().parent.parent
CHAPTER = "ch00_stack.ipynb"


def learner_runs(folder: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "--nbval-lax", "-q", f"{folder}/{CHAPTER}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_the_learners_command_passes_the_solutions():
    done = learner_runs("solutions")
    assert done.returncode == 0, done.stdout[-2000:]
    assert " passed" in done.stdout and "failed" not in done.stdout


@pytest.mark.slow
def test_the_learners_command_fails_fresh_exercises_at_their_checks():
    done = learner_runs("exercises")
    assert done.returncode == 1, done.stdout[-2000:]
    failed = {int(line.split("::Cell ")[1].split()[0]) for line in done.stdout.splitlines()
              if line.startswith("FAILED")}
    code = [cell for cell in notebooks.read(ROOT / "exercises" / CHAPTER).cells if cell.cell_type == "code"]
    checks = {i for i, cell in enumerate(code) if notebooks.check_name(cell)}
    answers = {i for i, cell in enumerate(code) if "raise NotImplementedError" in cell.source}
    assert len(checks) == 3 and checks <= failed, done.stdout[-2000:]  # chapter 00's three checks
    assert not answers & failed  # the unanswered exercise cells only define their functions
    assert "PASS ch00.decode_intensity 24/24" in done.stdout  # nbval shows the expected output
