"""CPU ``copy_rows``: each copying pair's row copied in place, tensor by tensor.

On a CPU the indices are host memory, so the copying pairs are read once per call and each row is one
``copy_`` from source to destination: half the memory traffic of the reference's gather-then-scatter
(which first writes the gathered rows to a temporary) and no temporary.
"""

from __future__ import annotations

import torch

from atom_kernels.ops.copy_rows.checks import check_copy_rows, check_copy_rows_values, valid_pairs
from atom_kernels.ops.copy_rows.table import RowTable


def copy_rows(rows: RowTable, src: torch.Tensor, dst: torch.Tensor) -> None:
    """See :func:`atom_kernels.ops.copy_rows.reference.copy_rows` (same contract)."""
    check_copy_rows(rows, src, dst)
    check_copy_rows_values(rows, src, dst)
    keep = valid_pairs(src, dst)
    pairs = list(zip(src[keep].tolist(), dst[keep].tolist()))
    for t in rows.tensors:
        for s, d in pairs:
            t[d].copy_(t[s])
