"""AI Infra Lab: the code behind the book, one module per concept.

`infra_lab.backend` decides where kernels run; `infra_lab.show(obj)` displays the real source
of anything here; `infra_lab.grading` checks and grades the exercises.
"""
import os
import sys

# numba's parallel kernels run on OpenMP threads, which by default spin for a while after each
# kernel, holding the cores that the numpy matmuls between kernels need. With them sleeping
# instead, one decode step of the target model over 32 sequences took 6.5 ms rather than 34 ms
# on a 2-core VM. It must be set before OpenMP starts; a value the user set wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _let_llvm_use_512_bit_vectors() -> None:
    """LLVM tunes every AVX-512 Intel CPU to prefer 256-bit vectors (a Skylake-era guard against
    the clock dropping under 512-bit work), so numba's loops use half the width the CPU has. With
    512-bit vectors chapter 08's int4 GEMV ran 1.6x faster on a 2-core Xeon VM (Sapphire Rapids
    class), and numpy's BLAS, the kernels' peer, uses them already. numba reads its CPU features
    when it first compiles, so this runs on import (numba already imported takes the setting too,
    unless it has compiled something); a NUMBA_CPU_FEATURES the user set wins, and CPUs without
    AVX-512 are left alone."""
    if "NUMBA_CPU_FEATURES" in os.environ:
        return
    try:
        import llvmlite.binding as llvm

        features = llvm.get_host_cpu_features()
    except (ImportError, RuntimeError):  # no numba here, or a host whose features LLVM cannot read
        return
    if features.get("avx512f"):
        os.environ["NUMBA_CPU_FEATURES"] = f"{features.flatten()},-prefer-256-bit"
        if "numba" in sys.modules:  # it read its config at import, before this
            sys.modules["numba"].config.CPU_FEATURES = os.environ["NUMBA_CPU_FEATURES"]


_let_llvm_use_512_bit_vectors()

from infra_lab.show import show  # noqa: E402

__version__ = "0.1.0"
__all__ = ["show", "__version__"]
