"""Shapes and dtypes of a GDN layer's vLLM state, from atom-core config alone (no layer needed).

vLLM asks the model class for these before it builds the model (``get_mamba_state_shape_from_config``,
which also sizes the hybrid page that attention blocks are aligned to) and every GDN layer again afterwards
(``get_state_shape``); both come from here so they cannot disagree.

Per slot (one vLLM Mamba block) a GDN layer has:
- ``conv``: the conv history, ``K - 1 + k`` columns (``k`` = speculative tokens: rollback room);
- ``ssm``: the committed recurrent state ``[Hv, Dv, Dk]``;
- ``pending`` (only with MTP, ``k > 0``): ``[1 + k, P]`` float32, the previous verify step's tokens as
  ``atom_kernels``' ``gated_delta_rule_verify`` stashes them (deferred commit, docs/kernel-api.md), ``P``
  from ``atom_kernels.ops.gated_delta_rule.pending_width`` (the kernels own the token format). vLLM's ``MambaSpec`` takes any number
  of state tensors: the page is their summed bytes and ``MambaBase.bind_kv_cache`` slices one view per
  tensor in this order, so the third tensor needs no change in vLLM. One side effect: vLLM's CPU platform
  keeps an explicitly requested bf16/fp16 ``mamba_ssm_cache_dtype`` only for models whose state dtypes are
  a pair (``platforms/cpu.py`` ``_cpu_mamba_backend``); with MTP it resets it to float32 (the default
  "auto" is reset to float32 there anyway).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from atom_core import Qwen3NextConfig
from atom_kernels.ops.gated_delta_rule import pending_width


@dataclass(frozen=True)
class GDNStateSpec:
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    num_speculative_tokens: int
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
    ) -> GDNStateSpec:
        return cls(
            num_k_heads=config.linear_num_key_heads,
            num_v_heads=config.linear_num_value_heads,
            head_k_dim=config.linear_key_head_dim,
            head_v_dim=config.linear_value_head_dim,
            conv_kernel=config.linear_conv_kernel_dim,
            num_speculative_tokens=num_speculative_tokens,
            conv_dtype=conv_dtype,
            ssm_dtype=ssm_dtype,
            conv_dim_first=conv_dim_first,
        )

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def conv_width(self) -> int:
        """Columns of conv history: ``K - 1`` plus one per speculative token (rollback room)."""
        return self.conv_kernel - 1 + self.num_speculative_tokens

    @property
    def scale(self) -> float:
        return self.head_k_dim**-0.5

    @property
    def has_pending(self) -> bool:
        """Whether the layer keeps a pending-token tensor (only with speculative decoding)."""
        return self.num_speculative_tokens > 0

    @property
    def pending_tokens(self) -> int:
        """Pending tokens per slot (``R`` of the verify op): one verify step's ``1 + k`` tokens."""
        return 1 + self.num_speculative_tokens

    @property
    def pending_width(self) -> int:
        """Floats per pending token, as the verify op defines it (``pending_width``)."""
        return pending_width(self.num_k_heads, self.head_k_dim, self.num_v_heads, self.head_v_dim)

    @property
    def dtypes(self) -> tuple[torch.dtype, ...]:
        """``(conv, ssm)``, plus float32 for ``pending`` with MTP."""
        if self.has_pending:
            return (self.conv_dtype, self.ssm_dtype, torch.float32)
        return (self.conv_dtype, self.ssm_dtype)

    def shapes(self) -> tuple[tuple[int, ...], ...]:
        """``(conv [W, C] or [C, W], ssm [Hv, Dv, Dk])`` per slot in vLLM's storage order, plus
        ``pending [1 + k, P]`` with MTP."""
        conv = (self.conv_dim, self.conv_width) if self.conv_dim_first else (self.conv_width, self.conv_dim)
        ssm = (self.num_v_heads, self.head_v_dim, self.head_k_dim)
        if self.has_pending:
            return conv, ssm, (self.pending_tokens, self.pending_width)
        return conv, ssm
