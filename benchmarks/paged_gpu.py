"""Chapter 03's GPU bar, in one run on a CUDA machine: the torch face of paged decode attention
(the Triton kernel, reading K and V through the block tables) as a share of the GPU's measured
copy bandwidth, against torch's gather-then-scaled_dot_product_attention on the same data, and
against the numpy reference.

Two inputs, both with blocks of 16 scattered at random and laid out as PagedKVCache lays them out
(a block's K rows, then its V rows): the CPU bar's (32 sequences of 2,048 tokens, 8 heads of 64,
fp32) and a larger bf16 one (64 sequences of 4,096 tokens, 8 heads of 128). A sweep over the
kernel's tile, warps and split size shows how much its defaults leave behind.

    python benchmarks/paged_gpu.py [--json out.json] [--no-sweep] [--dry-run]

--dry-run checks the script without a GPU: tiny inputs on the CPU, under Triton's interpreter.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

if "--dry-run" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import numpy as np
import torch

from infra_lab import hardware
from infra_lab.kernels import paged_attention
from infra_lab.kernels.paged_attention_triton import default_split_tokens, paged_decode_triton

INPUTS = {"bar: 32 x 2048, 8 x 64, fp32": (32, 2048, 8, 64, torch.float32),  # batch, length, heads, head_dim, dtype
          "64 x 4096, 8 x 128, bf16": (64, 4096, 8, 128, torch.bfloat16)}
DRY_INPUTS = {"dry run: 2 x 64, 2 x 16, fp32": (2, 64, 2, 16, torch.float32),
              "dry run: 2 x 64, 2 x 16, bf16": (2, 64, 2, 16, torch.bfloat16)}
BLOCK_SIZE = 16
DEVICE = "cpu" if "--dry-run" in sys.argv else "cuda"


def gpu_seconds(run, calls: int = 20, repeats: int = 7, graph: bool = True) -> dict:
    """Per-call seconds of `run`: CUDA events around `calls` back-to-back calls, the best and the
    median of `repeats` such loops. With `graph`, the calls are replays of one CUDA graph that
    holds `run` (as serving engines capture their decode steps), so Python's launch overhead drops
    out and what is timed is the GPU's work; without, each call launches from Python."""
    if DEVICE == "cpu":  # dry run: one call, wall clock
        started = time.perf_counter()
        run()
        seconds = time.perf_counter() - started
        return {"best": seconds, "median": seconds}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (and compile) off the capture
        run()
    torch.cuda.current_stream().wait_stream(side)
    if graph:
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            run()
        run = captured.replay
    run()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        for _ in range(calls):
            run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return {"best": min(times), "median": float(np.median(times))}


def scattered(batch, length, heads, head_dim, dtype, seed=0):
    """q, k_pool, v_pool (views of one K-beside-V pool), tables, lengths on the GPU."""
    generator = torch.Generator(device=DEVICE).manual_seed(seed)
    per_seq = length // BLOCK_SIZE
    kv = torch.randn(batch * per_seq, 2, BLOCK_SIZE, heads, head_dim, device=DEVICE, generator=generator).to(dtype)
    tables = torch.randperm(batch * per_seq, device=DEVICE, generator=generator).reshape(batch, per_seq)
    lengths = torch.full((batch,), length, device=DEVICE)
    q = torch.randn(batch, heads, head_dim, device=DEVICE, generator=generator).to(dtype)
    return q, kv[:, 0], kv[:, 1], tables, lengths


def rel_err(got, q, k_pool, v_pool, tables, lengths) -> float:
    """Max error against the float64 numpy reference, relative to the largest output."""
    host = [x.float().cpu().numpy() if x.is_floating_point() else x.cpu().numpy() for x in (q, k_pool, v_pool, tables, lengths)]
    reference = paged_attention.paged_decode_numpy(*host)
    return float(np.abs(got.float().cpu().numpy() - reference).max() / np.abs(reference).max())


def random_cases(n: int, seed=0) -> float:
    """Worst relative error over small random inputs: GQA, ragged lengths, odd block sizes and d."""
    rng = np.random.default_rng(seed)
    worst = 0.0
    for _ in range(n):
        batch, n_kv, group = int(rng.integers(1, 5)), int(rng.integers(1, 3)), int(rng.choice([1, 2, 4]))
        d, block_size, length = int(rng.choice([8, 24, 64, 128])), int(rng.choice([1, 5, 16])), int(rng.integers(1, 700))
        per_seq = -(-length // block_size)
        num_blocks = batch * per_seq + 2
        pool = rng.standard_normal((num_blocks, 2, block_size, n_kv, d)).astype(np.float32)
        tables = rng.permutation(num_blocks)[: batch * per_seq].reshape(batch, per_seq)
        lengths = rng.integers(1, length + 1, batch)
        q = rng.standard_normal((batch, n_kv * group, d)).astype(np.float32)
        reference = paged_attention.paged_decode_numpy(q, pool[:, 0], pool[:, 1], tables, lengths)
        kv, tables_gpu, lengths_gpu, q_gpu = (torch.from_numpy(x).to(DEVICE) for x in (pool, tables, lengths, q))
        got = paged_decode_triton(q_gpu, kv[:, 0], kv[:, 1], tables_gpu, lengths_gpu).cpu().numpy()
        worst = max(worst, float(np.abs(got - reference).max() / np.abs(reference).max()))
    return worst


def model_tokens_same() -> bool:
    """The small GPT gives the same greedy tokens from a paged pool as from contiguous caches."""
    from infra_lab import backend, model
    from infra_lab.model.generate import generate_many

    with backend.using("torch", DEVICE):
        target = model.load("target")
        prompts = ["import os\n", "class Config:\n", "def main():\n"]
        pool = target.new_paged_cache(num_blocks=16, block_size=16)
        return generate_many(target, prompts, 40, paged=pool) == generate_many(target, prompts, 40)


def measure(copy_bandwidth: float, sweep: bool = True) -> dict:
    dry = DEVICE == "cpu"
    figures = {"copy_bandwidth_TBps": copy_bandwidth / 1e12, "random_cases_max_rel_err": random_cases(3 if dry else 40),
               "model_greedy_tokens_same_from_paged_pool": model_tokens_same()}
    for name, shape in (DRY_INPUTS if dry else INPUTS).items():
        q, k_pool, v_pool, tables, lengths = args = scattered(*shape)
        cache_bytes = 2 * k_pool.numel() * k_pool.element_size()  # every K and V row, read once

        def share(seconds):
            return {"seconds": seconds, "cache_TBps": cache_bytes / seconds / 1e12,
                    "share_of_copy_bandwidth": cache_bytes / seconds / copy_bandwidth}

        ours = gpu_seconds(lambda: paged_decode_triton(*args))
        eager = gpu_seconds(lambda: paged_decode_triton(*args), graph=False)
        theirs = gpu_seconds(lambda: paged_attention.gather_then_sdpa(*args), calls=5)
        row = {"cache_MiB": cache_bytes / 2**20,
               "split_tokens": default_split_tokens(len(q), q.shape[1], tables.shape[1] * BLOCK_SIZE, 64, q.device),
               "triton": share(ours["best"]), "triton_median": share(ours["median"]),
               "triton_launched_from_python": share(eager["best"]),
               "gather_then_sdpa": share(theirs["best"]), "speedup_vs_gather": theirs["best"] / ours["best"],
               "torch_face_runs_triton": paged_attention.uses_triton(q.device)}
        if q.dtype == torch.float32:  # the float64 reference of 2 x 1 GiB of bf16 would take minutes
            row["rel_err"] = rel_err(paged_attention.paged_decode_torch(*args), *args)
        else:  # against torch's own path on float32 copies of the same bf16 values
            exact = paged_attention.gather_then_sdpa(q.float(), k_pool.float(), v_pool.float(), tables, lengths)
            row["rel_err_vs_fp32_gather_then_sdpa"] = float((paged_decode_triton(*args).float() - exact).abs().max()
                                                            / exact.abs().max())
        if sweep:
            row["sweep"] = []
            for tile in (16, 32) if dry else (16, 32, 64, 128):
                for num_warps in (2, 4, 8):
                    for split_tokens in (32, None) if dry else (256, 512, 1024, None):
                        seconds = gpu_seconds(lambda: paged_decode_triton(*args, tile=tile, split_tokens=split_tokens,
                                                                          num_warps=num_warps), calls=10, repeats=3)["best"]
                        row["sweep"].append({"tile": tile, "num_warps": num_warps, "split_tokens": split_tokens,
                                             "share_of_copy_bandwidth": cache_bytes / seconds / copy_bandwidth})
            row["sweep"].sort(key=lambda r: -r["share_of_copy_bandwidth"])
            row["sweep"] = row["sweep"][:8]  # the best eight
        figures[name] = row
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("--no-sweep", action="store_true", help="skip the sweep over tile, warps and split size")
    parser.add_argument("--dry-run", action="store_true", help="tiny inputs on the CPU, under Triton's interpreter")
    args = parser.parse_args()
    if DEVICE == "cuda" and not torch.cuda.is_available():
        parser.error("needs a CUDA GPU; on CPU, benchmarks/paged.py measures the numba kernel")
    started = time.perf_counter()
    device = hardware.measure(target=DEVICE, refresh=DEVICE == "cuda", progress=False)
    figures = {"device": device.name, **measure(device.memory_bandwidth, sweep=not args.no_sweep)}
    figures["seconds"] = time.perf_counter() - started
    print(json.dumps(figures, indent=1))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(figures, out, indent=1)


if __name__ == "__main__":
    main()
