"""The class report: pass rates, the most common failing case, and who was stopped, from rows
made by hand (the grader's own runs are in test_grader.py)."""
from html.parser import HTMLParser

from infra_lab.grading import report
from infra_lab.grading.grade import Row


class Cells(HTMLParser):
    """Every table cell's text, row by row."""

    def __init__(self):
        super().__init__()
        self.rows, self._cell = [], None

    def handle_starttag(self, tag, attrs):
        if tag == "tr":
            self.rows.append([])
        elif tag in ("td", "th"):
            self._cell = ""

    def handle_endtag(self, tag):
        if tag in ("td", "th"):
            self.rows[-1].append(self._cell)
            self._cell = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell += data


def rows_of(exercise, *graded):
    return [Row(f"s{i}.ipynb", exercise, passed, 24, passed / 24, status, detail)
            for i, (passed, status, detail) in enumerate(graded)]


CLASS = (rows_of("ch00.a", (24, "ok", ""), (24, "ok", ""), (3, "ok", "f(1, 2) returned 3, expected 4"),
                 (0, "ok", "f(1, 2) raised ZeroDivisionError: division by zero"),
                 (5, "ok", "f(0, 0) returned 1, expected 0"))
         + rows_of("ch00.b", (24, "ok", ""), (0, "timeout", "past 300 s"),
                   (0, "stopped", "memory limit: MemoryError: "), (0, "error", "NameError: name 'x' is not defined"),
                   (0, "missing", "no exercise cell")))


def test_the_summary_counts_full_some_and_no_points_and_finds_the_commonest_failing_call():
    s = report.exercise_summary([r for r in CLASS if r.exercise == "ch00.a"])
    assert (s["submissions"], s["full"], s["partial"], s["none"]) == (5, 2, 2, 1)
    assert (s["common_failure"], s["failing"]) == ("f(1, 2)", 2)
    assert s["statuses"] == {"ok": 5}
    b = report.exercise_summary([r for r in CLASS if r.exercise == "ch00.b"])
    assert (b["full"], b["none"], b["failing"]) == (1, 4, 0)
    assert b["statuses"] == {"ok": 1, "timeout": 1, "stopped": 1, "error": 1, "missing": 1}


def test_the_page_has_a_row_per_exercise_and_lists_the_stopped_and_timed_out():
    page = report.render(list(CLASS), "ch00_stack.ipynb", "limits only")
    tables = Cells()
    tables.feed(page)
    exercises = [row for row in tables.rows if row and row[0] in ("ch00.a", "ch00.b")]
    mean_a = f"{sum(r.points for r in CLASS[:5]) / 5:.2f}"
    assert [row[:5] for row in exercises] == [["ch00.a", "40% (2)", "2", "1", mean_a],
                                              ["ch00.b", "20% (1)", "0", "4", "0.20"]]
    assert "f(1, 2) (2 submissions)" in exercises[0][6]
    trouble = [row for row in tables.rows if row and row[0].endswith(".ipynb")]
    assert trouble == [["s1.ipynb", "ch00.b", "timeout", "past 300 s"],
                       ["s2.ipynb", "ch00.b", "stopped", "memory limit: MemoryError: "]]


def test_what_a_student_wrote_is_escaped():
    page = report.render(rows_of("ch00.a", (0, "ok", "<script>alert(1)</script>(1) returned 2, expected 3")),
                         "a<b>.ipynb", "limits")
    assert "<script>" not in page and "&lt;script&gt;" in page and "a&lt;b&gt;.ipynb" in page
