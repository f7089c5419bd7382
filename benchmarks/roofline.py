"""Chapter 01's bars, in one run: this machine's roofs, the probe against numpy, and each
kernel's share of its roof at full size: the roof measured beside it in the same run (memory
kernels in turns with the copy or read roof over arrays of their size, matmuls after the BLAS
roof), named with the share.

    python benchmarks/roofline.py [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import time

from infra_lab import backend, hardware, roofline_kernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    print(backend.describe())
    started = time.perf_counter()
    device = hardware.measure(target="cpu", refresh=True)
    measure_s = time.perf_counter() - started
    numpy_copy = device.probes["numpy_copy"][0][1]
    one_thread_probe = device.probes["copy_one_thread"][0][1]
    one_thread_numpy = device.probes["numpy_copy_one_thread"][0][1]
    runs = roofline_kernels.run_all("full")
    figures = {
        "device": device.name, "measure_seconds": measure_s,
        "memory_roof_GBps": device.memory_bandwidth / 1e9,
        "numpy_copy_GBps": numpy_copy / 1e9,
        "probe_over_numpy": device.memory_bandwidth / numpy_copy,
        "one_thread_probe_over_numpy": one_thread_probe / one_thread_numpy,
        "peak_GFLOPs": {dtype: rate / 1e9 for dtype, rate in device.peak_flops.items()},
        "kernels": {run.label: {"intensity": run.cost.intensity, "GFLOPs": run.flops_per_s / 1e9,
                                "GBps": run.bytes_per_s / 1e9, "roof": run.roof()[1],
                                "roof_GFLOPs": run.roof()[0] / 1e9,
                                "share_of_roof": run.fraction_of_roof()} for run in runs},
    }
    print(f"measure() took {measure_s:.1f} s on {device.name}")
    print(f"memory roof (numba copy) {figures['memory_roof_GBps']:.1f} GB/s; numpy copy "
          f"{figures['numpy_copy_GBps']:.1f} GB/s; probe/numpy {figures['probe_over_numpy']:.2f} "
          f"(one thread each: {figures['one_thread_probe_over_numpy']:.2f})")
    for label, kernel in figures["kernels"].items():
        print(f"{label:24s} {kernel['intensity']:8.2f} FLOP/B {kernel['GFLOPs']:8.1f} GFLOP/s "
              f"{kernel['GBps']:6.1f} GB/s  {kernel['share_of_roof']:5.0%} of the {kernel['roof']} "
              "roof measured beside it")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(figures, handle, indent=1)


if __name__ == "__main__":
    main()
