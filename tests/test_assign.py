import nbformat
import pytest

from infra_lab import cli
from infra_lab.grading import notebooks


def test_exercises_are_what_assign_writes(root):
    stale = notebooks.assign(root / "solutions", root / "exercises", write_files=False)
    assert stale == [], "run `infra-lab assign` and commit exercises/"
    solutions = sorted(p.name for p in (root / "solutions").glob("*.ipynb"))
    assert sorted(p.name for p in (root / "exercises").glob("*.ipynb")) == solutions


def test_assign_check_exits_nonzero_when_out_of_date(root, tmp_path, capsys):
    assert cli.main(["assign", "--solutions", str(root / "solutions"), "--exercises", str(tmp_path), "--check"]) == 1
    assert "out of date" in capsys.readouterr().out
    assert cli.main(["assign", "--solutions", str(root / "solutions"), "--exercises", str(tmp_path)]) == 0
    assert cli.main(["assign", "--solutions", str(root / "solutions"), "--exercises", str(tmp_path), "--check"]) == 0


def test_student_cells_hide_the_solution_and_name_the_exercise(root):
    solution = notebooks.read(root / "solutions" / "ch00_stack.ipynb")
    student = notebooks.to_assignment(solution)
    found = notebooks.exercises(student)
    assert list(found) == list(notebooks.exercises(solution)) == [
        "ch00.decode_intensity", "ch00.ttft_tpot", "ch00.idle_fraction"]
    for name, exercise in found.items():
        source = student.cells[exercise.solution_index].source
        assert notebooks.BEGIN not in source and notebooks.END not in source
        assert "# YOUR CODE HERE" in source
        assert f'raise NotImplementedError("exercise {name}:' in source
        assert student.cells[exercise.solution_index].metadata["infra_lab"]["exercise"] == name
        assert student.cells[exercise.check_index].outputs[0].text.startswith(f"PASS {name}")


def test_stub_keeps_the_code_around_the_markers_and_its_indent():
    cell = nbformat.v4.new_code_cell(
        "def f(x):\n    y = 1\n    ### BEGIN SOLUTION\n    return x + y\n    ### END SOLUTION\n")
    check = nbformat.v4.new_code_cell('check("ch99.f", f)')
    student = notebooks.to_assignment(nbformat.v4.new_notebook(cells=[cell, check]))
    assert student.cells[0].source == (
        'def f(x):\n    y = 1\n    # YOUR CODE HERE\n'
        '    raise NotImplementedError("exercise ch99.f: your code here")\n')


def test_an_unclosed_marker_is_an_error():
    cell = nbformat.v4.new_code_cell("### BEGIN SOLUTION\nx = 1\n")
    check = nbformat.v4.new_code_cell('check("ch99.x", x)')
    with pytest.raises(ValueError, match="exercise ch99.x: ### BEGIN SOLUTION has no matching"):
        notebooks.to_assignment(nbformat.v4.new_notebook(cells=[cell, check]))


def test_assign_reports_a_missing_folder(tmp_path, capsys):
    assert cli.main(["assign", "--solutions", str(tmp_path / "nope")]) == 2
    assert "no such folder" in capsys.readouterr().err
