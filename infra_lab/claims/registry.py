"""All the entries, in the book's order: each chapter's module, then the claims no chapter can test."""
from __future__ import annotations

from infra_lab.claims import ch00, ch01, ch02, ch03, ch04, ch05, ch06, ch07, ch08, ch09, ch10, ch11, untested
from infra_lab.claims.entry import Entry

MODULES = (ch00, ch01, ch02, ch03, ch04, ch05, ch06, ch07, ch08, ch09, ch10, ch11, untested)
ENTRIES: tuple[Entry, ...] = tuple(entry for module in MODULES for entry in module.ENTRIES)
BY_KEY: dict[str, Entry] = {entry.key: entry for entry in ENTRIES}
if len(BY_KEY) != len(ENTRIES):
    raise ValueError("two entries share a key: " + ", ".join(
        sorted({e.key for e in ENTRIES if sum(f.key == e.key for f in ENTRIES) > 1})))


def get(key: str) -> Entry:
    if key not in BY_KEY:
        raise KeyError(f"no entry {key!r}; there are {len(BY_KEY)}, e.g. {', '.join(list(BY_KEY)[:3])}")
    return BY_KEY[key]


def for_chapter(chapter: str) -> list[Entry]:
    """The entries of chapter `chapter` ("07"), or those no chapter tests ("")."""
    return [entry for entry in ENTRIES if entry.chapter == chapter]


def chapters() -> list[str]:
    """The chapters that register entries, in order ("" last: the untested claims)."""
    return sorted({entry.chapter for entry in ENTRIES}, key=lambda c: (c == "", c))
