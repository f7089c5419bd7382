"""One row of the appendix: a published number or claim (`Entry`) and our figure beside it
(`Figure`), with the helpers that build a figure from a committed run or from arithmetic done
when the page is built."""
from __future__ import annotations

import datetime
import re
from dataclasses import dataclass
from typing import Callable

from infra_lab import measured, verdict

BUILT = "computed when this page is built"  # `how` of a figure the page computes itself
ARITHMETIC = "arithmetic on published shapes and datasheets"  # its `machine`: no timing involved
CHAPTER = re.compile(r"[0-9]{2}")


@dataclass(frozen=True)
class Figure:
    """Our figure for an entry: its value as the page prints it, and where it comes from."""
    text: str  # "1.15× (median of 3 rounds; 95% interval 1.13× to 1.21×)"
    machine: str  # "AMD EPYC, 2 threads", or ARITHMETIC
    measured_on: str  # ISO date of the run, or of the build for a figure computed at build
    how: str  # the command that measured it, or BUILT
    claim: verdict.Claim | None = None  # the chapter's claim, where the chapter judges one
    found: verdict.Evidence | None = None  # the evidence it is judged on

    def __post_init__(self):
        if not self.text or not self.machine or not self.how:
            raise ValueError(f"a figure needs its text, machine and how; got {self!r}")
        datetime.date.fromisoformat(self.measured_on)
        if (self.claim is None) != (self.found is None):
            raise ValueError("a judged figure needs both its claim and its evidence")

    def verdict(self) -> str | None:
        """One of verdict.VERDICTS where the figure judges a claim, else None."""
        if self.claim is None:
            return None
        return verdict.judge(self.claim, self.found.low, self.found.high)


@dataclass(frozen=True)
class Entry:
    """A published number or claim that a chapter cites, and how we get ours."""
    key: str  # unique: "07.speculative-2-3x"
    chapter: str  # the chapter that tests it, "07"; "" where none can
    claim: str  # the claim in its own words
    source: str  # "A", "B" or "C" (verdict.ARTICLES), or "Kwon et al., SOSP 2023, Figure 2"
    published: str  # the published value as the source gives it: "20.4% to 38.2%"
    ours: Callable[[], Figure | None] | None = None  # None where it cannot be measured here
    not_here: str = ""  # why it cannot be measured here, where `ours` is None
    links: tuple[str, ...] = ()  # the papers' addresses, as the chapters cite them

    def __post_init__(self):
        if not self.key.startswith(f"{self.chapter or 'none'}."):
            raise ValueError(f"an entry's key starts with its chapter: {self.key!r}, {self.chapter!r}")
        if self.chapter and not CHAPTER.fullmatch(self.chapter):
            raise ValueError(f"a chapter is two digits, like '07'; got {self.chapter!r}")
        if (self.ours is None) == (not self.not_here):
            raise ValueError(f"{self.key}: give either `ours` or the reason it cannot be measured here")
        if not (self.claim and self.source and self.published):
            raise ValueError(f"{self.key}: an entry needs its claim, its source and the published value")


def today() -> str:
    return datetime.date.today().isoformat()


def computed(text: str, machine: str = ARITHMETIC) -> Figure:
    """A figure this page computes when it is built: arithmetic, or a cheap run on this machine."""
    return Figure(text, machine, today(), BUILT)


def committed(results: dict, section: str | None, text: str) -> Figure:
    """A figure read from a committed run (infra_lab.measured), labelled with that run."""
    run = measured.run_of(results, section)
    return Figure(text, run["machine"], run["measured_on"], run["command"])


def interval_text(claim: verdict.Claim, found: verdict.Evidence) -> str:
    if found.low == found.high:
        return f"{claim.figure(found.median)} (one run)"
    return (f"{claim.figure(found.median)} (median; {found.confidence:.0%} interval "
            f"{claim.figure(found.low)} to {claim.figure(found.high)})")


def judged(claim: verdict.Claim, found: verdict.Evidence, note: str = "") -> Figure:
    """The figure of a claim a chapter judges: the evidence's median and interval, its run, and a
    `note` on what the figure measures where the row's own words do not say."""
    text = interval_text(claim, found) + (f": {note}" if note else "")
    return Figure(text, found.machine, found.measured_on, found.command, claim, found)


def section_of(name: str, section: str) -> tuple[dict, dict] | None:
    """(the results file, its `section`) from benchmarks/results/`name`.json, or None where the
    repository is not at hand (a pip install) or the run skipped that section."""
    results = measured.load(name)
    found = (results or {}).get("sections", {}).get(section)
    if not found or "skipped" in found:
        return None
    return results, found
