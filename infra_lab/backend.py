"""Where kernels run: the one place that decides.

The default is torch on a CUDA GPU when there is one, else numba on the CPU.
`INFRA_LAB_BACKEND=numba|torch|numpy` forces a backend and `INFRA_LAB_DEVICE=cpu|cuda`
forces torch's device. Every kernel in infra_lab has a numpy face (the reference), a numba
face (CPU) and a torch face (GPU, and CPU as a peer); `pick` chooses among them.

The current backend is only the default: a caller that passes its own (an engine on its device)
gets it for the whole call, so two engines in one process can sit on two devices. A torch face
given numpy arrays moves them to `torch_device()`: the device of the backend its caller passed,
in this thread, else the current one's.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import platform
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

BACKENDS: tuple[str, ...] = ("numba", "torch", "numpy")
DEVICES: tuple[str, ...] = ("cpu", "cuda")


class BackendUnavailable(RuntimeError):
    """The requested backend or device is not on this machine."""


@dataclass(frozen=True)
class Backend:
    name: str  # one of BACKENDS
    device: str  # "cpu" or "cuda"; numpy and numba are always "cpu"


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _torch_has_cuda() -> bool:
    if not _installed("torch"):
        return False
    if "torch" not in sys.modules and _torch_build().endswith("+cpu"):
        # torch's CPU-only wheels say so in their version: importing one (1.5 s of CPU, in every
        # server on the numba backend) would only answer False
        return False
    import torch

    return torch.cuda.is_available()


def _torch_build() -> str:
    """The installed torch's version as its package records it ("2.13.0+cpu"), without importing it."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return ""


def available() -> dict[str, tuple[str, ...]]:
    """Backends installed here, each with the devices it can use."""
    found: dict[str, tuple[str, ...]] = {}
    if _installed("numba"):
        found["numba"] = ("cpu",)
    if _installed("torch"):
        found["torch"] = ("cpu", "cuda") if _torch_has_cuda() else ("cpu",)
    found["numpy"] = ("cpu",)
    return found


def _available_text() -> str:
    return ", ".join(f"{name} ({'/'.join(devs)})" for name, devs in available().items())


def resolve(name: str | None = None, device: str | None = None) -> Backend:
    """The Backend for `name` and `device`, with None meaning the default; raises if absent."""
    if name is not None and name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
    if device is not None and device not in DEVICES:
        raise ValueError(f"unknown device {device!r}; choose one of {', '.join(DEVICES)}")
    if name is None:
        if device == "cuda" or (device is None and _torch_has_cuda()):
            name = "torch"
        elif _installed("numba"):
            name = "numba"
        else:
            name = "numpy"
    found = available()
    if name not in found:
        raise BackendUnavailable(
            f"backend {name!r} is not installed here; available: {_available_text()}"
        )
    if device is None:
        device = "cuda" if name == "torch" and "cuda" in found["torch"] else "cpu"
    if device not in found[name]:
        raise BackendUnavailable(
            f"backend {name!r} cannot use device {device!r} here (no CUDA GPU visible); "
            f"available: {_available_text()}"
        )
    return Backend(name, device)


def _from_environment() -> Backend:
    name = os.environ.get("INFRA_LAB_BACKEND") or None
    device = os.environ.get("INFRA_LAB_DEVICE") or None
    try:
        return resolve(name, device)
    except ValueError as err:
        raise ValueError(f"INFRA_LAB_BACKEND={name!r} INFRA_LAB_DEVICE={device!r}: {err}") from None


_current: Backend | None = None


def current() -> Backend:
    """The backend kernels use now: set by `use`, else from the environment, else the default."""
    global _current
    if _current is None:
        _current = _from_environment()
    return _current


def use(name: str | None = None, device: str | None = None) -> Backend:
    """Make `name` on `device` the current backend; on error the current one stays."""
    global _current
    _current = resolve(name, device)
    return _current


@contextmanager
def using(name: str | None = None, device: str | None = None) -> Iterator[Backend]:
    """Run a block on another backend, then restore the one before."""
    before = current()
    chosen = use(name, device)
    try:
        yield chosen
    finally:
        use(before.name, before.device)


_passed = threading.local()  # .backend: the backend a caller passed to `pick`, during that call


def pick(faces: Mapping[str, Callable], backend: Backend | None = None) -> Callable:
    """The face of a kernel for `backend` (default: the current one). A torch face picked for a
    backend that is not the current one runs with that backend's device as `torch_device()`."""
    chosen = backend or current()
    if chosen.name not in faces:
        raise BackendUnavailable(
            f"this kernel has no {chosen.name!r} face; it has {', '.join(faces)}"
        )
    face = faces[chosen.name]
    if chosen.name != "torch" or chosen == current():
        return face

    def on_its_device(*args, **kwargs):
        before = getattr(_passed, "backend", None)
        _passed.backend = chosen
        try:
            return face(*args, **kwargs)
        finally:
            _passed.backend = before

    return on_its_device


def torch_device() -> str:
    """Where a torch face puts numpy inputs: the device of the backend its caller passed to
    `pick`, else the current backend's ("cpu" unless that is torch)."""
    chosen = getattr(_passed, "backend", None) or current()
    return chosen.device if chosen.name == "torch" else "cpu"


def threads() -> int:
    """CPU threads the kernels may use (numba's setting when numba is installed)."""
    if _installed("numba"):
        import numba

        return numba.get_num_threads()
    return os.cpu_count() or 1


def cpu_model() -> str:
    """The processor's name as the OS gives it ("Intel(R) Xeon(R) Processor", "AMD EPYC 7B13"):
    the same package runs at other speeds, and rounds differently, on another CPU."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> str:
    """Where this process computes, as the benchmarks record it: "<CPU model>, <n> threads"."""
    return f"{cpu_model()}, {threads()} threads"


def _version(module: str) -> str | None:
    if not _installed(module):
        return None
    return getattr(importlib.import_module(module), "__version__", "?")


def describe() -> str:
    """One line: where kernels run, on what, with which versions."""
    chosen = current()
    where = chosen.device
    if chosen.device == "cuda":
        import torch

        where = f"cuda ({torch.cuda.get_device_name(0)})"
    else:
        where = f"cpu ({cpu_model()}, {platform.machine()}, {threads()} threads)"
    versions = [f"python {platform.python_version()}"]
    for module in ("numpy", "numba", "torch"):
        version = _version(module)
        versions.append(f"{module} {version if version else 'not installed'}")
    from infra_lab import sizes

    quick = " | quick sizes (INFRA_LAB_QUICK): not the page's figures" if sizes.is_quick() else ""
    return f"infra_lab backend: {chosen.name} on {where} | " + ", ".join(versions) + quick
