"""The engine's clock: wall time for the real engine, simulated time for the simulator, so the
same scheduler and the same metrics run on both."""
from __future__ import annotations

import time


class WallClock:
    """Seconds since the clock was made."""

    def __init__(self):
        self.origin = time.perf_counter()

    def __call__(self) -> float:
        return time.perf_counter() - self.origin

    def wait_until(self, t_s: float) -> None:
        time.sleep(max(0.0, t_s - self()))


class VirtualClock:
    """Seconds of simulated time: only `advance` and `wait_until` move it."""

    def __init__(self):
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"time cannot go back; got {seconds} s")
        self.now_s += seconds

    def wait_until(self, t_s: float) -> None:
        self.now_s = max(self.now_s, t_s)
