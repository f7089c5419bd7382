"""The grader on whole notebooks: full marks, zero, tampering, crashes, hangs and floods. These
time their limits, so `make test` runs them apart from the rest, after it, two at a time (most of
their time is spent waiting out those limits); every chapter graded whole is in
test_grade_chapters.py."""
import csv
import socket
import subprocess
import sys
import threading
from pathlib import Path

import nbformat
import pytest

from infra_lab.grading import contain, grade, notebooks

pytestmark = pytest.mark.grader
EXERCISES = ["ch00.decode_intensity", "ch00.ttft_tpot", "ch00.idle_fraction"]
FAST = grade.Limits(submission_timeout_s=60, cell_timeout_s=3)


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    return root / "exercises" / "ch00_stack.ipynb", root / "solutions" / "ch00_stack.ipynb", \
        tmp_path_factory.mktemp("submissions")


def submission(base, folder, name, answers=None, check_source=None, check_output=None):
    """A copy of `base` with some exercise cells' code and check cells replaced."""
    notebook = notebooks.read(base)
    found = notebooks.exercises(notebook)
    for exercise, code in (answers or {}).items():
        notebook.cells[found[exercise].solution_index].source = code
    for exercise in found.values():
        cell = notebook.cells[exercise.check_index]
        if check_source is not None:
            cell.source = check_source.format(name=exercise.name)
        if check_output is not None:
            cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=check_output.format(name=exercise.name))]
    path = folder / f"{name}.ipynb"
    notebooks.write(notebook, path)
    return path


def scores(rows):
    return {row.exercise: (row.status, row.passed, row.points) for row in rows}


def test_solutions_score_full_marks(paths):
    assignment, solutions, _ = paths
    rows = grade.grade_one(notebooks.read(assignment), solutions, FAST)
    assert scores(rows) == {name: ("ok", 24, 1.0) for name in EXERCISES}


def test_fresh_exercises_score_zero(paths):
    assignment, _, _ = paths
    rows = grade.grade_one(notebooks.read(assignment), assignment, FAST)
    assert scores(rows) == {name: ("ok", 0, 0.0) for name in EXERCISES}


def test_tampered_check_cells_score_as_if_untouched(paths):
    assignment, solutions, folder = paths
    fake = 'print("PASS {name} 24/24")'
    unsolved = submission(assignment, folder, "unsolved_fake_checks", check_source=fake,
                          check_output="PASS {name} 24/24\n")
    solved = submission(solutions, folder, "solved_no_checks", check_source="pass", check_output="")
    assignment_notebook = notebooks.read(assignment)
    assert scores(grade.grade_one(assignment_notebook, unsolved, FAST)) == \
        {name: ("ok", 0, 0.0) for name in EXERCISES}
    assert scores(grade.grade_one(assignment_notebook, solved, FAST)) == \
        {name: ("ok", 24, 1.0) for name in EXERCISES}


def test_a_crash_costs_only_its_own_exercise(paths):
    assignment, solutions, folder = paths
    path = submission(solutions, folder, "raises", {"ch00.ttft_tpot": "raise RuntimeError('boom')"})
    got = scores(grade.grade_one(notebooks.read(assignment), path, FAST))
    assert got["ch00.ttft_tpot"] == ("error", 0, 0.0)
    assert got["ch00.decode_intensity"] == got["ch00.idle_fraction"] == ("ok", 24, 1.0)


def test_a_dying_process_is_contained(paths):
    assignment, solutions, folder = paths
    path = submission(solutions, folder, "exits", {"ch00.ttft_tpot": "import os\nos._exit(3)"})
    got = scores(grade.grade_one(notebooks.read(assignment), path, FAST))
    assert got == {"ch00.decode_intensity": ("ok", 24, 1.0), "ch00.ttft_tpot": ("error", 0, 0.0),
                   "ch00.idle_fraction": ("error", 0, 0.0)}


def test_an_infinite_loop_times_out_and_the_rest_is_graded(paths):
    assignment, solutions, folder = paths
    path = submission(solutions, folder, "loops", {"ch00.ttft_tpot": "while True:\n    pass"})
    got = scores(grade.grade_one(notebooks.read(assignment), path, FAST))
    assert got["ch00.ttft_tpot"] == ("timeout", 0, 0.0)
    assert got["ch00.decode_intensity"] == got["ch00.idle_fraction"] == ("ok", 24, 1.0)


def test_a_loop_that_swallows_the_alarm_is_killed_with_its_submission(paths):
    assignment, solutions, folder = paths
    stubborn = "import time\nwhile True:\n    try:\n        time.sleep(1)\n    except BaseException:\n        pass"
    path = submission(solutions, folder, "stubborn", {"ch00.ttft_tpot": stubborn})
    limits = grade.Limits(submission_timeout_s=24, cell_timeout_s=6)  # a fresh clone imports numba in its setup cell
    got = scores(grade.grade_one(notebooks.read(assignment), path, limits))
    assert got == {"ch00.decode_intensity": ("ok", 24, 1.0), "ch00.ttft_tpot": ("timeout", 0, 0.0),
                   "ch00.idle_fraction": ("timeout", 0, 0.0)}


def test_an_output_flood_is_contained(paths):
    assignment, solutions, folder = paths
    path = submission(solutions, folder, "floods", {"ch00.decode_intensity": "while True:\n    print('x' * 10000)"})
    got = scores(grade.grade_one(notebooks.read(assignment), path, FAST))
    assert got["ch00.decode_intensity"] == ("timeout", 0, 0.0)
    assert got["ch00.ttft_tpot"] == got["ch00.idle_fraction"] == ("ok", 24, 1.0)


def test_a_deleted_exercise_cell_is_missing(paths):
    assignment, solutions, folder = paths
    notebook = notebooks.read(solutions)
    del notebook.cells[notebooks.exercises(notebook)["ch00.idle_fraction"].solution_index]
    path = folder / "deleted.ipynb"
    notebooks.write(notebook, path)
    got = scores(grade.grade_one(notebooks.read(assignment), path, FAST))
    assert got["ch00.idle_fraction"] == ("missing", 0, 0.0)
    assert got["ch00.ttft_tpot"] == ("ok", 24, 1.0)


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "infra_lab.cli", *map(str, args)],
                          capture_output=True, text=True, timeout=300)


def test_cli_grades_a_folder_into_one_csv_even_with_a_hang(paths, tmp_path):
    assignment, solutions, _ = paths
    folder = tmp_path / "class"
    folder.mkdir()
    submission(solutions, folder, "alice")
    submission(solutions, folder, "bob", {"ch00.decode_intensity": "while True:\n    pass"})
    submission(assignment, folder, "carol")
    out = tmp_path / "grades.csv"
    done = run_cli("grade", assignment, folder, "--csv", out, "--cell-timeout", 3)
    assert done.returncode == 0, done.stderr
    with open(out, newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert list(rows[0]) == ["submission", "exercise", "passed", "total", "points", "status", "detail"]
    assert len(rows) == 9
    totals = {}
    for row in rows:
        name = row["submission"].rsplit("/", 1)[-1]
        totals[name] = totals.get(name, 0) + float(row["points"])
    assert totals == {"alice.ipynb": 3.0, "bob.ipynb": 2.0, "carol.ipynb": 0.0}
    assert {row["status"] for row in rows if "bob" in row["submission"]} == {"ok", "timeout"}
    page = out.with_suffix(".html").read_text()
    assert "ch00.decode_intensity" in page and "bob.ipynb" in page and "contained by" in done.stdout


def test_cli_bad_paths_get_one_line_and_exit_2(paths, tmp_path):
    assignment, solutions, _ = paths
    text = tmp_path / "notes.ipynb"
    text.write_text("these are not JSON")
    out = tmp_path / "g.csv"
    done = run_cli("grade", assignment, tmp_path / "absent.ipynb", text, "--csv", out)
    assert done.returncode == 2
    errors = done.stderr.strip().splitlines()
    assert errors == [f"error: {tmp_path / 'absent.ipynb'}: no such file",
                      f"error: {text}: not a Jupyter notebook (NotJSONError)"]
    assert {row["status"] for row in csv.DictReader(open(out))} == {"missing"}
    done = run_cli("grade", tmp_path / "absent.ipynb", solutions, "--csv", out)
    assert done.returncode == 2
    assert done.stderr.strip() == f"error: {tmp_path / 'absent.ipynb'}: no such file"


def test_cli_help_lists_every_command_with_a_line():
    done = run_cli("--help")
    assert done.returncode == 0
    for command in ("assign", "grade", "describe", "tidy"):
        assert any(line.strip().startswith(command + " ") for line in done.stdout.splitlines()), command


def test_every_grader_test_is_in_this_file(root):
    """`make test`'s grader pass collects this file alone (collecting every test module would cost
    each worker 10 s of the pass's minute): a test marked grader in another file would run in
    neither pass, so there must be none."""
    elsewhere = [path.name for path in sorted((root / "tests").glob("test_*.py"))
                 if path.name != "test_grader.py" and "mark.grader" in path.read_text()]
    assert elsewhere == []


# ---- a class at once: side by side, and contained ------------------------------------------------------

ROOT = Path(__file__).resolve().parent.parent
SOLVED = ("def decode_intensity(n_params, batch, bytes_per_param):\n"
          "    return 2 * n_params * batch / (n_params * bytes_per_param)\n")
TIGHT = grade.Limits(submission_timeout_s=90, cell_timeout_s=20,
                     budget=contain.Budget(memory_mb=4096, processes=64, file_mb=32, scratch_mb=64))
needs_namespaces = pytest.mark.skipif(contain.available() != "namespaces",
                                      reason="unshare and setpriv do not work here")


HOG = ("import numpy as np\nblocks = []\nfor _ in range(400):\n"  # untouched zeros: address space, not memory
       "    blocks.append(np.zeros(64 << 20, np.uint8))")


def hostile(tried: str) -> str:
    """An exercise cell that cheats: it tries something forbidden and, if that works, answers right."""
    return tried + "\n" + SOLVED


class Listener:
    """A TCP server on this machine's loopback that counts who connects."""

    def __init__(self):
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port, self.accepted = self.server.getsockname()[1], 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                connection, _ = self.server.accept()
            except OSError:
                return
            self.accepted += 1
            connection.close()


@needs_namespaces
def test_hostile_submissions_are_stopped_and_cost_only_their_own_points(paths, tmp_path):
    assignment, solutions, _ = paths
    folder = tmp_path / "class"
    folder.mkdir()
    good = submission(solutions, folder, "a_good")
    listener = Listener()
    planted = ROOT / "infra_lab" / "written_by_a_submission.py"
    tries = {
        "reads_a_neighbour": (f"open({str(good)!r}).read()", "error", "FileNotFoundError"),
        "writes_outside": (f"open({str(planted)!r}, 'w').write('x')", "stopped", ("no permission",
                                                                                 "read-only file system")),
        "opens_a_socket": (f"import socket\nsocket.create_connection(('127.0.0.1', {listener.port}), timeout=5)",
                           "error", "ConnectionRefusedError"),
        "forks_without_end": ("import os, time\nfor _ in range(400):\n    if os.fork() == 0:\n"
                              "        time.sleep(60)\n        os._exit(0)", "stopped", "process limit"),
        "allocates_without_end": (HOG,
                                  "stopped", "memory limit"),
        "fills_the_disk": ("for i in range(100):\n    open(f'/tmp/fill{i}', 'wb').write(bytes(4 << 20))",
                           "stopped", "disk space"),
        "writes_a_huge_file": ("open('huge', 'wb').write(bytes(64 << 20))", "stopped", "file size limit"),
        "edits_the_checks": ("from infra_lab.grading import checks\nchecks._run = lambda spec, candidate: "
                             "checks.CheckResult(spec.name, spec.n_cases, spec.n_cases, None)",
                             "stopped", "edited the checks (checks._run)"),
    }
    for name, (tried, _, _) in tries.items():
        submission(solutions, folder, name, {"ch00.decode_intensity": hostile(tried)})
    rows = grade.grade(assignment, grade.expand([folder]), tmp_path / "grades.csv", TIGHT, jobs=2)
    by_name: dict[str, dict] = {}
    for row in rows:
        by_name.setdefault(Path(row.submission).stem, {})[row.exercise] = row
    alone = grade.grade_one(notebooks.read(assignment), good, TIGHT)
    assert list(by_name["a_good"].values()) == alone
    assert {row.points for row in alone} == {1.0}
    wrong = {name: (row.status, row.points, row.detail) for name, (_, status, named) in tries.items()
             if (row := by_name[name]["ch00.decode_intensity"]).status != status or row.points
             or not any(words in row.detail for words in ([named] if isinstance(named, str) else named))}
    assert wrong == {}
    assert not planted.exists() and listener.accepted == 0
    assert by_name["writes_a_huge_file"]["ch00.ttft_tpot"].points == 1.0  # the rest of its work counts
    edited = by_name["edits_the_checks"]
    assert {row.status for row in edited.values()} == {"stopped"}  # the checks it edited judge nothing after


def test_side_by_side_gives_the_same_csv_as_one_at_a_time(paths, tmp_path):
    assignment, solutions, _ = paths
    folder = tmp_path / "class"
    folder.mkdir()
    submission(solutions, folder, "alice")
    submission(assignment, folder, "bob")
    submission(solutions, folder, "carol", {"ch00.ttft_tpot": "raise RuntimeError('boom')"})
    submission(solutions, folder, "dave", {"ch00.idle_fraction": "def idle_fraction(spans):\n    return 0.5"})
    paths_in_order = grade.expand([folder])
    one = grade.grade(assignment, paths_in_order, tmp_path / "one.csv", FAST, jobs=1)
    two = grade.grade(assignment, paths_in_order, tmp_path / "two.csv", FAST, jobs=2)
    assert one == two and (tmp_path / "one.csv").read_bytes() == (tmp_path / "two.csv").read_bytes()
    assert [Path(r.submission).stem for r in one[::3]] == ["alice", "bob", "carol", "dave"]


def test_limits_alone_stop_an_allocation_and_a_huge_file(paths, tmp_path):
    assignment, solutions, _ = paths
    path = submission(solutions, tmp_path, "greedy", {  # the memory it takes stays taken: it goes last
        "ch00.decode_intensity": hostile("open('huge', 'wb').write(bytes(64 << 20))"),
        "ch00.idle_fraction": HOG})
    limits = grade.Limits(60, 20, budget=TIGHT.budget, containment="limits")
    got = {row.exercise: row for row in grade.grade_one(notebooks.read(assignment), path, limits)}
    assert got["ch00.decode_intensity"].status == "stopped" and "file size limit" in got["ch00.decode_intensity"].detail
    assert got["ch00.ttft_tpot"].points == 1.0
    assert got["ch00.idle_fraction"].status == "stopped" and "memory limit" in got["ch00.idle_fraction"].detail
