"""How long each chapter takes to run: every chapter notebook in _toc.yml and its solutions
notebook, each executed top to bottom in a fresh kernel with nbclient, as the book's build does.

    .venv/bin/python benchmarks/chapter_times.py           # numba's caches as they are (warm)
    .venv/bin/python benchmarks/chapter_times.py --cold    # each notebook with empty caches

writes benchmarks/results/chapter_times.json: `machine`, `measured_on`, `command`, the
`seconds` of each notebook (kernel start included), the error of each one that `failed`, and
the disk the set-up takes. The first page shows the file itself, so no line of it is long.
`--cold` gives each notebook an empty numba cache (NUMBA_CACHE_DIR) and an empty infra_lab
cache (INFRA_LAB_CACHE, the measured roofs), as on the first run after a clone. The book's
first page (book/intro) shows the table. Run it when the machine is otherwise quiet.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results" / "chapter_times.json"
BUDGET_S = 90  # CHAPTER.md's budget for one notebook on a 2-core CPU
LINE = 60  # the book's first page shows this file: long strings are kept as lists of lines


def toc_files(toc: dict) -> list[tuple[str, str]]:
    """(part caption, file) for every page of a parsed jb-book _toc.yml except its root, in
    the book's order; a chapter's sections follow it under the same caption ("" outside
    parts). `file` is as written there, e.g. "book/ch00_stack"."""
    if not isinstance(toc, dict) or "root" not in toc:
        raise ValueError(f"a jb-book _toc.yml has a `root`; got {toc!r:.80}")
    found: list[tuple[str, str]] = []

    def walk(entries, caption: str, where: str) -> None:
        if not isinstance(entries, list):
            raise ValueError(f"{where} must be a list of entries; got {entries!r:.80}")
        for entry in entries:
            if not isinstance(entry, dict):
                raise ValueError(f"{where}: an entry must be a mapping; got {entry!r:.80}")
            if "file" in entry:
                found.append((caption, str(entry["file"])))
            elif "glob" in entry:
                raise ValueError(f"{where}: `glob: {entry['glob']}` is not supported; "
                                 "list the files one by one")
            elif "url" not in entry:
                raise ValueError(f"{where}: an entry needs `file` (or `url`); got {entry!r:.80}")
            if "sections" in entry:
                walk(entry["sections"], caption, f"{where} > {entry.get('file', '?')}")

    if "parts" in toc:
        for part in toc["parts"]:
            caption = part.get("caption", "") if isinstance(part, dict) else None
            if caption is None or "chapters" not in part:
                raise ValueError(f"a part needs `chapters`; got {part!r:.80}")
            walk(part["chapters"], caption, f"part {caption!r}")
    if "chapters" in toc:
        walk(toc["chapters"], "", "chapters")
    return found


def chapter_stems(root: Path = ROOT) -> list[str]:
    """Stems of the notebook pages in root/_toc.yml, in order, e.g. ["ch00_stack", ...]."""
    toc = yaml.safe_load((root / "_toc.yml").read_text(encoding="utf-8"))
    stems = []
    for _, file in toc_files(toc):
        path = root / file
        if path.with_suffix(".ipynb").is_file():
            stems.append(path.name)
        elif not path.with_suffix(".md").is_file():
            raise ValueError(f"_toc.yml lists {file!r}, but neither {file}.ipynb nor "
                             f"{file}.md exists under {root}")
    return stems


def notebooks_to_time(root: Path = ROOT) -> list[Path]:
    """book/<stem>.ipynb for every chapter in the table of contents, each followed by
    solutions/<stem>.ipynb where there is one; paths relative to root."""
    paths = []
    for stem in chapter_stems(root):
        paths.append(Path("book") / f"{stem}.ipynb")
        if (root / "solutions" / f"{stem}.ipynb").is_file():
            paths.append(Path("solutions") / f"{stem}.ipynb")
    return paths


def machine() -> dict:
    """CPU model and the cores this process may use."""
    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    model = model or platform.processor() or platform.machine() or "an unknown CPU"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": model, "cores": cores, "machine": f"{model}, {cores} cores"}


def du_bytes(path: Path) -> int | None:
    """Disk usage of `path` as `du` counts it (blocks in use), or None where it is missing."""
    if not path.exists():
        return None
    done = subprocess.run(["du", "-sk", str(path)], capture_output=True, text=True, check=True)
    return int(done.stdout.split()[0]) * 1024


def disk(root: Path = ROOT, largest: int = 3) -> dict:
    """What the set-up takes on disk: the virtual environment this script runs in, its
    `largest` packages, the checkout's tracked files, and the built site (_build, with its
    execution cache) where there is one."""
    venv = Path(sys.prefix)
    packages = Path(sysconfig.get_paths()["purelib"])
    entries = sorted(str(p) for p in packages.iterdir() if not p.name.endswith("-info"))
    done = subprocess.run(["du", "-sk", *entries], capture_output=True, text=True, check=True)
    sizes = sorted(((int(kb) * 1024, Path(name).name) for kb, name in
                    (line.split("\t", 1) for line in done.stdout.splitlines())), reverse=True)
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True,
                             check=True).stdout.split(b"\0")
    checkout = sum((root / name.decode()).stat().st_size for name in tracked
                   if name and (root / name.decode()).is_file())
    return {"venv": str(venv.relative_to(root)) if venv.is_relative_to(root) else str(venv),
            "venv_bytes": du_bytes(venv),
            "largest_packages": [{"name": name, "bytes": size}
                                 for size, name in sizes[:largest]],
            "checkout_bytes": checkout,
            "build_bytes": du_bytes(root / "_build")}


@contextlib.contextmanager
def environment(cold: bool):
    """Empty numba and infra_lab caches for the kernel when `cold`; else nothing changes."""
    if not cold:
        yield
        return
    saved = {key: os.environ.get(key) for key in ("NUMBA_CACHE_DIR", "INFRA_LAB_CACHE")}
    with tempfile.TemporaryDirectory(prefix="chapter_times_") as scratch:
        os.environ["NUMBA_CACHE_DIR"] = os.path.join(scratch, "numba")
        os.environ["INFRA_LAB_CACHE"] = os.path.join(scratch, "infra_lab")
        try:
            yield
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


def run_notebook(path: Path, cell_timeout: int, cold: bool) -> float:
    """Seconds to execute the notebook at `path` in a fresh kernel, started in its folder (as
    the book's build runs it), kernel start included. Raises on a cell error."""
    import nbclient
    import nbformat

    notebook = nbformat.read(path, as_version=4)
    kernel = notebook.metadata.get("kernelspec", {}).get("name", "python3")
    client = nbclient.NotebookClient(notebook, timeout=cell_timeout, kernel_name=kernel,
                                     resources={"metadata": {"path": str(path.parent)}})
    with environment(cold):
        start = time.perf_counter()
        client.execute()
        return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cold", action="store_true",
                        help="run each notebook with empty numba and infra_lab caches")
    parser.add_argument("--cell-timeout", type=int, default=300,
                        help="seconds one cell may take (the build's limit; default 300)")
    parser.add_argument("--out", type=Path, default=OUT, help=f"default {OUT}")
    parser.add_argument("--only", action="append", metavar="STEM",
                        help="time only this chapter and its solutions (repeatable); the other "
                             "figures in --out are kept, and `remeasured` says which were timed "
                             "later, and when")
    args = parser.parse_args(argv)

    os.environ.setdefault("TQDM_DISABLE", "1")
    from infra_lab import backend

    argv_shown = sys.argv[1:] if argv is None else argv
    results = {
        **machine(),
        "measured_on": datetime.date.today().isoformat(),
        "command": shlex.join([".venv/bin/python", "benchmarks/chapter_times.py", *argv_shown]),
        "python": platform.python_version(),
        "backend": backend.describe().split(" | "),
        "caches": "cold" if args.cold else "warm",
        "budget_s": BUDGET_S,
        "disk": disk(),
        "seconds": {},
        "failed": {},
        "load_average": [],  # 1-minute load before each notebook, and at the end
    }
    chosen = notebooks_to_time()
    if args.only:
        unknown = sorted(set(args.only) - {path.stem for path in chosen})
        if unknown:
            parser.error(f"no chapter {unknown[0]!r} in _toc.yml; choose from "
                         f"{sorted({path.stem for path in chosen})}")
        chosen = [path for path in chosen if path.stem in args.only]
        if args.out.is_file():  # keep the earlier run's figures for the other notebooks
            earlier = json.loads(args.out.read_text(encoding="utf-8"))
            remeasured = earlier.get("remeasured", {}) | {
                path.as_posix(): f"{results['measured_on']}, with --only" for path in chosen}
            results = earlier | {"seconds": earlier.get("seconds", {}), "remeasured": remeasured}
            results["failed"] = {k: v for k, v in earlier.get("failed", {}).items()
                                 if k not in remeasured}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for relative in chosen:
        results["load_average"].append(round(os.getloadavg()[0], 1))
        print(f"{relative} ...", end=" ", flush=True)
        try:
            seconds = run_notebook(ROOT / relative, args.cell_timeout, args.cold)
        except Exception as error:  # a failing notebook is recorded; the others still run
            name = getattr(error, "ename", type(error).__name__)
            value = getattr(error, "evalue", None) or str(error)
            first = next((line for line in value.splitlines() if line.strip()), "")
            message = re.sub(r"\x1b\[[0-9;]*m", "", f"{name}: {first.strip()}")  # no colours
            results["failed"][relative.as_posix()] = textwrap.wrap(message[:300], LINE)
            print(f"FAILED ({message})")
        else:
            results["seconds"][relative.as_posix()] = round(seconds, 1)
            over = "  <-- over the budget" if seconds > BUDGET_S else ""
            print(f"{seconds:.1f} s{over}")
        args.out.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    results["load_average"].append(round(os.getloadavg()[0], 1))
    args.out.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")
    return 1 if results["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
