"""A bursty request trace: the request rate swings between a base and `swing` times the base
(chapter 06's autoscaling runs on a 5x swing), with requests of log-normal lengths.

The rate is a square wave with raised-cosine ramps: `trough_s` at the base, `ramp_s` up, `peak_s`
at the top, `ramp_s` down, again and again. Arrivals are a non-homogeneous renewal process by
time rescaling: gaps of mean 1 drawn in units of the integrated rate, from a gamma distribution
of shape `burstiness` (1: Poisson; below 1 burstier, as vLLM's `--burstiness`). Lengths are
log-normal around stated medians (`WORKLOADS`), clipped so prompt + output fits the context.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from infra_lab.serving.traffic import TimedRequest


@dataclass(frozen=True)
class Lengths:
    prompt_median: float  # tokens
    output_median: float  # tokens
    sigma: float = 1.0  # of the log of each length (traffic.sharegpt_lengths' default spread)
    max_len: int = 8192  # prompt + output, tokens (LLaMA-3-8B's context)

    def __post_init__(self):
        if not (self.prompt_median >= 1 and self.output_median >= 1 and 0 <= self.sigma < math.inf
                and self.max_len >= 2):
            raise ValueError(f"need medians >= 1 token, a finite sigma >= 0 and max_len >= 2; got {self}")

    def draw(self, n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """(prompt, output) token counts, (n,) each: prompt in [1, max_len - 1], output >= 1 and
        prompt + output <= max_len."""
        rng = np.random.default_rng(seed)
        prompt = np.clip(np.rint(rng.lognormal(math.log(self.prompt_median), self.sigma, n)), 1, self.max_len - 1)
        output = np.clip(np.rint(rng.lognormal(math.log(self.output_median), self.sigma, n)), 1, self.max_len - prompt)
        return prompt.astype(np.int64), output.astype(np.int64)


WORKLOADS = {
    # Long prompts, short answers: code completion. Splitwise (Patel et al., ISCA 2024) reports medians
    # of about 1,500 prompt and 13 output tokens for the coding service of its Azure trace (Azure LLM
    # inference trace 2023). The GPU's work is mostly prefill.
    "code": Lengths(1500, 13),
    # Chat: ShareGPT's means (161.31 prompt, 337.99 output tokens; vLLM paper, Section 6.1), as medians
    # of a log-normal with sigma 1 (median = mean * exp(-sigma^2 / 2)).
    "sharegpt": Lengths(161.31 * math.exp(-0.5), 337.99 * math.exp(-0.5)),
}


@dataclass(frozen=True)
class BurstyRate:
    base_per_s: float  # requests/s in the trough
    swing: float = 5.0  # peak / base
    trough_s: float = 150.0
    ramp_s: float = 90.0
    peak_s: float = 60.0

    def __post_init__(self):
        if not (0 < self.base_per_s < math.inf and 1 <= self.swing < math.inf):
            raise ValueError(f"need base_per_s > 0 and swing >= 1 (finite); got {self.base_per_s}, {self.swing}")
        if not all(0 <= s < math.inf for s in (self.trough_s, self.ramp_s, self.peak_s)) or self.period_s <= 0:
            raise ValueError(f"phase lengths must be finite, >= 0 and not all 0; got trough {self.trough_s}, "
                             f"ramp {self.ramp_s}, peak {self.peak_s}")

    @property
    def period_s(self) -> float:
        return self.trough_s + 2 * self.ramp_s + self.peak_s

    @property
    def peak_per_s(self) -> float:
        return self.base_per_s * self.swing

    @property
    def mean_per_s(self) -> float:
        """The rate averaged over a period (a raised-cosine ramp averages halfway)."""
        top = self.swing - 1
        return self.base_per_s * (1 + top * (self.ramp_s + self.peak_s) / self.period_s)

    def __call__(self, t_s) -> np.ndarray:
        """Requests/s at times `t_s` (any shape); a period starts with its trough."""
        phase = np.mod(np.asarray(t_s, float), self.period_s) - self.trough_s  # < 0: in the trough
        rise = np.clip(phase / self.ramp_s, 0, 1) if self.ramp_s else (phase >= 0).astype(float)
        fall_at = phase - self.ramp_s - self.peak_s
        fall = np.clip(fall_at / self.ramp_s, 0, 1) if self.ramp_s else (fall_at >= 0).astype(float)
        up = (1 - np.cos(np.pi * rise)) / 2 - (1 - np.cos(np.pi * fall)) / 2  # 0 in the trough, 1 at the peak
        return self.base_per_s * (1 + (self.swing - 1) * up)

    def scaled(self, time_scale: float) -> BurstyRate:
        """The same wave with every phase `time_scale` times as long (and the same rates)."""
        return BurstyRate(self.base_per_s, self.swing, self.trough_s * time_scale, self.ramp_s * time_scale,
                          self.peak_s * time_scale)


def arrivals(rate: BurstyRate, duration_s: float, seed: int = 0, burstiness: float = 1.0,
             grid_s: float = 0.01) -> np.ndarray:
    """Arrival times in [0, duration_s), sorted: gamma gaps (shape `burstiness`, mean 1) in units of
    the integrated rate, mapped back to seconds on a grid of `grid_s`."""
    if not (0 < duration_s < math.inf and 0 < burstiness < math.inf and 0 < grid_s < math.inf):
        raise ValueError(f"need finite duration_s, burstiness and grid_s > 0; got {duration_s}, {burstiness}, "
                         f"{grid_s}")
    t = np.linspace(0.0, duration_s, int(math.ceil(duration_s / grid_s)) + 1)  # (g,)
    r = rate(t)
    integrated = np.concatenate([[0.0], np.cumsum((r[1:] + r[:-1]) / 2 * np.diff(t))])  # (g,) expected arrivals
    rng = np.random.default_rng(seed)
    expected = integrated[-1]
    n = int(expected + 10 * math.sqrt(expected / burstiness) + 10)  # enough gaps to pass the end
    points = np.cumsum(rng.gamma(burstiness, 1 / burstiness, n))
    while points[-1] < expected:
        points = np.concatenate([points, points[-1] + np.cumsum(rng.gamma(burstiness, 1 / burstiness, n))])
    points = points[points < expected]
    return np.interp(points, integrated, t)


def bursty_trace(rate: BurstyRate, duration_s: float, lengths: Lengths, seed: int = 0,
                 burstiness: float = 1.0) -> list[TimedRequest]:
    """Requests arriving at `rate` over [0, duration_s), with lengths drawn from `lengths`, in
    arrival order. Prompts are token 1 repeated (the simulator reads only their length); requests of
    one prompt length share one list."""
    arrival_seed, length_seed = (int(s.generate_state(1)[0]) for s in np.random.SeedSequence(seed).spawn(2))
    times = arrivals(rate, duration_s, arrival_seed, burstiness)
    prompts, outputs = lengths.draw(len(times), length_seed)
    shared: dict[int, list[int]] = {}
    return [TimedRequest(float(t), shared.setdefault(int(p), [1] * int(p)), int(o))
            for t, p, o in zip(times, prompts, outputs)]
