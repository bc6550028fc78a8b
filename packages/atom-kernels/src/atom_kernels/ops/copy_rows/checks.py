"""Validation of ``copy_rows`` (every backend): metadata always, index values where reading them is free."""

from __future__ import annotations

import torch

from atom_kernels.ops._checks import Checker, values_checkable
from atom_kernels.ops.copy_rows.table import RowTable


def check_copy_rows(rows: RowTable, src: torch.Tensor, dst: torch.Tensor) -> None:
    c = Checker("copy_rows")
    if not isinstance(rows, RowTable):
        c.fail(
            f"rows must be a RowTable (atom_kernels.ops.copy_rows.RowTable.build), got {type(rows).__name__}"
        )
    c.tensor("src", src, ("N",), (torch.int64,), same_device=False)
    c.tensor("dst", dst, ("N",), (torch.int64,), same_device=False)
    for name, t in (("src", src), ("dst", dst)):
        if t.device != rows.device:
            c.fail(f"{name} is on {t.device}, expected {rows.device} (the device of the row table)")


def valid_pairs(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """The pairs that copy: both indices >= 0 and ``src != dst`` (bool ``[N]``)."""
    return (src >= 0) & (dst >= 0) & (src != dst)


def check_copy_rows_values(rows: RowTable, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Indices of the copying pairs below ``rows.num_rows``; no destination twice and none also a source
    (one launch reads and writes rows in no set order). Skipped where reading the values would synchronise
    a device under CUDA-graph capture."""
    if src.numel() == 0 or not values_checkable(src, dst):
        return
    keep = valid_pairs(src, dst)
    s, d = src[keep], dst[keep]
    if s.numel() == 0:
        return
    hi = int(torch.maximum(s.max(), d.max()))
    if hi >= rows.num_rows:
        raise ValueError(f"copy_rows: indices must be < {rows.num_rows} (the rows of the table), got {hi}")
    if d.unique().numel() != d.numel():
        raise ValueError(f"copy_rows: a destination row appears twice in dst {d.tolist()}")
    both = set(d.tolist()) & set(s.tolist())
    if both:
        raise ValueError(
            f"copy_rows: rows {sorted(both)} are both a destination and a source; a copy's sources must "
            "not be written by the same call"
        )
