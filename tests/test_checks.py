import pytest

from infra_lab import stack
from infra_lab.grading import check, checks, results


def line(capsys, name, candidate):
    check(name, candidate)
    return capsys.readouterr().out


def test_the_reference_passes_every_case(capsys):
    for name in checks.known_checks():
        reference = checks._lookup(name).reference
        assert line(capsys, name, reference) == f"PASS {name} 24/24\n"


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
