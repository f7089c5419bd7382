"""Chapter 03's bar, in one run: the numba paged decode kernel on 32 sequences of 2,048 tokens,
8 heads of 64, fp32, blocks of 16 scattered at random; its bandwidth against this machine's
measured memory roof, its speed against torch's gather-then-scaled_dot_product_attention, and
its error against the numpy reference.

    python benchmarks/paged.py [--json out.json]
"""
from __future__ import annotations

import argparse
import json

import numpy as np
import torch

from infra_lab import backend, hardware
from infra_lab.kernels import paged_attention


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
    reference = paged_attention.paged_decode_numpy(q, k_pool, v_pool, tables, lengths)
    got = paged_attention.paged_decode_numba(q, k_pool, v_pool, tables, lengths)
    moved = k_pool.nbytes + v_pool.nbytes
    figures = {"bytes_moved": moved, "numba_GBps": moved / ours / 1e9, "torch_GBps": moved / theirs / 1e9,
               "memory_roof_GBps": device.memory_bandwidth / 1e9,
               "share_of_roof": moved / ours / device.memory_bandwidth, "speedup_vs_torch": theirs / ours,
               "max_rel_error": float(np.abs(got - reference).max() / np.abs(reference).max())}
    print(f"paged decode, {batch} x {length} tokens, {heads} heads of {head_dim}, blocks of {block_size}: "
          f"numba {figures['numba_GBps']:.1f} GB/s = {figures['share_of_roof']:.0%} of the {figures['memory_roof_GBps']:.1f} GB/s roof; "
          f"torch gather+SDPA {figures['torch_GBps']:.1f} GB/s; numba/torch speed {figures['speedup_vs_torch']:.1f}x; "
          f"max rel error {figures['max_rel_error']:.1e}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(figures, handle, indent=1)


if __name__ == "__main__":
    main()
