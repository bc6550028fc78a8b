"""The part of a checkpoint tensor one tensor-parallel rank reads (the ``tp`` column of
:data:`atom_models.weight_map.RULES`), its FP8 block scales' part, the sliced read itself, and the
part-major regrouping of its rows (the ``regroup`` column)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from atom_core import Qwen3NextConfig

from atom_models.parallel.layout import TPLayout
from atom_models.parallel.shard import fp8_block_range
from atom_models.weight_map import COLS, CONV_QKV_ROWS, KV_ROWS, ROWS, TP_SPLITS


@dataclass(frozen=True)
class Pieces:
    """``ranges`` (``[start, end)``) of dimension ``dim`` of the full tensor, read and stacked in order."""

    dim: int
    ranges: tuple[tuple[int, int], ...]

    def shape(self, full: tuple[int, ...]) -> tuple[int, ...]:
        out = list(full)
        out[self.dim] = sum(e - s for s, e in self.ranges)
        return tuple(out)


def _dim(tp: str) -> int:
    return 1 if tp == COLS else 0


def full_shape(
    tp: str | None, local: tuple[int, ...], layout: TPLayout, config: Qwen3NextConfig
) -> tuple[int, ...]:
    """The checkpoint shape a parameter slice of shape ``local`` on this rank expects."""
    if tp is None or layout.world_size == 1:
        return tuple(local)
    if tp not in TP_SPLITS:
        raise ValueError(f"unknown tensor-parallel split {tp!r} (weight_map.RULES)")
    out, d = list(local), _dim(tp)
    if tp == KV_ROWS:
        out[0] = local[0] // layout.num_kv_heads * config.num_key_value_heads
    else:
        out[d] = local[d] * layout.world_size
    return tuple(out)


def rank_pieces(
    tp: str | None, full: tuple[int, ...], layout: TPLayout, config: Qwen3NextConfig
) -> Pieces | None:
    """What this rank reads of a checkpoint tensor of shape ``full`` (None: all of it)."""
    if tp is None or layout.world_size == 1:
        return None
    n, r = layout.world_size, layout.rank
    if tp == KV_ROWS:
        per_head = full[0] // config.num_key_value_heads
        start = layout.kv_head_start * per_head
        return Pieces(0, ((start, start + layout.num_kv_heads * per_head),))
    if tp == CONV_QKV_ROWS:
        segments = (config.linear_key_dim, config.linear_key_dim, config.linear_value_dim)
        ranges, offset = [], 0
        for seg in segments:
            m = seg // n
            ranges.append((offset + r * m, offset + (r + 1) * m))
            offset += seg
        return Pieces(0, tuple(ranges))
    if tp in (ROWS, COLS):
        d = _dim(tp)
        m = full[d] // n
        return Pieces(d, ((r * m, (r + 1) * m),))
    raise ValueError(f"unknown tensor-parallel split {tp!r} (weight_map.RULES)")


def scale_pieces(
    module: str, pieces: Pieces | None, block: tuple[int, int], world_size: int
) -> Pieces | None:
    """The block-scale rows / columns that a weight slice uses; ``ValueError`` naming ``module`` when a
    range straddles a block boundary (:func:`~atom_models.parallel.shard.fp8_block_range`)."""
    if pieces is None:
        return None
    if len(pieces.ranges) != 1:
        raise ValueError(f"{module}: an FP8 weight split into {len(pieces.ranges)} slices is not supported")
    b, what = (int(block[0]), "rows") if pieces.dim == 0 else (int(block[1]), "columns")
    (start, end) = pieces.ranges[0]
    return Pieces(pieces.dim, (fp8_block_range(module, start, end, b, what, world_size),))


def read(f, name: str, pieces: Pieces | None) -> torch.Tensor:
    """``name`` from an open ``safe_open`` handle: the whole tensor, or only ``pieces`` (``get_slice``)."""
    if pieces is None:
        return f.get_tensor(name)
    sl = f.get_slice(name)
    parts = [sl[s:e] if pieces.dim == 0 else sl[:, s:e] for s, e in pieces.ranges]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=pieces.dim)


def regroup_rows(t: torch.Tensor, parts: tuple[int, ...]) -> torch.Tensor:
    """Rows of ``t`` as G groups of ``parts`` (row counts, in order) -> part-major: the first part of every
    group, then the second, ... (``[q_0 k_0 q_1 k_1]`` -> ``[q_0 q_1 k_0 k_1]``); other dims as they are."""
    width = sum(parts)
    if width <= 0 or t.shape[0] % width:
        raise ValueError(f"regroup_rows: {t.shape[0]} rows are not whole groups of parts {list(parts)}")
    groups = t.unflatten(0, (t.shape[0] // width, width))
    out, start = [], 0
    for n in parts:
        out.append(groups[:, start : start + n].flatten(0, 1))
        start += n
    return torch.cat(out)


def regroup_scale_parts(name: str, parts: tuple[tuple[str, int], ...], block_rows: int) -> tuple[int, ...]:
    """The block-scale rows of each part of a regrouped FP8 weight (``parts``: ``(what, rows)`` pairs of
    :func:`atom_models.weight_map.group_parts`). Exact only when every part is whole row blocks; otherwise
    ``ValueError`` naming the tensor, the parts that are not, and the block."""
    bad = [f"{what}" for what, n in parts if n % block_rows]
    if bad:
        raise ValueError(
            f"tensor {name}: its rows are regrouped part-major on load (weight_map regroup), which moves the FP8 "
            f"block scales in whole blocks of {block_rows} rows, but {', '.join(bad)} "
            f"{'is' if len(bad) == 1 else 'are'} not a multiple of {block_rows} (weight_block_size); load with "
            "dequantize_fp8=True, or use a checkpoint that lists this module in modules_to_not_convert"
        )
    return tuple(n // block_rows for _, n in parts)
