"""The verdicts of two (or more) book builds, compared claim by claim.

Every verdict on a page comes from `infra_lab.verdict` and a committed benchmark run, so two
builds on one machine must agree on each claim, whatever their live runs measured. This reads
each build's executed chapters from its jupyter-cache (`<build>/.jupyter_cache`, what the pages
are rendered from; the copies in jupyter_execute/ keep no outputs when a chapter came from the
cache), the newest run of each, collects every "**Verdict: ….** <claim>" paragraph by chapter
and claim, and prints one line per claim with the verdict of each build; the exit status is 1
when any claim differs or is missing from a build.

    .venv/bin/python tests/compare_verdicts.py _build /tmp/another-clone/_build
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

VERDICT = re.compile(r"\*\*Verdict: (holds|does not hold|inconclusive here)\.\*\* (.+?)(?: Target:|$)",
                     re.S)


def verdicts(build: Path) -> dict[tuple[str, str], str]:
    """(chapter, claim sentence) -> verdict, over a build's executed chapters."""
    from jupyter_cache import get_cache

    if not (build / ".jupyter_cache").is_dir():
        raise SystemExit(f"error: {build}: no .jupyter_cache (run `make book`)")
    cache = get_cache(build / ".jupyter_cache")
    newest = {}  # chapter -> its newest cache record
    for record in cache.list_cache_records():
        path = Path(record.uri)
        if path.parent.name == "book" and (path.stem not in newest
                                           or record.created > newest[path.stem].created):
            newest[path.stem] = record
    if not newest:
        raise SystemExit(f"error: {build}: no executed chapters in its cache (run `make book`)")
    found: dict[tuple[str, str], str] = {}
    for chapter, record in sorted(newest.items()):
        for cell in cache.get_cache_bundle(record.pk).nb.cells:
            for output in cell.get("outputs", []):
                data = output.get("data", {})
                text = data.get("text/markdown") or output.get("text") or ""
                text = "".join(text) if isinstance(text, list) else text
                for said, claim in VERDICT.findall(text):
                    found[(chapter, " ".join(claim.split()))] = said
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
