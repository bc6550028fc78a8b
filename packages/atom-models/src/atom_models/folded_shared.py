"""Where the loader writes the shared expert of a MoE block that folds it into the routed experts
(:class:`~atom_models.moe.SparseMoeBlock` with ``num_shared = m > 0``).

The checkpoint keeps HF's layout (``mlp.gate.weight [E, H]``, ``mlp.shared_expert_gate.weight [1, H]``,
``mlp.shared_expert.{gate,up}_proj.weight [Is, H]``, ``down_proj.weight [H, Is]``); the block holds a router
``[R, H]`` (rows ``[0, E)``, then the shared gate row in every row from ``E`` on: ``moe.router_rows``) and
stacked experts whose rows ``E + j`` hold slice j
(``[jI, (j+1)I)`` of the intermediate dim, I the full ``moe_intermediate_size``) of the shared expert's
gate / up rows and down columns. A tensor-parallel rank holds ``intermediate_range`` of each slice, so it
reads ``[jI + start, jI + end)``. The names come from ``weight_map.FOLDED_SHARED_RULES``;
:func:`plan_copies` plans the loader's copies into such a block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from atom_models.load_plan import FP8_DTYPES, FP8_FILE_DTYPES, SCALE_SUFFIX, Copy, PlanState
from atom_models.moe import SparseMoeBlock
from atom_models.parallel.slices import Pieces, scale_pieces
from atom_models.weight_map import COLS, map_name, sources_for


def folded_block(module: nn.Module, pname: str) -> SparseMoeBlock | None:
    """The MoE block with the shared expert folded in that parameter ``pname`` (``<block>.<child>.<leaf>``,
    relative to ``module``) belongs to, or None."""
    if pname.count(".") < 2:
        return None
    try:
        block = module.get_submodule(pname.rsplit(".", 2)[0])
    except AttributeError:
        return None
    return block if isinstance(block, SparseMoeBlock) and block.num_shared else None


def sources(module: nn.Module, pname: str, local: str, rows: int) -> list[str]:
    """``weight_map.sources_for`` of parameter ``pname`` (``local``: its scope-relative name; ``rows``: its
    expert / row count): a folded block's stacked experts take its ``num_experts`` routed experts plus the
    shared expert's tensors, its router also the shared gate row."""
    block = folded_block(module, pname)
    if block is None:
        return sources_for(local, rows, first_expert=expert_start(module, pname) or 0)
    return sources_for(local, block.experts.num_experts, folded=True)


def expert_start(module: nn.Module, pname: str) -> int | None:
    """The first checkpoint expert of the expert-parallel routed experts that parameter ``pname`` belongs
    to (``Experts.expert_start``), or None (not such a parameter, or every expert held)."""
    if "." not in pname:
        return None
    try:
        owner = module.get_submodule(pname.rsplit(".", 1)[0])
    except AttributeError:
        return None
    return getattr(owner, "expert_start", None)


@dataclass(frozen=True)
class Place:
    """One destination of a checkpoint tensor: ``view`` of the parameter (``scale_view`` of its FP8 block
    scales, if the parameter is FP8) and the ``pieces`` of the checkpoint tensor to read (None: all of it)."""

    view: torch.Tensor
    scale_view: torch.Tensor | None
    pieces: Pieces | None


def places(
    block: SparseMoeBlock, local: str, pname: str, params: dict[str, torch.Tensor], scale_suffix: str
) -> tuple[tuple[int, ...], list[Place]] | None:
    """``(checkpoint shape expected, destinations)`` of checkpoint tensor ``local`` (scope-relative) bound
    for parameter ``pname`` of the folded ``block``; None when the ordinary rule places it (a routed
    expert). ``params``: every parameter by name (FP8 scales included, named ``<weight>{scale_suffix}``)."""
    param = params[pname]
    e = block.experts.num_experts
    if pname.rsplit(".", 2)[1] == "gate":  # the router: rows [0, E) from mlp.gate, then the shared gate
        if local.endswith("shared_expert_gate.weight"):  # [1, H] into every row from E on (broadcast)
            return (1, param.shape[1]), [Place(param[e:], None, None)]
        return (e, param.shape[1]), [Place(param[:e], None, None)]
    rule = map_name(local, folded=True)
    if rule is None:
        return None
    experts = block.experts
    m, inter = experts.num_shared, experts.full_intermediate_size
    start, end = experts.intermediate_range
    dim = 1 if rule.tp == COLS else 0  # the shared expert's intermediate dim: gate / up rows, down columns
    full = (m * inter, param.shape[2]) if dim == 0 else (param.shape[1], m * inter)
    scales = params.get(pname + scale_suffix) if param.dtype == torch.float8_e4m3fn else None
    out = []
    for j in range(m):
        view, sview = param[e + j], None if scales is None else scales[e + j]
        if rule.shard is not None:  # gate or up half of w13 (and of its scale rows)
            part, parts = rule.shard
            view = view.chunk(parts)[part]
            sview = None if sview is None else sview.chunk(parts)[part]
        out.append(Place(view, sview, Pieces(dim, ((j * inter + start, j * inter + end),))))
    return full, out


def plan_copies(
    f, fname: str, name: str, *, local: str, block: SparseMoeBlock, pname: str, state: PlanState
) -> list[str] | None:
    """Plan the copies of checkpoint tensor ``name`` (``local``: scope-relative; ``f``: the open
    ``safe_open`` handle of its file ``fname``) bound for parameter ``pname`` of the folded ``block``: the
    router's rows, or one slice per pseudo-expert with the FP8 scale rows / columns that slice uses (copied
    to every pseudo-expert that uses them), appended to ``state`` as ``loader._plan`` appends its own.
    Returns the problems, or None when the ordinary rule places the tensor (a routed expert)."""
    all_params, layout, fp8_block = state.all_params, state.layout, state.fp8_block
    placed = places(block, local, pname, all_params, SCALE_SUFFIX)
    if placed is None:
        return None
    full, dests = placed
    shape = tuple(f.get_slice(name).get_shape())
    if shape != full:
        rank = (
            "" if layout.world_size == 1 else f"; tensor parallel rank {layout.rank} of {layout.world_size}"
        )
        return [
            f"tensor {name} in {fname} has shape {list(shape)}, expected {list(full)} "
            f"(for {pname}, the shared expert folded in{rank})"
        ]
    scale = name + SCALE_SUFFIX if fp8_block is not None and name + SCALE_SUFFIX in state.scales else None
    planned = []
    for place in dests:
        copy = Copy(name, place.view, pieces=place.pieces)
        if scale is not None:
            copy.scale, copy.scale_view = scale, place.scale_view
            state.used_scales.add(scale)
            copy.scale_pieces = scale_pieces(
                pname.rsplit(".", 1)[0], place.pieces, fp8_block, layout.world_size
            )
            want = None if place.scale_view is None else tuple(place.scale_view.shape)
            state.scale_checks.append((scale, shape, want, pname + SCALE_SUFFIX, copy.scale_pieces))
        planned.append(copy)
    dtype = f.get_slice(name).get_dtype()
    if dtype in FP8_FILE_DTYPES and scale is None:
        return [f"tensor {name} in {fname} is FP8 but {name + SCALE_SUFFIX} is missing"]
    if all_params[pname].dtype in FP8_DTYPES and dtype not in FP8_FILE_DTYPES:
        return [
            f"tensor {name} in {fname} has dtype {dtype}, but {pname} is FP8 "
            "(quantization_config does not list it in modules_to_not_convert)"
        ]
    state.copies[fname].extend(planned)
    return []
