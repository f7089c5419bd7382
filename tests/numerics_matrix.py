"""The numerics-marked tests (`pytest -m numerics`) under other thread counts and other CPU
kernels: a tolerance that holds only for this machine's BLAS, thread count or vector width fails
here before it fails on someone else's CPU.

    .venv/bin/python tests/numerics_matrix.py            # every configuration
    .venv/bin/python tests/numerics_matrix.py --list     # their names and settings
    .venv/bin/python tests/numerics_matrix.py "1 thread" "OpenBLAS Prescott"

Each configuration runs pytest in a fresh process with its environment: numba's, OpenMP's (torch
follows OMP_NUM_THREADS), OpenBLAS's and MKL's thread counts; numpy's and scipy's OpenBLAS
forced onto another CPU's kernels with OPENBLAS_CORETYPE (their wheels are built DYNAMIC_ARCH;
threadpoolctl reports the kernels taken, printed beside each line); and every library held to
AVX2, as on an AMD EPYC: torch's own kernels (ATEN_CPU_CAPABILITY), MKL's and oneDNN's, numba's
code (NUMBA_CPU_NAME) and OpenBLAS's (Zen takes its Haswell kernels). The tests that spawn
processes for 20 s and more (marked slow) run in the default configuration only. pytest is given
the test files that mark tests numerics (`numerics_files`), so a file elsewhere that fails to
import, someone's work in progress, stops no run here (`make check` finds it). One line per
configuration; the exit status is 1 when any fails. About 9 minutes on 2 (shared) cores.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
THREAD_VARIABLES = ("NUMBA_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
EVERY = "numerics"
FAST = "numerics and not slow"
AVX2 = {"OPENBLAS_CORETYPE": "Haswell", "ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        "ONEDNN_MAX_CPU_ISA": "AVX2", "NUMBA_CPU_NAME": "haswell"}


def threads(n: int) -> dict[str, str]:
    return dict.fromkeys(THREAD_VARIABLES, str(n))


CONFIGURATIONS: list[tuple[str, dict[str, str], str]] = [  # (name, environment, marker expression)
    ("default", {}, EVERY),
    ("1 thread", threads(1), FAST),
    ("2 threads", threads(2), FAST),
    ("OpenBLAS Haswell", {"OPENBLAS_CORETYPE": "Haswell"}, FAST),
    ("OpenBLAS SandyBridge", {"OPENBLAS_CORETYPE": "SandyBridge"}, FAST),
    ("OpenBLAS Prescott, 1 thread", {"OPENBLAS_CORETYPE": "Prescott"} | threads(1), FAST),
    ("AVX2 everywhere (as on AMD EPYC)", AVX2, FAST),
]

PROBE = """
import numba, threadpoolctl, torch
pools = threadpoolctl.threadpool_info()
blas = sorted({i.get("architecture") or "?" for i in pools if i["internal_api"] == "openblas"})
print(f"openblas={'/'.join(blas)} torch={torch.backends.cpu.get_cpu_capability()}x{torch.get_num_threads()} "
      f"numba={numba.config.NUMBA_NUM_THREADS}")
"""


def probe(env: dict[str, str]) -> str:
    """What the environment gave: OpenBLAS's kernels, torch's vector width and threads, numba's threads."""
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    return done.stdout.strip() if done.returncode == 0 else f"probe failed: {done.stderr.strip()[-200:]}"


def numerics_files() -> list[str]:
    """The test files that mark tests numerics (a decorator, a pytest.param's marks, or pytestmark)."""
    return sorted(str(path) for path in (ROOT / "tests").glob("test_*.py") if "mark.numerics" in path.read_text())


def run(name: str, settings: dict[str, str], marker: str, timeout_s: float = 900) -> bool:
    env = os.environ | settings
    seen = probe(env)
    started = time.perf_counter()
    command = [sys.executable, "-m", "pytest", "-m", marker, "-q", "-p", "no:cacheprovider", *numerics_files()]
    try:
        done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
        code, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as expired:
        code, output = -1, f"timed out after {timeout_s:g} s\n{expired.stdout or ''}"
    seconds = time.perf_counter() - started
    lines = [line for line in output.splitlines() if line.strip()]
    summary = lines[-1].strip("= ") if lines else "no output"
    print(f"{name:34s} {'passed' if code == 0 else 'FAILED':6s} {seconds:6.1f} s  {summary}  [{seen}]", flush=True)
    if code != 0:  # pytest's short summary names each failure
        for line in lines:
            if line.startswith(("FAILED", "ERROR")):
                print(f"    {line}")
    return code == 0


def main(argv: list[str]) -> int:
    if "--list" in argv:
        for name, settings, marker in CONFIGURATIONS:
            print(f"{name:34s} -m '{marker}'  {' '.join(f'{k}={v}' for k, v in settings.items()) or '(as is)'}")
        return 0
    chosen = [c for c in CONFIGURATIONS if not argv or c[0] in argv]
    unknown = set(argv) - {c[0] for c in CONFIGURATIONS}
    if unknown:
        print(f"unknown configuration {sorted(unknown)[0]!r}; --list names them", file=sys.stderr)
        return 2
    results = [run(*configuration) for configuration in chosen]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
