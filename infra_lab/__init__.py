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
_OPENMP_POLICY_AT_IMPORT = os.environ.get("OMP_WAIT_POLICY")
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


def _one_openmp_runtime() -> None:
    """torch ships its own libgomp and starts it on import. Imported before infra_lab, that
    runtime has read no OMP_WAIT_POLICY and spins, and numba's OpenMP kernels then ran 2 to 7
    times slower (chapter 09's MoE layer: 384 ms against 196 ms on 2 cores). In that case
    numba's kernels go to numba's own work queue, which uses no OpenMP (as fast there for the
    MoE layer; slower only to launch a tiny kernel); otherwise they stay on OpenMP, which now
    sleeps between kernels. tests/test_threading_layer.py times both orders. The work queue's
    one limit: two Python threads must not run parallel kernels at the same moment (numba stops
    the process if they do); the engine runs its kernels from one thread. A
    NUMBA_THREADING_LAYER the user set wins."""
    spinning_torch = "torch" in sys.modules and (_OPENMP_POLICY_AT_IMPORT or "").upper() != "PASSIVE"
    if "NUMBA_THREADING_LAYER" in os.environ or not spinning_torch:
        return
    os.environ["NUMBA_THREADING_LAYER"] = "workqueue"  # child processes (ranks, kernels) inherit it
    if "numba" in sys.modules:  # it read its config at import, before this
        sys.modules["numba"].config.THREADING_LAYER = "workqueue"


_let_llvm_use_512_bit_vectors()
_one_openmp_runtime()

from infra_lab.show import show  # noqa: E402

__version__ = "0.1.0"
__all__ = ["show", "__version__"]
