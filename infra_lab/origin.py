"""Where this package was installed from, and a file of that repository at that commit.

A chapter's setup cell on Colab installs the package with `pip install "infra-lab @ git+URL"`.
pip records that URL and the commit it checked out in the installed package (direct_url.json,
PEP 610). The chapters read a few files that live beside the package in the repository, not in
it (the committed benchmark runs in benchmarks/results/): on such an install they come from
the same commit, fetched once into the cache. Any other install has no such record.
"""
from __future__ import annotations

import importlib.metadata
import json
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from infra_lab.cache import cache_dir

FETCH_TIMEOUT_S = 30


@dataclass(frozen=True)
class Origin:
    url: str  # https://github.com/OWNER/REPO, or file:///path of a local repository
    commit: str  # the 40 hex digits pip checked out


def installed_from() -> Origin | None:
    """The git repository and commit pip installed this package from, or None."""
    try:
        text = importlib.metadata.distribution("infra-lab").read_text("direct_url.json")
    except importlib.metadata.PackageNotFoundError:
        return None
    try:
        record = json.loads(text or "{}")
    except ValueError:  # a damaged record names no repository
        return None
    vcs = record.get("vcs_info") or {}
    if vcs.get("vcs") != "git" or not vcs.get("commit_id"):
        return None
    return Origin(record["url"].removesuffix(".git").rstrip("/"), vcs["commit_id"])


def raw_url(origin: Origin, relative: str) -> str | None:
    """Where a GitHub repository serves `relative` at the commit, or None for another host."""
    prefix = "https://github.com/"
    if not origin.url.startswith(prefix):
        return None
    return f"https://raw.githubusercontent.com/{origin.url.removeprefix(prefix)}/{origin.commit}/{relative}"


def repository_file(relative: str, origin: Origin | None = None) -> Path | None:
    """The file `relative` (e.g. "benchmarks/results/rl.json") of the repository at the commit
    the package came from, as a local path; None where that is unknown or cannot be fetched."""
    origin = origin or installed_from()
    if origin is None:
        return None
    if origin.url.startswith("file://"):  # a local clone: its files are at hand
        path = Path(urllib.parse.urlparse(origin.url).path) / relative
        return path if path.is_file() else None
    url = raw_url(origin, relative)
    if url is None:
        return None
    kept = cache_dir() / "repository" / origin.commit / relative
    if not kept.is_file():
        try:
            with urllib.request.urlopen(url, timeout=FETCH_TIMEOUT_S) as response:
                body = response.read()
        except OSError:  # offline, or no such file at that commit
            return None
        kept.parent.mkdir(parents=True, exist_ok=True)
        partial = kept.with_suffix(kept.suffix + ".part")
        partial.write_bytes(body)
        partial.replace(kept)
    return kept
