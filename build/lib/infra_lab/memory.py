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


def _release_free_heap() -> None:
    """Hand freed heap memory back to the OS (glibc's malloc_trim(3)), so that a call reusing it
    has to fault its pages in again and shows up in the high-water mark. No lasting effect."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


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
    _release_free_heap()
    before = _status_kib("VmRSS")
    CLEAR_REFS.write_text("5")
    run()
    return max(0, _status_kib("VmHWM") - before) * 1024
