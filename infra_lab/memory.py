"""Peak memory of a call: how far resident memory rose above where it stood before.

Linux keeps a high-water mark of resident memory (VmHWM) that writing 5 to /proc/self/clear_refs
resets (proc(5)). Resetting it, running the call and reading it back measures everything the call
touched, numpy's arrays and numba's own allocations alike, which tracemalloc would not see.
"""
from __future__ import annotations

from pathlib import Path

STATUS = Path("/proc/self/status")
CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_kib(field: str) -> int:
    for line in STATUS.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise OSError(f"{STATUS} has no {field}")


def _fresh_pages_for_large_arrays() -> None:
    """glibc serves large allocations with mmap and returns them on free, but raises that
    threshold after each free, after which freed memory stays resident and is reused unseen.
    Fix the threshold at 64 KiB so that every large array is fresh memory (mallopt(3))."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


_fresh_pages_for_large_arrays()  # from import on, so arrays made before a measurement are not reused unseen


def supported() -> bool:
    try:
        CLEAR_REFS.write_text("5")
        _status_kib("VmHWM")
        return True
    except OSError:
        return False


def peak_extra_bytes(run) -> int:
    """Bytes of resident memory `run()` needed beyond what was resident before it."""
    if not supported():
        raise OSError("peak memory needs Linux's /proc/self/clear_refs and VmHWM; not available here")
    _fresh_pages_for_large_arrays()
    before = _status_kib("VmRSS")
    CLEAR_REFS.write_text("5")
    run()
    return max(0, _status_kib("VmHWM") - before) * 1024
