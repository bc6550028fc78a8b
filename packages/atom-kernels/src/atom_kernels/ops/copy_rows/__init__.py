"""Row copies across many tensors at once: ``copy_rows(rows, src, dst)`` sets row ``dst[i]`` of every
tensor of a :class:`RowTable` to its row ``src[i]`` (pairs with a negative index or ``src == dst`` are
skipped)."""

from atom_kernels.ops.copy_rows.checks import check_copy_rows, check_copy_rows_values
from atom_kernels.ops.copy_rows.table import CHUNK_BYTES, RowTable

__all__ = ["CHUNK_BYTES", "RowTable", "check_copy_rows", "check_copy_rows_values"]
