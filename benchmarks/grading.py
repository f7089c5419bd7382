"""Grading a class: 200 generated submissions of chapter 00, one at a time and side by side.

The class mixes what a real one hands in: right answers, wrong ones, fresh notebooks, crashes,
hangs (stopped by the cell's time limit), and hostile notebooks (reading a neighbour's file,
writing outside their folder, a socket to this machine, processes without end, memory without end,
a full disk, a huge file, editing the checks). Both runs use the same containment (the grader's
"auto") and limits; the target: side by side takes at most 0.6x the time of one at a time, with
byte-identical CSVs.

    python benchmarks/grading.py [--quick] [--json PATH] [--jobs N]
"""
from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from engine_core import run_sections, section_parser  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).parent / "results" / "grading.json"
SECTIONS = ("class",)
TARGET = 0.6
RIGHT = ("def decode_intensity(n_params, batch, bytes_per_param):\n"
         "    return 2 * n_params * batch / (n_params * bytes_per_param)\n")
WRONG = "def decode_intensity(n_params, batch, bytes_per_param):\n    return batch / bytes_per_param\n"
HOG = ("import numpy as np\nblocks = []\nfor _ in range(400):\n"  # untouched zeros: address space, not memory
       "    blocks.append(np.zeros(64 << 20, np.uint8))")
HOSTILE = {  # each tries its act, then answers right: a wall that fails shows as a pass
    "reads a neighbour": "open({neighbour!r}).read()",
    "writes outside": "open({planted!r}, 'w').write('x')",
    "opens a socket": "import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=5)",
    "forks without end": "import os, time\nfor _ in range(400):\n    if os.fork() == 0:\n"
                         "        time.sleep(30)\n        os._exit(0)",
    "allocates without end": HOG,
    "fills the disk": "for i in range(100):\n    open(f'/tmp/fill{{i}}', 'wb').write(bytes(4 << 20))",
    "writes a huge file": "open('huge', 'wb').write(bytes(64 << 20))",
    "edits the checks": "from infra_lab.grading import checks\nchecks._run = lambda spec, candidate: "
                        "checks.CheckResult(spec.name, spec.n_cases, spec.n_cases, None)",
}
# shares of the class, in tenths of a percent of n, by kind
MIX = {"right": 500, "wrong": 150, "fresh": 100, "crashes": 100, "hangs": 50, "hostile": 100}


def make_class(folder: Path, n: int) -> dict[str, str]:
    """n submissions in `folder` (name -> kind), in a fixed order."""
    from infra_lab.grading import notebooks

    solutions, exercises = ROOT / "solutions" / "ch00_stack.ipynb", ROOT / "exercises" / "ch00_stack.ipynb"
    kinds = [kind for kind, share in MIX.items() for _ in range(max(1, round(n * share / 1000)))][:n]
    kinds += ["right"] * (n - len(kinds))
    first = folder / "s000.ipynb"
    made, hostile = {}, list(HOSTILE)
    for i, kind in enumerate(kinds):
        path = folder / f"s{i:03d}.ipynb"
        notebook = notebooks.read(exercises if kind == "fresh" else solutions)
        cell = notebook.cells[notebooks.exercises(notebook)["ch00.decode_intensity"].solution_index]
        if kind == "wrong":
            cell.source = WRONG
        elif kind == "crashes":
            cell.source = "raise RuntimeError('a bug')"
        elif kind == "hangs":
            cell.source = "while True:\n    pass"
        elif kind == "hostile":
            act = hostile[i % len(hostile)]
            kind = f"hostile: {act}"
            cell.source = HOSTILE[act].format(neighbour=str(first),
                                              planted=str(ROOT / "infra_lab" / "planted.py")) + "\n" + RIGHT
        notebooks.write(notebook, path)
        made[path.name] = kind
    return made


def class_section(n: int, jobs: int) -> dict:
    from infra_lab.grading import contain, grade

    limits = grade.Limits(submission_timeout_s=60, cell_timeout_s=5,
                          budget=contain.Budget(memory_mb=4096, processes=64, file_mb=32, scratch_mb=64))
    level = grade.containment(limits)
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch, "class")
        folder.mkdir()
        kinds = make_class(folder, n)
        submissions = grade.expand([folder])
        runs = {}
        for name, width in (("one at a time", 1), ("side by side", jobs)):
            load = os.getloadavg()[0]
            started = time.perf_counter()
            rows = grade.grade(ROOT / "exercises" / "ch00_stack.ipynb", submissions, Path(scratch, f"{width}.csv"),
                               limits, jobs=width)
            runs[name] = {"jobs": width, "seconds": time.perf_counter() - started, "load_1min_at_start": load,
                          "csv": Path(scratch, f"{width}.csv").read_bytes()}
        same = runs["one at a time"]["csv"] == runs["side by side"]["csv"]
    ratio = runs["side by side"]["seconds"] / runs["one at a time"]["seconds"]
    outcomes: dict[str, dict[str, int]] = {}
    for row in rows:
        if row.exercise == "ch00.decode_intensity":
            kind = kinds[Path(row.submission).name]
            key = f"{row.status}, {'full marks' if row.points == 1 else 'no points' if row.points == 0 else 'some'}"
            outcomes.setdefault(kind, {}).setdefault(key, 0)
            outcomes[kind][key] += 1
    planted = (ROOT / "infra_lab" / "planted.py").exists()
    return {"submissions": n, "cores": os.cpu_count(), "containment": contain.describe(level, limits.budget),
            "runs": {k: {x: y for x, y in v.items() if x != "csv"} for k, v in runs.items()},
            "ratio": ratio, "identical_csv": same, "outcomes_of_the_hostile_exercise": outcomes,
            "planted_file_exists": planted,
            "target": f"side by side at most {TARGET}x one at a time, identical CSVs",
            "passed": ratio <= TARGET and same and not planted}


def headline(name: str, figures: dict) -> str:
    runs = figures["runs"]
    return (f"{figures['submissions']} submissions: one at a time {runs['one at a time']['seconds']:.0f} s, "
            f"side by side ({runs['side by side']['jobs']} jobs) {runs['side by side']['seconds']:.0f} s, "
            f"ratio {figures['ratio']:.2f}, identical CSVs {figures['identical_csv']}")


def main() -> None:
    parser = section_parser(__doc__, SECTIONS, RESULTS)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    n = 20 if args.quick else 200
    run_sections("benchmarks/grading.py", SECTIONS, {"class": lambda _: class_section(n, args.jobs)},
                 args, headline, RESULTS, {"quick": args.quick})


if __name__ == "__main__":
    main()
