"""The serving simulator: the real engine and its scheduler, with the model runner replaced by a
step-time model on a virtual clock, so a reader can serve LLaMA-3-8B on an H100 from a laptop.

A step's time is chapter 01's roofline time for the whole mixed batch (weights read once, each
sequence's KV read and written, max of the compute and memory times), divided by an efficiency,
plus a fixed cost per step and one per sequence:

    t = step_s + sequence_s * B + max(FLOPs / peak, bytes / bandwidth) / efficiency

On a GPU the defaults are the ideal (no overheads, efficiency 1), so the simulator gives a lower
bound on each step and an upper bound on throughput. To check the simulator against the real
engine, `fit` finds the three constants for this machine from steps of the real model timed one
by one (not from the workload it will then predict).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from infra_lab.hardware import Device
from infra_lab.kv.paged import PagedKVCache
from infra_lab.model.config import ModelConfig
from infra_lab.model.cost import batch_cost, bytes_per_element, kv_bytes_per_token
from infra_lab.serving.clock import VirtualClock
from infra_lab.serving.config import EngineConfig
from infra_lab.serving.engine import Engine
from infra_lab.serving.request import Request
from infra_lab.serving.runner import ModelRunner


@dataclass(frozen=True)
class StepTimeModel:
    config: ModelConfig
    peak_flops: float  # FLOP/s
    bandwidth: float  # bytes/s
    dtype: str = "bf16"
    step_s: float = 0.0  # fixed cost of a step (launches, Python, the scheduler)
    sequence_s: float = 0.0  # cost of each sequence in the batch (metadata, sampling)
    efficiency: float = 1.0  # share of the roof the kernels reach

    @classmethod
    def on(cls, config: ModelConfig, device: Device, dtype: str = "bf16", **constants) -> StepTimeModel:
        return cls(config, device.flops(dtype), device.memory_bandwidth, dtype, **constants)

    def roof_s(self, sequences: list[tuple[int, int]]) -> float:
        """The roofline's time for a step: sequence b adds sequences[b] = (context, new) tokens."""
        cost = batch_cost(self.config, sequences, self.dtype)
        return max(cost.flops / self.peak_flops, cost.bytes / self.bandwidth)

    def seconds(self, sequences: list[tuple[int, int]]) -> float:
        return self.step_s + self.sequence_s * len(sequences) + self.roof_s(sequences) / self.efficiency

    def fit(self, samples: list[tuple[list[tuple[int, int]], float]]) -> StepTimeModel:
        """This model with step_s, sequence_s and efficiency fitted by non-negative least squares
        to measured (sequences, seconds) pairs."""
        if len(samples) < 3:
            raise ValueError(f"fitting three constants needs at least 3 timed steps; got {len(samples)}")
        features = np.array([[1.0, len(seqs), self.roof_s(seqs)] for seqs, _ in samples])  # (S, 3)
        seconds = np.array([s for _, s in samples])
        if not (seconds > 0).all():
            raise ValueError("every timed step needs a positive time")
        from scipy.optimize import nnls

        (step_s, sequence_s, inverse_efficiency), _ = nnls(features, seconds)
        if inverse_efficiency <= 0:
            raise ValueError("the fit gave the roofline term no weight: time steps of more varied sizes")
        return StepTimeModel(self.config, self.peak_flops, self.bandwidth, self.dtype, float(step_s),
                             float(sequence_s), float(1 / inverse_efficiency))


class SimulatedRunner(ModelRunner):
    """The model runner with its forward replaced by the step-time model: the same block
    reservations, metadata and commits, no model; every request samples token 0."""

    def __init__(self, time_model: StepTimeModel, pool: PagedKVCache, clock: VirtualClock):
        super().__init__(None, pool, clock=clock, config=time_model.config)
        self.time_model = time_model

    def _forward(self, tokens: np.ndarray, meta) -> None:
        query_lens = np.diff(meta.query_starts)
        sequences = list(zip((meta.context_lens - query_lens).tolist(), query_lens.tolist()))
        self.clock.advance(self.time_model.seconds(sequences))
        return None

    @staticmethod
    def _greedy(logits, last_rows: np.ndarray) -> np.ndarray:
        return np.zeros(len(last_rows), np.int64)

    @staticmethod
    def _sample(logits, row: int, request: Request) -> int:
        return 0


def pool_blocks(config: ModelConfig, device: Device, dtype: str = "bf16", block_size: int = 16,
                memory_share: float = 0.9) -> int:
    """KV blocks that fit in `memory_share` of the device's memory after the weights (vLLM's
    gpu_memory_utilization is 0.9 by default)."""
    weights = config.total_params * bytes_per_element(dtype)
    free = device.memory_bytes * memory_share - weights
    blocks = int(free // (kv_bytes_per_token(config, dtype) * block_size))
    if blocks < 1:
        raise ValueError(f"{config.name} in {dtype} ({weights / 1e9:.1f} GB of weights) leaves no room for a KV "
                         f"block in {memory_share:.0%} of {device.name}'s {device.memory_bytes / 1e9:.0f} GB")
    return blocks


def simulated_engine(time_model: StepTimeModel, config: EngineConfig) -> Engine:
    """An engine whose steps take the model's time on a virtual clock; the pool keeps the block
    bookkeeping only (one number per slot, not the model's K and V)."""
    clock = VirtualClock()
    pool = PagedKVCache(1, 1, 1, config.num_blocks, config.block_size, prefix_sharing=config.prefix_cache == "hash")
    return Engine(config=config, runner=SimulatedRunner(time_model, pool, clock), clock=clock)


CALIBRATION_STEPS = (  # (sequences, tokens each, context before): decodes, prefill chunks, and mixes
    [(1, 0)] * 1, [(1, 100)] * 8, [(1, 200)] * 32, [(1, 300)] * 64, [(1, 50)] * 128,
    [(64, 0)], [(256, 0)], [(512, 0)], [(128, 256)] * 2, [(1, 150)] * 32 + [(256, 0)],
)


def time_steps(model, backend, steps=CALIBRATION_STEPS, repeats: int = 5,
               block_size: int = 16) -> list[tuple[list[tuple[int, int]], float]]:
    """Time the real engine's runner on steps of the given shapes, each step a list of (new tokens,
    context) per sequence: the best of `repeats`, through ModelRunner.run (metadata, forward,
    sampling), as the engine runs them, over a pool of `block_size`-token blocks. Each shape's
    contexts are prefilled once, untimed, and every repeat runs on forks of them. Returns
    (sequences as (context, new), seconds) pairs."""
    import time

    from infra_lab.serving.request import RequestState, SamplingParams

    samples = []
    for shape in steps:
        blocks = sum(-(-(context + new + 1) // block_size) for new, context in shape)
        pool = model.new_paged_cache(2 * blocks + 8, block_size, backend=backend)
        runner = ModelRunner(model, pool, backend)
        parents = [Request(i, [int(t) for t in np.arange(context + new) % 200 + 32], SamplingParams(max_tokens=2),
                           state=RequestState.RUNNING) for i, (new, context) in enumerate(shape)]
        filled = [(parent, context) for parent, (_, context) in zip(parents, shape) if context]
        for parent, context in filled:  # the contexts, in one untimed step
            parent.seq = pool.new_sequence()
            pool.reserve(parent.seq, context)
        if filled:
            for parent, chunk in runner.run(filled).computed.items():
                pool.commit(parents[parent].seq, chunk)
        best = float("inf")
        for _ in range(repeats):
            batch = []
            for parent, (new, context) in zip(parents, shape):
                child = Request(parent.request_id, parent.prompt, parent.params, state=RequestState.RUNNING)
                # shares the parent's blocks; its first write copies the last one
                child.seq = pool.fork(parent.seq) if parent.seq is not None else pool.new_sequence()
                child.num_computed = context
                pool.reserve(child.seq, new)
                batch.append((child, new))
            started = time.perf_counter()
            runner.run(batch)
            best = min(best, time.perf_counter() - started)
            for child, _ in batch:
                pool.free(child.seq)
        samples.append(([(context, new) for new, context in shape], best))
    return samples
