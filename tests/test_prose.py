"""What the chapters say to a reader, read from their sources: no word of the book's own
process ("seed", "issue", "bar" for a target), and no verdict on a claim except through
infra_lab.verdict, whose rule and wording every chapter shares. The site test reads the same
on the built pages."""
import ast
import json
from pathlib import Path

import pytest
from _words import INTERNAL, QUOTED_VERDICT, VERDICT_WORDS

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = sorted((ROOT / "book").glob("*.ipynb"))
def prose_of(notebook: Path) -> list[tuple[int, str]]:
    """(cell index, text) for each markdown cell and each string literal of each code cell."""
    found = []
    for index, cell in enumerate(json.loads(notebook.read_text(encoding="utf-8"))["cells"]):
        source = "".join(cell["source"])
        if cell["cell_type"] == "markdown":
            found.append((index, source))
        elif cell["cell_type"] == "code":  # IPython's magics and shell lines are not Python
            tree = ast.parse("\n".join("" if line.lstrip().startswith(("%", "!")) else line
                                       for line in source.splitlines()))
            found += [(index, node.value) for node in ast.walk(tree)
                      if isinstance(node, ast.Constant) and isinstance(node.value, str)]
    return found


@pytest.mark.parametrize("notebook", CHAPTERS, ids=lambda p: p.stem)
def test_no_chapter_speaks_of_seeds_issues_or_bars(notebook):
    hits = [(i, m.group(0)) for i, text in prose_of(notebook) for m in INTERNAL.finditer(text)]
    assert hits == [], f"{notebook.name}: (cell, words) a reader cannot know: {hits}"


@pytest.mark.parametrize("notebook", CHAPTERS, ids=lambda p: p.stem)
def test_every_verdict_comes_from_the_shared_function(notebook):
    hits = [(i, m.group(0)) for i, text in prose_of(notebook) for m in VERDICT_WORDS.finditer(text)]
    cells = json.loads(notebook.read_text(encoding="utf-8"))["cells"]
    hits += [(i, m.group(0)) for i, cell in enumerate(cells) if cell["cell_type"] == "code"
             for m in QUOTED_VERDICT.finditer("".join(cell["source"]))]
    assert hits == [], (f"{notebook.name}: (cell, word) a verdict written by hand; "
                        f"use infra_lab.verdict.verdict: {hits}")


def test_the_scan_finds_what_it_looks_for(tmp_path):
    cells = [{"cell_type": "markdown", "source": ["The seed article's bar of 10 s; a line meets a roof."]},
             {"cell_type": "code", "source": ['x = "meets" if ok else "misses"\n', 'y = f"which {x} the 10% target"\n',
                                              "%time x"]},
             {"cell_type": "code", "source": ['y = f"{z} falls short of the target"']}]
    notebook = tmp_path / "x.ipynb"
    notebook.write_text(json.dumps({"cells": cells}))
    texts = [t for _, t in prose_of(notebook)]
    assert any(INTERNAL.search(t) for t in texts)
    assert [m.group(0).split()[-1] for t in texts for m in VERDICT_WORDS.finditer(t)] == ["target"]
    assert QUOTED_VERDICT.findall("".join(cells[1]["source"])) == ['"', '"']  # "meets" and "misses"
