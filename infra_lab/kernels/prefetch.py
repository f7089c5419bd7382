"""Software prefetch for numba kernels, and a read-only probe that shows what it buys.

A CPU's hardware prefetchers learn a stream of addresses and load ahead of it. A paged KV cache
breaks the stream: after every block, a kernel that reads one sequence after another jumps to
another block, chosen by the block table, and the prefetchers must learn the stream again.
`prefetch_l2` lets a kernel that knows the block table say where it goes next, one block ahead.
`read_blocks` is the probe: `benchmarks/paged.py` and chapter 03 read the same bytes through
the scattered tables, through them with the next block prefetched, and in address order, which
is the order the paged kernel itself reads the pool in.
"""
from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

_READ, _KEEP_IN_L2, _DATA = 0, 2, 1  # llvm.prefetch arguments: rw, locality (2 = x86 prefetcht1), cache type


@intrinsic
def prefetch_l2(typingctx, array, index):
    """Start loading the cache line that holds array[index] (a 1-D array; index in range) into
    L2, for reading. Returns at once and never faults. Locality 2 (x86 `prefetcht1`, into L2)
    read faster than `prefetcht0` (into L1) in `read_blocks` on the 2-core Zen 4 VM where this
    module was written."""
    if not (isinstance(array, types.Array) and array.ndim == 1 and isinstance(index, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        array_type = signature.args[0]
        view = context.make_array(array_type)(context, builder, args[0])
        address = cgutils.get_item_pointer(context, builder, array_type, view, [args[1]], wraparound=False)
        byte_address = builder.bitcast(address, ir.IntType(8).as_pointer())
        i32 = ir.IntType(32)
        function_type = ir.FunctionType(ir.VoidType(), [byte_address.type, i32, i32, i32])
        function = builder.module.declare_intrinsic("llvm.prefetch", [byte_address.type], function_type)
        builder.call(function, [byte_address] + [ir.Constant(i32, flag) for flag in (_READ, _KEEP_IN_L2, _DATA)])
        return context.get_dummy_value()

    return types.void(array, index), codegen


LINE_FLOATS = 16  # float32 values in a 64-byte cache line


@numba.njit(inline="always")
def prefetch_span(flat, start, count):  # flat (n,) float32: one prefetch per cache line of flat[start:start+count]
    for i in range(start, start + count, LINE_FLOATS):
        prefetch_l2(flat, i)


@numba.njit(fastmath=True)
def _sum(values):  # (n,) -> float32; fastmath lets LLVM split the sum into vector lanes
    total = np.float32(0)
    for i in range(values.shape[0]):
        total += values[i]
    return total


def read_blocks(pool, tables, prefetch: bool):
    """Sum every block that tables (tasks, blocks) names in pool (num_blocks, block_floats), one
    task per table row: a paged kernel's reads without its arithmetic. With `prefetch`, while
    reading a block in chunks of 512 floats, prefetch the same chunk of the task's next block."""
    pool, tables = np.ascontiguousarray(pool), np.asarray(tables)
    if pool.ndim != 2 or tables.ndim != 2 or not np.issubdtype(tables.dtype, np.integer):
        raise ValueError(f"need pool (num_blocks, block_floats) and integer tables (tasks, blocks); "
                         f"got pool {pool.shape}, tables {tables.shape} of {tables.dtype}")
    if tables.size and (tables.min() < 0 or tables.max() >= len(pool)):
        raise ValueError(f"tables must name blocks in [0, {len(pool)}); got {tables.min()} to {tables.max()}")
    return _read_blocks(pool, tables, bool(prefetch))


@numba.njit(parallel=True, fastmath=True, cache=True)
def _read_blocks(pool, tables, prefetch):
    block_floats = pool.shape[1]
    chunk = min(512, block_floats)
    flat = pool.reshape(-1)
    out = np.zeros(tables.shape[0], np.float32)
    for task in numba.prange(tables.shape[0]):
        total = np.float32(0)
        for j in range(tables.shape[1]):
            start = tables[task, j] * block_floats
            upcoming = tables[task, j + 1] * block_floats if j + 1 < tables.shape[1] else -1
            for offset in range(0, block_floats, chunk):
                size = min(chunk, block_floats - offset)
                if prefetch and upcoming >= 0:
                    prefetch_span(flat, upcoming + offset, size)
                total += _sum(flat[start + offset: start + offset + size])
        out[task] = total
    return out
