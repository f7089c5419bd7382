"""The verdicts of two (or more) book builds, compared claim by claim.

Every verdict on a page comes from `infra_lab.verdict` and a committed benchmark run, so two
builds on one machine must agree on each claim, whatever their live runs measured. This reads
each build's executed chapters (`<build>/jupyter_execute/book/*.ipynb`, what `make book` kept),
collects every "**Verdict: ….** <claim>" paragraph by chapter and claim, and prints one line
per claim with the verdict of each build; the exit status is 1 when any claim differs or is
missing from a build.

    .venv/bin/python tests/compare_verdicts.py _build /tmp/another-clone/_build
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

VERDICT = re.compile(r"\*\*Verdict: (holds|does not hold|inconclusive here)\.\*\* (.+?)(?: Target:|$)",
                     re.S)


def verdicts(build: Path) -> dict[tuple[str, str], str]:
    """(chapter, claim sentence) -> verdict, over a build's executed chapters."""
    found: dict[tuple[str, str], str] = {}
    chapters = sorted((build / "jupyter_execute" / "book").glob("*.ipynb"))
    if not chapters:
        raise SystemExit(f"error: {build}: no executed chapters in jupyter_execute/book (run `make book`)")
    for path in chapters:
        notebook = json.loads(path.read_text(encoding="utf-8"))
        for cell in notebook["cells"]:
            for output in cell.get("outputs", []):
                data = output.get("data", {})
                text = data.get("text/markdown") or output.get("text") or ""
                text = "".join(text) if isinstance(text, list) else text
                for said, claim in VERDICT.findall(text):
                    found[(path.stem, " ".join(claim.split()))] = said
    return found


def main(builds: list[str]) -> int:
    if len(builds) < 2:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    each = [verdicts(Path(b)) for b in builds]
    claims = sorted(set().union(*each))
    differ = 0
    for chapter, claim in claims:
        said = [v.get((chapter, claim), "missing") for v in each]
        same = len(set(said)) == 1
        differ += not same
        print(f"{'same' if same else 'DIFFER'}  {chapter}: {' | '.join(said)}  {claim[:90]}")
    print(f"{len(claims)} claims in {len(builds)} builds, {differ} differ")
    return 1 if differ or not claims else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
