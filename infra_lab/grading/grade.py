"""Grade submissions: each student's exercise cells, put into the pristine assignment, run in a
separate process with a time limit, one CSV row per submission and exercise.

Only the student's exercise (solution) cells are taken. Their copies of the check cells, any
outputs stored there, and edits to other cells are ignored, so tampering changes nothing.
"""
from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import nbformat

from infra_lab.grading import notebooks, reference_use

# "reference": the solution uses the package's own answer to the exercise (reference_use), so it
# scores no points whatever its cases; the instructor decides
STATUSES = ("ok", "error", "timeout", "missing", "reference")
COLUMNS = ("submission", "exercise", "passed", "total", "points", "status")


@dataclass(frozen=True)
class Row:
    submission: str
    exercise: str
    passed: int
    total: int
    points: float
    status: str  # one of STATUSES


@dataclass(frozen=True)
class Limits:
    submission_timeout_s: float = 300.0
    cell_timeout_s: float = 60.0
    output_limit_chars: int = 100_000


def plan_for(assignment: nbformat.NotebookNode, submission: nbformat.NotebookNode) -> tuple[list[dict], set[str]]:
    """The cells to run: the assignment's, with the student's exercise cells swapped in.
    Returns the cells and the exercises the submission lacks."""
    wanted = notebooks.exercises(assignment)
    theirs = notebooks.exercises(submission)
    solution_at = {ex.solution_index: ex.name for ex in wanted.values()}
    missing = set(wanted) - set(theirs)
    cells = []
    for index, cell in enumerate(assignment.cells):
        if cell.cell_type != "code":
            continue
        if index in solution_at:
            name = solution_at[index]
            if name not in missing:
                source = submission.cells[theirs[name].solution_index].source
                cells.append({"role": "solution", "exercise": name, "source": source})
        elif notebooks.check_name(cell) in wanted:
            name = notebooks.check_name(cell)
            if name not in missing:
                cells.append({"role": "check", "exercise": name, "source": cell.source})
        else:
            cells.append({"role": "context", "source": cell.source})
    return cells, missing


def _run_plan(cells: list[dict], limits: Limits) -> tuple[list[dict], bool]:
    """Run the cells in a fresh process; return its reports and whether time ran out."""
    with tempfile.TemporaryDirectory(prefix="infra-lab-grade-") as workdir:
        plan_path, results_path = Path(workdir, "plan.json"), Path(workdir, "results.jsonl")
        plan_path.write_text(json.dumps({"cells": cells, "cell_timeout_s": limits.cell_timeout_s,
                                         "output_limit": limits.output_limit_chars}))
        results_path.touch()
        environment = {**os.environ, "MPLBACKEND": "Agg"}
        quiet = None if os.environ.get("INFRA_LAB_GRADER_DEBUG") else subprocess.DEVNULL
        process = subprocess.Popen(
            [sys.executable, "-m", "infra_lab.grading.runner", str(plan_path), str(results_path)],
            cwd=workdir, env=environment, stdin=subprocess.DEVNULL, stdout=quiet, stderr=quiet,
            start_new_session=True,
        )
        timed_out = False
        try:
            process.wait(timeout=limits.submission_timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:  # also reaps anything the student's code left running in the group
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait()
        reports = []
        for line in results_path.read_text(errors="replace").splitlines():
            try:  # a line cut off by the kill is dropped
                reports.append(json.loads(line))
            except json.JSONDecodeError:
                pass
        return reports, timed_out


def grade_one(assignment: nbformat.NotebookNode, submission_path: Path, limits: Limits) -> list[Row]:
    wanted = notebooks.exercises(assignment)
    try:
        submission = notebooks.read(submission_path)
    except notebooks.NotANotebook:
        return [Row(str(submission_path), name, 0, 0, 0.0, "missing") for name in wanted]
    cells, missing = plan_for(assignment, submission)
    reports, timed_out = _run_plan(cells, limits)
    # never reached, or begun and cut off: the time ran out, or the process died
    unfinished = "timeout" if timed_out else "error"
    outcome: dict[str, dict] = {}
    for report in reports:
        if "exercise" in report:
            outcome[report["exercise"]] = report
    sources = {cell["exercise"]: cell["source"] for cell in cells if cell["role"] == "solution"}
    rows = []
    for name, exercise in wanted.items():
        report = outcome.get(name, {"status": unfinished})
        status = "missing" if name in missing else report["status"]
        if status == "started":
            status = unfinished
        if status == "ok" and reference_use.answers_used(name, sources.get(name, "")):
            status = "reference"
        passed, total = int(report.get("passed", 0)), int(report.get("total", 0))
        points = round(exercise.points * passed / total, 4) if status == "ok" and total else 0.0
        rows.append(Row(str(submission_path), name, passed, total, points, status))
    return rows


def expand(paths: list[str]) -> list[Path]:
    """Submissions: files as given, folders as the notebooks inside them (sorted)."""
    expanded = []
    for path in map(Path, paths):
        if path.is_dir():
            expanded.extend(sorted(p for p in path.glob("*.ipynb") if p.is_file()))
        else:
            expanded.append(path)
    return expanded


def grade(assignment_path: Path, submission_paths: list[Path], csv_path: Path,
          limits: Limits = Limits(), progress=None) -> list[Row]:
    """Grade every submission and write the CSV; bad submission paths get 'missing' rows."""
    assignment = notebooks.read(assignment_path)
    if not notebooks.exercises(assignment):
        raise notebooks.NotANotebook(f"{assignment_path}: has no exercises to grade")
    rows: list[Row] = []
    for path in submission_paths:
        started = time.perf_counter()
        rows.extend(grade_one(assignment, path, limits))
        if progress:
            progress(path, time.perf_counter() - started)
    with open(csv_path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(COLUMNS)
        for row in rows:
            writer.writerow([row.submission, row.exercise, row.passed, row.total,
                             row.points, row.status])
    return rows
