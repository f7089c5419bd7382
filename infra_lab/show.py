"""Show the real code: render the source of an infra_lab function or class, highlighted.

Chapters never paste code that lives in the package; they call `show(obj)`, so what the reader
sees is exactly what the tests test. A listing longer than FOLD_LINES is folded: the page shows
the lines that carry the idea (`lines=(first text, last text)`) and keeps the whole listing behind
a click. The HTML uses inline styles and wraps long lines, so it renders the same in Jupyter, on
Colab and on the static site, and never runs past the page's edge.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, replace
from pathlib import Path

from pygments import highlight
from pygments.formatters import HtmlFormatter
from pygments.lexers import PythonLexer

PACKAGE_ROOT = Path(__file__).resolve().parent
FOLD_LINES = 30


@dataclass(frozen=True)
class Source:
    code: str
    path: str  # relative to the repository, e.g. "infra_lab/backend.py"
    first_line: int

    @property
    def last_line(self) -> int:
        return self.first_line + self.code.count("\n") - (1 if self.code.endswith("\n") else 0)

    @property
    def title(self) -> str:
        return f"{self.path}, lines {self.first_line}\u2013{self.last_line}"

    def __repr__(self) -> str:  # plain text: terminals and text-only renderers
        return f"# {self.title}\n{self.code}"

    def excerpt(self, first_text: str, last_text: str) -> Source:
        """The lines from the first containing `first_text` to the next containing `last_text`."""
        lines = self.code.splitlines(keepends=True)
        start = next((i for i, line in enumerate(lines) if first_text in line), None)
        if start is None:
            raise ValueError(f"{self.title}: no line contains {first_text!r}")
        end = next((i for i in range(start, len(lines)) if last_text in lines[i]), None)
        if end is None:
            raise ValueError(f"{self.title}: no line from {start + self.first_line} on "
                             f"contains {last_text!r}")
        return replace(self, code="".join(lines[start:end + 1]),
                       first_line=self.first_line + start)

    def _repr_html_(self) -> str:
        return _listing_html(self.title, self.code)


@dataclass(frozen=True)
class Folded:
    """A long listing: the excerpt that carries the idea, and the whole of it behind a click."""

    whole: Source
    shown: Source | None  # None: nothing is picked, the whole listing is folded

    @property
    def code(self) -> str:
        return self.whole.code

    def __repr__(self) -> str:
        return repr(self.shown or self.whole)

    def _repr_html_(self) -> str:
        count = self.whole.code.count("\n") + (not self.whole.code.endswith("\n"))
        top = "" if self.shown is None else _listing_html(self.shown.title, self.shown.code)
        return (f"{top}<details class=\"infra-lab-fold\"><summary>All {count} lines of "
                f"{self.whole.title}</summary>{self.whole._repr_html_()}</details>")


def _listing_html(title: str, code: str) -> str:
    """Highlighted code whose long lines wrap under their own indent plus four columns, so a
    wrapped line still reads as Python (a hanging indent per line; no horizontal scroll)."""
    formatter = HtmlFormatter(noclasses=True, nowrap=False, style="default", linespans="L",
                              prestyles="white-space:pre-wrap;overflow-wrap:anywhere")
    body = highlight(code, PythonLexer(), formatter)
    for number, line in enumerate(code.splitlines(), start=1):
        hang = len(line) - len(line.lstrip(" ")) + 4  # columns
        body = body.replace(f'<span id="L-{number}">',
                            f'<span style="display:block;padding-left:{hang}ch;'
                            f'text-indent:-{hang}ch">', 1)
    return (
        '<div class="infra-lab-source" style="border:1px solid #ddd;border-radius:4px;'
        'margin:0.5em 0">'
        '<div style="font-family:monospace;font-size:85%;padding:2px 8px;'
        f'background:#f3f3f3;border-bottom:1px solid #ddd">{title}</div>'
        f'<div style="padding:0 8px">{body}</div></div>'
    )


def source_of(obj: object) -> Source:
    """The source of an infra_lab module, class or function, with where it lives."""
    # numba dispatchers (py_func), Triton kernels (fn) and functools caches (__wrapped__) wrap it
    target = inspect.unwrap(getattr(obj, "py_func", None) or getattr(obj, "fn", None) or obj)
    try:
        path = Path(inspect.getsourcefile(target) or "").resolve()
        lines, first_line = inspect.getsourcelines(target)
    except (TypeError, OSError):
        raise TypeError(
            f"show() needs an infra_lab module, class or function with Python source; "
            f"got {obj!r} of type {type(obj).__name__}"
        ) from None
    if PACKAGE_ROOT not in path.parents:
        raise ValueError(
            f"show() displays infra_lab code only; {getattr(obj, '__qualname__', obj)!r} "
            f"lives in {path.name}"
        )
    relative = path.relative_to(PACKAGE_ROOT.parent).as_posix()
    return Source("".join(lines), relative, max(first_line, 1))


def show(obj: object, lines: tuple[str, str] | None = None) -> Source | Folded:
    """Display the highlighted source of `obj`; the notebook renders the returned value.

    `lines=(first text, last text)` picks the lines that carry the idea out of a long listing;
    the whole listing then folds under them. A listing over FOLD_LINES lines with no pick is
    folded whole.
    """
    whole = source_of(obj)
    if lines is not None:
        return Folded(whole, whole.excerpt(*lines))
    if whole.last_line - whole.first_line + 1 > FOLD_LINES:
        return Folded(whole, None)
    return whole
