"""Where the package came from (pip's PEP 610 record) and the repository's files at that commit:
read from a local clone, fetched once from GitHub into the cache, None where neither works."""
import io
import json

import pytest

from infra_lab import measured, origin

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class Installed:
    def __init__(self, record):
        self.record = record

    def read_text(self, name):
        return json.dumps(self.record) if name == "direct_url.json" else None


def installed_as(monkeypatch, record):
    monkeypatch.setattr(origin.importlib.metadata, "distribution", lambda name: Installed(record))


@pytest.mark.parametrize("record, expected", [
    ({"url": "https://github.com/fork/book.git", "vcs_info": {"vcs": "git", "commit_id": COMMIT}},
     origin.Origin("https://github.com/fork/book", COMMIT)),
    ({"url": "file:///srv/clone", "vcs_info": {"vcs": "git", "commit_id": COMMIT}},
     origin.Origin("file:///srv/clone", COMMIT)),
    ({"url": "file:///home/me/book", "dir_info": {"editable": True}}, None),  # `pip install -e .`
    ({"url": "https://example.org/infra_lab-0.1.0.whl", "archive_info": {}}, None),
])
def test_only_a_git_install_names_its_repository_and_commit(monkeypatch, record, expected):
    installed_as(monkeypatch, record)
    assert origin.installed_from() == expected


def test_a_plain_install_has_no_record(monkeypatch):
    class Plain:
        def read_text(self, name):
            return None
    monkeypatch.setattr(origin.importlib.metadata, "distribution", lambda name: Plain())
    assert origin.installed_from() is None


def test_a_damaged_record_names_no_repository(monkeypatch):
    class Damaged:
        def read_text(self, name):
            return '{"url": "https://github.com/fork/bo'
    monkeypatch.setattr(origin.importlib.metadata, "distribution", lambda name: Damaged())
    assert origin.installed_from() is None


def test_a_local_clone_serves_its_files(tmp_path):
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "benchmarks" / "results" / "rl.json").write_text("{}")
    local = origin.Origin(f"file://{tmp_path}", COMMIT)
    assert origin.repository_file("benchmarks/results/rl.json", local) == tmp_path / "benchmarks/results/rl.json"
    assert origin.repository_file("benchmarks/results/absent.json", local) is None


def test_github_files_are_fetched_at_the_commit_once(tmp_path, monkeypatch):
    monkeypatch.setenv("INFRA_LAB_CACHE", str(tmp_path))
    asked = []

    def urlopen(url, timeout):
        asked.append(url)
        return io.BytesIO(b'{"machine": "m"}')
    monkeypatch.setattr(origin.urllib.request, "urlopen", urlopen)
    github = origin.Origin("https://github.com/fork/book", COMMIT)
    for _ in range(2):
        kept = origin.repository_file("benchmarks/results/rl.json", github)
        assert kept.read_text() == '{"machine": "m"}'
    assert asked == [f"https://raw.githubusercontent.com/fork/book/{COMMIT}/benchmarks/results/rl.json"]
    assert kept == tmp_path / "repository" / COMMIT / "benchmarks/results/rl.json"


def test_offline_or_another_host_gives_none(tmp_path, monkeypatch):
    monkeypatch.setenv("INFRA_LAB_CACHE", str(tmp_path))

    def offline(url, timeout):
        raise OSError("no network")
    monkeypatch.setattr(origin.urllib.request, "urlopen", offline)
    assert origin.repository_file("x.json", origin.Origin("https://github.com/fork/book", COMMIT)) is None
    assert origin.repository_file("x.json", origin.Origin("https://gitlab.com/fork/book", COMMIT)) is None
    assert not (tmp_path / "repository").exists()


def test_measured_reads_the_installed_commits_results_when_none_lie_beside_the_package(tmp_path, monkeypatch):
    clone = tmp_path / "clone"
    (clone / "benchmarks" / "results").mkdir(parents=True)
    run = {"machine": "NVIDIA H200", "measured_on": "2026-12-01", "command": "python benchmarks/x.py"}
    (clone / "benchmarks" / "results" / "x.json").write_text(json.dumps(run))
    installed_as(monkeypatch, {"url": f"file://{clone}", "vcs_info": {"vcs": "git", "commit_id": COMMIT}})
    monkeypatch.setattr(measured, "RESULTS", tmp_path / "site-packages" / "benchmarks" / "results")
    assert measured.load("x") == run
    assert measured.load("absent") is None
    assert measured.load("x", folder=tmp_path / "elsewhere") is None  # a folder given is the only place
