"""Verdicts on the articles' claims: one rule for every chapter, from a committed benchmark run.

A claim the book tests ("speculative decoding speeds generation 2 to 3×") comes with a target
(at least 2×) and is judged from a benchmark run kept in benchmarks/results/: the median of its
rounds with a 95% interval for that median, the machine it ran on and the date. The verdict is

- "holds" when the whole interval lies on the target's side,
- "does not hold" when the whole interval lies on the other side,
- "inconclusive here" when the interval straddles the target.

A chapter's live run on the reader's machine is shown beside the verdict with `live`, labelled
with that machine; it never changes the verdict, since one short run cannot narrow the interval.
"""
from __future__ import annotations

import datetime
import math
from dataclasses import dataclass

from infra_lab import backend, measured

VERDICTS = ("holds", "does not hold", "inconclusive here")
DIRECTIONS = ("at least", "at most")
# The three articles whose claims the book tests (original title, then English), by key
ARTICLES = {
    "A": "“AI Infra深度解析：掌握六大核心要素，洞悉技术演进趋势” (AI Infra in depth: six core "
         "elements and where the technology is going)",
    "B": "“行业杂谈 | AI Infra深度解析：从算力底座到智能应用的技术桥梁” (Industry notes: AI Infra in "
         "depth, the bridge from compute to applications)",
    "C": "“拒绝GPU空转！深入解读AI Infra如何榨干硅的算力极限” (No more idle GPUs! How AI Infra squeezes "
         "the last FLOP out of the silicon)",
}


@dataclass(frozen=True)
class Claim:
    """What an article says, and the target a measurement must reach for it to hold."""
    statement: str  # the claim as the page states it: "speculative decoding speeds generation 2 to 3×"
    source: str  # "A", "B" or "C" (ARTICLES), or who set the target: "this book's target for its kernels"
    target: float  # the value the measurement must reach
    direction: str  # "at least" or "at most": which side of the target holds the claim
    unit: str = "×"  # printed after each figure: "×", "%", " ms"
    digits: int = 2  # decimals printed

    def __post_init__(self):
        if self.direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {', '.join(DIRECTIONS)}; got {self.direction!r}")
        if not math.isfinite(self.target):
            raise ValueError(f"the target must be a finite number; got {self.target!r}")
        if not self.statement.strip():
            raise ValueError("a claim needs its statement")

    def sentence(self) -> str:
        """The claim with its source: "The article “…” (…) claims that …", or, for a target the
        book set itself, "This book's target for its kernels: …"."""
        if self.source in ARTICLES:
            return f"The article {ARTICLES[self.source]} claims that {self.statement}."
        return f"{self.source[0].upper() + self.source[1:]}: {self.statement}."

    def figure(self, value: float) -> str:
        if self.unit == "%":
            return f"{100 * value:.{self.digits}f}%"
        return f"{value:.{self.digits}f}{self.unit}"


def median_coverage(rounds: int, confidence: float = 0.95) -> float:
    """How often the interval the benchmarks give for a median of `rounds` values (the k-th
    smallest to the k-th largest, benchmarks/engine_core.py's median_interval) holds the true
    median: 1 - 2 P(Binomial(rounds, 1/2) < k). Below 6 rounds no such interval reaches 95%: 3
    rounds' range holds it 75% of the time."""
    if rounds < 1:
        raise ValueError(f"need at least one round; got {rounds}")
    tail = lambda k: sum(math.comb(rounds, i) for i in range(k)) / 2 ** rounds  # noqa: E731
    k = 0
    while k + 1 <= rounds // 2 and tail(k + 1) <= (1 - confidence) / 2:
        k += 1
    return 1 - 2 * tail(max(k, 1))


@dataclass(frozen=True)
class Evidence:
    """A committed benchmark figure: the median of its rounds and an interval for it."""
    median: float
    low: float
    high: float
    machine: str  # "Intel(R) Xeon(R) Processor, 2 threads"
    measured_on: str  # ISO date
    command: str  # what produced it: "python benchmarks/speculative.py"
    confidence: float = 0.95  # how often such an interval holds the median (median_coverage)

    def __post_init__(self):
        if not all(math.isfinite(x) for x in (self.median, self.low, self.high)):
            raise ValueError(f"a median and its interval must be finite; got {self.median!r} in "
                             f"[{self.low!r}, {self.high!r}]")
        if not self.low <= self.median <= self.high:
            raise ValueError(f"the interval [{self.low!r}, {self.high!r}] must hold its median {self.median!r}")
        if not self.machine or not self.measured_on or not self.command:
            raise ValueError("evidence names its machine, its date and the command that measured it")
        datetime.date.fromisoformat(self.measured_on)  # raises ValueError on a malformed date


def evidence(results: dict, figure: dict, section: str | None = None) -> Evidence:
    """Evidence from a loaded results file (infra_lab.measured.load) and one of its figures: a
    dict with "median" and either "low" and "high" or "interval_95" (the benchmarks' two forms),
    and, where it keeps them, its "rounds" (or "per_round"), whose count sets the interval's
    confidence. Give the `section` of a sectioned benchmark: it may have run on another machine
    than the file's own."""
    if "low" in figure and "high" in figure:
        low, high = figure["low"], figure["high"]
    elif "interval_95" in figure:
        low, high = figure["interval_95"]
    else:
        raise ValueError(f"a figure needs its median and 95% interval ('low' and 'high', or 'interval_95'); "
                         f"got keys {sorted(figure)}")
    rounds = figure.get("rounds", figure.get("per_round"))  # the benchmarks use either name
    confidence = median_coverage(len(rounds)) if rounds else 0.95
    run = measured.run_of(results, section)
    return Evidence(float(figure["median"]), float(low), float(high), run["machine"], run["measured_on"],
                    run["command"], confidence)


def judge(claim: Claim, low: float, high: float) -> str:
    """One of VERDICTS: where the interval [low, high] lies against the claim's target."""
    if not (math.isfinite(low) and math.isfinite(high)) or low > high:
        raise ValueError(f"an interval needs finite low <= high; got [{low!r}, {high!r}]")
    if claim.direction == "at least":
        return "holds" if low >= claim.target else "does not hold" if high < claim.target else "inconclusive here"
    return "holds" if high <= claim.target else "does not hold" if low > claim.target else "inconclusive here"


def verdict(claim: Claim, found: Evidence) -> str:
    """The verdict as a Markdown paragraph: the claim, its source, the target, the benchmark's
    median and interval, and the machine, date and command of the run."""
    said = judge(claim, found.low, found.high)
    spread = ("one run: no interval" if found.low == found.high else
              f"median; {found.confidence:.0%} interval {claim.figure(found.low)} to "
              f"{claim.figure(found.high)}")
    return (f"**Verdict: {said}.** {claim.sentence()} "
            f"Target: {claim.direction} {claim.figure(claim.target)}. The committed benchmark run measured "
            f"{claim.figure(found.median)} ({spread}) on {found.machine}, {found.measured_on} "
            f"(`{found.command}`).")


def one_run(results: dict, value: float, section: str | None = None) -> Evidence:
    """Evidence from a figure measured once (a training run): its interval is the point itself,
    so the verdict is never "inconclusive" and the page says there was one run."""
    run = measured.run_of(results, section)
    return Evidence(float(value), float(value), float(value), run["machine"], run["measured_on"], run["command"])


def live(claim: Claim, value: float, what: str = "this page's live run") -> str:
    """The reader's own figure, labelled with their machine, as a sentence beside the verdict."""
    if not math.isfinite(value):
        raise ValueError(f"a live figure must be finite; got {value!r}")
    return (f"{what[0].upper() + what[1:]} measured {claim.figure(value)} on {backend.machine()}: one "
            "short run, shown for comparison; the verdict rests on the benchmark's interval.")
