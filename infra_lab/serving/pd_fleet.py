"""Placements of prefill and decode on GPUs, colocated or disaggregated, and the simulated
instances they are made of (chapter 06; `pd_fleet_loop` runs them).

Colocated: N replicas, each running prefill and decode in one engine. Disaggregated (Zhong et al.,
"DistServe", OSDI 2024; Patel et al., "Splitwise", ISCA 2024): prefill instances compute each
prompt and its first token; the request's K and V (kv_bytes_per_token x prompt tokens) cross a
link; a decode instance imports the request (Engine.export_request / import_request) and holds its
K and V in its pool while it generates the rest. Every instance is chapter 05's engine on its own
virtual clock, its steps timed by the simulator's roofline (simulator.StepTimeModel), here with
the compute and memory roofs each lowered to a stated share (MFU, MBU).

An instance of tensor-parallel degree t is t GPUs acting as one: t x FLOP/s, t x bandwidth, t x
memory, plus Megatron-LM's two all-reduces per layer of the new tokens' activations (Shoeybi et
al., 2019), each timed as a ring all-reduce (every GPU sends 2(t-1)/t of the message, NCCL's "bus
bandwidth") one way over the device's intra-node link; the all-reduces' latency is left out.

TTFT is arrival to first token: queueing and prefill (DistServe counts it on the prefill side; the
transfer is not in it). TPOT is a request's mean gap after its first token, (finish - first token)
/ (output - 1), so the transfer and any wait for room on the decode instance count there. Dispatch:
a prompt goes to the instance with the fewest tokens queued to compute; a prefilled request to the
decode instance with the fewest KV blocks promised to it (ties: the first). A decode instance takes
a request in once its pool can hold the whole prompt + output of every request it runs and a batch
slot is free; until then the request waits, first come first served.
"""
from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import dataclass, replace

import numpy as np

from infra_lab.hardware import Device
from infra_lab.kv.paged import PagedKVCache
from infra_lab.model.config import ModelConfig
from infra_lab.model.cost import batch_cost, bytes_per_element
from infra_lab.serving import traffic
from infra_lab.serving.clock import VirtualClock
from infra_lab.serving.config import EngineConfig
from infra_lab.serving.engine import Engine
from infra_lab.serving.links import Link, intra_node_link
from infra_lab.serving.prefill_first import PrefillFirstScheduler
from infra_lab.serving.scheduler import Scheduler
from infra_lab.serving.simulator import SimulatedRunner, StepTimeModel, pool_blocks, simulated_engine

COLOCATED_POLICIES = {  # a colocated engine's batching -> (EngineConfig policy, scheduler)
    "prefill-first": ("continuous", PrefillFirstScheduler),  # vLLM v0.2-v0.3, DistServe's baseline
    "continuous": ("continuous", Scheduler),  # Orca's: decodes ride along in a prefill step
    "chunked": ("chunked", Scheduler),  # Sarathi-Serve's: prompts in chunks beside the decodes
}


def _count(name: str, value, least: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < least:
        raise ValueError(f"{name} must be an integer >= {least}; got {value!r}")


@dataclass(frozen=True)
class Serving:
    """How every instance serves: the model, its number format, what the kernels reach of each
    roof, and the engine's settings (vLLM's defaults of 2023)."""
    model: ModelConfig
    dtype: str = "fp16"
    compute_efficiency: float = 1.0  # the share of peak FLOP/s the kernels reach (MFU)
    memory_efficiency: float = 1.0  # the share of peak bandwidth they reach (MBU)
    policy: str = "prefill-first"  # a colocated engine's batching, one of COLOCATED_POLICIES
    max_batch: int = 256  # vLLM's max_num_seqs
    token_budget: int = 2048  # vLLM's max_num_batched_tokens (at least 2048)
    block_size: int = 16
    memory_share: float = 0.9  # vLLM's gpu_memory_utilization
    allreduce: bool = True  # time tensor parallelism's all-reduces

    def __post_init__(self):
        for name in ("compute_efficiency", "memory_efficiency"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1]; got {getattr(self, name)}")
        if self.policy not in COLOCATED_POLICIES:
            raise ValueError(f"policy must be one of {', '.join(map(repr, COLOCATED_POLICIES))}; got {self.policy!r}")
        bytes_per_element(self.dtype)  # raises on an unknown dtype


@dataclass(frozen=True)
class Instances:
    """`count` engines, each `tp` GPUs of `device` acting as one (tensor parallelism)."""
    count: int
    device: Device
    tp: int = 1

    def __post_init__(self):
        if isinstance(self.count, (int, np.integer)) and not isinstance(self.count, bool) and self.count == 0:
            raise ValueError("count must be >= 1: a placement needs at least one instance of each kind it names "
                             "(one replica colocated; one prefill and one decode instance disaggregated); got 0")
        _count("count", self.count)
        _count("tp", self.tp)
        if not isinstance(self.device, Device):
            raise TypeError(f"device must be a hardware.Device (hardware.get(name)); got {type(self.device).__name__}")

    @property
    def gpus(self) -> int:
        return self.count * self.tp

    @property
    def label(self) -> str:
        return f"{self.count} x {self.device.name}" + (f" (TP{self.tp})" if self.tp > 1 else "")


@dataclass(frozen=True)
class Colocated:
    replicas: Instances

    @property
    def gpus(self) -> int:
        return self.replicas.gpus

    @property
    def label(self) -> str:
        return f"colocated {self.replicas.label}"


@dataclass(frozen=True)
class Disaggregated:
    prefill: Instances
    decode: Instances
    link: Link | None = None  # between a prefill and a decode GPU; None: the prefill device's intra-node link

    @property
    def gpus(self) -> int:
        return self.prefill.gpus + self.decode.gpus

    @property
    def transfer_link(self) -> Link:
        return self.link or intra_node_link(self.prefill.device)

    @property
    def label(self) -> str:
        return f"prefill {self.prefill.label}, decode {self.decode.label}"


@dataclass(frozen=True)
class SLO:
    """Latency objectives (seconds); math.inf leaves one out."""
    ttft_s: float = math.inf
    tpot_s: float = math.inf

    def __post_init__(self):
        for name in ("ttft_s", "tpot_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds (math.inf: no objective); got {getattr(self, name)}")

    def scaled(self, factor: float) -> SLO:
        """Both objectives times `factor` (DistServe's SLO scale: below 1 is tighter)."""
        if not 0 < factor < math.inf:
            raise ValueError(f"an SLO scale must be finite and > 0; got {factor}")
        return SLO(self.ttft_s * factor, self.tpot_s * factor)


# ---- the request stream -------------------------------------------------------------------------

@dataclass(frozen=True)
class Arrival:
    at_s: float  # seconds after the stream starts
    prompt: int  # tokens
    output: int  # tokens it generates (no stop token ends it early)


@dataclass(frozen=True)
class FixedLengths:
    """Every request the same: `prompt` tokens in, `output` out (DistServe's Figure 1: 512 and 64)."""
    prompt: int
    output: int

    def __post_init__(self):
        _count("prompt", self.prompt)
        _count("output", self.output)

    def __call__(self, n: int, seed: int = 0) -> list[tuple[int, int]]:
        return [(self.prompt, self.output)] * n

    @property
    def label(self) -> str:
        return f"{self.prompt} in, {self.output} out"


@dataclass(frozen=True)
class ShareGPTLengths:
    """ShareGPT's log-normal lengths at their own means (traffic.sharegpt_lengths at scale 1:
    161 prompt and 338 output tokens before clipping), clipped so prompt + output <= max_len."""
    max_len: int = 2048

    def __call__(self, n: int, seed: int = 0) -> list[tuple[int, int]]:
        return traffic.sharegpt_lengths(n, seed, self.max_len, scale=1.0)

    @property
    def label(self) -> str:
        return f"ShareGPT-like, up to {self.max_len} tokens"


def poisson(rate_per_s: float, n: int, lengths, seed: int = 0) -> list[Arrival]:
    """`n` requests arriving as a Poisson stream of `rate_per_s` (req/s) with `lengths(n, seed)`.
    With one seed, the lengths are the same at every rate and the arrival times scale as 1 / rate,
    so a higher rate is the same stream, compressed."""
    if not rate_per_s > 0:
        raise ValueError(f"rate_per_s must be > 0 requests per second (math.inf: all at once); got {rate_per_s}")
    _count("n", n)
    arrival_seed, length_seed = (int(s.generate_state(1)[0]) for s in np.random.SeedSequence(seed).spawn(2))
    times = traffic.poisson_arrivals(rate_per_s, n, arrival_seed)
    return [Arrival(float(t), int(p), int(o)) for t, (p, o) in zip(times, lengths(n, length_seed))]


# ---- one instance -------------------------------------------------------------------------------

def tensor_parallel(device: Device, tp: int) -> Device:
    """`tp` GPUs of `device` as one: every peak, the bandwidth and the memory times tp."""
    _count("tp", tp)
    return replace(device, name=device.name if tp == 1 else f"{tp} x {device.name}",
                   peak_flops={dtype: rate * tp for dtype, rate in device.peak_flops.items()},
                   memory_bandwidth=device.memory_bandwidth * tp, memory_bytes=device.memory_bytes * tp, probes={})


@dataclass(frozen=True)
class TensorParallelStepTime(StepTimeModel):
    """The simulator's step time for `tp` GPUs as one, each roof lowered to the share the kernels
    reach of it, plus the all-reduces tensor parallelism adds."""
    tp: int = 1
    allreduce_bytes_per_s: float = math.inf  # one way, between two GPUs of the instance
    compute_efficiency: float = 1.0  # of peak_flops (MFU)
    memory_efficiency: float = 1.0  # of bandwidth (MBU)

    def roof_s(self, sequences: list[tuple[int, int]]) -> float:
        cost = batch_cost(self.config, sequences, self.dtype)
        return max(cost.flops / (self.peak_flops * self.compute_efficiency),
                   cost.bytes / (self.bandwidth * self.memory_efficiency))

    def allreduce_s(self, tokens: int) -> float:
        """Two ring all-reduces per layer of `tokens` rows of d_model activations."""
        if self.tp == 1:
            return 0.0
        message = tokens * self.config.d_model * bytes_per_element(self.dtype)  # bytes per all-reduce
        return 2 * self.config.n_layers * 2 * (self.tp - 1) / self.tp * message / self.allreduce_bytes_per_s

    def seconds(self, sequences: list[tuple[int, int]]) -> float:
        return super().seconds(sequences) + self.allreduce_s(sum(new for _, new in sequences))


def step_time_model(serving: Serving, device: Device, tp: int = 1) -> TensorParallelStepTime:
    group = tensor_parallel(device, tp)
    rate = intra_node_link(device).bytes_per_s if tp > 1 and serving.allreduce else math.inf
    return TensorParallelStepTime(serving.model, group.flops(serving.dtype), group.memory_bandwidth, serving.dtype,
                                  tp=tp, allreduce_bytes_per_s=rate, compute_efficiency=serving.compute_efficiency,
                                  memory_efficiency=serving.memory_efficiency)


def engine_config(serving: Serving, device: Device, tp: int = 1, policy: str = "continuous") -> EngineConfig:
    """The engine settings of one instance: its pool is what fits in memory_share of tp GPUs."""
    blocks = pool_blocks(serving.model, tensor_parallel(device, tp), serving.dtype, serving.block_size,
                         serving.memory_share)
    return EngineConfig(policy=policy, max_batch=serving.max_batch, token_budget=serving.token_budget,
                        num_blocks=blocks, block_size=serving.block_size)


class Instance:
    """One engine of a fleet, its role ("colocated", "prefill" or "decode"), and for a decode
    instance the KV blocks promised to its requests."""

    def __init__(self, role: str, index: int, time_model: StepTimeModel, config: EngineConfig, label: str,
                 scheduler_class: type[Scheduler] = Scheduler):
        self.role, self.index, self.label = role, index, label
        if scheduler_class is Scheduler:
            self.engine = simulated_engine(time_model, config)
        else:  # simulated_engine's engine, with another scheduler
            clock = VirtualClock()
            pool = PagedKVCache(1, 1, 1, config.num_blocks, config.block_size)
            self.engine = Engine(config=config, runner=SimulatedRunner(time_model, pool, clock), clock=clock,
                                 scheduler_class=scheduler_class)
        self.promised_blocks = 0  # decode: blocks every request sent its way may need, landed or not
        self.reserved_blocks = 0  # decode: blocks the requests it runs may need
        self.awaiting: deque[tuple] = deque()  # decode: landed handoffs waiting for room

    @property
    def clock_s(self) -> float:
        return self.engine.clock()

    @property
    def queued_tokens(self) -> int:
        scheduler = self.engine.scheduler
        return sum(r.num_uncomputed for r in itertools.chain(scheduler.waiting, scheduler.running))


def instances(role: str, group: Instances, serving: Serving, policy: str = "continuous",
              scheduler_class: type[Scheduler] = Scheduler) -> list[Instance]:
    """The engines of `group`, for `role`."""
    model, config = step_time_model(serving, group.device, group.tp), engine_config(serving, group.device, group.tp,
                                                                                     policy)
    return [Instance(role, i, model, config, f"{role} {i} ({group.label})", scheduler_class)
            for i in range(group.count)]
