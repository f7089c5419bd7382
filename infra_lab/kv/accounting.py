"""Where KV-cache memory goes: a request stream served under a fixed budget, paged or contiguous.

Every engine step admits waiting requests (first come, first served) while memory allows, and
every running request emits one token; a request leaves when its output is done. Contiguous
allocation (as in Orca, which the vLLM paper measures) reserves one range per request up front:
`max_len` slots ("max"), the next power of two of its true length ("pow2"), or exactly its true
length ("oracle"), from a first-fit free list. Paging takes `block_size`-token blocks as tokens
arrive. Per step we count slots holding real tokens, reserved but not yet used, lost in the last
partial block (internal fragmentation), and free but unusable because no hole is large enough
for the next request (external fragmentation).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Mean prompt and output lengths (tokens) of the two datasets in the vLLM paper (Kwon et al.,
# SOSP 2023, Section 6.1 / Figure 11): ShareGPT 161.31 and 337.99, Alpaca 19.31 and 58.45.
DATASETS = {"sharegpt": (161.31, 337.99), "alpaca": (19.31, 58.45)}
RESERVATION_POLICIES = ("paged", "max", "pow2", "oracle")


@dataclass(frozen=True)
class Request:
    prompt: int  # tokens
    output: int


def synthetic_requests(dataset: str, n: int, seed: int = 0, max_len: int = 2048, sigma: float = 1.0,
                       scale: float = 1.0) -> list[Request]:
    """Log-normal prompt and output lengths with the dataset's means times `scale` (the spread
    `sigma` is our choice; the paper gives histograms, not parameters), clipped so that prompt +
    output fits `max_len`."""
    if dataset not in DATASETS:
        raise ValueError(f"unknown dataset {dataset!r}; choose one of {', '.join(DATASETS)}")
    if n < 1 or max_len < 2:
        raise ValueError(f"need n >= 1 and max_len >= 2; got n={n}, max_len={max_len}")
    if not 0 < scale < np.inf:
        raise ValueError(f"scale must be a positive finite number; got {scale}")
    rng = np.random.default_rng(seed)
    requests = []
    for mean in zip(*[rng.lognormal(np.log(m * scale) - sigma**2 / 2, sigma, n) for m in DATASETS[dataset]]):
        prompt = int(np.clip(round(mean[0]), 1, max_len - 1))
        output = int(np.clip(round(mean[1]), 1, max_len - prompt))
        requests.append(Request(prompt, output))
    return requests


class FirstFit:
    """A contiguous address space of `capacity` slots with first-fit allocation."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.holes: list[list[int]] = [[0, capacity]]  # [start, size], sorted by start
        self.taken: dict[int, int] = {}

    def allocate(self, size: int) -> int | None:
        for hole in self.holes:
            if hole[1] >= size:
                start = hole[0]
                hole[0] += size
                hole[1] -= size
                self.holes = [h for h in self.holes if h[1] > 0]
                self.taken[start] = size
                return start
        return None

    def free(self, start: int) -> None:
        size = self.taken.pop(start)
        self.holes.append([start, size])
        self.holes.sort()
        merged: list[list[int]] = []
        for hole in self.holes:
            if merged and merged[-1][0] + merged[-1][1] == hole[0]:
                merged[-1][1] += hole[1]
            else:
                merged.append(hole)
        self.holes = merged

    @property
    def free_slots(self) -> int:
        return sum(size for _, size in self.holes)


@dataclass(frozen=True)
class Usage:
    policy: str
    steps: int
    busy_steps: int  # steps with requests waiting for memory: the averages below are over these
    # (over every step if memory never ran short)
    mean_running: float  # requests in flight
    real: float  # shares of the budget
    reserved_unused: float  # contiguous: reserved for tokens not generated yet (over-reservation)
    internal: float  # paged: the unused tail of each sequence's last block
    external: float  # contiguous: free, but in holes too small for the next request
    free: float
    preemptions: int = 0
    # paged: block-table entries per request in flight (blocks held over requests, both summed
    # over the same steps); a contiguous range needs one (start, size) pair instead
    table_entries: float = 0.0


def _reservation(policy: str, request: Request, max_len: int) -> int:
    length = request.prompt + request.output
    return {"max": max_len, "pow2": 1 << (length - 1).bit_length(), "oracle": length}[policy]


def _account(totals, running, waiting, space, free_blocks, policy, block_size, budget, max_len) -> None:
    real = sum(r.prompt + generated for r, generated, _ in running)
    totals["running"] += len(running)
    totals["real"] += real / budget
    if policy == "paged":
        blocks = sum(blocks for _, _, blocks in running)
        totals["blocks"] += blocks
        held = blocks * block_size
        totals["internal"] += (held - real) / budget
        totals["free"] += free_blocks * block_size / budget
    else:
        reserved = sum(space.taken.values())
        totals["reserved_unused"] += (reserved - real) / budget
        blocked = waiting and space.free_slots >= _reservation(policy, waiting[0], max_len)
        stranded = space.free_slots if blocked else 0
        totals["external"] += stranded / budget  # enough free in total, but no hole big enough
        totals["free"] += (space.free_slots - stranded) / budget


def simulate(requests: list[Request], budget_tokens: int, policy: str, block_size: int = 16,
             max_len: int = 2048) -> Usage:
    """Serve `requests` (all waiting at the start) with `budget_tokens` KV slots."""
    if policy not in RESERVATION_POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose one of {', '.join(RESERVATION_POLICIES)}")
    if block_size < 1 or budget_tokens < max(block_size, 1):
        raise ValueError(f"need block_size >= 1 and a budget of at least one block; got {block_size}, {budget_tokens}")
    too_long = [r for r in requests if r.prompt + r.output > min(max_len, budget_tokens)]
    if too_long:
        raise ValueError(f"a request of {too_long[0].prompt + too_long[0].output} tokens cannot fit max_len "
                         f"{max_len} or the budget of {budget_tokens}")
    waiting = list(requests)
    running: list[list] = []  # [request, generated, handle]
    space = FirstFit(budget_tokens) if policy != "paged" else None
    free_blocks = budget_tokens // block_size
    totals = dict.fromkeys(("running", "real", "reserved_unused", "internal", "external", "free",
                            "blocks"), 0.0)
    every = dict(totals)
    steps, preemptions, busy_steps = 0, 0, 0
    while waiting or running:
        while waiting:  # admit in order while the head fits
            head = waiting[0]
            if policy == "paged":
                need = -(-(head.prompt + 1) // block_size)
                if need > free_blocks:
                    break
                free_blocks -= need
                running.append([head, 1, need])
            else:
                start = space.allocate(_reservation(policy, head, max_len))
                if start is None:
                    break
                running.append([head, 1, start])
            waiting.pop(0)
        if not running:
            raise RuntimeError("the head request can never be admitted")  # unreachable after the check above
        steps += 1
        _account(every, running, waiting, space, free_blocks, policy, block_size, budget_tokens, max_len)
        if waiting:  # steps under memory pressure: someone is queued
            busy_steps += 1
            _account(totals, running, waiting, space, free_blocks, policy, block_size, budget_tokens, max_len)
        still = []
        for item in running:  # every running request emits a token
            request, generated, handle = item
            if generated >= request.output:
                if policy == "paged":
                    free_blocks += handle
                else:
                    space.free(handle)
                continue
            item[1] += 1
            still.append(item)
        running = still
        if policy == "paged":  # new blocks for sequences that crossed a block boundary
            for item in running:
                request, generated, blocks = item
                if -(-(request.prompt + generated) // block_size) <= blocks:
                    continue
                while free_blocks == 0:  # preempt the newest other request, as vLLM does
                    victim = running[-1] if running[-1] is not item else running[-2]
                    running.remove(victim)
                    free_blocks += victim[2]
                    done = victim[0].prompt + victim[1] - 1  # its KV is recomputed on readmission
                    waiting.insert(0, Request(done, victim[0].output - victim[1] + 1))
                    preemptions += 1
                free_blocks -= 1
                item[2] += 1
    shares, count = (totals, busy_steps) if busy_steps else (every, steps)  # no pressure: all steps
    return Usage(policy, steps, busy_steps, *(shares[key] / count for key in
                 ("running", "real", "reserved_unused", "internal", "external", "free")), preemptions,
                 shares["blocks"] / shares["running"] if policy == "paged" else 0.0)
