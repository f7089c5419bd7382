import numpy as np
import pytest

from infra_lab import memory

pytestmark = pytest.mark.skipif(not memory.supported(), reason="needs Linux /proc/self/clear_refs")


def test_a_large_temporary_is_seen_even_after_an_earlier_one_was_freed():
    warm = np.ones(20_000_000)  # 160 MB, then freed: the heap may keep it
    del warm
    grown = memory.peak_extra_bytes(lambda: np.ones(10_000_000).sum())  # an 80 MB temporary
    assert 70e6 < grown < 120e6


def test_a_call_that_allocates_nothing_large_measures_near_zero():
    data = np.ones(1_000_000)
    assert memory.peak_extra_bytes(lambda: data.sum()) < 4e6
