"""The types of a checkpoint load plan, shared by :mod:`atom_models.loader` (which builds and executes the
plan) and :mod:`atom_models.folded_shared` (which plans a folded MoE block's shared-expert tensors):
how a module's parameter names relate to checkpoint names (:class:`Scope`), one tensor bound for one
parameter slice (:class:`Copy`), what the planning of one module accumulates (:class:`PlanState`) and the
whole plan (:class:`Plan`)."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from atom_models.parallel.layout import TPLayout
from atom_models.parallel.slices import Pieces

SCALE_SUFFIX = "_scale_inv"  # FP8: ``<name>.weight_scale_inv`` holds the block scales of ``<name>.weight``
FP8_DTYPES = (torch.float8_e4m3fn,)  # parameter dtypes that hold FP8 weights (block scales beside them)
FP8_FILE_DTYPES = ("F8_E4M3", "F8_E5M2")  # safetensors dtype names of FP8 checkpoint tensors


@dataclass(frozen=True)
class Scope:
    """How a module's parameter names relate to checkpoint names."""

    param_prefix: str  # e.g. "model." for the target trunk, "" for the MTP head
    ckpt_prefix: str  # "model." / "mtp."
    layer_offset: int  # checkpoint layer j is parameter layer j + offset

    def to_ckpt(self, local: str) -> str:
        return self.ckpt_prefix + _renumber(local, -self.layer_offset)

    def from_ckpt(self, name: str) -> str | None:
        if not name.startswith(self.ckpt_prefix):
            return None
        return _renumber(name[len(self.ckpt_prefix) :], self.layer_offset)


_LAYER = re.compile(r"^layers\.(\d+)\.")


def _renumber(local: str, offset: int) -> str:
    if not offset:
        return local
    return _LAYER.sub(lambda m: f"layers.{int(m.group(1)) + offset}.", local, count=1)


@dataclass
class Copy:
    """One checkpoint tensor (or this rank's part of it) bound for one parameter slice."""

    name: str  # checkpoint tensor
    view: torch.Tensor  # destination (a slice of a parameter)
    scale: str | None = None  # its FP8 block scales in the checkpoint, if any
    scale_view: torch.Tensor | None = None  # where they go (FP8 parameters); None: dequantise into ``view``
    pieces: Pieces | None = None  # the part this tensor-parallel rank reads (None: all of it)
    scale_pieces: Pieces | None = None  # the block scales that part uses
    rows: tuple[int, ...] | None = None  # weight_map regroup: the parts of a group (rows), else None
    scale_rows: tuple[int, ...] | None = None  # the same in block-scale rows (FP8 parameters)


@dataclass
class Plan:
    copies: dict[str, list[Copy]]  # file -> copies
    scale_files: dict[str, str]  # scale tensor name -> file


# A block-scale shape check, run once every scale header is read: (scale name, weight shape, shape of the
# scale parameter's slice or None (dequantised on load), that parameter, this rank's part of the scales)
ScaleCheck = tuple[str, tuple[int, ...], tuple[int, ...] | None, str, Pieces | None]


@dataclass(frozen=True)
class PlanState:
    """The planning of one module's load: its settings and what it accumulates (appended to in place)."""

    all_params: dict[str, torch.Tensor]  # every parameter by name, FP8 scales included
    layout: TPLayout  # this tensor-parallel rank
    fp8_block: tuple[int, int] | None  # the checkpoint's FP8 block shape, None without FP8
    copies: dict[str, list[Copy]]  # file -> copies planned so far
    scales: dict[str, str]  # FP8 scale tensor name -> file
    used_scales: set[str]  # the scale tensors some copy reads
    scale_checks: list[ScaleCheck]  # block-scale shape checks to run once every header is read
