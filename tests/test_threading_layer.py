"""One OpenMP runtime, whatever the import order: with torch imported before infra_lab, torch's
libgomp has started spinning, and numba's OpenMP kernels beside it ran 2 to 7 times slower
(infra_lab/__init__.py sends them to numba's work queue then). Each order runs in a fresh
process, as a notebook kernel would, timing chapter 09's MoE layer on numba."""
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")

MOE_LAYER = """
import sys, time
if sys.argv[1] == "torch first":
    import torch
import numpy as np
import numba
from infra_lab.moe.experts import ExpertWeights
from infra_lab.moe.numba_layer import moe_layer_numba
if sys.argv[1] == "infra_lab first":
    import torch

rng = np.random.default_rng(0)
tokens, d, f, experts = 2048, 128, 256, 8
x = rng.standard_normal((tokens, d)).astype(np.float32)  # (T, d)
router = (rng.standard_normal((d, experts)) / np.sqrt(d)).astype(np.float32)  # (d, E)
weights = ExpertWeights(*((rng.standard_normal(s) / np.sqrt(s[1])).astype(np.float32)
                          for s in ((experts, d, f), (experts, d, f), (experts, f, d))))
moe_layer_numba(x, router, weights, 2)
best = float("inf")
for _ in range(9):  # the best of 9: the timing least disturbed by other work on the machine
    start = time.perf_counter()
    moe_layer_numba(x, router, weights, 2)
    best = min(best, time.perf_counter() - start)
print(numba.threading_layer(), best)
"""


def moe_seconds(order: str, **env) -> tuple[str, float]:
    environment = {k: v for k, v in os.environ.items() if k not in ("NUMBA_THREADING_LAYER", "OMP_WAIT_POLICY")}
    done = subprocess.run([sys.executable, "-c", MOE_LAYER, order], env=environment | env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    layer, seconds = done.stdout.split()
    return layer, float(seconds)


@pytest.mark.slow
def test_the_moe_layer_runs_as_fast_after_import_torch_as_before():
    # the two orders take turns, three times each, so load from other work falls on both alike
    runs = [moe_seconds(order) for _ in range(3) for order in ("infra_lab first", "torch first")]
    layers = {layer for layer, _ in runs}
    before, after = min(s for _, s in runs[0::2]), min(s for _, s in runs[1::2])
    assert [layer for layer, _ in runs[:2]] == ["omp", "workqueue"] and len(layers) == 2
    # Two OpenMP runtimes made this 2-7x slower on an idle machine. Beside the rest of the suite
    # a fresh-clone run once measured 1.9x with the fix in place (9.4 against 17.8 ms), so a
    # timing bound here follows the load: the work-queue layer above is what this test holds;
    # the timings only guard against a slowdown far past anything load has shown
    assert after < 4 * before, (before, after)


@pytest.mark.slow
def test_torch_started_passive_keeps_openmp():
    assert moe_seconds("torch first", OMP_WAIT_POLICY="passive")[0] == "omp"


def test_a_threading_layer_the_user_chose_wins():
    code = "import torch, infra_lab, numba; print(numba.config.THREADING_LAYER)"
    env = dict(os.environ, NUMBA_THREADING_LAYER="omp")
    env.pop("OMP_WAIT_POLICY", None)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "omp", done.stderr
