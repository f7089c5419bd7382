"""The grader's reference-use status (infra_lab.grading.reference_use): a solution that calls the
package's own answer is found through every import form, and no real solution is flagged."""
from pathlib import Path

import pytest

from infra_lab.grading import checks, notebooks
from infra_lab.grading.reference_use import ANSWERS, answers_used, names_used, resolve

ROOT = Path(__file__).resolve().parent.parent
ANSWER = "infra_lab.serving.speculative.expected_tokens"


@pytest.mark.parametrize("source", [
    "from infra_lab.serving.speculative import expected_tokens\n"
    "def expected_tokens_(a, g):\n    return expected_tokens(a, g)",
    "from infra_lab.serving.speculative import expected_tokens as e\nf = lambda a, g: e(a, g)",
    "from infra_lab.serving import speculative\ndef f(a, g):\n    return speculative.expected_tokens(a, g)",
    "from infra_lab.serving import speculative as s\ndef f(a, g):\n    return s.expected_tokens(a, g)",
    "import infra_lab.serving.speculative\ndef f(a, g):\n"
    "    return infra_lab.serving.speculative.expected_tokens(a, g)",
    "import infra_lab.serving.speculative as sp\nf = sp.expected_tokens",
    "from infra_lab.serving.speculative import *\nf = expected_tokens",
    "%load_ext autoreload\nfrom infra_lab.serving.speculative import expected_tokens",
])
def test_every_import_form_of_the_answer_is_found(source):
    assert answers_used("ch07.expected_tokens", source) == [ANSWER]


@pytest.mark.parametrize("source", [
    "def expected_tokens(alpha, gamma):\n    return (1 - alpha ** (gamma + 1)) / (1 - alpha)",
    "from infra_lab.serving import speculative\nV = speculative.Verdict",  # another object of the module
    "from infra_lab.serving.speculative import Verdict",
    "def f(:\n    broken",  # a cell that does not parse is graded as it runs, not flagged
    "",
])
def test_an_own_answer_or_another_object_is_not_flagged(source):
    assert answers_used("ch07.expected_tokens", source) == []


def test_a_method_answer_is_found_on_any_object():
    assert answers_used("ch05.preempt", "def preempt(scheduler, plan):\n    scheduler._preempt(plan)") \
        == ["._preempt"]
    assert answers_used("ch05.preempt", "def preempt(scheduler, plan):\n    return plan.victims") == []
    assert ".victims" in names_used("plan.victims")


def test_every_answer_names_a_real_object_of_a_known_exercise():
    known = set(checks.known_checks())
    for exercise, answers in ANSWERS.items():
        assert exercise in known, exercise
        for answer in answers:
            if not answer.startswith("."):
                assert callable(resolve(answer)), answer


def test_no_solution_uses_the_answer_it_is_asked_to_write():
    for path in sorted((ROOT / "solutions").glob("*.ipynb")):
        notebook = notebooks.read(path)
        for name, exercise in notebooks.exercises(notebook).items():
            source = notebook.cells[exercise.solution_index].source
            assert answers_used(name, source) == [], (path.name, name)

