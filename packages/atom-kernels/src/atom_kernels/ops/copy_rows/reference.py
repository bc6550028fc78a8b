"""Reference ``copy_rows``: per tensor, one gather of the source rows and one scatter to the destinations."""

from __future__ import annotations

import torch

from atom_kernels.ops.copy_rows.checks import check_copy_rows, check_copy_rows_values, valid_pairs
from atom_kernels.ops.copy_rows.table import RowTable


def copy_rows(rows: RowTable, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Set row ``dst[i]`` of every tensor of ``rows`` to its row ``src[i]``, in place.

    Args:
        rows: the tensors (:class:`~atom_kernels.ops.copy_rows.RowTable`, built once for a fixed set).
        src, dst: ``[N]`` int64 row indices on the table's device. A pair with ``src[i] < 0``,
            ``dst[i] < 0`` or ``src[i] == dst[i]`` copies nothing (callers may pass fixed-size index
            tensors padded with -1). Precondition: no destination appears twice and none is the source of
            another pair (a single kernel reads and writes in no set order); every index is below
            ``rows.num_rows``.

    The reference selects the copying pairs with a boolean mask (a host synchronisation on a GPU): it is the
    spec, not a capturable path.
    """
    check_copy_rows(rows, src, dst)
    check_copy_rows_values(rows, src, dst)
    keep = valid_pairs(src, dst)
    s, d = src[keep], dst[keep]
    if s.numel() == 0:
        return
    for t in rows.tensors:
        t.index_copy_(0, d, t.index_select(0, s))
