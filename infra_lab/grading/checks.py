"""Seeded property checks of a student's function against the reference implementation.

Each check draws random cases from a generator seeded by the check's name, calls the student's
function and then the reference on copies of the same arguments, and compares the results (a
case whose call raises fails without the reference's run). The printed line is deterministic,
so a notebook can keep it as the cell's expected output.
A check named "chNN.exercise" is registered by the chapter module infra_lab/grading/chNN.py,
found by name and imported the first time one of its checks is asked for.
"""
from __future__ import annotations

import copy
import importlib
import importlib.util
import math
import pkgutil
import re
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Check:
    name: str  # "chNN.exercise"
    reference: Callable
    draw_case: Callable[[np.random.Generator], tuple]  # one tuple of positional arguments
    n_cases: int = 24
    rtol: float = 1e-6
    atol: float = 1e-9
    drive: Callable | None = None  # drive(obj, *case) -> result, for classes and stateful exercises


@dataclass(frozen=True)
class CheckResult:
    name: str
    passed: int
    total: int
    first_failure: str | None

    @property
    def line(self) -> str:
        verdict = "PASS" if self.passed == self.total else "FAIL"
        tail = f": {self.first_failure}" if self.first_failure else ""
        return f"{verdict} {self.name} {self.passed}/{self.total}{tail}"


_REGISTRY: dict[str, Check] = {}
_RESULTS: list[CheckResult] = []
CHAPTER_PACKAGE = "infra_lab.grading"  # where the chapter modules chNN.py that register checks live
_CHAPTER_NAME = re.compile(r"ch\d\d")


def register(spec: Check) -> Check:
    _REGISTRY[spec.name] = spec
    return spec


def chapter_modules(package: str = CHAPTER_PACKAGE) -> list[str]:
    """Names of the chapter modules (chNN) in `package`, in chapter order."""
    found = pkgutil.iter_modules(importlib.import_module(package).__path__)
    return sorted(module.name for module in found if _CHAPTER_NAME.fullmatch(module.name))


def _load_chapter(chapter: str, package: str) -> bool:
    """Import `package.chapter` so that its checks register; False if there is no such module."""
    if not _CHAPTER_NAME.fullmatch(chapter):
        return False
    module = f"{package}.{chapter}"
    if importlib.util.find_spec(module) is None:
        return False
    importlib.import_module(module)
    return True


def known_checks(package: str = CHAPTER_PACKAGE) -> list[str]:
    """Every check name, after importing each chapter module of `package`."""
    for chapter in chapter_modules(package):
        _load_chapter(chapter, package)
    return sorted(_REGISTRY)


def _lookup(name: str, package: str = CHAPTER_PACKAGE) -> Check:
    """The check called `name` ("chNN.exercise"), importing its chapter module from `package`."""
    chapter = name.split(".")[0]
    has_module = _load_chapter(chapter, package)
    if name not in _REGISTRY:
        raise KeyError(_unknown_check_message(name, chapter, has_module, package))
    return _REGISTRY[name]


def _unknown_check_message(name: str, chapter: str, has_module: bool, package: str) -> str:
    if not _CHAPTER_NAME.fullmatch(chapter):
        why = f": {chapter!r} is not a chapter (names look like ch03.Allocator)"
    elif not has_module:
        why = f": {package} has no module {chapter} (chapters: {', '.join(chapter_modules(package))})"
    else:
        why = ""
    return f"no check named {name!r}{why}; known checks: {', '.join(known_checks(package))}"


def short_repr(value: object, limit: int = 120) -> str:
    """A deterministic, bounded repr: floats to 6 significant digits, long sequences cut."""
    if isinstance(value, (float, np.floating)):
        text = "nan" if math.isnan(value) else f"{float(value):.6g}"
    elif isinstance(value, np.ndarray):
        text = f"array(shape={value.shape}, dtype={value.dtype})"
    elif isinstance(value, tuple):
        text = "(" + ", ".join(short_repr(item, limit) for item in value) + ("," if len(value) == 1 else "") + ")"
    elif isinstance(value, list):
        shown = ", ".join(short_repr(item, limit) for item in value[:6])
        text = f"[{shown}{', ...' if len(value) > 6 else ''}]"
    elif isinstance(value, (int, str, bool, type(None), np.integer)):
        text = repr(value)
    else:
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _close(expected: object, got: object, spec: Check) -> bool:
    if isinstance(expected, (str, type(None), dict)):
        return type(got) is type(expected) and got == expected
    if isinstance(expected, (tuple, list)):
        if not isinstance(got, (tuple, list, np.ndarray)) or len(got) != len(expected):
            return False
        return all(_close(e, g, spec) for e, g in zip(expected, got))
    try:
        expected_array = np.asarray(expected, dtype=float)
        got_array = np.asarray(got, dtype=float)
    except (TypeError, ValueError):
        return False
    if expected_array.shape != got_array.shape:
        return False
    return bool(np.allclose(got_array, expected_array, rtol=spec.rtol, atol=spec.atol, equal_nan=True))


def _difference(expected: object, got: object, spec: Check) -> str:
    """Where the first mismatch lies, for the failure line: the path of item numbers down to it,
    and the values there (for equal-shaped arrays, the largest gap)."""
    path: list[str] = []  # "[i]", with the entry's label when it starts with one (a drive's step)
    while isinstance(expected, (tuple, list)) and isinstance(got, (tuple, list)):
        common = min(len(expected), len(got))
        first = next((i for i in range(common) if not _close(expected[i], got[i], spec)), None)
        if first is None:
            if len(expected) == len(got):
                return ""
            return f"; item {''.join(path) or '[]'} has {len(got)} entries, expected {len(expected)}"
        expected, got = expected[first], got[first]
        labelled = isinstance(expected, (tuple, list)) and expected and isinstance(expected[0], str)
        path.append(f"[{first}] ({expected[0]})" if labelled else f"[{first}]")
    where = "item " + "".join(path)
    try:
        e, g = np.asarray(expected, dtype=float), np.asarray(got, dtype=float)
    except (TypeError, ValueError):
        e = g = None
    if e is not None and e.shape == g.shape and e.size >= 2:
        gap = np.abs(np.nan_to_num(e - g, nan=np.inf))
        worst = np.unravel_index(int(np.argmax(gap)), gap.shape)
        return (f"; {where if path else 'result'} largest gap at index {tuple(int(i) for i in worst)}: "
                f"got {short_repr(g[worst])}, expected {short_repr(e[worst])}")
    if path:
        return f"; first difference at {where}: got {short_repr(got)}, expected {short_repr(expected)}"
    return ""


def _run(spec: Check, candidate: object) -> CheckResult:
    if not callable(candidate):
        return CheckResult(spec.name, 0, spec.n_cases,
                           f"expected a function, got {type(candidate).__name__}")
    rng = np.random.default_rng(zlib.crc32(spec.name.encode()))
    cases: Sequence[tuple] = [spec.draw_case(rng) for _ in range(spec.n_cases)]
    function_name = spec.name.split(".", 1)[1]
    passed, first_failure = 0, None
    run = (lambda obj, case: spec.drive(obj, *case)) if spec.drive else (lambda obj, case: obj(*case))
    for args in cases:
        call = f"{function_name}{short_repr(tuple(args), 100)}"
        # the candidate first: a case it fails by raising needs no expected value, so a fresh
        # exercise costs none of the references' time (real servers, replays, training)
        try:
            got = run(candidate, copy.deepcopy(args))
        except Exception as error:  # the student's bug is the finding, not a crash
            failure = f"{call} raised {type(error).__name__}: {error}"
        else:
            expected = run(spec.reference, copy.deepcopy(args))
            if _close(expected, got, spec):
                passed += 1
                continue
            failure = (f"{call} returned {short_repr(got, 80)}, expected {short_repr(expected, 80)}"
                       + _difference(expected, got, spec))
        first_failure = first_failure or failure.splitlines()[0][:600]
    return CheckResult(spec.name, passed, spec.n_cases, first_failure)


def cases(name: str) -> int:
    """How many cases the check for exercise `name` runs (24 unless a check says fewer)."""
    return _lookup(name).n_cases


def check(name: str, candidate: object) -> None:
    """Check `candidate` against the reference for exercise `name` and print one line."""
    result = _run(_lookup(name), candidate)
    _RESULTS.append(result)
    print(result.line)


def results() -> list[CheckResult]:
    """Every check run in this process, in order (the grader reads these)."""
    return list(_RESULTS)
