"""Driving a chapter's explorers from Python, in the kernel that runs the chapter, as a widget
test does: after each cell that builds an explorer, a cell the chapter does not have moves every
control of every live face built since (infra_lab.explore.LIVE) to another value and checks that
the face redrew with it. Shared by the torch pass on this repository's ipywidgets
(test_notebooks_on_torch.py) and the one on a Colab runtime's (test_colab_runtime.py)."""
import nbformat

DRIVE_MARK = "# driving the explorers built since the last drive"
DRIVE = DRIVE_MARK + '''
import ipywidgets as _widgets
from infra_lab import explore as _explore


def _moved(control):
    """Another value the control allows (the next option, the other side of a box, a step),
    or None where it offers one option only (some do at quick sizes)."""
    pairs = _explore.options_of(control)
    if pairs is not None:
        others = [value for _, value in pairs if value != control.value]
        return others[0] if others else None
    if isinstance(control.value, bool):
        return not control.value
    step = getattr(control, "step", None) or 1
    up = control.value + step
    return up if up <= control.max else control.value - step


_driven = globals().get("_explorers_driven", 0)
for _live in _explore.LIVE[_driven:]:
    _moves = 0
    for _name, _control in _live.controls.items():
        _before, _value = _live.draws, _moved(_control)
        if _value is None:
            continue
        _control.value = _value
        assert _live.draws == _before + 1, f"{_name} moved to {_value!r}: no redraw"
        assert _live.drawn_with[_name] == _control.value, (_name, _live.drawn_with)
        _moves += 1
    assert _moves, f"no control of {list(_live.controls)} could move"
    print(f"explorer driven: {_moves} of {len(_live.controls)} controls moved, "
          f"ipywidgets {_widgets.__version__}")
_explorers_driven = len(_explore.LIVE)
'''


def builds_an_explorer(cell) -> bool:
    return cell.cell_type == "code" and "explorer(" in cell.source


def with_drive_cells(notebook) -> int:
    """Inserts a drive cell after each cell that builds an explorer; returns how many explorers
    the chapter builds (one `explorer(` call each)."""
    count, cells = 0, []
    for cell in notebook.cells:
        cells.append(cell)
        if builds_an_explorer(cell):
            count += cell.source.count("explorer(")
            cells.append(nbformat.v4.new_code_cell(DRIVE))
    notebook.cells = cells
    return count


def driven(notebook) -> list[str]:
    """What the drive cells printed, one line per explorer driven."""
    lines = []
    for cell in notebook.cells:
        if cell.cell_type == "code" and cell.source.startswith(DRIVE_MARK):
            for output in cell.outputs:
                lines += [line for line in output.get("text", "").splitlines() if line]
    return lines
