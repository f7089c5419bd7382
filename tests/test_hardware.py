import json
import time

import numpy as np
import pytest

from infra_lab import backend, hardware


@pytest.fixture
def quick_probe(monkeypatch, tmp_path):
    """Small sizes so a whole measure() takes a second; the cache in a temporary folder."""
    monkeypatch.setenv("INFRA_LAB_CACHE", str(tmp_path))
    monkeypatch.setattr(hardware, "SWEEP_BYTES", [2**13, 2**16])
    monkeypatch.setattr(hardware, "DRAM_BYTES", 2**22)
    monkeypatch.setattr(hardware, "BLAS_SIZES", (128, 256))
    return tmp_path


def test_measure_fills_every_figure_and_caches_per_machine(quick_probe):
    device = hardware.measure(target="cpu", progress=False)
    assert set(device.peak_flops) == {"fp32", "fp64"} and min(device.peak_flops.values()) > 1e8
    assert device.memory_bandwidth == device.probes["copy"][-1][1] > 1e8
    assert [size for size, _ in device.probes["triad"]] == [2**13, 2**16, 2**22]
    assert [size for size, _ in device.probes["read"]] == [2**13, 2**16, 2**22]
    for name in ("numpy_copy", "numpy_copy_one_thread", "copy_one_thread"):
        assert device.probes[name][0][1] > 1e8
    cached = list(quick_probe.glob("hardware-*.json"))
    assert len(cached) == 1 and json.loads(cached[0].read_text())["name"] == device.name
    started = time.perf_counter()
    assert hardware.measure(target="cpu", progress=False) == device
    assert time.perf_counter() - started < 0.5
    assert hardware.measure(target="cpu", progress=False, refresh=True) != device  # new timings


def test_measure_on_cuda_without_a_gpu_names_what_is_available(monkeypatch):
    monkeypatch.setattr(backend, "_torch_has_cuda", lambda: False)
    with pytest.raises(backend.BackendUnavailable, match="cannot use device 'cuda'"):
        hardware.measure(target="cuda")
    with pytest.raises(ValueError, match="target must be 'cpu' or 'cuda'; got 'tpu'"):
        hardware.measure(target="tpu")


@pytest.mark.parametrize("call, message", [
    (lambda: hardware.stream_bandwidth("scale", 2**16),
     "kernel must be one of 'copy', 'triad', 'read'; got 'scale'"),
    (lambda: hardware.stream_bandwidth("copy", 2**16, repeats=0), "need repeats >= 1; got 0"),
    (lambda: hardware.stream_bandwidth("copy", 0), "need bytes_per_array >= 256"),
    (lambda: hardware.stream_bandwidth("copy", -5), "got -5"),
    (lambda: hardware.blas_flops("bf16"), "numpy BLAS measures fp32, fp64; got 'bf16'"),
    (lambda: hardware.blas_flops("fp32", n=0), "need n >= 1"),
    (lambda: hardware.numpy_copy_bandwidth(0), "need bytes_per_array >= 4"),
    (lambda: hardware.best_seconds(lambda: None, 0), "repeats must be >= 1; got 0"),
])
def test_bad_probe_sizes_get_clear_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_the_copy_probe_really_copies():
    src = np.arange(1000, dtype=np.float32)
    dst = np.zeros_like(src)
    hardware._copy_passes(dst, src, 3, 2)
    np.testing.assert_array_equal(dst, src)
    a, b, c = np.zeros(999, np.float32), np.ones(999, np.float32), np.arange(999, dtype=np.float32)
    hardware._triad_passes(a, b, c, np.float32(2), 2, 3)
    np.testing.assert_array_equal(a, 1 + 2 * c)


def test_the_read_probe_reads_every_word():
    words = np.arange(-500, 1001, dtype=np.int32)
    assert hardware._read_passes(words, 3, 4) == 3 * int(words.sum())
    run, moved = hardware.stream_kernel("read", 2**16, bytes_per_timing=2**18)
    one = int(np.ones(1, np.float32).view(np.int32)[0])  # the bits of 1.0
    assert moved == 2**18 and run() == 4 * 2**14 * one


@pytest.mark.parametrize("kernel, arrays", [("copy", 2), ("triad", 3), ("read", 1)])
def test_stream_kernels_count_the_arrays_they_move(kernel, arrays):
    _, moved = hardware.stream_kernel(kernel, 2**16, bytes_per_timing=0)
    assert moved == arrays * 2**16


def test_the_compute_roof_is_the_fastest_cube(monkeypatch):
    rates = {128: 5e9, 256: 9e9, 512: 7e9}
    monkeypatch.setattr(hardware, "blas_flops", lambda dtype, n: rates[n])
    assert hardware.blas_peak("fp32", (128, 256, 512)) == 9e9
    monkeypatch.setattr(hardware, "BLAS_SIZES", (128, 512))
    assert hardware.blas_peak("fp64") == 7e9
