"""The appendix's registry (infra_lab.claims): every claim a chapter judges and every paper a chapter
links has its entry; every entry's figure is computed from the committed runs here; the page lists at
least 40 rows, links each to a chapter that exists, and says nothing a reader cannot know."""
import ast
import json
import re
from pathlib import Path

import pytest
import yaml
from _words import INTERNAL, VERDICT_WORDS

from infra_lab import verdict
from infra_lab.claims import hardware_table, page, registry
from infra_lab.claims.entry import Entry, Figure, computed

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = sorted((ROOT / "book").glob("ch[0-9][0-9]_*.ipynb"))
APPENDIX = ROOT / "book" / "appendix_numbers.ipynb"
PAPER = re.compile(r"https?://(?:arxiv\.org/abs/|doi\.org/|www\.usenix\.org/conference/|proceedings\.)"
                   r"[^\s)\]>\"'`]+")
READING = "## Summary and further reading"
# Papers a chapter links that carry no number for the appendix: (chapter, address) -> why.
NO_NUMBER = {
    # definitions and methods cited in a chapter's text
    ("00", "https://arxiv.org/abs/2309.06180"): "TTFT and TPOT as the vLLM paper defines them",
    ("00", "https://arxiv.org/abs/2401.09670"): "TTFT and TPOT as the DistServe paper defines them",
    ("00", "https://doi.org/10.1145/1498765.1498785"): "the roofline model itself",
    ("01", "https://doi.org/10.1145/1498765.1498785"): "the roofline model itself",
    ("02", "https://arxiv.org/abs/1706.03762"): "attention's definition",
    ("02", "https://arxiv.org/abs/1805.02867"): "the online softmax's merge rule, an identity",
    # further reading only: the chapter quotes no figure from these
    ("01", "https://arxiv.org/abs/2211.05102"): "Pope et al., inference scaling",
    ("02", "https://arxiv.org/abs/2305.13245"): "GQA",
    ("02", "https://arxiv.org/abs/2307.08691"): "FlashAttention-2",
    ("02", "https://arxiv.org/abs/2402.02750"): "KIVI",
    ("04", "https://arxiv.org/abs/2309.06180"): "PagedAttention, chapter 03's subject",
    ("05", "https://arxiv.org/abs/2401.09670"): "DistServe, for goodput's definition",
    ("05", "https://arxiv.org/abs/2403.02310"): "Sarathi-Serve, chunked prefill's paper",
    ("07", "https://arxiv.org/abs/2401.10774"): "Medusa, a drafter the book does not build",
    ("07", "https://arxiv.org/abs/2401.15077"): "EAGLE, a drafter the book does not build",
    ("08", "https://arxiv.org/abs/2208.07339"): "LLM.int8()",
    ("08", "https://arxiv.org/abs/1710.03740"): "mixed-precision training, whose loss scaling the chapter runs",
    ("09", "https://arxiv.org/abs/1701.06538"): "the sparsely-gated MoE layer",
    ("09", "https://arxiv.org/abs/2006.16668"): "GShard",
    ("09", "https://arxiv.org/abs/2202.08906"): "ST-MoE",
    ("10", "https://arxiv.org/abs/1604.06174"): "activation checkpointing's paper",
    ("10", "https://arxiv.org/abs/2006.15704"): "PyTorch Distributed",
    ("10", "https://arxiv.org/abs/2304.11277"): "PyTorch FSDP",
    ("11", "https://arxiv.org/abs/1707.06347"): "PPO",
    ("11", "https://arxiv.org/abs/2107.03374"): "pass@k's estimator",
    ("11", "https://arxiv.org/abs/2409.19256"): "HybridFlow (verl)",
    ("11", "https://arxiv.org/abs/2503.20783"): "Dr. GRPO",
    ("11", "https://arxiv.org/abs/2504.13837"): "pass@k after RL",
    ("11", "https://arxiv.org/abs/2505.24298"): "AReaL",
}


def chapter_of(path: Path) -> str:
    return path.stem[2:4]


def cells(path: Path) -> list[dict]:
    return json.loads(path.read_text(encoding="utf-8"))["cells"]


def code_of(cell: dict) -> str:
    return "\n".join("" if line.lstrip().startswith(("%", "!")) else line  # IPython's magics
                     for line in "".join(cell["source"]).splitlines())


def pattern(node: ast.expr) -> str | None:
    """A regular expression for the strings `node` can build: its constants as they are, each
    formatted value as any text; None where it is no string expression."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return re.escape(node.value)
    if isinstance(node, ast.JoinedStr):
        return "".join(pattern(part) if isinstance(part, ast.Constant) else ".+?" for part in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = pattern(node.left), pattern(node.right)
        return None if left is None or right is None else left + right
    return None


def claims_built(path: Path) -> list[dict]:
    """Each verdict.Claim(...) call in the notebook's code: its statement as a pattern, and its
    source, target and direction where they are constants."""
    found = []
    for cell in cells(path):
        if cell["cell_type"] != "code":
            continue
        for node in ast.walk(ast.parse(code_of(cell))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "Claim"):
                continue
            named = dict(zip(("statement", "source", "target", "direction"), node.args))
            named.update({k.arg: k.value for k in node.keywords})
            constant = {key: value.value for key, value in named.items() if isinstance(value, ast.Constant)}
            found.append({"statement": pattern(named["statement"]), "code": ast.unparse(named["statement"]),
                          **{key: constant[key] for key in ("source", "target", "direction") if key in constant}})
    return found


def paper_links(path: Path) -> set[str]:
    return {url for cell in cells(path) for url in PAPER.findall("".join(cell["source"]))}


@pytest.fixture(scope="module")
def figures() -> dict[str, Figure | None]:
    return page.figures_of(list(registry.ENTRIES))


def test_the_scan_reads_claims_and_their_statements(tmp_path):
    notebook = tmp_path / "ch99_x.ipynb"
    source = ('a = verdict.Claim("plain " "words", "A", 2.0, "at least")\n'
              'b = verdict.Claim(f"at {x:.0%} and {y}", "this book\'s target", t, direction="at most")\n'
              '%time c = 1\n')
    notebook.write_text(json.dumps({"cells": [{"cell_type": "code", "source": [source]}]}))
    a, b = claims_built(notebook)
    assert a == {"statement": re.escape("plain words"), "code": "'plain words'", "source": "A", "target": 2.0,
                 "direction": "at least"}
    assert re.fullmatch(b["statement"], "at 95% and 3") and b["direction"] == "at most" and "target" not in b


def test_the_chapters_build_their_claims_as_the_notebooks_do():
    assert sum(len(claims_built(path)) for path in CHAPTERS) >= 20


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_every_claim_a_chapter_judges_has_its_entry(path, figures):
    chapter = chapter_of(path)
    registered = [figures[e.key].claim for e in registry.for_chapter(chapter)
                  if figures[e.key] is not None and figures[e.key].claim is not None]
    for built in claims_built(path):
        same = [claim for claim in registered if re.fullmatch(built["statement"], claim.statement)
                and all(getattr(claim, key) == built[key] for key in ("source", "target", "direction") if key in built)]
        assert same, f"{path.name} judges a claim the registry lacks for chapter {chapter}: {built['code']}"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_every_paper_a_chapter_links_has_its_entry(path):
    chapter = chapter_of(path)
    registered = {url for entry in registry.for_chapter(chapter) for url in entry.links}
    missing = sorted(url for url in paper_links(path) - registered if (chapter, url) not in NO_NUMBER)
    assert missing == [], f"{path.name} links papers with no entry in infra_lab/claims/ch{chapter}.py: {missing}"


def test_the_papers_without_a_number_are_still_cited_and_have_no_entry():
    linked = {(chapter_of(path), url) for path in CHAPTERS for url in paper_links(path)}
    assert set(NO_NUMBER) <= linked, sorted(set(NO_NUMBER) - linked)
    registered = {(e.chapter, url) for e in registry.ENTRIES for url in e.links}
    assert set(NO_NUMBER).isdisjoint(registered), sorted(set(NO_NUMBER) & registered)


def test_the_scan_finds_paper_links_in_prose_and_code(tmp_path):
    notebook = tmp_path / "ch99_x.ipynb"
    notebook.write_text(json.dumps({"cells": [
        {"cell_type": "markdown", "source": ["[Orca](https://www.usenix.org/conference/osdi22/presentation/yu), "
                                             "[a post](https://example.org/x)"]},
        {"cell_type": "code", "source": ['url = "https://arxiv.org/abs/2309.06180"']}]}))
    assert paper_links(notebook) == {"https://www.usenix.org/conference/osdi22/presentation/yu",
                                     "https://arxiv.org/abs/2309.06180"}


def test_the_page_lists_at_least_40_rows():
    assert len(registry.ENTRIES) >= 40
    articles = [e for e in registry.ENTRIES if page.is_article(e)]
    assert len(articles) >= 20  # SOURCES.md's claims, and the ones no chapter can test


def test_every_entry_has_a_figure_computed_here_or_a_reason(figures):
    for entry in registry.ENTRIES:
        figure = figures[entry.key]
        if entry.ours is None:
            assert entry.not_here and figure is None, entry.key
        else:
            assert isinstance(figure, Figure), f"{entry.key}: no figure from the committed runs"
            assert figure.machine and figure.measured_on and figure.how, entry.key
            if figure.claim is not None:
                assert figure.verdict() in verdict.VERDICTS, entry.key


def test_the_tables_hold_every_entry_once_and_link_existing_chapters(figures):
    stems = page.chapter_stems()
    assert set(stems) == {chapter_of(path) for path in CHAPTERS}
    tables = page.table(list(registry.ENTRIES), figures, stems)
    rows = [line for line in tables.splitlines() if line.startswith("| ") and not line.startswith("| chapter |")]
    assert len(rows) == len(registry.ENTRIES)
    assert all(row.count(" | ") == 5 for row in rows), [row for row in rows if row.count(" | ") != 5][:2]
    for target in re.findall(r"\]\(([\w.]+\.ipynb)\)", tables):
        assert (ROOT / "book" / target).is_file(), target
    assert all(e.chapter in stems for e in registry.ENTRIES if e.chapter)


def test_the_page_says_nothing_a_reader_cannot_know(figures):
    stems = page.chapter_stems()
    texts = [page.table(list(registry.ENTRIES), figures, stems), page.runs(figures), page.gpu_table()]
    for text in texts:
        assert not INTERNAL.search(text), INTERNAL.search(text).group(0)
        prose = [cell for line in text.splitlines() for cell in line.split(" | ")
                 if not cell.strip().startswith("Verdict:")]  # the shared function's verdicts, by design
        assert [m.group(0) for c in prose for m in VERDICT_WORDS.finditer(c)] == []


def test_a_judged_figure_carries_the_chapters_claim_and_verdict():
    claim = verdict.Claim("x is at least 2×", "C", 2.0, "at least")
    found = verdict.Evidence(2.5, 2.1, 2.9, "a machine", "2026-12-01", "python benchmarks/x.py")
    figure = Figure("2.5×", found.machine, found.measured_on, found.command, claim, found)
    assert figure.verdict() == "holds"
    assert page.verdict_cell(figure) == "Verdict: holds (target: at least 2.00×)"
    with pytest.raises(ValueError, match="both its claim and its evidence"):
        Figure("2.5×", "m", "2026-12-01", "c", claim, None)


def test_a_row_without_its_run_says_where_the_run_lives():
    entry = Entry("07.x", "07", "a claim", "C", "2×", lambda: None)
    assert page.ours_cell(entry, None) == page.ELSEWHERE
    unmeasured = Entry("07.y", "07", "a claim", "C", "2×", not_here="needs a GPU")
    assert page.ours_cell(unmeasured, None) == "not measurable here: needs a GPU"
    assert page.verdict_cell(None) == "–"


def test_the_hardware_table_has_the_datasheets_and_the_dated_probes():
    assert [row.device for row in hardware_table.datasheet_rows()] == list(hardware_table.DATASHEETS)
    measured_rows = hardware_table.gpu_rows() + hardware_table.cpu_rows()
    assert any("H200" in row.device for row in measured_rows)
    assert any(row.flops.get("fp32") for row in hardware_table.cpu_rows())
    for row in measured_rows:
        assert re.search(r"measured \d{4}-\d{2}-\d{2} by `", row.source), row.source
    table = page.gpu_table()
    assert table.count("\n") == 1 + len(hardware_table.DATASHEETS) + len(hardware_table.gpu_rows())


@pytest.mark.parametrize("fields, named", [
    (dict(chapter="7", key="7.x"), "two digits"),
    (dict(key="08.x"), "starts with its chapter"),
    (dict(ours=None), "either `ours` or the reason"),
    (dict(not_here="no GPU"), "either `ours` or the reason"),
    (dict(published=""), "the published value"),
])
def test_an_entry_names_what_it_lacks(fields, named):
    good = dict(key="07.x", chapter="07", claim="a claim", source="C", published="2×",
                ours=lambda: computed("2×"))
    Entry(**good)
    with pytest.raises(ValueError, match=re.escape(named)):
        Entry(**{**good, **fields})


def test_the_appendix_is_in_the_table_of_contents_under_appendix():
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text(encoding="utf-8"))
    parts = {part["caption"]: [c["file"] for c in part["chapters"]] for part in toc["parts"]}
    assert parts.get("Appendix") == ["book/appendix_numbers"]
    assert APPENDIX.is_file()


@pytest.mark.slow
def test_the_appendix_runs_and_shows_every_row():
    """Run the page as the book's build does; its tables hold every entry."""
    import nbclient
    import nbformat

    notebook = nbformat.read(APPENDIX, as_version=4)
    nbclient.NotebookClient(notebook, timeout=300, resources={"metadata": {"path": str(APPENDIX.parent)}}).execute()
    shown = "\n".join(output["data"]["text/markdown"] for cell in notebook.cells if cell.cell_type == "code"
                      for output in cell.outputs if "text/markdown" in output.get("data", {}))
    rows = [line for line in shown.splitlines() if line.startswith("| ") and "](ch" in line or "| none |" in line]
    assert len(rows) >= len(registry.ENTRIES)
    assert f"**{len(registry.ENTRIES)} numbers and claims**" in shown
