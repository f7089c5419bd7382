"""No exercise's answer is printed on its chapter's page.

The solution notebooks stay off the site, but a page that lists the package's code can print
the very function an exercise asks for. This test reads every code block of each built chapter
page (`_build/html`, as a reader gets it: listings, folded listings and code cells alike) and
each answer written between the solution markers in `solutions/`, and fails where the page
gives the answer away: half or more of its lines (two at least: one line of a two-line answer
can be the formula its statement gives), or a run of RUN lines in a row.

Lines are compared as code, not as text: comments, blank lines, `def` lines, docstrings and
imports drop out and spaces are ignored; a line shorter than SHORT characters then (`else:`,
`return x`) is too common to count.
"""
import os
import re
from pathlib import Path

import pytest
from bs4 import BeautifulSoup

from infra_lab.grading import notebooks

pytestmark = pytest.mark.site
ROOT = Path(__file__).resolve().parent.parent
SITE = Path(os.environ.get("INFRA_LAB_SITE") or ROOT / "_build" / "html").resolve()
SHORT = 12  # characters without spaces: a line shorter than this says nothing on its own
RUN = 4  # this many answer lines in a row on the page are the answer's core
SHARE = 0.5  # the share of the answer's lines that gives it away
KEYWORD_LINE = re.compile(r"(def|class|import|from)\b|@")  # a signature, an import, a decorator
SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))


def code_lines(text: str) -> list[str]:
    """The lines of `text` that carry code, spaces removed; short lines dropped."""
    out, in_docstring = [], False
    for line in text.splitlines():
        stripped = line.strip()
        quotes = next((q for q in ('"""', "'''") if q in stripped), None)
        if in_docstring or (quotes and stripped.startswith(quotes)):
            if quotes and (in_docstring or stripped.count(quotes) == 1):
                in_docstring = not in_docstring
            continue
        code = re.sub(r"\s+", "", stripped.split("#", 1)[0])
        if len(code) < SHORT or KEYWORD_LINE.match(stripped):
            continue
        out.append(code)
    return out


def longest_run(answer: list[str], page: list[str]) -> int:
    """The most answer lines that appear in a row, in the same order, on the page."""
    best = 0
    for i in range(len(answer)):
        for j in range(len(page)):
            k = 0
            while i + k < len(answer) and j + k < len(page) and answer[i + k] == page[j + k]:
                k += 1
            best = max(best, k)
    return best


def given_away(answer: list[str], page: list[str]) -> str | None:
    """Why `page` gives `answer` away, or None when it does not."""
    if not answer:
        return None
    shown = set(page)
    matched = sum(line in shown for line in answer)
    share, run = matched / len(answer), longest_run(answer, page)
    if (share >= SHARE and matched >= 2) or run >= RUN:
        return f"{share:.0%} of its {len(answer)} lines are on the page, {run} in a row"
    return None


def answer_text(source: str) -> str:
    """The code between the solution markers of an answer cell."""
    inside, lines = False, []
    for line in source.splitlines():
        if line.strip() == notebooks.BEGIN:
            inside = True
        elif line.strip() == notebooks.END:
            inside = False
        elif inside:
            lines.append(line)
    return "\n".join(lines)


def page_code(html: Path) -> list[str]:
    """Every code line of a built page: each <pre> block, in the page's order."""
    soup = BeautifulSoup(html.read_text(encoding="utf-8"), "html.parser")
    return [line for pre in soup.find_all("pre") for line in code_lines(pre.get_text())]


@pytest.mark.parametrize("solution", SOLUTIONS, ids=lambda p: p.stem)
def test_no_answer_is_printed_on_its_chapter_page(solution):
    html = SITE / "book" / f"{solution.stem}.html"
    if not html.is_file():
        pytest.fail(f"no built page {html}: run `make book` first")
    page = page_code(html)
    assert len(page) > 20, "the page's code blocks were not found"
    notebook = notebooks.read(solution)
    found = notebooks.exercises(notebook)
    assert found, f"{solution.name} has no exercises"
    leaks = {}
    for name, exercise in found.items():
        why = given_away(code_lines(answer_text(notebook.cells[exercise.solution_index].source)), page)
        if why:
            leaks[name] = why
    assert not leaks, leaks


def test_the_detector_finds_a_copied_answer_and_passes_a_different_one():
    answer = code_lines('''
def evict(cache, n_tokens):
    """Free at least n_tokens,
    the least recently used leaves first."""
    if n_tokens < 0:  # nothing to free
        raise ValueError(f"cannot evict {n_tokens} tokens")
    leaves = [node for node in cache.nodes() if not node.children]
    leaves.sort(key=lambda node: node.last_access)
    freed = 0
    while freed < n_tokens and leaves:
        leaf = leaves.pop(0)
        freed += cache.remove(leaf)
        parent = leaf.parent
        if parent is not cache.root and not parent.children:
            leaves.append(parent)
            leaves.sort(key=lambda node: node.last_access)
    return freed
''')
    # the def, the docstring, the comment, `freed = 0`, `return freed` drop out
    assert len(answer) == 11 and answer[0] == "ifn_tokens<0:"
    assert code_lines("defaults = dict(a=1)\nfrom_cache = load(key)") == [
        "defaults=dict(a=1)", "from_cache=load(key)"]  # names that begin like keywords stay
    copied = code_lines("x = 1\n" + "\n".join(answer) + "\nprint(  x  )")
    assert given_away(answer, copied)
    run_of_four = code_lines("leaves = [node for node in cache.nodes() if not node.children]\n"
                             "leaves.sort(key=lambda node: node.last_access)\n"
                             "while freed < n_tokens and leaves:\n"
                             "    leaf = leaves.pop(0)\n")
    assert given_away(answer, run_of_four)  # 4 of 11 lines, in a row
    scattered = run_of_four[:3] + ["print(leaf)"] + run_of_four[3:]
    assert given_away(answer, scattered) is None  # 4 of 11, at most 3 in a row
    other = code_lines("order = sorted(cache.nodes(), key=lambda node: -node.last_access)\n"
                       "if n_tokens < 0:\n    raise ValueError(f'cannot evict {n_tokens} tokens')\n")
    assert given_away(answer, other) is None  # two lines any evict would have are no answer
    formula = code_lines("return expected_tokens(alpha, gamma) / (gamma * c + 1)\n"
                         "return max(range(1, max_gamma + 1), key=speedup)")
    assert given_away(formula, formula[:1]) is None  # the one line the statement gives
    assert given_away(formula, formula)
