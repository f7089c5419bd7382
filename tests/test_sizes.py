"""sizes: full sizes unless INFRA_LAB_QUICK asks for quick ones, a bad value named, and the
first line of every chapter's output saying when a run used quick sizes."""
import pytest

from infra_lab import backend, sizes


@pytest.mark.parametrize("value", ["", "0", "false", "No"])
def test_full_sizes_unless_asked(value, monkeypatch):
    monkeypatch.setenv(sizes.ENVIRONMENT, value)
    assert sizes.sized(512, quick=32) == 512 and not sizes.is_quick()
    assert "quick sizes" not in backend.describe()


@pytest.mark.parametrize("value", ["1", "true", " YES "])
def test_quick_sizes_when_asked_and_the_first_line_says_so(value, monkeypatch):
    monkeypatch.setenv(sizes.ENVIRONMENT, value)
    assert sizes.sized(512, quick=32) == 32 and sizes.is_quick()
    assert backend.describe().endswith("quick sizes (INFRA_LAB_QUICK): not the page's figures")


def test_unset_means_full(monkeypatch):
    monkeypatch.delenv(sizes.ENVIRONMENT, raising=False)
    assert sizes.sized((8, 16), quick=(1, 2)) == (8, 16)


def test_a_bad_value_names_itself_and_what_is_allowed(monkeypatch):
    monkeypatch.setenv(sizes.ENVIRONMENT, "maybe")
    with pytest.raises(ValueError, match=r"INFRA_LAB_QUICK='maybe': allowed are 1, true, yes"):
        sizes.sized(1, quick=0)
