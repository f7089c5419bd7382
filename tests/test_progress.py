"""Progress bars show to a live learner and stay off the built site."""
import pytest

from infra_lab import progress


@pytest.mark.parametrize("value, off", [("", False), ("0", False), ("false", False),
                                        ("1", True), ("True", True)])
def test_tqdm_disable_turns_every_bar_off(monkeypatch, value, off):
    monkeypatch.setenv("TQDM_DISABLE", value)
    assert progress.bar(range(3), show=True).disable is off
    assert progress.bar(range(3), show=False).disable is True
    assert list(progress.bar(range(3), show=True)) == [0, 1, 2]
