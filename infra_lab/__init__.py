"""AI Infra Lab: the code behind the book, one module per concept.

`infra_lab.backend` decides where kernels run; `infra_lab.show(obj)` displays the real source
of anything here; `infra_lab.grading` checks and grades the exercises.
"""
import os

# numba's parallel kernels run on OpenMP threads, which by default spin for a while after each
# kernel, holding the cores that the numpy matmuls between kernels need. With them sleeping
# instead, one decode step of the target model over 32 sequences took 6.5 ms rather than 34 ms
# on a 2-core VM. It must be set before OpenMP starts; a value the user set wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _let_llvm_use_512_bit_vectors() -> None:
    """LLVM tunes every AVX-512 Intel CPU to prefer 256-bit vectors (a Skylake-era guard against
    the clock dropping under 512-bit work), so numba's loops use half the width the CPU has. With
    512-bit vectors chapter 08's int4 GEMV ran 1.6x faster on a 2-core Xeon VM (Sapphire Rapids class), and
    numpy's BLAS, the kernels' peer, uses them already. numba reads NUMBA_CPU_FEATURES when it
    first compiles, so this must run first; a value the user set wins, and CPUs without AVX-512
    are left alone."""
    if "NUMBA_CPU_FEATURES" in os.environ:
        return
    try:
        import llvmlite.binding as llvm
    except ImportError:  # no numba here
        return
    features = llvm.get_host_cpu_features()
    if features.get("avx512f"):
        os.environ["NUMBA_CPU_FEATURES"] = f"{features.flatten()},-prefer-256-bit"


_let_llvm_use_512_bit_vectors()

from infra_lab.show import show  # noqa: E402

__version__ = "0.1.0"
__all__ = ["show", "__version__"]
