"""The simulator: the engine's own scheduler on a virtual clock whose steps take the roofline
step-time model's time; the model's constants are recovered by its fit; a mixed batch's cost is
the uniform step cost where the batch is uniform."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from infra_lab import hardware, roofline
from infra_lab.model import cost
from infra_lab.serving import metrics, simulator, traffic
from infra_lab.serving.config import EngineConfig

LLAMA = roofline.preset("llama-3-8b")


@given(batch=st.integers(1, 64), new=st.integers(1, 300), context=st.integers(0, 2000))
def test_a_uniform_mixed_batch_costs_what_step_cost_says(batch, new, context):
    mixed = cost.batch_cost(LLAMA, [(context, new)] * batch, "bf16")
    uniform = cost.step_cost(LLAMA, batch, new, context, "bf16")
    assert mixed.flops == pytest.approx(uniform.flops) and mixed.bytes == pytest.approx(uniform.bytes)


@settings(max_examples=20, deadline=None)
@given(step_s=st.floats(0, 1e-3), sequence_s=st.floats(0, 1e-4), efficiency=st.floats(0.05, 1), seed=st.integers(0, 99))
def test_the_fit_recovers_the_constants_of_a_known_model(step_s, sequence_s, efficiency, seed):
    truth = simulator.StepTimeModel.on(LLAMA, hardware.get("H100 SXM"), "bf16", step_s=step_s,
                                       sequence_s=sequence_s, efficiency=efficiency)
    rng = np.random.default_rng(seed)
    shapes = [[(int(rng.integers(0, 2000)), 1)] * int(rng.integers(1, 128)) for _ in range(6)]
    shapes += [[(0, int(rng.integers(16, 2048)))] for _ in range(4)]
    fitted = truth.fit([(seqs, truth.seconds(seqs)) for seqs in shapes])
    for seqs in shapes:
        assert fitted.seconds(seqs) == pytest.approx(truth.seconds(seqs), rel=1e-6)


def test_the_simulated_engine_serves_every_request_and_its_clock_is_the_sum_of_its_steps():
    model = simulator.StepTimeModel.on(LLAMA, hardware.get("H100 SXM"), "bf16", step_s=1e-3)
    config = EngineConfig(policy="chunked", max_batch=16, token_budget=256, num_blocks=512)
    engine = simulator.simulated_engine(model, config)
    served = engine.serve(traffic.sharegpt_like(40, rate_per_s=50, seed=1))
    assert all(len(r.output) == r.params.max_tokens for r in served)
    assert all(s.forward_s == pytest.approx(s.seconds) for s in engine.log)  # the model's time is the step's
    assert engine.log[-1].end_s == pytest.approx(max(r.finish_s for r in served))
    assert engine.blocks.pool.num_free == 512
    assert metrics.summarize(served, engine.log, 16).throughput_tok_s > 0


def test_a_pool_that_leaves_no_room_is_named():
    assert simulator.pool_blocks(LLAMA, hardware.get("H100 SXM")) > 0
    with pytest.raises(ValueError, match="leaves no room for a KV block"):
        simulator.pool_blocks(roofline.preset("llama-3-70b"), hardware.get("L4"))
