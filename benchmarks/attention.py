"""Chapter 02's bars, in one run on this machine:

1. tiled (FlashAttention) attention in numba against torch's CPU scaled_dot_product_attention:
   causal, fp32, L = 2048, d = 64, 8 heads; speed ratio, error against float64, extra memory;
2. generating to the full context with the KV cache against recomputing the prefix: speed ratio
   and whether greedy decoding gives the same tokens;
3. numba against torch logits of the trained model.

    python benchmarks/attention.py [--json out.json]
"""
from __future__ import annotations

import argparse
import json

import numpy as np
import torch
import torch.nn.functional as F

from infra_lab import backend, hardware, memory, model, roofline
from infra_lab.kernels import attention


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    print(backend.describe())
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((8, 2048, 64)).astype(np.float32) for _ in range(3))
    reference = attention.attention_numpy(q, k, v, causal=True)
    ours = attention.attention_numba(q, k, v)
    tq, tk, tv = (torch.from_numpy(x)[None] for x in (q, k, v))
    numba_s = hardware.best_seconds(lambda: attention.attention_numba(q, k, v), 7)
    torch_s = hardware.best_seconds(lambda: F.scaled_dot_product_attention(tq, tk, tv, is_causal=True), 7)
    flops = roofline.attention_prefill(2048, 8, 64, "fp32").flops
    figures = {
        "attention": {
            "numba_ms": numba_s * 1e3, "torch_ms": torch_s * 1e3, "speedup_vs_torch": torch_s / numba_s,
            "max_rel_error_vs_float64": float(np.abs(ours - reference).max() / np.abs(reference).max()),
            "numba_GFLOPs": flops / numba_s / 1e9, "torch_GFLOPs": flops / torch_s / 1e9,
            "blas_peak_GFLOPs": hardware.blas_flops("fp32") / 1e9,
            "extra_memory_MiB": memory.peak_extra_bytes(lambda: attention.attention_numba(q, k, v)) / 2**20
            if memory.supported() else None,
            "output_MiB": q.nbytes / 2**20,
        }
    }
    target = model.load("target")
    prompt = "import os\n"
    new = target.config.context - len(prompt)
    cached = model.generate(target, prompt, new, temperature=0, backend=backend.resolve("numba"))
    recomputed = model.generate(target, prompt, new, temperature=0, use_cache=False, backend=backend.resolve("numba"))
    figures["generation"] = {"new_tokens": new, "cached_s": cached.seconds, "recompute_s": recomputed.seconds,
                             "speedup": recomputed.seconds / cached.seconds,
                             "same_tokens": cached.new_tokens == recomputed.new_tokens,
                             "cached_tokens_per_s": cached.tokens_per_s}
    tokens = np.frombuffer(open(attention.__file__, "rb").read()[:512], np.uint8).astype(np.int64)
    numba_logits = target.forward(tokens, backend=backend.resolve("numba"))
    torch_logits = target.forward(tokens, backend=backend.resolve("torch", "cpu"))
    figures["logits_max_abs_diff_numba_vs_torch"] = float(np.abs(numba_logits - torch_logits).max())
    a = figures["attention"]
    print(f"attention L=2048 d=64 8 heads causal fp32: numba {a['numba_ms']:.1f} ms, torch {a['torch_ms']:.1f} ms, "
          f"numba/torch speed {a['speedup_vs_torch']:.2f}x; rel error {a['max_rel_error_vs_float64']:.1e}; "
          f"extra memory {a['extra_memory_MiB']:.1f} MiB (output {a['output_MiB']:.0f} MiB); "
          f"GFLOP/s numba {a['numba_GFLOPs']:.0f}, torch {a['torch_GFLOPs']:.0f}, BLAS peak {a['blas_peak_GFLOPs']:.0f}")
    g = figures["generation"]
    print(f"generation of {g['new_tokens']} tokens: cache {g['cached_s']:.2f} s, recompute {g['recompute_s']:.2f} s, "
          f"{g['speedup']:.1f}x, same tokens: {g['same_tokens']}")
    print(f"logits numba vs torch: max abs diff {figures['logits_max_abs_diff_numba_vs_torch']:.2e}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(figures, handle, indent=1)


if __name__ == "__main__":
    main()
