"""Show the real code: render the source of an infra_lab function or class, highlighted.

Chapters never paste code that lives in the package; they call `show(obj)`, so what the reader
sees is exactly what the tests test. The HTML uses inline styles so it renders the same in
Jupyter, on Colab and on the static site.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path

from pygments import highlight
from pygments.formatters import HtmlFormatter
from pygments.lexers import PythonLexer

PACKAGE_ROOT = Path(__file__).resolve().parent


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

    def _repr_html_(self) -> str:
        formatter = HtmlFormatter(noclasses=True, nowrap=False, style="default")
        body = highlight(self.code, PythonLexer(), formatter)
        return (
            '<div class="infra-lab-source" style="border:1px solid #ddd;border-radius:4px;'
            'margin:0.5em 0">'
            '<div style="font-family:monospace;font-size:85%;padding:2px 8px;'
            f'background:#f3f3f3;border-bottom:1px solid #ddd">{self.title}</div>'
            f'<div style="padding:0 8px;overflow-x:auto">{body}</div></div>'
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


def show(obj: object) -> Source:
    """Display the highlighted source of `obj`; the notebook renders the returned value."""
    return source_of(obj)
