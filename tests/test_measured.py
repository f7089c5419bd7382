"""GPU figures kept in benchmarks/results/ say where and when they were measured."""
import json

import pytest

from infra_lab import measured


def test_every_results_file_names_its_machine_date_and_command():
    names = sorted(p.stem for p in measured.RESULTS.glob("*.json"))
    assert "gpu_check_h200" in names and "paged_gpu_h200" in names
    for name in names:
        results = measured.load(name)
        assert results["measured_on"][:4].isdigit()
        assert results["machine"] in measured.label(results)


def test_a_missing_repository_gives_none(tmp_path):
    assert measured.load("gpu_check_h200", folder=tmp_path / "absent") is None


def test_an_unknown_name_lists_the_known_ones(tmp_path):
    (tmp_path / "one.json").write_text(json.dumps({"machine": "m", "measured_on": "d",
                                                   "command": "c"}))
    with pytest.raises(ValueError, match=r"no results named 'two'.*\['one'\]"):
        measured.load("two", folder=tmp_path)


def test_a_file_without_its_provenance_is_refused(tmp_path):
    (tmp_path / "bare.json").write_text(json.dumps({"machine": "m"}))
    with pytest.raises(ValueError, match="does not say its measured_on, command"):
        measured.load("bare", folder=tmp_path)


def test_every_cpu_result_names_the_cpu_model():
    """A figure beside a live one must say which CPU made it: "2 threads" alone does not."""
    for name in sorted(p.stem for p in measured.RESULTS.glob("*.json")):
        results = measured.load(name)
        runs = [results, *(results.get("kept_runs") or {}).values()]
        for run in runs:
            assert run["machine"].split(",")[0].strip() not in ("", "cpu", "CPU"), (name, run["machine"])
            assert any(word in run["machine"] for word in ("Intel", "AMD", "NVIDIA", "Apple", "Arm", "EPYC")), \
                (name, run["machine"])


def test_a_section_kept_from_an_earlier_run_keeps_its_machine_and_date(tmp_path, monkeypatch):
    """A run of some sections only, on another machine, writes its own machine at the top and
    the earlier run's beside each section it kept; labels and verdicts read the section's."""
    import sys
    import time

    sys.path.insert(0, str(measured.RESULTS.parent))
    import engine_core

    out = tmp_path / "bench.json"
    out.write_text(json.dumps({"machine": "Intel(R) Xeon(R) Processor, 2 threads", "measured_on": "2026-12-02",
                               "command": "python b.py", "sections": {"a": {"x": 1}, "b": {"y": 2}}}))
    monkeypatch.setattr(engine_core.backend, "machine", lambda: "AMD EPYC, 2 threads")
    engine_core.write_sections(out, "b.py", ("a", "b"), {"b": {"y": 3}}, {}, True, time.perf_counter(), 0.0)
    results = json.loads(out.read_text())
    assert results["machine"] == "AMD EPYC, 2 threads" and results["sections"] == {"a": {"x": 1}, "b": {"y": 3}}
    assert measured.run_of(results, "a") == {"machine": "Intel(R) Xeon(R) Processor, 2 threads",
                                             "measured_on": "2026-12-02", "command": "python b.py"}
    assert measured.run_of(results, "b")["machine"] == "AMD EPYC, 2 threads"
    assert measured.label(results, "a").startswith("Intel(R) Xeon(R) Processor, 2 threads, measured 2026-12-02")
