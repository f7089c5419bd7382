"""Chapter 03's bar, in one run: the numba paged decode kernel on 32 sequences of 2,048 tokens,
8 heads of 64, fp32, blocks of 16 scattered at random; its bandwidth against this machine's
measured memory roof, its speed against torch's gather-then-scaled_dot_product_attention, and
its error against the numpy reference.

Two read-only probes say what the roof means for this kernel, which only reads: a plain sum over
the same bytes read in order (the machine's read bandwidth; the copy roof counts reads and
writes, which can overlap), and the same sum through the same scattered block tables (the
access pattern's own ceiling).

    python benchmarks/paged.py [--json out.json]
"""
from __future__ import annotations

import argparse
import json

import numba
import numpy as np
import torch

from infra_lab import backend, hardware
from infra_lab.kernels import paged_attention


@numba.njit(fastmath=True)
def _sum(values):  # (n,) -> float32; fastmath lets LLVM split the sum into vector lanes
    total = np.float32(0)
    for i in range(values.shape[0]):
        total += values[i]
    return total


@numba.njit(parallel=True, fastmath=True)
def read_blocks(pool, tables):
    """Sum every block named by tables (rows, blocks) of pool (num_blocks, block_elements), one
    row per task: the kernel's reads without its arithmetic."""
    out = np.zeros(tables.shape[0], np.float32)
    for row in numba.prange(tables.shape[0]):
        total = np.float32(0)
        for j in range(tables.shape[1]):
            total += _sum(pool[tables[row, j]])
        out[row] = total
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    print(backend.describe())
    rng = np.random.default_rng(0)
    batch, length, heads, head_dim, block_size = 32, 2048, 8, 64, 16
    per_seq = length // block_size
    k_pool, v_pool = (rng.standard_normal((batch * per_seq, block_size, heads, head_dim)).astype(np.float32) for _ in range(2))
    tables = rng.permutation(batch * per_seq).reshape(batch, per_seq)
    lengths = np.full(batch, length)
    q = rng.standard_normal((batch, heads, head_dim)).astype(np.float32)
    device = hardware.measure(target="cpu", refresh=True)
    ours = hardware.best_seconds(lambda: paged_attention.paged_decode_numba(q, k_pool, v_pool, tables, lengths), 7)
    torch_args = [torch.from_numpy(np.ascontiguousarray(a)) for a in (q, k_pool, v_pool, tables, lengths)]
    theirs = hardware.best_seconds(lambda: paged_attention.paged_decode_torch(*torch_args), 7)
    flat_k, flat_v = k_pool.reshape(len(k_pool), -1), v_pool.reshape(len(v_pool), -1)  # (blocks, elements)
    tasks = tables.reshape(-1, 16)  # 16 blocks per task, as the kernel splits
    in_order = np.arange(tables.size).reshape(tasks.shape)
    scattered_read = hardware.best_seconds(lambda: (read_blocks(flat_k, tasks), read_blocks(flat_v, tasks)), 7)
    ordered_read = hardware.best_seconds(lambda: (read_blocks(flat_k, in_order), read_blocks(flat_v, in_order)), 7)
    reference = paged_attention.paged_decode_numpy(q, k_pool, v_pool, tables, lengths)
    got = paged_attention.paged_decode_numba(q, k_pool, v_pool, tables, lengths)
    moved = k_pool.nbytes + v_pool.nbytes
    figures = {"bytes_moved": moved, "numba_GBps": moved / ours / 1e9, "torch_GBps": moved / theirs / 1e9,
               "memory_roof_GBps": device.memory_bandwidth / 1e9,
               "share_of_roof": moved / ours / device.memory_bandwidth, "speedup_vs_torch": theirs / ours,
               "read_in_order_GBps": moved / ordered_read / 1e9, "read_scattered_GBps": moved / scattered_read / 1e9,
               "share_of_read_in_order": ordered_read / ours, "share_of_read_scattered": scattered_read / ours,
               "max_rel_error": float(np.abs(got - reference).max() / np.abs(reference).max())}
    print(f"paged decode, {batch} x {length} tokens, {heads} heads of {head_dim}, blocks of {block_size}: "
          f"numba {figures['numba_GBps']:.1f} GB/s = {figures['share_of_roof']:.0%} of the {figures['memory_roof_GBps']:.1f} GB/s roof; "
          f"torch gather+SDPA {figures['torch_GBps']:.1f} GB/s; numba/torch speed {figures['speedup_vs_torch']:.1f}x; "
          f"max rel error {figures['max_rel_error']:.1e}")
    print(f"read-only probes over the same bytes: in order {figures['read_in_order_GBps']:.1f} GB/s (the kernel reaches "
          f"{figures['share_of_read_in_order']:.0%}), through the same scattered tables {figures['read_scattered_GBps']:.1f} GB/s "
          f"(the kernel reaches {figures['share_of_read_scattered']:.0%})")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(figures, handle, indent=1)


if __name__ == "__main__":
    main()
