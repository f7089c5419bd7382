import re
import sys
from pathlib import Path

import pytest

from infra_lab import stack
from infra_lab.grading import check, checks, results


def line(capsys, name, candidate):
    check(name, candidate)
    return capsys.readouterr().out


def test_every_check_is_passed_by_an_independent_solution_under_nbval(root):
    """Each check's reference passing its own cases would compare the package with itself. What
    holds a check's cases instead: every chapter graded whole gives solutions/ full marks on every
    check (test_grade_chapters.py), and every check cell keeps "PASS name 24/24" (or its count) as its expected
    output for the learner's nbval (test_learner_nbval.py), for a solution written apart from
    the package (its exercise cells import nothing from infra_lab.grading)."""
    from infra_lab.grading import notebooks

    expected = {}
    for path in sorted((root / "solutions").glob("*.ipynb")):
        for cell in notebooks.read(path).cells:
            if name := notebooks.check_name(cell):
                expected[name] = "".join(output.get("text", "") for output in cell.outputs)
            elif cell.cell_type == "code" and "BEGIN SOLUTION" in cell.source:
                assert "infra_lab.grading" not in cell.source and "from infra_lab import grading" \
                    not in cell.source, (path.name, cell.source[:80])
    assert {name: expected.get(name) for name in checks.known_checks()} == \
        {name: f"PASS {name} {checks.cases(name)}/{checks.cases(name)}\n" for name in checks.known_checks()}


def test_a_wrong_answer_fails_with_its_first_case(capsys):
    out = line(capsys, "ch00.ttft_tpot", lambda arrival, times: (times[0] - arrival, 0.0))
    assert out.startswith("FAIL ch00.ttft_tpot ")
    assert "returned" in out and "expected" in out
    assert out.count("\n") == 1


def test_the_line_is_deterministic(capsys):
    wrong = lambda intervals, start, end: 0.5  # noqa: E731
    assert line(capsys, "ch00.idle_fraction", wrong) == line(capsys, "ch00.idle_fraction", wrong)


def test_an_exception_in_student_code_is_a_failing_case(capsys):
    def broken(n_params, batch, bytes_per_param):
        raise NotImplementedError("exercise ch00.decode_intensity: replace this line")

    out = line(capsys, "ch00.decode_intensity", broken)
    assert out.startswith("FAIL ch00.decode_intensity 0/24: decode_intensity(")
    assert "raised NotImplementedError: exercise ch00.decode_intensity" in out


def test_partial_credit_counts_the_cases_that_pass(capsys):
    def right_for_one_token_only(arrival, times):
        return stack.ttft_tpot(arrival, times) if len(times) == 1 else (0.0, 0.0)

    out = line(capsys, "ch00.ttft_tpot", right_for_one_token_only)
    passed = int(out.split()[2].split("/")[0])
    assert 0 < passed < 24


def test_a_non_function_fails_cleanly(capsys):
    assert line(capsys, "ch00.decode_intensity", 42) == \
        "FAIL ch00.decode_intensity 0/24: expected a function, got int\n"


def test_student_code_cannot_change_the_reference_arguments(capsys):
    def mutating(intervals, start, end):
        intervals.clear()
        return 1.0

    assert line(capsys, "ch00.idle_fraction", mutating).startswith("FAIL")
    assert line(capsys, "ch00.idle_fraction", stack.idle_fraction).startswith("PASS")


def test_an_unknown_exercise_lists_the_known_ones():
    with pytest.raises(KeyError, match="no check named 'ch00.nope'; known checks: ch00.decode_intensity"):
        check("ch00.nope", print)


def test_results_records_each_check_in_order(capsys):
    before = len(results())
    check("ch00.decode_intensity", stack.decode_intensity)
    check("ch00.decode_intensity", 1)
    recorded = results()[before:]
    assert [(r.passed, r.total) for r in recorded] == [(24, 24), (0, 24)]


def test_short_repr_is_bounded_and_stable():
    assert checks.short_repr(0.1 + 0.2) == "0.3"
    assert checks.short_repr(list(range(100))) == "[0, 1, 2, 3, 4, 5, ...]"
    assert len(checks.short_repr("x" * 1000)) == 120
    assert checks.short_repr(object()) == "<object>"


# ---- finding chapter modules by name ----------------------------------------------------------

def test_every_chapter_module_in_the_package_is_discovered():
    package_dir = Path(checks.__file__).parent
    on_disk = sorted(path.stem for path in package_dir.glob("ch*.py") if re.fullmatch(r"ch\d\d", path.stem))
    assert on_disk and checks.chapter_modules() == on_disk
    assert {name.split(".")[0] for name in checks.known_checks()} == set(on_disk)


@pytest.fixture
def extra_chapters(tmp_path, monkeypatch):
    """A package made at test time, holding chapter modules ch05 and ch06 (and a non-chapter
    module), importable from tmp_path; its checks go into a copy of the registry."""
    package = tmp_path / "extra_chapters_for_test"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for chapter, exercise, factor in (("ch05", "double", 2), ("ch06", "triple", 3)):
        (package / f"{chapter}.py").write_text(
            "from infra_lab.grading.checks import Check, register\n\n\n"
            f"def {exercise}(x):\n    return {factor} * x\n\n\n"
            f"register(Check('{chapter}.{exercise}', {exercise}, lambda rng: (float(rng.uniform()),)))\n")
    (package / "helpers.py").write_text("raise AssertionError('not a chapter module: never imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(checks, "_REGISTRY", dict(checks._REGISTRY))
    yield package.name
    for module in [name for name in sys.modules if name.startswith(package.name)]:
        del sys.modules[module]


def test_a_check_in_a_chapter_module_added_later_is_found(extra_chapters):
    spec = checks._lookup("ch05.double", package=extra_chapters)
    assert spec.name == "ch05.double"
    assert f"{extra_chapters}.ch06" not in sys.modules  # a lookup imports its own chapter only
    assert checks._run(spec, lambda x: x + x).line == "PASS ch05.double 24/24"


def test_known_checks_imports_every_chapter_module_of_the_package(extra_chapters):
    assert checks.chapter_modules(extra_chapters) == ["ch05", "ch06"]
    assert {"ch05.double", "ch06.triple"} <= set(checks.known_checks(extra_chapters))


def test_a_chapter_without_a_module_names_the_chapters_and_the_checks():
    chapters = ", ".join(checks.chapter_modules())
    expected = f"no check named 'ch99.x': infra_lab.grading has no module ch99 (chapters: {chapters}); known checks: "
    with pytest.raises(KeyError, match=re.escape(expected) + "ch00.decode_intensity"):
        check("ch99.x", print)


def test_a_name_that_is_not_a_chapter_says_what_names_look_like():
    with pytest.raises(KeyError, match=re.escape("no check named 'os.path': 'os' is not a chapter (names look like")):
        check("os.path", print)
