"""Where one rank's part of a sharded weight sits in the full weight, and the FP8 block rule for it.

A column-parallel linear holds some output rows of the full weight, a row-parallel one some input columns.
A fused weight (``gate_up_proj`` = ``[gate; up]``) is made of *parts* (the checkpoint tensors it fuses);
a rank holds one contiguous range of each part, stacked in part order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from atom_models.parallel.context import ParallelContext, SingleProcess

COLUMN = "column"  # output rows split: local output features, no communication (optionally all-gathered)
ROW = "row"  # input columns split: partial sums, all-reduced (unless the caller reduces later)


@dataclass(frozen=True)
class LinearShard:
    """This rank's share of a linear's split dimension (rows for ``column``, columns for ``row``).

    ``parts`` are the full sizes of the fused checkpoint tensors along that dimension; ``ranges`` this
    rank's ``[start, end)`` inside each part (same order). ``reduce``: a row-parallel output is all-reduced
    in ``forward``; ``gather``: a column-parallel output is all-gathered along the last dimension.
    """

    kind: Literal["column", "row"]
    parallel: ParallelContext
    parts: tuple[int, ...]
    ranges: tuple[tuple[int, int], ...]
    reduce: bool = True
    gather: bool = False

    @property
    def local_size(self) -> int:
        return sum(e - s for s, e in self.ranges)

    @property
    def full_size(self) -> int:
        return sum(self.parts)

    @property
    def local_parts(self) -> tuple[int, ...]:
        return tuple(e - s for s, e in self.ranges)

    @property
    def is_sharded(self) -> bool:
        return self.local_size != self.full_size

    @classmethod
    def even(
        cls,
        kind: Literal["column", "row"],
        parallel: ParallelContext,
        parts: tuple[int, ...],
        *,
        reduce: bool = True,
        gather: bool = False,
    ) -> LinearShard:
        """Every part split into ``world_size`` equal contiguous ranges; rank r holds the r-th of each."""
        tp, r = parallel.world_size, parallel.rank
        for p in parts:
            if p % tp:
                raise ValueError(
                    f"{kind}-parallel linear: size {p} is not divisible by the tensor parallel size {tp}"
                )
        ranges = tuple((r * (p // tp), (r + 1) * (p // tp)) for p in parts)
        return cls(kind, parallel, tuple(parts), ranges, reduce=reduce, gather=gather)

    @classmethod
    def replicated(cls, parallel: ParallelContext, size: int) -> LinearShard:
        """The whole weight on every rank (``column`` with the full range: no communication)."""
        return cls(COLUMN, parallel, (size,), ((0, size),))


def single(size: int) -> LinearShard:
    """The unsharded (TP = 1) description of a split dimension of ``size``."""
    return LinearShard.replicated(SingleProcess(), size)


def fp8_block_range(module: str, start: int, end: int, block: int, what: str, tp: int) -> tuple[int, int]:
    """The ``[first, last)`` block indices that rows/columns ``[start, end)`` of an FP8 weight use.

    A rank's slice must start on a block boundary or lie inside one block; otherwise its first rows would
    share a block scale with the previous rank's rows and the per-rank scale tensor could not describe
    them: raise ``ValueError`` naming the module, the per-rank size and the block (vLLM refuses the same).
    """
    if start % block and start // block != (end - 1) // block:
        raise ValueError(
            f"{module}: with tensor parallel size {tp} each rank holds {end - start} {what} of the FP8 weight "
            f"(rank range [{start}, {end})), which neither starts on a {block}-{what[:-1]} block boundary nor "
            f"lies inside one block of weight_block_size; use a tensor parallel size that divides the "
            f"{what} into multiples of {block} (or expert parallelism for routed experts)"
        )
    return start // block, -(-end // block)


def check_every_rank(module: str, full: int, size: int, block: int, what: str, tp: int) -> None:
    """:func:`fp8_block_range` for every rank's ``[j * size, (j + 1) * size)`` of a part of ``full``
    rows/columns (the even split, and the KV-head ranges, are all of this form), so that every rank reaches
    the same verdict: one rank refusing while another builds would leave the other waiting in its first
    collective."""
    if size <= 0 or full % size:
        raise ValueError(f"{module}: a rank's {size} {what} do not split the {full} {what} of the FP8 weight")
    for j in range(full // size):
        fp8_block_range(module, j * size, (j + 1) * size, block, what, tp)


def check_fp8_shard(module: str, shard: LinearShard, block: tuple[int, int]) -> None:
    """:func:`check_every_rank` for every part of a sharded linear (rows of a column-parallel one, columns
    of a row-parallel one); ``ValueError`` naming ``module`` if any rank's range straddles a block boundary
    (the same on every rank)."""
    b, what = (int(block[0]), "rows") if shard.kind == COLUMN else (int(block[1]), "columns")
    for part, (start, end) in zip(shard.parts, shard.ranges):
        check_every_rank(module, part, end - start, b, what, shard.parallel.world_size)
