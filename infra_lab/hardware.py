"""Devices and their limits: a catalog of accelerators, and a probe of the machine you run on.

A Device holds the two roofs of the roofline model (Williams, Waterman and Patterson, CACM
2009): peak FLOP/s per dtype and memory bandwidth in bytes/s. Catalog figures are dense (no 2:4
sparsity; vendors quote tensor-core rates with sparsity, which are twice these) and each part
cites its datasheet. `measure()` fills the same fields for this machine by running kernels.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numba
import numpy as np

from infra_lab import backend
from infra_lab.cache import cache_dir

TERA = 1e12
GB = 1e9  # datasheets' GB and TB/s are decimal
PROBE_VERSION = 4  # bump when measure() changes, so cached results are redone


@dataclass(frozen=True)
class Device:
    name: str
    peak_flops: dict[str, float]  # dtype -> dense FLOP/s (OP/s for int8)
    memory_bandwidth: float  # bytes/s
    memory_bytes: float
    source: str
    probes: dict[str, list[list[float]]] = field(default_factory=dict)  # measured curves

    def flops(self, dtype: str) -> float:
        """Peak dense FLOP/s for `dtype`; raises if the device has no such unit."""
        if dtype not in self.peak_flops:
            raise ValueError(
                f"{self.name} has no {dtype!r} peak; it has {', '.join(self.peak_flops)}")
        return self.peak_flops[dtype]


def _part(name, memory_gb, bandwidth_gb_s, source, **tflops) -> Device:
    return Device(name=name, peak_flops={dtype: value * TERA for dtype, value in tflops.items()},
                  memory_bandwidth=bandwidth_gb_s * GB, memory_bytes=memory_gb * GB, source=source)


CATALOG: dict[str, Device] = {device.name: device for device in (
    _part("A100 SXM 80GB", 80, 2039, "NVIDIA A100 Tensor Core GPU datasheet (2021), A100 80GB SXM "
          "column; tensor-core rates there with sparsity are twice these",
          fp64=19.5, fp32=19.5, tf32=156, bf16=312, fp16=312, int8=624),
    _part("H100 SXM", 80, 3350, "NVIDIA H100 Tensor Core GPU datasheet (2023), H100 SXM column; "
          "tensor-core rates there are quoted with sparsity, the dense rates used here are half",
          fp64=67, fp32=67, tf32=494.7, bf16=989.4, fp16=989.4, fp8=1978.9, int8=1978.9),
    _part("H200", 141, 4800, "NVIDIA H200 Tensor Core GPU datasheet (2024), H200 SXM column; "
          "halved sparse tensor-core rates, as for the H100",
          fp64=67, fp32=67, tf32=494.7, bf16=989.4, fp16=989.4, fp8=1978.9, int8=1978.9),
    _part("L4", 24, 300, "NVIDIA L4 Tensor Core GPU datasheet (2023); halved sparse "
          "tensor-core rates", fp32=30.3, tf32=60, bf16=121, fp16=121, fp8=242.5, int8=242.5),
    _part("T4", 16, 320, "NVIDIA T4 Tensor Core GPU datasheet (2019); Colab's free GPU",
          fp32=8.1, fp16=65, int8=130),
    _part("MI300X", 192, 5300, "AMD Instinct MI300X accelerator datasheet (2023); dense "
          "matrix rates", fp64=163.4, fp32=163.4, tf32=653.7, bf16=1307.4, fp16=1307.4,
          fp8=2614.9, int8=2614.9),
    _part("TPU v5e", 16, 819, "Google Cloud TPU v5e documentation, key chip specifications "
          "(per chip)", bf16=197, int8=394),
)}


def get(name: str) -> Device:
    """The catalog Device called `name`."""
    if name not in CATALOG:
        raise KeyError(f"unknown device {name!r}; known devices: {', '.join(CATALOG)}")
    return CATALOG[name]


# ---- CPU probes: numba streaming kernels (McCalpin's STREAM copy and triad, and a read) ---

@numba.njit(inline="always")
def _copy_range(dst, src):  # (m,), (m,)
    for i in range(src.shape[0]):
        dst[i] = src[i]


@numba.njit(inline="always")
def _triad_range(a, b, c, scalar):  # a = b + scalar * c, all (m,)
    for i in range(a.shape[0]):
        a[i] = b[i] + scalar * c[i]


@numba.njit(inline="always")
def _read_range(src):  # (m,) int32: an integer sum vectorizes, a float one would not
    total = 0
    for i in range(src.shape[0]):
        total += src[i]
    return total


@numba.njit(parallel=True, cache=True)
def _copy_passes(dst, src, passes, n_chunks):  # (n,), (n,); a chunk per thread
    chunk = (src.shape[0] + n_chunks - 1) // n_chunks
    for t in numba.prange(n_chunks):
        part = slice(t * chunk, (t + 1) * chunk)
        for _ in range(passes):
            _copy_range(dst[part], src[part])


@numba.njit(parallel=True, cache=True)
def _triad_passes(a, b, c, scalar, passes, n_chunks):  # (n,) each
    chunk = (a.shape[0] + n_chunks - 1) // n_chunks
    for t in numba.prange(n_chunks):
        part = slice(t * chunk, (t + 1) * chunk)
        for _ in range(passes):
            _triad_range(a[part], b[part], c[part], scalar)


@numba.njit(parallel=True, cache=True)
def _read_passes(src, passes, n_chunks):  # (n,) int32; returns the sum, so no read is skipped
    chunk = (src.shape[0] + n_chunks - 1) // n_chunks
    sums = np.zeros(n_chunks, np.int64)
    for t in numba.prange(n_chunks):
        part = slice(t * chunk, (t + 1) * chunk)
        for _ in range(passes):
            sums[t] += _read_range(src[part])
    return sums.sum()


STREAM_ARRAYS = {"copy": 2, "triad": 3, "read": 1}  # arrays each kernel moves


def best_seconds(run, repeats: int) -> float:
    """The fastest of `repeats` timed calls of `run`, after one untimed warm-up call."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1; got {repeats}")
    run()  # warm: compile, fault pages in, fill caches
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def stream_kernel(kernel: str, bytes_per_array: int, bytes_per_timing: float = 256e6):
    """(run, bytes): a call of the numba `kernel` over float32 arrays of `bytes_per_array` each,
    and the bytes it moves. "copy" is a = b (one read, one write), "triad" a = b + s c (two
    reads, one write), "read" a sum over b (reads only). STREAM counts every array once, so
    copy and triad count reads and writes alike, and a kernel that only reads can pass the copy
    roof. Small arrays are swept many times in one call, so a call moves about
    `bytes_per_timing`."""
    if kernel not in STREAM_ARRAYS:
        raise ValueError(f"kernel must be one of {', '.join(map(repr, STREAM_ARRAYS))}; "
                         f"got {kernel!r}")
    if bytes_per_array < 4 * 64:
        raise ValueError(f"need bytes_per_array >= 256; got {bytes_per_array}")
    n = bytes_per_array // 4
    arrays = STREAM_ARRAYS[kernel]
    passes = max(1, int(bytes_per_timing // (arrays * n * 4)))
    threads = numba.get_num_threads()
    a, b, c = np.zeros(n, np.float32), np.ones(n, np.float32), np.full(n, 2.0, np.float32)
    if kernel == "copy":
        def run():
            _copy_passes(a, b, passes, threads)
    elif kernel == "triad":
        def run():
            _triad_passes(a, b, c, np.float32(3.0), passes, threads)
    else:
        words = b.view(np.int32)

        def run():
            return _read_passes(words, passes, threads)
    return run, arrays * n * 4 * passes


def stream_bandwidth(kernel: str, bytes_per_array: int, repeats: int = 3,
                     bytes_per_timing: float = 256e6) -> float:
    """Bytes/s of `stream_kernel(kernel, bytes_per_array)`, the best of `repeats` calls."""
    if repeats < 1:
        raise ValueError(f"need repeats >= 1; got {repeats}")
    run, moved = stream_kernel(kernel, bytes_per_array, bytes_per_timing)
    return moved / best_seconds(run, repeats)


def numpy_copy_bandwidth(bytes_per_array: int = 256 * 2**20, repeats: int = 3,
                         threads: int | None = None) -> float:
    """Bytes/s of numpy's own copy (np.copyto) of a large float32 array, split across
    `threads` Python threads (default: as many as numba uses), 2 arrays moved."""
    if bytes_per_array < 4 or repeats < 1:
        raise ValueError(f"need bytes_per_array >= 4 and repeats >= 1; got {bytes_per_array}, {repeats}")
    from concurrent.futures import ThreadPoolExecutor

    threads = threads or numba.get_num_threads()
    src = np.ones(bytes_per_array // 4, np.float32)
    dst = np.empty_like(src)
    bounds = np.linspace(0, src.size, threads + 1).astype(int)
    parts = [slice(lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:])]
    with ThreadPoolExecutor(threads) as pool:
        def run() -> None:
            list(pool.map(lambda part: np.copyto(dst[part], src[part]), parts))

        return 2 * src.nbytes / best_seconds(run, repeats)


def blas_flops(dtype: str = "fp32", n: int = 2048, repeats: int = 3) -> float:
    """FLOP/s of numpy's BLAS on an n x n x n matmul: 2 n^3 FLOPs, best of `repeats`."""
    numpy_dtypes = {"fp32": np.float32, "fp64": np.float64}
    if dtype not in numpy_dtypes:
        raise ValueError(f"numpy BLAS measures {', '.join(numpy_dtypes)}; got {dtype!r}")
    if n < 1 or repeats < 1:
        raise ValueError(f"need n >= 1 and repeats >= 1; got {n}, {repeats}")
    rng = np.random.default_rng(0)
    left = rng.standard_normal((n, n)).astype(numpy_dtypes[dtype])
    right = rng.standard_normal((n, n)).astype(numpy_dtypes[dtype])
    return 2 * n**3 / best_seconds(lambda: left @ right, repeats)


BLAS_SIZES = (512, 1024, 2048)  # the compute roof is the fastest of these cubes


def blas_peak(dtype: str = "fp32", sizes: tuple[int, ...] | None = None) -> float:
    """The compute roof: the fastest FLOP/s of numpy's BLAS over n x n x n matmuls, n in
    `sizes` (default BLAS_SIZES). On some machines a mid-sized cube runs faster than a
    large one, which no longer fits the caches the library tiles for."""
    return max(blas_flops(dtype, n=n) for n in (sizes or BLAS_SIZES))


SWEEP_BYTES = [2**k for k in range(13, 29, 2)]  # 8 KiB .. 128 MiB per array: L1 to DRAM
DRAM_BYTES = 256 * 2**20


def _measure_cpu(progress) -> Device:
    # numpy first: numba's OpenMP threads spin for a while after each parallel region
    probes: dict[str, list[list[float]]] = {
        "numpy_copy": [[DRAM_BYTES, numpy_copy_bandwidth(DRAM_BYTES)]],
        "numpy_copy_one_thread": [[DRAM_BYTES, numpy_copy_bandwidth(DRAM_BYTES, threads=1)]],
        "copy": [], "triad": [], "read": []}
    progress("numpy copy")
    for size in SWEEP_BYTES + [DRAM_BYTES]:
        for kernel in ("copy", "triad", "read"):
            probes[kernel].append([size, stream_bandwidth(kernel, size)])
            progress(f"{kernel} {size // 1024} KiB")
    threads = numba.get_num_threads()
    numba.set_num_threads(1)  # like for like with numpy's one-thread copy above
    try:
        probes["copy_one_thread"] = [[DRAM_BYTES, stream_bandwidth("copy", DRAM_BYTES)]]
    finally:
        numba.set_num_threads(threads)
    progress("one thread each")
    flops = {}
    for dtype in ("fp32", "fp64"):
        flops[dtype] = blas_peak(dtype)
        progress(f"BLAS {dtype}")
    return Device(name=f"{backend.cpu_model()} ({numba.get_num_threads()} threads)", peak_flops=flops,
                  memory_bandwidth=probes["copy"][-1][1], memory_bytes=float(_memory_bytes()),
                  source="measured here: numba STREAM copy at 256 MiB per array (the memory "
                         "roof, reads and writes counted), the fastest numpy BLAS matmul of "
                         "512, 1024 and 2048 cubes (the compute roofs)",
                  probes=probes)


# ---- GPU probes: torch device-to-device copy and matmul per dtype ------------------------

def cuda_seconds(torch, run, repeats: int) -> float:
    """The fastest of `repeats` calls of `run` on the GPU, timed with CUDA events."""
    run()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(repeats):
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return best


def _cuda_matmul_flops(torch, dtype: str, n: int = 8192) -> float | None:
    """FLOP/s of an n x n x n torch matmul in `dtype` on the GPU, or None if unsupported."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(n, n, device="cuda", generator=generator)
    b = torch.randn(n, n, device="cuda", generator=generator)
    try:
        if dtype in ("fp32", "tf32"):
            torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"
            run = lambda: a @ b  # noqa: E731
        elif dtype in ("bf16", "fp16"):
            kind = torch.bfloat16 if dtype == "bf16" else torch.float16
            a, b = a.to(kind), b.to(kind)
            run = lambda: a @ b  # noqa: E731
        elif dtype == "fp8":
            a8 = a.to(torch.float8_e4m3fn)
            b8 = b.to(torch.float8_e4m3fn).t().contiguous().t()  # column-major, as cuBLASLt wants
            one = torch.ones((), device="cuda")
            run = lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)  # noqa: E731
        elif dtype == "int8":
            a8, b8 = a.clamp(-127, 127).to(torch.int8), b.clamp(-127, 127).to(torch.int8)
            run = lambda: torch._int_mm(a8, b8)  # noqa: E731
        else:
            return None
        seconds = cuda_seconds(torch, run, repeats=10)
    except (RuntimeError, AttributeError, TypeError):
        return None
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False
    return 2 * n**3 / seconds


def _measure_cuda(progress) -> Device:
    import torch

    probes: dict[str, list[list[float]]] = {"copy": []}
    for size in [2**k for k in range(20, 32, 2)] + [2**32]:  # 1 MiB .. 4 GiB per array
        src = torch.empty(size // 4, dtype=torch.float32, device="cuda").fill_(1.0)
        dst = torch.empty_like(src)
        seconds = cuda_seconds(torch, lambda: dst.copy_(src), repeats=10)
        probes["copy"].append([size, 2 * size / seconds])
        del src, dst
        progress(f"copy {size // 2**20} MiB")
    flops = {}
    for dtype in ("fp32", "tf32", "bf16", "fp16", "fp8", "int8"):
        rate = _cuda_matmul_flops(torch, dtype)
        if rate is not None:
            flops[dtype] = rate
        progress(f"matmul {dtype}")
    properties = torch.cuda.get_device_properties(0)
    return Device(name=torch.cuda.get_device_name(0), peak_flops=flops,
                  memory_bandwidth=max(bandwidth for _, bandwidth in probes["copy"]),
                  memory_bytes=float(properties.total_memory),
                  source="measured here: torch device-to-device copy, torch matmul 8192^3 "
                         "(fp8 through torch._scaled_mm, int8 through torch._int_mm)",
                  probes=probes)


# ---- measure(): cached per machine ----------------------------------------------------

def _memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def _fingerprint(target: str) -> str:
    parts = [PROBE_VERSION, target, platform.node(), backend.cpu_model(), os.cpu_count(),
             numba.get_num_threads()]
    if target == "cuda":
        import torch

        parts.append(torch.cuda.get_device_name(0))
    return hashlib.sha1(json.dumps(parts).encode()).hexdigest()[:16]


def measure(target: str | None = None, refresh: bool = False, progress: bool = True) -> Device:
    """A Device for this machine, every figure measured: the GPU when `target` is "cuda" (the
    default when the backend runs torch on CUDA), else the CPU. The result is cached per
    machine; `refresh=True` measures again. Takes about 10 s on a 2-core CPU."""
    if target is None:
        from infra_lab import backend

        target = backend.current().device
    if target not in ("cpu", "cuda"):
        raise ValueError(f"target must be 'cpu' or 'cuda'; got {target!r}")
    if target == "cuda":
        from infra_lab import backend

        backend.resolve("torch", "cuda")  # raises, naming what is available, if there is no GPU
    path = cache_dir() / f"hardware-{_fingerprint(target)}.json"
    if path.is_file() and not refresh:
        return Device(**json.loads(path.read_text()))
    from infra_lab import progress as progress_bars

    steps = 3 * (len(SWEEP_BYTES) + 1) + 4 if target == "cpu" else 13
    with progress_bars.bar(total=steps, desc=f"measuring this {target}", show=progress,
                           leave=False) as bar:
        def step(label: str) -> None:
            bar.set_postfix_str(label)
            bar.update()

        device = _measure_cpu(step) if target == "cpu" else _measure_cuda(step)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(json.dumps(asdict(device)))
    partial.replace(path)  # atomic: a concurrent reader sees the old file or the new one
    return device
