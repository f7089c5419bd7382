"""moe.simulate, the explorer's toy router: deterministic, its loads add up, each balancing
method evens the loads it was given, and bad settings are named."""
import numpy as np
import pytest

from infra_lab.moe import simulate


@pytest.mark.parametrize("n_experts, k", [(8, 1), (8, 2), (16, 4)])
def test_balancing_evens_the_toy_routers_loads(n_experts, k):
    loads = {m: simulate.simulate(n_experts, k, m, None) for m in simulate.METHODS}
    for method, result in loads.items():
        assert result.received.sum() == simulate.TOKENS * k and result.dropped == 0
        assert (result.kept == result.received).all() and result.slots is None
    assert loads["bias"].max_over_mean < loads["none"].max_over_mean
    assert loads["aux"].max_over_mean < loads["none"].max_over_mean


def test_capacity_drops_what_exceeds_the_slots_and_the_runs_repeat():
    router = simulate.balanced_router(8, 2, "none")
    tight = simulate.loads(router, 1.0)
    assert tight.slots == int(np.ceil(simulate.TOKENS * 2 / 8))
    assert (tight.kept == np.minimum(tight.received, tight.slots)).all()
    assert tight.dropped == pytest.approx(1 - tight.kept.sum() / tight.received.sum()) and tight.dropped > 0
    again = simulate.loads(simulate.balanced_router(8, 2, "none"), 1.0)
    assert (again.received == tight.received).all()


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="unknown balancing 'loss'"):
        simulate.simulate(8, 2, "loss", None)
    with pytest.raises(ValueError, match="experts per token k must be an integer from 1 to the 8"):
        simulate.simulate(8, 9, "none", None)
    with pytest.raises(ValueError, match="capacity factor must be a number > 0"):
        simulate.simulate(8, 2, "none", 0)
