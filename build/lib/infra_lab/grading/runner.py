"""Run one merged submission, cell by cell, in this (separate) process.

The grader starts `python -m infra_lab.grading.runner PLAN.json RESULTS.jsonl` in a process
group of its own and kills the group when the submission's time runs out. Here each cell gets
a time limit of its own (an alarm raises inside the student's code), output is capped so a
flood cannot fill memory, and every exercise's outcome is appended to RESULTS.jsonl as soon as
it is known, so a later hang cannot erase earlier results.
"""
from __future__ import annotations

import json
import signal
import sys
from pathlib import Path


class CellTimeout(BaseException):
    """Raised inside a cell that ran past its limit (BaseException: `except Exception` in
    student code cannot swallow it)."""


class CappedStream:
    """A text stream that keeps the first `limit` characters and counts the rest."""

    def __init__(self, limit: int) -> None:
        self.limit, self.kept, self.dropped = limit, [], 0
        self.size = 0

    def write(self, text: str) -> int:
        room = self.limit - self.size
        if room > 0:
            self.kept.append(text[:room])
            self.size += min(room, len(text))
        self.dropped += max(0, len(text) - max(room, 0))
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


def _alarm(signum, frame):
    raise CellTimeout()


def run(plan_path: Path, results_path: Path) -> None:
    plan = json.loads(plan_path.read_text(encoding="utf-8"))
    results = results_path.open("a", encoding="utf-8")

    def report(**row) -> None:
        results.write(json.dumps(row) + "\n")
        results.flush()

    output = CappedStream(plan["output_limit"])
    sys.stdout = sys.stderr = output
    from IPython.core.interactiveshell import InteractiveShell

    from infra_lab.grading import checks

    shell = InteractiveShell.instance(colors="nocolor")
    signal.signal(signal.SIGALRM, _alarm)
    failed: set[str] = set()

    def run_cell(source: str) -> str:
        signal.setitimer(signal.ITIMER_REAL, plan["cell_timeout_s"])
        try:
            outcome = shell.run_cell(source, store_history=False)
        except CellTimeout:  # raised outside the cell's own frames
            return "timeout"
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        if isinstance(outcome.error_in_exec, CellTimeout):
            return "timeout"
        return "ok" if outcome.success else "error"

    for cell in plan["cells"]:
        role, exercise = cell["role"], cell.get("exercise")
        if role == "context":
            run_cell(cell["source"])
        elif role == "solution":
            report(exercise=exercise, status="started")
            status = run_cell(cell["source"])
            if status != "ok":
                failed.add(exercise)
                report(exercise=exercise, status=status, passed=0)
        elif role == "check" and exercise not in failed:
            before = len(checks.results())
            status = run_cell(cell["source"])
            new = [r for r in checks.results()[before:] if r.name == exercise]
            if status == "ok" and new:
                report(exercise=exercise, status="ok", passed=new[-1].passed, total=new[-1].total)
            else:
                report(exercise=exercise, status="error" if status == "ok" else status, passed=0)
    report(done=True, output_chars=output.size + output.dropped)
    results.close()


if __name__ == "__main__":
    run(Path(sys.argv[1]), Path(sys.argv[2]))
