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
