"""The AI-infrastructure stack, and the first measurements of where the silicon sits idle.

A request's latency splits into prefill (the whole prompt in one pass, which sets the time to
first token, TTFT) and decode (one token per step, which sets the time per output token, TPOT).
A device can be "busy" by a utilization counter and still idle most of the time: between
kernels (execution-idle), or inside memory-bound kernels whose arithmetic units wait for bytes.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from infra_lab import backend as backends
from infra_lab.kernels.gemv import gemv


@dataclass(frozen=True)
class Layer:
    name: str
    examples: str
    chapters: tuple[str, ...]  # book chapter numbers that build this layer


STACK: tuple[Layer, ...] = (
    Layer("Serving and orchestration", "routers, autoscalers, priorities, hot reload; "
          "prefill/decode disaggregation", ("06",)),
    Layer("Inference engine", "schedulers, continuous batching, paged and radix KV caches, "
          "speculative decoding", ("03", "04", "05", "07")),
    Layer("Training systems", "ZeRO, data/tensor/pipeline parallelism, RL post-training",
          ("10", "11")),
    Layer("Model and framework", "the transformer, attention kernels, MoE layers, "
          "quantized formats; PyTorch", ("02", "08", "09")),
    Layer("System software", "CUDA/ROCm, compilers (numba, Triton), collectives (NCCL, gloo)",
          ("00",)),
    Layer("Hardware", "GPU/TPU compute units, HBM, interconnects; their roofline", ("01",)),
)

PLANNED: frozenset[str] = frozenset()  # chapters not yet in the book: drawn as to come

CHAPTERS: dict[str, str] = {  # chapter number -> short name, as the stack diagram labels it
    "00": "the stack", "01": "roofline", "02": "attention", "03": "paged KV",
    "04": "radix KV", "05": "batching", "06": "P/D split", "07": "speculative",
    "08": "precision", "09": "MoE", "10": "parallelism", "11": "RL",
}


def decode_intensity(n_params: float, batch: int, bytes_per_param: float) -> float:
    """FLOP/byte of the weight matmuls in one decode step: each of `batch` tokens does 2 FLOPs
    per parameter, while every parameter is read from memory once."""
    return 2 * n_params * batch / (n_params * bytes_per_param)


def ttft_tpot(arrival_s: float, token_times_s: list[float]) -> tuple[float, float]:
    """(TTFT, TPOT) in seconds for one request.

    TTFT is the first token's time minus the arrival; TPOT is the mean gap between later
    tokens, (last - first) / (n - 1), and 0.0 for a one-token answer.
    """
    if not token_times_s:
        raise ValueError("a request needs at least one output token; got none")
    ttft = token_times_s[0] - arrival_s
    if len(token_times_s) == 1:
        return ttft, 0.0
    return ttft, (token_times_s[-1] - token_times_s[0]) / (len(token_times_s) - 1)


def idle_fraction(intervals: list[tuple[float, float]], start_s: float, end_s: float) -> float:
    """Fraction of the window [start_s, end_s] in which no kernel runs.

    `intervals` are (begin, end) kernel executions; they may overlap (several streams) and may
    stick out of the window, so the busy time is the length of their union inside it.
    """
    if not end_s > start_s:
        raise ValueError(f"the window needs end_s > start_s; got [{start_s}, {end_s}]")
    busy, reach = 0.0, start_s
    for begin, end in sorted(intervals):
        begin, end = max(begin, reach), min(end, end_s)
        if end > begin:
            busy += end - begin
            reach = end
    return 1.0 - busy / (end_s - start_s)


def decode_timeline(width: int, n_layers: int = 8, steps: int = 20,
                    seed: int = 0) -> tuple[list[tuple[float, float]], float, float]:
    """Run a toy batch-1 decode for real and record when kernels ran.

    Each step pushes a vector through `n_layers` GEMVs of width x width (fp32) on the current
    backend, with the host-side work of a real loop in between (a nonlinearity and picking the
    next input). A kernel's interval opens just before the `gemv` call and closes when it has
    returned and, on a GPU, when `synchronize` says the kernel has finished: the call's Python
    dispatch, the launch and the wait count as busy. The time between intervals is the loop's
    own work: the nonlinearity (a small kernel of its own on a GPU, numpy's tanh on a CPU)
    and the bookkeeping. On a GPU the weights stay on the device. Returns the kernel
    (begin, end) intervals and the window, in seconds (`time.perf_counter`).
    """
    if width < 1 or n_layers < 1 or steps < 1:
        raise ValueError(f"width, n_layers and steps must be >= 1; "
                         f"got {width}, {n_layers}, {steps}")
    rng = np.random.default_rng(seed)
    weights = [(rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32)
               for _ in range(n_layers)]  # each (width, width)
    x = rng.standard_normal(width).astype(np.float32)  # (width,)
    current = backends.current()
    nonlinearity, synchronize = np.tanh, lambda: None
    if current.name == "torch":
        import torch

        weights = [torch.from_numpy(w).to(current.device) for w in weights]
        x, nonlinearity = torch.from_numpy(x).to(current.device), torch.tanh
        if current.device == "cuda":
            synchronize = torch.cuda.synchronize
    gemv(weights[0], x)  # compile or warm up before timing
    synchronize()
    intervals: list[tuple[float, float]] = []
    start = time.perf_counter()
    for _ in range(steps):
        for w in weights:
            begin = time.perf_counter()
            y = gemv(w, x)
            synchronize()
            intervals.append((begin, time.perf_counter()))
            x = nonlinearity(y)  # host work between kernels
    return intervals, start, time.perf_counter()


def step_windows(intervals: list[tuple[float, float]], start_s: float, end_s: float,
                 n_layers: int) -> list[tuple[float, float]]:
    """The (begin, end) of each decode step of a `decode_timeline`: step k runs from the call
    of its first kernel (the window's start, for the first step) to the call of the next
    step's first kernel (the window's end, for the last), the work after its last kernel
    included. The windows tile [start_s, end_s]."""
    if n_layers < 1 or not intervals or len(intervals) % n_layers:
        raise ValueError(f"need a whole number of steps of n_layers >= 1 kernels; got "
                         f"{len(intervals)} intervals and n_layers={n_layers}")
    calls = [begin for begin, _ in intervals[n_layers::n_layers]]  # each later step's first
    edges = [start_s, *calls, end_s]
    return list(zip(edges[:-1], edges[1:]))
