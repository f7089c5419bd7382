"""The appendix page's tables, as Markdown, built from the registry: each entry's claim, source, published
value, our figure with its machine and date, the verdict where a chapter judges one, and the chapter's link."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

from infra_lab import verdict
from infra_lab.book import REPO_ROOT
from infra_lab.claims import hardware_table
from infra_lab.claims.entry import BUILT, Entry, Figure

BOOK = REPO_ROOT / "book"
ELSEWHERE = "its committed run is in the repository's benchmarks/results/, not at hand here"
TERA, GIGA = 1e12, 1e9


def chapter_stems(book: Path = BOOK) -> dict[str, str]:
    """{"07": "ch07_speculative", ...}: the chapter notebooks in `book` (none for a pip install)."""
    return {path.stem[2:4]: path.stem for path in sorted(book.glob("ch[0-9][0-9]_*.ipynb"))}


def chapter_link(chapter: str, stems: dict[str, str]) -> str:
    if not chapter:
        return "none"
    return f"[{chapter}]({stems[chapter]}.ipynb)" if chapter in stems else chapter


def figures_of(entries: list[Entry]) -> dict[str, Figure | None]:
    """Each entry's figure, computed once; None where it cannot be measured here or its run is not at hand."""
    return {entry.key: entry.ours() if entry.ours else None for entry in entries}


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def source_cell(entry: Entry) -> str:
    if entry.source in verdict.ARTICLES:
        return f"article {entry.source}"
    return f"[{cell(entry.source)}]({entry.links[0]})" if entry.links else cell(entry.source)


def ours_cell(entry: Entry, figure: Figure | None) -> str:
    if entry.ours is None:
        return f"not measurable here: {cell(entry.not_here)}"
    if figure is None:
        return ELSEWHERE
    if figure.how == BUILT:
        return f"{cell(figure.text)} (computed when this page was built)"
    return f"{cell(figure.text)} ({figure.machine}, {figure.measured_on})"


def verdict_cell(figure: Figure | None) -> str:
    """"Verdict: holds (target: at least 2.00×)" where the figure judges a claim, else a dash."""
    if figure is None or figure.claim is None:
        return "–"
    claim = figure.claim
    return f"Verdict: {figure.verdict()} (target: {claim.direction} {claim.figure(claim.target)})"


def is_article(entry: Entry) -> bool:
    return entry.source in verdict.ARTICLES


def is_target(entry: Entry) -> bool:
    return entry.source.startswith("this book's target")


def table(entries: list[Entry], figures: dict[str, Figure | None], stems: dict[str, str]) -> str:
    # the source last: at the page's width a wide table scrolls sideways, and the claim, the numbers
    # and the verdict are what a reader must see without scrolling
    rows = ["| chapter | claim | published | verdict | ours | source |", "|---|---|---|---|---|---|"]
    rows += [f"| {chapter_link(e.chapter, stems)} | {cell(e.claim)} | {cell(e.published)} | "
             f"{verdict_cell(figures[e.key])} | {ours_cell(e, figures[e.key])} | {source_cell(e)} |" for e in entries]
    return "\n".join(rows)


def stated(entry: Entry, figure: Figure | None) -> str:
    """The chapter's own words for a claim it judges (its verdict.Claim's statement), else the entry's."""
    return figure.claim.statement if figure is not None and figure.claim is not None else entry.claim


def targets_table(entries: list[Entry], figures: dict[str, Figure | None], stems: dict[str, str]) -> str:
    rows = ["| chapter | the chapter's claim | verdict | ours | set by |", "|---|---|---|---|---|"]
    rows += [f"| {chapter_link(e.chapter, stems)} | {cell(stated(e, figures[e.key]))} | "
             f"{verdict_cell(figures[e.key])} | {ours_cell(e, figures[e.key])} | {cell(e.source)} |" for e in entries]
    return "\n".join(rows)


def tally(figures: dict[str, Figure | None]) -> Counter:
    """How many figures judge a claim with each of verdict.VERDICTS."""
    return Counter(f.verdict() for f in figures.values() if f is not None and f.claim is not None)


def runs(figures: dict[str, Figure | None]) -> str:
    """The committed runs our figures come from: machine, date, command, and how many rows each gives."""
    found = Counter((f.machine, f.measured_on, f.how) for f in figures.values() if f is not None and f.how != BUILT)
    rows = ["| machine | measured on | command | rows |", "|---|---|---|---:|"]
    rows += [f"| {machine} | {date} | `{command}` | {n} |" for (machine, date, command), n in sorted(
        found.items(), key=lambda item: (item[0][1], item[0][2]))]
    return "\n".join(rows)


def number(value: float | None, scale: float, digits: int) -> str:
    return "–" if value is None else f"{value / scale:,.{digits}f}"


def gpu_table() -> str:
    """The accelerators' datasheets, then what the book's probes measured on an H200."""
    rows = ["| device | bf16 TFLOP/s | fp8 TFLOP/s | fp32 TFLOP/s | memory TB/s | memory GB | source |",
            "|---|---:|---:|---:|---:|---:|---|"]
    for row in hardware_table.datasheet_rows() + hardware_table.gpu_rows():
        rate = row.flops.get
        bandwidth = number(row.bandwidth, TERA, 2) + ("" if row.roof == "datasheet" else f" ({row.roof})")
        rows.append(f"| {row.device} | {number(rate('bf16'), TERA, 0)} | {number(rate('fp8'), TERA, 0)} | "
                    f"{number(rate('fp32'), TERA, 1)} | {bandwidth} | {number(row.memory_bytes, GIGA, 0)} | "
                    f"{cell(row.source)} |")
    return "\n".join(rows)


def cpu_table(rows: list[hardware_table.Row]) -> str:
    """The CPUs' figures: no datasheet applies (hardware_table.NO_CPU_DATASHEET), so what probes measured."""
    lines = ["| CPU | fp32 GFLOP/s | fp64 GFLOP/s | memory GB/s | source |", "|---|---:|---:|---:|---|"]
    for row in rows:
        bandwidth = "–" if row.bandwidth is None else f"{row.bandwidth / GIGA:,.1f} ({row.roof})"
        lines.append(f"| {row.device} | {number(row.flops.get('fp32'), GIGA, 0)} | "
                     f"{number(row.flops.get('fp64'), GIGA, 0)} | {bandwidth} | {cell(row.source)} |")
    return "\n".join(lines)
