"""The package is a stack and imports point down it: the import-linter contracts in
pyproject.toml hold the layers, and no module reaches itself through its imports.

Imports inside functions count (grimp reads every import statement): a lazy import still ties
two modules together.
"""
import subprocess
import sys
from pathlib import Path

import grimp


def test_the_import_contracts_hold(root):
    lint_imports = Path(sys.executable).parent / "lint-imports"
    done = subprocess.run([str(lint_imports), "--no-cache", "--no-logo", "pyproject.toml"], cwd=root,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


def import_cycles(graph: grimp.ImportGraph) -> list[tuple[str, ...]]:
    """One chain per cycle, a -> b -> ... -> a, found from each direct import a -> b that has
    a way back; a cycle reached from several of its edges is reported once."""
    cycles: dict[frozenset, tuple[str, ...]] = {}
    for importer in sorted(graph.modules):
        for imported in sorted(graph.find_modules_directly_imported_by(importer)):
            way_back = graph.find_shortest_chain(importer=imported, imported=importer)
            if way_back:
                chain = (importer, *way_back)
                cycles.setdefault(frozenset(chain), chain)
    return list(cycles.values())


def test_the_cycle_finder_reports_each_cycle_once():
    graph = grimp.ImportGraph()
    for importer, imported in [("p.a", "p.b"), ("p.b", "p.c"), ("p.c", "p.a"), ("p.c", "p.d")]:
        graph.add_import(importer=importer, imported=imported)
    assert import_cycles(graph) == [("p.a", "p.b", "p.c", "p.a")]


def test_no_module_imports_itself_through_others():
    cycles = import_cycles(grimp.build_graph("infra_lab", cache_dir=None))
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(chain) for chain in cycles)
