""":class:`RowTable`: a fixed set of row-indexed tensors, described once for the ``copy_rows`` op.

A table is built once per set of tensors (e.g. every GDN state tensor of every layer of a model) and then
used for every call. It keeps the tensors themselves (the reference and CPU forms index them) and, on their
device, one entry per *chunk* of a row: a row is split into chunks of at most :data:`CHUNK_BYTES` bytes, and
entry ``j`` holds ``(address of chunk j in row 0, row stride in bytes, chunk size in bytes, unit in
bytes)``. The unit is the widest of 16 / 8 / 4 / 2 / 1 bytes that divides the tensor's base address, its
row stride and its row size, so a kernel may move the chunk in units of that width. Row ``r`` of a chunk
starts at ``address + r * stride``.

Rows may lie further apart than their size (vLLM's Mamba state tensors are ``as_strided`` views of a shared
page pool: the row stride is the page size), but each row must be one dense block of memory, its elements in
any order (a transposed view of a contiguous row, like the GDN conv state, is fine): a row is copied as
bytes. :meth:`RowTable.build` checks that and names the offending tensor otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

CHUNK_BYTES = 16384
"""Bytes of one chunk entry (a multiple of 16, so chunks keep their tensor's alignment)."""

UNITS = (16, 8, 4, 2, 1)
"""Copy units in bytes, widest first."""


def dense_row(t: torch.Tensor) -> bool:
    """Whether one row of ``t`` (``t[0]``'s sizes and strides) covers one dense block of memory: the
    strides of its dims (of size > 1), in increasing order, are the running products of their sizes."""
    dims = sorted((st, sz) for sz, st in zip(t.shape[1:], t.stride()[1:]) if sz > 1)
    expected = 1
    for st, sz in dims:
        if st != expected:
            return False
        expected *= sz
    return True


def copy_unit(address: int, stride_bytes: int, row_bytes: int) -> int:
    """The widest unit of :data:`UNITS` dividing the base address, the row stride and the row size."""
    for unit in UNITS:
        if address % unit == 0 and stride_bytes % unit == 0 and row_bytes % unit == 0:
            return unit
    return 1


@dataclass(frozen=True, eq=False)
class RowTable:
    """The tensors of one ``copy_rows`` set and their chunk table (see the module docstring).

    ``tensors``: the tensors as given (row index = dim 0); ``names``: one per tensor, for errors; ``chunks``:
    ``[M, 4]`` int64 on the tensors' device; ``num_rows``: the smallest dim-0 size (valid indices are below
    it); ``row_bytes``: each tensor's row size."""

    tensors: tuple[torch.Tensor, ...]
    names: tuple[str, ...]
    chunks: torch.Tensor
    num_rows: int
    row_bytes: tuple[int, ...]

    @property
    def device(self) -> torch.device:
        return self.chunks.device

    @classmethod
    def build(cls, tensors: Sequence[torch.Tensor], names: Sequence[str] | None = None) -> RowTable:
        """Describe ``tensors`` (at least one, all on one device, each at least 1-D with dense rows that do
        not overlap). ``names`` (default ``tensor 0``, ``tensor 1``, ...) name them in errors."""
        tensors = tuple(tensors)
        names = tuple(names) if names is not None else tuple(f"tensor {i}" for i in range(len(tensors)))
        if not tensors:
            raise ValueError("RowTable.build: no tensors")
        if len(names) != len(tensors):
            raise ValueError(f"RowTable.build: {len(names)} names for {len(tensors)} tensors")
        device = tensors[0].device
        entries: list[tuple[int, int, int, int]] = []
        row_bytes = []
        for t, name in zip(tensors, names):
            if not isinstance(t, torch.Tensor) or t.dim() < 1:
                raise ValueError(f"RowTable.build: {name} must be a tensor of at least one dim (its rows)")
            if t.device != device:
                raise ValueError(
                    f"RowTable.build: {name} is on {t.device}, expected {device} (of {names[0]})"
                )
            size = t.element_size()
            numel = math.prod(t.shape[1:])
            if not dense_row(t):
                raise ValueError(
                    f"RowTable.build: the rows of {name} (shape {tuple(t.shape)}, strides {t.stride()}) are "
                    "not dense blocks of memory; copy_rows moves each row as one block of bytes"
                )
            if t.shape[0] > 1 and t.stride(0) < numel:
                raise ValueError(
                    f"RowTable.build: the rows of {name} overlap (row stride {t.stride(0)} < {numel} "
                    "elements per row)"
                )
            address, stride, nbytes = t.data_ptr(), t.stride(0) * size, numel * size
            unit = copy_unit(address, stride, nbytes)
            row_bytes.append(nbytes)
            for off in range(0, nbytes, CHUNK_BYTES):
                entries.append((address + off, stride, min(CHUNK_BYTES, nbytes - off), unit))
        chunks = torch.tensor(entries, dtype=torch.int64).reshape(-1, 4).to(device)
        return cls(
            tensors=tensors,
            names=names,
            chunks=chunks,
            num_rows=min(t.shape[0] for t in tensors),
            row_bytes=tuple(row_bytes),
        )
