"""Grade submissions: each student's exercise cells, put into the pristine assignment, run in a
separate, contained process (infra_lab.grading.contain) with a time limit, one CSV row per
submission and exercise. `jobs` submissions run side by side; the rows come out in the order
the submissions were given, the same as one at a time.

Only the student's exercise (solution) cells are taken. Their copies of the check cells, any
outputs stored there, and edits to other cells are ignored, so tampering changes nothing.
"""
from __future__ import annotations

import concurrent.futures
import csv
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import nbformat

from infra_lab.grading import contain, notebooks, reference_use

# "reference": the solution uses the package's own answer to the exercise (reference_use), so it
# scores no points whatever its cases; the instructor decides. "stopped": a limit or a wall of the
# containment stopped it, or it edited the checks; `detail` names which.
STATUSES = ("ok", "error", "timeout", "missing", "reference", "stopped")
COLUMNS = ("submission", "exercise", "passed", "total", "points", "status", "detail")
SIGNALS = {signal.SIGXCPU: "CPU time limit", signal.SIGXFSZ: "file size limit"}


@dataclass(frozen=True)
class Row:
    submission: str
    exercise: str
    passed: int
    total: int
    points: float
    status: str  # one of STATUSES
    detail: str = ""  # the first failing case, the error, or what stopped it


@dataclass(frozen=True)
class Limits:
    submission_timeout_s: float = 300.0
    cell_timeout_s: float = 60.0
    output_limit_chars: int = 100_000
    budget: contain.Budget = field(default_factory=contain.Budget)
    containment: str = "auto"  # "auto" (namespaces where they work, else limits), or one of contain.LEVELS

    def __post_init__(self):
        if self.containment not in ("auto", *contain.LEVELS):
            raise ValueError(f"containment must be auto, {' or '.join(contain.LEVELS)}; got {self.containment!r}")


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


def _run_plan(cells: list[dict], limits: Limits, level: str, slot: int = 0,
              hide: tuple[str, ...] = ()) -> tuple[list[dict], bool, str | None]:
    """Run the cells in a fresh, contained process; return its reports, whether time ran out, and
    the limit that killed it, if one did."""
    with tempfile.TemporaryDirectory(prefix="infra-lab-grade-") as workdir:
        plan_path, results_path = Path(workdir, "plan.json"), Path(workdir, "results.jsonl")
        # limits alone: the runner sets them on itself first (a preexec_fn is unsafe beside threads);
        # namespaces: the containment's first process sets them before it becomes the runner
        own_limits = {"budget": asdict(limits.budget), "processes": contain.process_limit(limits.budget, False)} \
            if level == "limits" else None
        plan_path.write_text(json.dumps({"cells": cells, "cell_timeout_s": limits.cell_timeout_s,
                                         "output_limit": limits.output_limit_chars, "limits": own_limits}))
        results_path.touch()
        scratch = Path(workdir, "scratch")
        scratch.mkdir()
        spec = {"plan": str(plan_path), "results": str(results_path), "slot": slot, "hide": list(hide),
                "budget": asdict(limits.budget)}
        argv, environment = contain.command(level, [str(plan_path), str(results_path)], spec, scratch)
        quiet = None if os.environ.get("INFRA_LAB_GRADER_DEBUG") else subprocess.DEVNULL
        process = subprocess.Popen(
            argv, cwd=scratch, env=environment, stdin=subprocess.DEVNULL, stdout=quiet, stderr=quiet,
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
        killed_by = None if timed_out else SIGNALS.get(-process.returncode)
        reports = []
        for line in results_path.read_text(errors="replace").splitlines():
            try:  # a line cut off by the kill is dropped
                reports.append(json.loads(line))
            except json.JSONDecodeError:
                pass
        return reports, timed_out, killed_by


def containment(limits: Limits) -> str:
    """The level `limits` asks for: "auto" is namespaces where a trial run works here."""
    return contain.available() if limits.containment == "auto" else limits.containment


def grade_one(assignment: nbformat.NotebookNode, submission_path: Path, limits: Limits, level: str | None = None,
              slot: int = 0, hide: tuple[str, ...] = ()) -> list[Row]:
    wanted = notebooks.exercises(assignment)
    try:
        submission = notebooks.read(submission_path)
    except notebooks.NotANotebook:
        return [Row(str(submission_path), name, 0, 0, 0.0, "missing", "not a notebook") for name in wanted]
    cells, missing = plan_for(assignment, submission)
    reports, timed_out, killed_by = _run_plan(cells, limits, level or containment(limits), slot, hide)
    # never reached, or begun and cut off: the time ran out, a limit killed the process, or it died
    unfinished = "timeout" if timed_out else "stopped" if killed_by else "error"
    unfinished_detail = (f"past {limits.submission_timeout_s:g} s" if timed_out else killed_by
                         or "the process ended before this exercise's result")
    outcome: dict[str, dict] = {}
    output_chars = 0
    for report in reports:
        if "exercise" in report:
            outcome[report["exercise"]] = report
        output_chars = report.get("output_chars", output_chars)
    sources = {cell["exercise"]: cell["source"] for cell in cells if cell["role"] == "solution"}
    flood = f"; output cut at {limits.output_limit_chars} of {output_chars} characters" \
        if output_chars > limits.output_limit_chars else ""
    rows = []
    for name, exercise in wanted.items():
        report = outcome.get(name, {"status": unfinished, "detail": unfinished_detail})
        status = "missing" if name in missing else report["status"]
        detail = "no exercise cell" if name in missing else report.get("detail") or ""
        if status == "started":
            status, detail = unfinished, unfinished_detail
        if status == "ok" and reference_use.answers_used(name, sources.get(name, "")):
            status, detail = "reference", "uses the package's own answer"
        passed, total = int(report.get("passed", 0)), int(report.get("total", 0))
        points = round(exercise.points * passed / total, 4) if status == "ok" and total else 0.0
        rows.append(Row(str(submission_path), name, passed, total, points, status, (detail + flood)[:300]))
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


def hidden_folders(submission_paths: list[Path], csv_path: Path) -> tuple[str, ...]:
    """Folders a submission's run must not see (namespaces): the submissions' and the grades'.
    A folder that holds the package or the interpreter cannot be hidden whole and stays visible."""
    needed = [Path(p).resolve() for p in (sys.prefix, sys.base_prefix)] + [Path(__file__).resolve().parent]
    folders = {p.resolve().parent for p in submission_paths} | {csv_path.resolve().parent}
    return tuple(sorted(str(f) for f in folders if not any(n.is_relative_to(f) for n in needed)))


def grade(assignment_path: Path, submission_paths: list[Path], csv_path: Path,
          limits: Limits = Limits(), progress=None, jobs: int | None = None) -> list[Row]:
    """Grade every submission, `jobs` at a time (default: the cores here), and write the CSV in the
    order given; bad submission paths get 'missing' rows."""
    assignment = notebooks.read(assignment_path)
    if not notebooks.exercises(assignment):
        raise notebooks.NotANotebook(f"{assignment_path}: has no exercises to grade")
    jobs = jobs or os.cpu_count() or 1
    if not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs must be a whole number >= 1; got {jobs!r}")
    csv_path.parent.mkdir(parents=True, exist_ok=True)  # before the grading, not after it
    level, hide = containment(limits), hidden_folders(submission_paths, csv_path)
    slots: queue.Queue[int] = queue.Queue()
    for slot in range(jobs):
        slots.put(slot)

    def one(path: Path) -> list[Row]:
        slot = slots.get()
        try:
            started = time.perf_counter()
            rows = grade_one(assignment, path, limits, level, slot, hide)
            if progress:
                progress(path, time.perf_counter() - started)
            return rows
        finally:
            slots.put(slot)

    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        rows = [row for graded in pool.map(one, submission_paths) for row in graded]
    write_csv(rows, csv_path)
    return rows


def write_csv(rows: list[Row], csv_path: Path) -> None:
    with open(csv_path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(COLUMNS)
        for row in rows:
            writer.writerow([getattr(row, column) for column in COLUMNS])
