"""The class report beside the grades' CSV: one HTML page an instructor opens in a browser.

Per exercise: how many submissions scored full marks, some points or none, the mean points, the
statuses, and the most common failing case (the call of the first case a submission failed, as
its check printed it); then every submission that timed out or was stopped, with what stopped it.
"""
from __future__ import annotations

import collections
import html
import re
from pathlib import Path

from infra_lab.grading.grade import Row

_CALL = re.compile(r"^(.*?)\s+(?:returned|raised)\s")  # "f(1, 2) returned 3, expected 4" -> "f(1, 2)"


def failing_case(detail: str) -> str:
    """The failing call named in a row's detail ("f(1, 2) returned 3, expected 4" -> "f(1, 2)")."""
    found = _CALL.match(detail)
    return found.group(1) if found else detail


def exercise_summary(rows: list[Row]) -> dict:
    """{"submissions", "full", "partial", "none", "mean_points", "statuses", "common_failure", "failing"}
    for one exercise's rows."""
    full = sum(1 for r in rows if r.status == "ok" and r.total and r.passed == r.total)
    partial = sum(1 for r in rows if r.status == "ok" and 0 < r.passed < r.total)
    failures = collections.Counter(failing_case(r.detail) for r in rows
                                   if r.status == "ok" and r.passed < r.total and r.detail)
    common, count = failures.most_common(1)[0] if failures else ("", 0)
    return {"submissions": len(rows), "full": full, "partial": partial, "none": len(rows) - full - partial,
            "mean_points": sum(r.points for r in rows) / len(rows) if rows else 0.0,
            "statuses": dict(collections.Counter(r.status for r in rows)),
            "common_failure": common, "failing": count}


def _table(head: list[str], body: list[list[str]]) -> str:
    cells = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    rows = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in body)
    return f"<table><thead><tr>{cells}</tr></thead><tbody>{rows}</tbody></table>"


def render(rows: list[Row], assignment: str, containment: str) -> str:
    """The report's HTML for `rows` (every submission's rows, as grade.grade returns them)."""
    by_exercise: dict[str, list[Row]] = {}
    for row in rows:
        by_exercise.setdefault(row.exercise, []).append(row)
    submissions = list(dict.fromkeys(r.submission for r in rows))
    body = []
    for name, group in by_exercise.items():
        s = exercise_summary(group)
        statuses = ", ".join(f"{k} {v}" for k, v in sorted(s["statuses"].items()))
        common = (f"<code>{html.escape(s['common_failure'][:200])}</code> ({s['failing']} submissions)"
                  if s["failing"] else "")
        body.append([html.escape(name), f"{s['full'] / s['submissions']:.0%} ({s['full']})", str(s["partial"]),
                     str(s["none"]), f"{s['mean_points']:.2f}", html.escape(statuses), common])
    exercises = _table(["exercise", "full marks", "some points", "no points", "mean points", "statuses",
                        "most common failing case"], body)
    stopped = [[html.escape(r.submission), html.escape(r.exercise), html.escape(r.status), html.escape(r.detail)]
               for r in rows if r.status in ("timeout", "stopped")]
    trouble = _table(["submission", "exercise", "status", "what stopped it"], stopped) if stopped \
        else "<p>None: every submission finished within its limits.</p>"
    totals = collections.defaultdict(float)
    for row in rows:
        totals[row.submission] += row.points
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>Grades: {html.escape(assignment)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; max-width: 70em; }}
table {{ border-collapse: collapse; margin: 1em 0; }}
th, td {{ border: 1px solid #ccc; padding: 0.3em 0.6em; text-align: left; vertical-align: top; }}
th {{ background: #f3f3f3; }}
code {{ font-size: 0.9em; }}
</style></head><body>
<h1>Grades: {html.escape(assignment)}</h1>
<p>{len(submissions)} submissions, {len(by_exercise)} exercises; mean total
{sum(totals.values()) / max(1, len(totals)):.2f} points. Each ran contained by
{html.escape(containment)}.</p>
<h2>Exercises</h2>
{exercises}
<h2>Timed out or stopped</h2>
{trouble}
</body></html>
"""


def write(rows: list[Row], path: Path, assignment: str, containment: str) -> None:
    path.write_text(render(rows, assignment, containment), encoding="utf-8")
