"""Shapes and dtypes of a GDN layer's vLLM state, from atom-core config alone (no layer needed).

vLLM asks the model class for these before it builds the model (``get_mamba_state_shape_from_config``)
and every GDN layer again afterwards (``get_state_shape``); both come from here so they cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from atom_core import Qwen3NextConfig


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
    def dtypes(self) -> tuple[torch.dtype, torch.dtype]:
        return (self.conv_dtype, self.ssm_dtype)

    def shapes(self) -> tuple[tuple[int, int], tuple[int, int, int]]:
        """``(conv [W, C] or [C, W], ssm [Hv, Dv, Dk])`` per slot, in vLLM's storage order."""
        conv = (self.conv_dim, self.conv_width) if self.conv_dim_first else (self.conv_width, self.conv_dim)
        return conv, (self.num_v_heads, self.head_v_dim, self.head_k_dim)
