"""Run one merged submission, cell by cell, in this (separate) process.

The grader starts `python -m infra_lab.grading.runner PLAN.json RESULTS.jsonl` in a process
group of its own and kills the group when the submission's time runs out. Here each cell gets
a time limit of its own (an alarm raises inside the student's code), output is capped so a
flood cannot fill memory, and every exercise's outcome is appended to RESULTS.jsonl as soon as
it is known, so a later hang cannot erase earlier results. RESULTS.jsonl may be "fd:N", a file
descriptor the containment (infra_lab.grading.contain) opened before the submission's user could.

A cell stopped by a limit (memory, processes, file size, open files, a read-only file system, the
network) is reported as "stopped", naming the limit; so is an exercise whose code edits the checks
module in memory (its functions or its results), which would let it grade itself.
"""
from __future__ import annotations

import errno
import json
import signal
import sys
from pathlib import Path

# errno of an OSError -> the limit or wall that stopped it
STOPPED_BY = {errno.EACCES: "no permission", errno.EPERM: "no permission",
              errno.EAGAIN: "process limit", errno.EFBIG: "file size limit", errno.ENOSPC: "disk space",
              errno.EMFILE: "open files limit", errno.EROFS: "read-only file system",
              errno.ENETUNREACH: "network", errno.EHOSTUNREACH: "network", errno.ENETDOWN: "network"}


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


def stopped_by(error: BaseException | None) -> str | None:
    """The limit an exception shows the cell ran into, or None for an ordinary error."""
    if isinstance(error, MemoryError):
        return "memory limit"
    if isinstance(error, RuntimeError) and "can't start new thread" in str(error):
        return "process limit"
    if isinstance(error, OSError):
        return STOPPED_BY.get(error.errno)
    return None


def _fingerprint(module) -> dict:
    """What a submission must not change in the checks module: each name's object (and code), and
    each registered check's spec (`_REGISTRY` gains checks as chapters load; none may change)."""
    names = {name: (value, getattr(value, "__code__", None)) for name, value in vars(module).items()
             if not name.startswith("__")}
    return names | {f"_REGISTRY[{key!r}]": (spec, None) for key, spec in module._REGISTRY.items()}


def _edited(module, before: dict) -> str | None:
    """What changed since `before`, named; `before` gains the checks registered since."""
    now = _fingerprint(module)
    changed = []
    for name in sorted(before.keys() | now.keys()):
        if name not in before:
            if not name.startswith("_REGISTRY"):  # a check registered since is no edit
                changed.append(name)
        elif name not in now or before[name][0] is not now[name][0] or before[name][1] is not now[name][1]:
            changed.append(name)
    before.update({name: value for name, value in now.items() if name not in before})
    return f"edited the checks (checks.{', checks.'.join(changed)})" if changed else None


def run(plan_path: Path, results_path: Path) -> None:
    plan = json.loads(plan_path.read_text(encoding="utf-8"))
    if plan.get("limits"):  # containment by limits alone: set here, before any student code
        from infra_lab.grading import contain

        contain.set_limits(contain.Budget(**plan["limits"]["budget"]), plan["limits"]["processes"])
    target = str(results_path)
    results = (open(int(target[3:]), "a", encoding="utf-8") if target.startswith("fd:")
               else results_path.open("a", encoding="utf-8"))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a file past the size limit raises EFBIG, not a kill

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
    pristine = _fingerprint(checks)
    results_of = checks.results

    def run_cell(source: str) -> tuple[str, str | None]:
        """("ok" | "error" | "timeout" | "stopped", what stopped it or the error's name)."""
        signal.setitimer(signal.ITIMER_REAL, plan["cell_timeout_s"])
        try:
            outcome = shell.run_cell(source, store_history=False)
        except CellTimeout:  # raised outside the cell's own frames
            return "timeout", None
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        error = outcome.error_in_exec or outcome.error_before_exec
        if isinstance(error, CellTimeout):
            return "timeout", None
        edited = _edited(checks, pristine)
        if edited:
            return "stopped", edited
        limit = stopped_by(error)
        if limit:
            return "stopped", f"{limit}: {type(error).__name__}: {str(error)[:200]}"
        return ("ok", None) if outcome.success else ("error", f"{type(error).__name__}: {str(error)[:200]}")

    for index, cell in enumerate(plan["cells"]):
        role, exercise = cell["role"], cell.get("exercise")
        if role == "context":
            run_cell(cell["source"])
        elif role == "solution":
            report(exercise=exercise, status="started")
            status, detail = run_cell(cell["source"])
            if status != "ok":
                failed.add(exercise)
                report(exercise=exercise, status=status, passed=0, detail=detail)
            if detail and detail.startswith("memory limit"):  # what it holds stays held: nothing else can run
                for later in plan["cells"][index + 1:]:
                    if later["role"] == "solution":
                        report(exercise=later["exercise"], status="stopped", passed=0,
                               detail=f"not run: {exercise} reached the memory limit")
                break
        elif role == "check" and exercise not in failed:
            before = len(results_of())
            status, detail = run_cell(cell["source"])
            new = [r for r in results_of()[before:] if r.name == exercise]
            if status == "ok" and new:
                report(exercise=exercise, status="ok", passed=new[-1].passed, total=new[-1].total,
                       detail=new[-1].first_failure)
            else:
                report(exercise=exercise, status="error" if status == "ok" else status, passed=0,
                       detail=detail or "the check printed no result")
    report(done=True, output_chars=output.size + output.dropped)
    results.close()


if __name__ == "__main__":
    run(Path(sys.argv[1]), Path(sys.argv[2]))
