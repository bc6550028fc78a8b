"""Triton ``copy_rows``: one launch copies every chunk of every tensor of a :class:`RowTable` for every pair.

The grid is ``(chunks of the table, groups of PAIRS pairs)``. A program reads its chunk entry (address in
row 0, row stride, bytes, unit) and its group's pairs (one vector load; a group with no copying pair ends
there), then for each pair loads ``src`` / ``dst``, skips the pair on the device when an index is negative
or both are equal, and copies the chunk of that row. Each copy moves
the chunk in its tensor's unit (:data:`~atom_kernels.ops.copy_rows.table.UNITS`): 16-, 8- and 4-byte units as
``int32`` elements with alignment hints of 16 / 8 / 4 bytes (16-byte vector loads and stores on the GPU where
the table allows), 2- and 1-byte units as ``int16`` / ``int8``. Indices stay on the device, the grid depends
only on the shapes: the launch is capturable in a CUDA graph, and a caller may pass fixed-size index tensors
padded with -1.

A single launch gives no order between pairs, so a destination must be no other pair's source (the
precondition of the op). Only ``tl`` primitives: also compiles for ROCm.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_kernels.ops._checks import values_checkable
from atom_kernels.ops.copy_rows.checks import check_copy_rows, check_copy_rows_values
from atom_kernels.ops.copy_rows.table import RowTable

BLOCK_BYTES = 4096  # bytes one loop iteration of a program moves
TARGET_PROGRAMS = 8192  # more pairs than this many programs' worth: each program loops over several pairs
MAX_PAIRS = 64
MAX_GRID_Y = 65535


@triton.jit
def _copy_chunk(addr, stride, s, d, nbytes, ELEM: tl.constexpr, ALIGN: tl.constexpr, BLOCK: tl.constexpr):
    """Copy ``nbytes`` from ``addr + s * stride`` to ``addr + d * stride`` as ``ELEM`` elements; the two
    addresses and ``nbytes`` are multiples of ``ALIGN`` bytes (the hints let the compiler vectorise)."""
    esize: tl.constexpr = ELEM.primitive_bitwidth // 8
    # the hints go on the pointers (Triton's alignment analysis does not carry them through int_to_ptr)
    sp = tl.multiple_of((addr + s * stride).to(tl.pointer_type(ELEM)), ALIGN)
    dp = tl.multiple_of((addr + d * stride).to(tl.pointer_type(ELEM)), ALIGN)
    n = tl.multiple_of((nbytes // esize).to(tl.int32), ALIGN // esize)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        m = offs < n
        tl.store(dp + offs, tl.load(sp + offs, mask=m), mask=m)


@triton.jit
def _copy_rows_kernel(chunks_ptr, src_ptr, dst_ptr, n_pairs, PAIRS: tl.constexpr, BLOCK_BYTES: tl.constexpr):
    entry = chunks_ptr + tl.program_id(0).to(tl.int64) * 4
    addr = tl.load(entry)
    stride = tl.load(entry + 1)
    nbytes = tl.load(entry + 2)
    unit = tl.load(entry + 3)
    first = tl.program_id(1) * PAIRS
    # one vector load of the group's pairs: a group of padding only (most of a padded batch) ends here
    o = first + tl.arange(0, PAIRS)
    sv = tl.load(src_ptr + o, mask=o < n_pairs, other=-1)
    dv = tl.load(dst_ptr + o, mask=o < n_pairs, other=-1)
    live = (sv >= 0) & (dv >= 0) & (sv != dv)
    if tl.sum(live.to(tl.int32), axis=0) > 0:
        for i in range(PAIRS):
            p = first + i
            if p < n_pairs:
                s = tl.load(src_ptr + p)
                d = tl.load(dst_ptr + p)
                if (s >= 0) & (d >= 0) & (s != d):
                    if unit == 16:
                        _copy_chunk(addr, stride, s, d, nbytes, tl.int32, 16, BLOCK_BYTES // 4)
                    elif unit == 8:
                        _copy_chunk(addr, stride, s, d, nbytes, tl.int32, 8, BLOCK_BYTES // 4)
                    elif unit == 4:
                        _copy_chunk(addr, stride, s, d, nbytes, tl.int32, 4, BLOCK_BYTES // 4)
                    elif unit == 2:
                        _copy_chunk(addr, stride, s, d, nbytes, tl.int16, 2, BLOCK_BYTES // 2)
                    else:
                        _copy_chunk(addr, stride, s, d, nbytes, tl.int8, 1, BLOCK_BYTES)


def pairs_per_program(num_pairs: int, num_chunks: int) -> int:
    """Pairs one program handles: 1 while ``chunks x pairs`` programs stay within :data:`TARGET_PROGRAMS`,
    else the power of two (at most :data:`MAX_PAIRS`) that brings the grid near it. A function of the shapes
    only, so a captured launch keeps its plan."""
    pairs = 1
    while pairs < MAX_PAIRS and num_chunks * triton.cdiv(num_pairs, pairs) > TARGET_PROGRAMS:
        pairs *= 2
    return pairs


def copy_rows(rows: RowTable, src: torch.Tensor, dst: torch.Tensor) -> None:
    """See :func:`atom_kernels.ops.copy_rows.reference.copy_rows` (same contract)."""
    check_copy_rows(rows, src, dst)
    if not src.is_cuda and values_checkable(src, dst):
        check_copy_rows_values(rows, src, dst)
    n = src.shape[0]
    if n == 0:
        return
    num_chunks = rows.chunks.shape[0]
    pairs = pairs_per_program(n, num_chunks)
    groups = triton.cdiv(n, pairs)
    if groups > MAX_GRID_Y:
        raise ValueError(f"copy_rows: {n} pairs exceed one launch ({MAX_GRID_Y} groups of {pairs})")
    _copy_rows_kernel[(num_chunks, groups)](
        rows.chunks,
        src.contiguous(),
        dst.contiguous(),
        n,
        PAIRS=pairs,
        BLOCK_BYTES=BLOCK_BYTES,
        num_warps=4,
    )
