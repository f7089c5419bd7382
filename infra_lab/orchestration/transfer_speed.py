"""How fast K and V move between two processes on this machine (chapter 06): kv_transfer's two
transports against a plain memory copy of the same bytes in one process.

Two ranks (processes.run_on_ranks). Rank 0 sends a transfer of the given size, the way a prefill
worker does (header first, then the K and V); rank 1 takes it the way a decode worker does (into
its inbox over gloo, or copied out of the shared-memory segment) and answers with one small
message. A transfer's time is that round trip less the round trip of an empty transfer (the two
control messages), the best of `repeats`; transfers smaller than BATCH_BYTES go several in a row
before the one answer, and the time is shared among them. The memory copy is numpy's copy of the same number of
bytes from one array to another, the best of `repeats`: the floor any transport on one machine
works against. A copy into freshly allocated memory (`first_touch`) shows what a new
shared-memory segment costs: the kernel maps and zeroes each page on its first touch.
"""
from __future__ import annotations

import json
import os
import time

import numpy as np

WIRE_HEADER = {"wire": 1, "state": {}, "kv": None}
BATCH_BYTES = 64 * 2**20  # small transfers go this many bytes at a time, so that one control round trip
# (subtracted once per batch) is small beside them


def _header(transfer_id: str) -> bytes:
    return json.dumps(WIRE_HEADER | {"transfer_id": transfer_id}).encode()


def _rank(sizes: list[int], repeats: int) -> dict:
    import torch
    import torch.distributed as dist

    from infra_lab.orchestration import kv_transfer

    rank = dist.get_rank()
    gloo = kv_transfer.GlooLink(rank, 2, None, receive=rank == 1)
    shm = kv_transfer.SharedMemoryLink()
    ack = torch.zeros(1, dtype=torch.int64)
    results: dict = {"gloo": {}, "shm": {}, "memcpy": {}, "first_touch": {}}
    for transport in ("gloo", "shm"):
        for size in [0] + sizes:
            payload = np.full(size, 7, np.uint8)
            batch = max(1, BATCH_BYTES // max(size, 1)) if size else 1
            best = float("inf")
            for i in range(repeats):
                ids = [f"{transport}{size}x{i}b{b}p{os.getppid()}" for b in range(batch)]
                dist.barrier()
                if rank == 0:
                    started = time.perf_counter()
                    for transfer_id in ids:
                        if transport == "gloo":
                            gloo.send(1, _header(transfer_id), payload, timeout_s=120)
                        else:
                            shm.send(transfer_id, _header(transfer_id), payload)
                    if transport == "shm":
                        dist.send(ack, 1)  # "they are written"
                    dist.recv(ack, 1)
                    best = min(best, time.perf_counter() - started)
                else:
                    if transport == "shm":
                        dist.recv(ack, 0)
                    for transfer_id in ids:
                        _, got = (gloo if transport == "gloo" else shm).claim(transfer_id, 120)
                        assert got.size == size
                    dist.send(ack, 0)
            results[transport][size] = (best, batch)
    if rank == 0:
        for size in sizes:
            src, dst = np.full(size, 7, np.uint8), np.empty(size, np.uint8)
            best = float("inf")
            for _ in range(repeats):
                started = time.perf_counter()
                np.copyto(dst, src)
                best = min(best, time.perf_counter() - started)
            results["memcpy"][size] = best
            best = float("inf")
            for _ in range(repeats):  # the same copy into memory never touched: each page faults in first
                started = time.perf_counter()
                fresh = np.empty(size, np.uint8)
                np.copyto(fresh, src)
                best = min(best, time.perf_counter() - started)
                del fresh
            results["first_touch"][size] = best
    if rank == 1:  # the receiver thread waits on a message that will not come: close it
        dist.barrier()
        return {}
    gloo.send(1, json.dumps({"wire": 1, "transfer_id": "end", "close": True, "state": {}, "kv": None}).encode(),
              np.zeros(0, np.uint8), timeout_s=60)
    dist.barrier()
    return results


def measure(sizes: list[int], repeats: int = 5) -> dict:
    """{size in bytes: {"gloo_s", "shm_s", "memcpy_s", "gloo_share", "shm_share"}}: seconds to move
    `size` bytes each way, and each transport's speed as a share of the memory copy's."""
    from infra_lab.processes import run_on_ranks

    if not sizes or min(sizes) < 1:
        raise ValueError(f"sizes must be byte counts >= 1; got {sizes}")
    results, _ = run_on_ranks(_rank, 2, list(sizes), repeats, timeout_s=600)
    out = {}
    for size in sizes:
        control = {t: results[t][0][0] for t in ("gloo", "shm")}
        each = {t: max((results[t][size][0] - control[t]) / results[t][size][1], 1e-9) for t in ("gloo", "shm")}
        copy = results["memcpy"][size]
        out[size] = {"gloo_s": each["gloo"], "shm_s": each["shm"], "memcpy_s": copy,
                     "gloo_share": copy / each["gloo"], "shm_share": copy / each["shm"],
                     "gloo_gb_s": size / each["gloo"] / 1e9, "shm_gb_s": size / each["shm"] / 1e9,
                     "memcpy_gb_s": size / copy / 1e9, "first_touch_gb_s": size / results["first_touch"][size] / 1e9,
                     "batch": results["gloo"][size][1],
                     "control_round_trip_s": control}
    return out
