"""A GDN layer's vLLM state: the geometry of ``atom_models.gdn_state`` in vLLM's storage order and dtypes.

vLLM asks the model class for these before it builds the model (``get_mamba_state_shape_from_config``,
which also sizes the hybrid page that attention blocks are aligned to) and every GDN layer again afterwards
(``get_state_shape``); both come from here so they cannot disagree. Under tensor parallelism the shapes are
one rank's (its key heads with their value heads: conv channels, ``Hv`` and the pending width all divide by
the TP size), from the :class:`~atom_models.parallel.TPLayout` at vLLM's TP size; every rank holds equal
sizes, so the layout of rank 0 serves before the model exists.

Per slot (one vLLM Mamba block) the tensors are ``conv`` (stored ``[W, C]``, vLLM's default, or ``[C, W]``),
``ssm`` and, with MTP, ``pending`` (float32) and ``pending_pos`` (int32, one value), shaped by
:class:`~atom_models.gdn_state.GDNGeometry`. vLLM's ``MambaSpec`` takes any number of state tensors: the
page is their summed bytes and ``MambaBase.bind_kv_cache`` slices one view per tensor in this order, so
the extra tensors need no change in vLLM. One side effect: on CPUs with AVX512-BF16, vLLM's CPU platform
keeps an explicitly requested bf16/fp16 ``mamba_ssm_cache_dtype`` only for models whose state dtypes are a
pair (``platforms/cpu.py`` ``_cpu_mamba_backend``); with MTP it resets it to float32. The dtypes themselves
come from ``models/common.py`` (``ssm_cache_dtype``: ``auto`` is float32 on every CPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from atom_core import Qwen3NextConfig
from atom_models.gdn_state import GDNGeometry
from atom_models.parallel import TPLayout


@dataclass(frozen=True)
class GDNStateSpec:
    geometry: GDNGeometry
    conv_dtype: torch.dtype
    ssm_dtype: torch.dtype
    conv_dim_first: bool = False

    @classmethod
    def from_config(
        cls,
        config: Qwen3NextConfig,
        num_speculative_tokens: int,
        conv_dtype: torch.dtype,
        ssm_dtype: torch.dtype,
        conv_dim_first: bool = False,
        layout: TPLayout | None = None,
    ) -> GDNStateSpec:
        """``layout``: one rank's sizes (None: the whole layer, TP = 1)."""
        geometry = GDNGeometry.from_config(config, num_speculative_tokens, layout=layout)
        return cls(geometry, conv_dtype, ssm_dtype, conv_dim_first)

    @property
    def bytes_per_slot(self) -> int:
        """Bytes of one slot's state tensors (one layer), before vLLM pads the page to the attention page."""
        return sum(
            torch.Size(shape).numel() * dtype.itemsize
            for shape, dtype in zip(self.shapes(), self.dtypes, strict=True)
        )

    @property
    def has_pending(self) -> bool:
        return self.geometry.has_pending

    @property
    def dtypes(self) -> tuple[torch.dtype, ...]:
        """``(conv, ssm)``, plus float32 ``pending`` and int32 ``pending_pos`` with MTP."""
        if self.has_pending:
            return (self.conv_dtype, self.ssm_dtype, torch.float32, torch.int32)
        return (self.conv_dtype, self.ssm_dtype)

    def shapes(self) -> tuple[tuple[int, ...], ...]:
        """``(conv [W, C] or [C, W], ssm [Hv, Dv, Dk])`` per slot in vLLM's storage order, plus
        ``pending [1 + k, P]`` and ``pending_pos [1]`` with MTP."""
        geo = self.geometry
        conv = geo.conv_shape if self.conv_dim_first else geo.conv_shape[::-1]
        pending = geo.pending_shape
        if pending is None:
            return (conv, geo.ssm_shape)
        return (conv, geo.ssm_shape, pending, geo.pending_pos_shape)
