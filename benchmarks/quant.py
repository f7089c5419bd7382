"""Issue 17's bars for chapter 08's low precision, on the CPU with numba (torch on a CUDA GPU when
there is one). Each section is one function and one bar:

- formats: fp8 e4m3 and e5m2 rounding equals torch's float8_e4m3fn and float8_e5m2 for all 256
  codes and a million random floats (saturation, subnormals and NaN included);
- gemv: y = x W at batch 1 on a 4096 x 4096 matrix: the dequantizing numba kernels (int8 per
  channel and per group, int4 with group scales) against numpy's fp32 BLAS GEMV (and torch's, a
  peer), each as a share of the memory roof (the faster of a numba read-only STREAM and numpy's
  copy, measured in the same rounds) in the bytes it actually reads. "streamed" cycles through enough matrices to overflow the last-level
  cache, as a decode step reads weights it has not touched since the last token; "cached" repeats
  one matrix. Bars: int4 at least 3x and int8 at least 2x as fast as fp32 BLAS, streamed;
- batch: the same kernels from batch 1 to 256: the batch at which int4 stops beating fp32 BLAS,
  measured, beside the roofline's prediction (bytes over the measured bandwidth against the
  dequantization work over the kernel's measured rate, and 2 B n² FLOPs over BLAS's peak);
- quality: validation bits per byte of the shipped model for round-to-nearest, AWQ-style and
  GPTQ-style quantization at 8, 4 and 3 bits, and SmoothQuant's W8A8, against the model's bytes;
- training: the small model's training under fp32, fp16 without and with dynamic loss scaling,
  and bf16 autocast: loss after 200 steps, and the fp16 run's underflowed gradients;
- cuda: bf16 and fp8 matmul TFLOP/s and the quantized model's tokens/s on a CUDA GPU (only when
  one is present).

Ratios come from runs in this one invocation; variants take turns in a new order each round, and
a ratio is the median of the rounds' own ratios with a 95% interval for that median.

    python benchmarks/quant.py [--quick] [--only SECTION ...] [--rounds N] [--json PATH]
"""
from __future__ import annotations

import functools
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from infra_lab import backend, hardware
from infra_lab.quant import formats
from infra_lab.quant.matmul import QuantizedMatrix, matmul_numba

sys.path.insert(0, str(Path(__file__).parent))
from engine_core import median_interval, run_sections, section_parser  # noqa: E402  (one helper for the intervals of every benchmark)

RESULTS = Path(__file__).parent / "results" / "quant.json"
SECTIONS = ("formats", "gemv", "batch", "quality", "training", "cuda")
FULL = {"n": 4096, "stream_bytes": 768 * 2**20, "rounds": 7, "batches": (1, 2, 4, 8, 16, 32, 64, 128, 256),
        "call_s": 0.25, "random_floats": 1_000_000}
QUICK = {"n": 1024, "stream_bytes": 64 * 2**20, "rounds": 2, "batches": (1, 4, 16), "call_s": 0.05,
         "random_floats": 100_000}
# (name, bits, group): the dequantizing kernels the bars are about; fp32 is numpy's BLAS
# (int4 g128 and int8 per channel carry the bars; the rest are the explorer's grid)
KERNELS = (("int8 per channel", 8, None), ("int8 g64", 8, 64), ("int8 g32", 8, 32), ("int4 g128", 4, 128),
           ("int4 per channel", 4, None), ("int4 g64", 4, 64), ("int4 g32", 4, 32))


def ratio(numerators: list[float], denominators: list[float]) -> dict:
    values = [a / b for a, b in zip(numerators, denominators)]
    low, high = median_interval(values)
    return {"median": statistics.median(values), "low": low, "high": high, "rounds": values}


# ---- formats ------------------------------------------------------------------------------------

def formats_section(sizes: dict) -> dict:
    try:
        import torch
    except ImportError:
        return {"skipped": "torch is not installed"}
    rng = np.random.default_rng(0)
    count = sizes["random_floats"]
    floats = np.concatenate([  # spread over every binade of both formats, and past their ranges
        rng.standard_normal(count).astype(np.float32) * np.float32(2.0) ** rng.integers(-24, 20, count),
        np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 448, 449, 464, 480, 57344, 61439, 61440, 2**-9, 2**-10,
                  2**-16, 2**-17, 2**-18], np.float32)])
    out = {"floats": int(floats.size)}
    for fmt, dtype in ((formats.E4M3, torch.float8_e4m3fn), (formats.E5M2, torch.float8_e5m2)):
        theirs = torch.from_numpy(floats).to(dtype).view(torch.uint8).numpy()
        ours = formats.encode(floats, fmt)
        codes = np.arange(256, dtype=np.uint8)
        decoded_theirs = torch.from_numpy(codes).view(dtype).float().numpy()
        decoded_ours = formats.decode(codes, fmt)
        same_codes = bool(np.array_equal(decoded_theirs, decoded_ours, equal_nan=True))
        same_floats = bool(np.array_equal(ours, theirs))  # NaNs too: a negative NaN is 0xFF in both
        out[fmt.name] = {"codes_equal": same_codes, "floats_equal": same_floats,
                         "mismatches": int((ours != theirs).sum())}
    out["passed"] = all(out[f.name]["codes_equal"] and out[f.name]["floats_equal"] for f in (formats.E4M3, formats.E5M2))
    return out


# ---- gemv ---------------------------------------------------------------------------------------

class Streamed:
    """Enough copies of one kind of matrix to overflow the caches, and a cursor over them: each
    call reads the matrix used longest ago."""

    def __init__(self, make, count: int):
        self.items = [make(i) for i in range(count)]
        self.cursor = 0

    def next(self):
        self.cursor = (self.cursor + 1) % len(self.items)
        return self.items[self.cursor]


def random_quantized(n: int, bits: int, group: int | None, seed: int) -> QuantizedMatrix:
    """A matrix of random codes and scales: the kernels' speed does not depend on the values."""
    rng = np.random.default_rng(seed)
    q_max = 2 ** (bits - 1) - 1
    values = rng.integers(-q_max, q_max + 1, (n, n), dtype=np.int8)
    scales = rng.uniform(0.01, 0.02, (n, n // (group or n))).astype(np.float16)
    return QuantizedMatrix.from_values(values, scales, bits, group)


def seconds_per_call(run, streamed: Streamed, budget_s: float) -> float:
    """Mean seconds of `run(item)` over calls that together take about `budget_s` (at least 3)."""
    started, calls = time.perf_counter(), 0
    while calls < 3 or time.perf_counter() - started < budget_s:
        run(streamed.next())
        calls += 1
    return (time.perf_counter() - started) / calls


class Kernels:
    """The variants of one product size: fp32 BLAS, torch's fp32, and the dequantizing kernels,
    each with its streamed set of matrices."""

    def __init__(self, sizes: dict, seed: int = 0):
        n = sizes["n"]
        self.n, self.sizes = n, sizes
        count = lambda nbytes: max(2, -(-sizes["stream_bytes"] // nbytes))  # noqa: E731
        rng = np.random.default_rng(seed)
        self.variants = {"fp32 BLAS": (Streamed(lambda i: rng.standard_normal((n, n), np.float32), count(4 * n * n)),
                                       lambda x, w: x @ w, 4 * n * n)}
        for name, bits, group in KERNELS:
            streamed = Streamed(lambda i, b=bits, g=group: random_quantized(n, b, g, seed + i),
                                count(n * n * bits // 8))
            self.variants[name] = (streamed, matmul_numba, streamed.items[0].nbytes)
        try:
            import torch

            fp32 = self.variants["fp32 BLAS"][0]
            tensors = Streamed(lambda i: torch.from_numpy(fp32.items[i % len(fp32.items)]), len(fp32.items))
            self.variants["fp32 torch"] = (tensors, lambda x, w: torch.from_numpy(x) @ w, 4 * n * n)
        except ImportError:
            pass

    def time(self, name: str, batch: int, streamed: bool = True) -> float:
        items, run, _ = self.variants[name]
        x = np.random.default_rng(batch).standard_normal((batch, self.n)).astype(np.float32)
        if streamed:
            return seconds_per_call(lambda w: run(x, w), items, self.sizes["call_s"])
        first = Streamed(lambda i: items.items[0], 1)
        run(x, first.items[0])
        return seconds_per_call(lambda w: run(x, w), first, self.sizes["call_s"])


def memory_roof() -> float:
    """Bytes/s: the faster of a numba read-only STREAM and numpy's own copy (reads and writes
    counted), each over 256 MiB arrays: no kernel here should read faster."""
    return max(hardware.stream_bandwidth("read", 256 * 2**20), hardware.numpy_copy_bandwidth(256 * 2**20))


def gemv(kernels: Kernels, rounds: int, seed: int = 0) -> dict:
    order = np.random.default_rng(seed)
    names = list(kernels.variants)
    for name in names:  # compile, and touch every matrix once
        kernels.time(name, 1)
    seconds = {(name, how): [] for name in names for how in ("streamed", "cached")}
    roof = []
    for _ in range(rounds):
        for name in order.permutation(names):
            for how in ("streamed", "cached"):
                seconds[name, how].append(kernels.time(name, 1, how == "streamed"))
        roof.append(memory_roof())
    out = {"n": kernels.n, "read_roof_GBps": {"median": statistics.median(roof) / 1e9, "rounds": roof},
           "streamed_matrices": {name: len(v[0].items) for name, v in kernels.variants.items()}}
    for name in names:
        nbytes = kernels.variants[name][2]
        row = {"bytes": nbytes}
        for how in ("streamed", "cached"):
            mine, blas = seconds[name, how], seconds["fp32 BLAS", how]
            row[how] = {"ms": statistics.median(mine) * 1e3, "speedup_over_fp32": ratio(blas, mine),
                        "GBps": nbytes / statistics.median(mine) / 1e9,
                        "share_of_roof": ratio([nbytes / s for s in mine], roof)}
        out[name] = row
    need = {"int4 g128": 3.0, "int8 per channel": 2.0}
    out["bars"] = {name: {"need": x, "got": out[name]["streamed"]["speedup_over_fp32"]["median"]}
                   for name, x in need.items()}
    out["passed"] = all(b["got"] >= b["need"] for b in out["bars"].values())
    return out


def batch_section(kernels: Kernels, rounds: int, gemv_out: dict | None, seed: int = 0) -> dict:
    """Every kernel against fp32 BLAS as the batch grows, streamed; for int4 g128, the batch where
    it stops beating the faster fp32 peer (numpy's BLAS or torch), measured and as the roofline
    predicts it."""
    order = np.random.default_rng(seed + 1)
    names = list(kernels.variants)
    n = kernels.n
    rows = {}
    for batch in kernels.sizes["batches"]:
        seconds = {name: [] for name in names}
        for _ in range(max(1, rounds // 2)):
            for name in order.permutation(names):
                seconds[name].append(kernels.time(name, batch))
        # the fp32 peer: numpy's BLAS or torch's, whichever was faster in each round (from batch 2
        # numpy runs a GEMM whose small-batch path can be several times slower than torch's)
        fp32 = [min(pair) for pair in zip(*(seconds[k] for k in names if k.startswith("fp32")))]
        rows[str(batch)] = {"ms": {k: statistics.median(v) * 1e3 for k, v in seconds.items()},
                            "speedup": {k: ratio(seconds["fp32 BLAS"], v) for k, v in seconds.items()},
                            "best_fp32_ms": statistics.median(fp32) * 1e3,
                            "speedup_over_best_fp32": {k: ratio(fp32, v) for k, v in seconds.items()}}
        print(f"  batch {batch}: int4 g128 {rows[str(batch)]['speedup']['int4 g128']['median']:.2f}x over BLAS, "
              f"{rows[str(batch)]['speedup_over_best_fp32']['int4 g128']['median']:.2f}x over the best fp32", flush=True)
    measured = next((int(b) for b, r in rows.items() if r["speedup_over_best_fp32"]["int4 g128"]["median"] < 1),
                    None)
    against_blas = next((int(b) for b, r in rows.items() if r["speedup"]["int4 g128"]["median"] < 1), None)
    # the roofline: time = max(bytes / bandwidth, work / rate), each rate measured here
    bandwidth = (gemv_out or {}).get("read_roof_GBps", {}).get("median", 0) * 1e9 or \
        memory_roof()
    blas_peak = hardware.blas_peak("fp32")
    cached_int4 = kernels.time("int4 g128", 1, streamed=False)
    dequant_rate = n * n / cached_int4  # weights dequantized and multiplied per second, from cache
    bytes_fp32, bytes_int4 = kernels.variants["fp32 BLAS"][2], kernels.variants["int4 g128"][2]

    def predicted(batch: float) -> tuple[float, float]:
        return (max(bytes_fp32 / bandwidth, 2 * batch * n * n / blas_peak),
                max(bytes_int4 / bandwidth, batch * n * n / dequant_rate))

    grid = np.arange(1, 1025)
    crossing = next((int(b) for b in grid if predicted(b)[1] >= predicted(b)[0]), None)
    return {"rows": rows, "stops_beating_fp32_at_batch": measured, "stops_beating_numpy_blas_at_batch": against_blas,
            "predicted_crossover_batch": crossing,
            "prediction_inputs": {"read_GBps": bandwidth / 1e9, "blas_peak_GFLOPs": blas_peak / 1e9,
                                  "int4_dequant_Gweights_per_s": dequant_rate / 1e9}}


# ---- the run ------------------------------------------------------------------------------------

def headline(name: str, s: dict) -> str:
    if "skipped" in s:
        return f"skipped ({s['skipped']})"
    if name == "formats":
        return ", ".join(f"{k}: codes {v['codes_equal']}, floats {v['floats_equal']}"
                         for k, v in s.items() if isinstance(v, dict))
    if name == "gemv":
        return ", ".join(f"{k}: {v['streamed']['speedup_over_fp32']['median']:.2f}x "
                         f"({v['streamed']['share_of_roof']['median']:.0%} of roof)"
                         for k, v in s.items() if isinstance(v, dict) and "streamed" in v)
    if name == "batch":
        return (f"int4 stops beating fp32 at batch {s['stops_beating_fp32_at_batch']}, "
                f"predicted {s['predicted_crossover_batch']}")
    return ""


def main() -> None:
    parser = section_parser(__doc__, SECTIONS, RESULTS)
    args = parser.parse_args()
    sizes = QUICK if args.quick else FULL
    rounds = args.rounds or sizes["rounds"]
    kernels = functools.cache(lambda: Kernels(sizes, args.seed))  # built once, for gemv and batch
    runs = {"formats": lambda _: formats_section(sizes), "gemv": lambda _: gemv(kernels(), rounds, args.seed),
            "batch": lambda done: batch_section(kernels(), rounds, done.get("gemv"), args.seed),
            "quality": lambda _: quality(sizes, args.quick), "training": lambda _: training(sizes, args.quick),
            "cuda": lambda _: cuda(sizes)}
    run_sections("benchmarks/quant.py", SECTIONS, runs, args, headline, RESULTS,
                 {"quick": args.quick, "seed": args.seed,
                  "sizes": {k: list(v) if isinstance(v, tuple) else v for k, v in sizes.items()}})


def quality(sizes: dict, quick: bool) -> dict:
    """Validation bits per byte of every method, bits and group, against the model's bytes."""
    from infra_lab.model import corpus, transformer
    from infra_lab.model.quantized import bits_per_byte, calibration_inputs, quantize_model

    target = transformer.load("target")
    train_bytes, validation = corpus.load()
    windows = 8 if quick else None
    started = time.perf_counter()
    calibration = calibration_inputs(target, train_bytes=train_bytes)
    rows = [{"name": "float", "method": "float", "bits": 32, "group": None, "bytes_fp32": 4 * target.n_params,
             "bytes": 2 * target.n_params, "bits_per_byte": bits_per_byte(target, validation, windows)}]
    calibration_s = time.perf_counter() - started
    configs = [(m, b, g) for b in (8, 4, 3) for g in (None, 64, 32) for m in ("rtn", "awq", "gptq")]
    configs.append(("smoothquant", 8, None))
    if quick:
        configs = [c for c in configs if c[2] in (None, 32) and c[1] != 8] + [("rtn", 8, None)]
    for method, bits, group in configs:
        began = time.perf_counter()
        quantized = quantize_model(target, method, bits, group, None if method == "rtn" else calibration)
        quantize_s = time.perf_counter() - began
        rows.append({"name": quantized.name, "method": method, "bits": bits, "group": group,
                     "bytes": quantized.weight_bytes, "bits_per_byte": bits_per_byte(quantized, validation, windows),
                     "quantize_s": quantize_s})
        print(f"  {rows[-1]['name']}: {rows[-1]['bits_per_byte']:.4f} bits/byte, {rows[-1]['bytes'] / 1e6:.3f} MB",
              flush=True)
    base = rows[0]["bits_per_byte"]
    for row in rows:
        row["loss_bits_per_byte"] = row["bits_per_byte"] - base
    cell = {(r["method"], r["bits"], r["group"]): r for r in rows}
    int8 = cell.get(("rtn", 8, None))
    beats = {}
    for bits in (4, 3):
        for group in (None, 64, 32):
            rtn = cell.get(("rtn", bits, group))
            for method in ("awq", "gptq"):
                mine = cell.get((method, bits, group))
                if rtn and mine:
                    beats[f"{method} int{bits} {'per-channel' if group is None else f'g{group}'}"] = {
                        "loss": mine["loss_bits_per_byte"], "rtn_loss": rtn["loss_bits_per_byte"],
                        "bytes": mine["bytes"], "rtn_bytes": rtn["bytes"],
                        "beats_rtn": mine["bits_per_byte"] < rtn["bits_per_byte"]}
    bars = {"int8 per-channel rtn loses at most 0.01 bits/byte": bool(int8 and int8["loss_bits_per_byte"] <= 0.01),
            "awq and gptq beat rtn in every 4- and 3-bit cell": all(v["beats_rtn"] for v in beats.values())}
    return {"rows": rows, "against_rtn": beats, "bars": bars, "passed": all(bars.values()),
            "validation_windows": windows or "all", "calibration_s": calibration_s}


def training(sizes: dict, quick: bool) -> dict:
    """The target model trained from the same weights on the same batches in each precision."""
    try:
        from infra_lab.model import precision
    except ImportError:
        return {"skipped": "torch is not installed"}
    steps = 20 if quick else 200
    runs = {}
    for name in precision.PRECISIONS:
        runs[name] = precision.train_run(name, steps=steps, seed=0)
        print(f"  {name}: final loss {runs[name]['final_loss']:.4f} in {runs[name]['seconds']:.0f} s", flush=True)
    base = runs["fp32"]["final_loss"]
    gaps = {name: run["final_loss"] / base - 1 for name, run in runs.items() if name != "fp32"}
    lost, entries = runs["fp16"]["underflowed"], runs["fp16"]["activation_gradient_entries"]
    lost_scaled = runs["fp16-scaled"]["underflowed"]
    summary = (f"{np.mean(lost):,.0f} activation-gradient entries per step on average "
               f"({np.mean(lost) / entries:.2%} of the {entries:,} of a step), against "
               f"{np.mean(lost_scaled):,.0f} with dynamic loss scaling")
    bars = {"fp16 without loss scaling underflows": bool(sum(lost) > 0),
            "fp16 with dynamic loss scaling within 2% of fp32": abs(gaps["fp16-scaled"]) <= 0.02,
            "bf16 within 2% of fp32": abs(gaps["bf16"]) <= 0.02}
    return {"runs": runs, "relative_to_fp32": gaps, "underflow_summary": summary, "bars": bars,
            "passed": all(bars.values())}


def cuda(sizes: dict) -> dict:
    """bf16 and fp8 matmul TFLOP/s (hardware.measure's own probes), and the quantized model's
    decode tokens/s through the engine on torch, against the float model's."""
    try:
        import torch
    except ImportError:
        return {"skipped": "torch is not installed"}
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA GPU on this machine"}
    from infra_lab.model import transformer
    from infra_lab.model.quantized import quantize_model
    from infra_lab.serving import traffic
    from infra_lab.serving.config import EngineConfig
    from infra_lab.serving.engine import Engine
    from infra_lab.serving.request import SamplingParams

    gpu = backend.Backend("torch", "cuda")
    flops = {dtype: hardware._cuda_matmul_flops(torch, dtype) / 1e12 for dtype in ("bf16", "fp8")}
    target = transformer.load("target")
    prompts = traffic.stdlib_prompts([64] * 64, seed=0)
    served = {}
    for name, model in (("float", target), ("rtn int4 g32", quantize_model(target, "rtn", 4, 32)),
                        ("rtn int8 per-channel", quantize_model(target, "rtn", 8))):
        engine = Engine(model, EngineConfig(max_batch=64, token_budget=4096, num_blocks=2048), gpu)
        engine.generate(prompts[:4], SamplingParams(max_tokens=8))  # warm up
        started = time.perf_counter()
        outputs = engine.generate(prompts, SamplingParams(max_tokens=128))
        served[name] = sum(len(o) for o in outputs) / (time.perf_counter() - started)
    return {"TFLOPs": flops, "fp8_over_bf16": flops["fp8"] / flops["bf16"], "engine_tokens_per_s": served,
            "machine": torch.cuda.get_device_name()}



if __name__ == "__main__":
    main()
