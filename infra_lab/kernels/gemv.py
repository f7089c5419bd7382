"""GEMV, y = W x: the matrix-vector product at the heart of batch-1 decode.

Each weight is read once and used for one multiply-add, so GEMV does 2 FLOPs per weight loaded:
it is bound by memory bandwidth on every machine (Williams et al., "Roofline", CACM 2009).
"""
from __future__ import annotations

import numba
import numpy as np

from infra_lab import backend as backends


def _check_shapes(weights_shape: tuple, x_shape: tuple) -> None:
    if len(weights_shape) != 2 or len(x_shape) != 1 or weights_shape[1] != x_shape[0]:
        raise ValueError(
            f"gemv needs W of shape (n_out, n_in) and x of shape (n_in,); "
            f"got W {tuple(weights_shape)} and x {tuple(x_shape)}"
        )


def gemv_numpy(weights: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Reference: (n_out, n_in) @ (n_in,) -> (n_out,)."""
    _check_shapes(weights.shape, x.shape)
    return weights @ x


ROWS_PER_TASK = 4  # rows that share each load of x


@numba.njit(parallel=True, fastmath=True, cache=True, nogil=True)
def _gemv_rows(weights, x, out):  # (n_out, n_in), (n_in,), (n_out,)
    n_out, n_in = weights.shape
    for task in numba.prange((n_out + ROWS_PER_TASK - 1) // ROWS_PER_TASK):
        first = task * ROWS_PER_TASK
        if first + ROWS_PER_TASK <= n_out:  # four streaming dot products, one pass over x
            acc0 = acc1 = acc2 = acc3 = x[0] * 0
            for col in range(n_in):
                x_col = x[col]
                acc0 += weights[first, col] * x_col
                acc1 += weights[first + 1, col] * x_col
                acc2 += weights[first + 2, col] * x_col
                acc3 += weights[first + 3, col] * x_col
            out[first], out[first + 1], out[first + 2], out[first + 3] = acc0, acc1, acc2, acc3
        else:  # the last rows
            for row in range(first, n_out):
                acc = x[0] * 0
                for col in range(n_in):
                    acc += weights[row, col] * x[col]
                out[row] = acc


def gemv_numba(weights: np.ndarray, x: np.ndarray) -> np.ndarray:
    """CPU: tasks of four rows each, spread over the threads; each task streams its rows once."""
    _check_shapes(weights.shape, x.shape)
    weights = np.ascontiguousarray(weights)
    x = np.ascontiguousarray(x, dtype=weights.dtype)
    out = np.empty(weights.shape[0], dtype=weights.dtype)  # (n_out,)
    _gemv_rows(weights, x, out)
    return out


def gemv_torch(weights, x):
    """torch.mv on whatever device the tensors live on (numpy arrays go to the backend's)."""
    import torch

    _check_shapes(tuple(weights.shape), tuple(x.shape))
    if isinstance(weights, np.ndarray):
        device = backends.torch_device()
        result = torch.mv(torch.from_numpy(weights).to(device), torch.from_numpy(x).to(device))
        return result.cpu().numpy()
    return torch.mv(weights, x)


FACES = {"numpy": gemv_numpy, "numba": gemv_numba, "torch": gemv_torch}


def gemv(weights, x, backend: backends.Backend | None = None):
    """y = W x on the current backend (or the one given)."""
    return backends.pick(FACES, backend)(weights, x)
