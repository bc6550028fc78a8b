"""The one definition of a Gated DeltaNet layer's state: geometry per slot, and the tensors of one layer.

Per slot (one sequence) a GDN layer keeps:
- ``conv``: the conv history, channel-major ``[C, W]`` with ``W = K - 1 + k`` (``K`` the conv kernel width,
  ``k`` the number of speculative tokens: the history of a verify step is read at offset
  ``num_accepted - 1``, so ``k`` extra columns of room);
- ``ssm``: the committed recurrent state ``[Hv, Dv, Dk]``;
- ``pending`` (only with speculative decoding, ``k > 0``): ``[1 + k, P]`` float32, the previous verify
  step's tokens as ``gated_delta_rule_verify`` stashes them (``P = pending_width(Hk, Dk, Hv, Dv)``);
- ``pending_pos`` (with ``pending``): ``[1]`` int32, the sequence position of pending token 0. A slot is
  then a self-describing snapshot: committing ``L - pending_pos`` pending tokens gives the state after the
  first ``L`` tokens, for every ``L`` its pending tokens cover (see :mod:`atom_models.gdn_snapshot`).

The standalone engine allocates these for its slots (``engine.cache``); the vLLM plugin declares them to
vLLM in its storage order (its ``GDNStateSpec``). Both take the shapes from :class:`GDNGeometry`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from atom_core import Qwen3NextConfig
from atom_kernels.ops.gated_delta_rule import pending_width

from atom_models.parallel.layout import TPLayout


@dataclass(frozen=True)
class GDNGeometry:
    """Head counts and dims of a GDN layer, and the state shapes per slot for ``num_speculative_tokens``."""

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    num_speculative_tokens: int = 0

    @classmethod
    def from_config(
        cls, config: Qwen3NextConfig, num_speculative_tokens: int = 0, layout: TPLayout | None = None
    ) -> GDNGeometry:
        """The whole layer's geometry, or with ``layout`` one tensor-parallel rank's (its key heads and
        their value heads: every state shape is ``1 / world_size`` of the whole layer's)."""
        return cls(
            num_k_heads=config.linear_num_key_heads if layout is None else layout.linear_num_key_heads,
            num_v_heads=config.linear_num_value_heads if layout is None else layout.linear_num_value_heads,
            head_k_dim=config.linear_key_head_dim,
            head_v_dim=config.linear_value_head_dim,
            conv_kernel=config.linear_conv_kernel_dim,
            num_speculative_tokens=num_speculative_tokens,
        )

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the conv: ``[q (Hk*Dk) | k (Hk*Dk) | v (Hv*Dv)]``."""
        return 2 * self.key_dim + self.value_dim

    @property
    def conv_width(self) -> int:
        """Columns of conv history: ``K - 1`` plus one per speculative token."""
        return self.conv_kernel - 1 + self.num_speculative_tokens

    @property
    def scale(self) -> float:
        """Query scale of the delta rule, ``Dk ** -0.5``."""
        return self.head_k_dim**-0.5

    @property
    def has_pending(self) -> bool:
        """Whether a layer keeps pending tokens (only with speculative decoding)."""
        return self.num_speculative_tokens > 0

    @property
    def num_verify_tokens(self) -> int:
        """Tokens of one verify step, ``1 + k``: the pending tokens per slot (``R`` of the verify op)."""
        return 1 + self.num_speculative_tokens

    @property
    def pending_width(self) -> int:
        """Floats per pending token, as the verify op defines it."""
        return pending_width(self.num_k_heads, self.head_k_dim, self.num_v_heads, self.head_v_dim)

    @property
    def conv_shape(self) -> tuple[int, int]:
        """Per slot, channel-major ``(C, W)`` (the layout the conv ops index; storage may be transposed)."""
        return self.conv_dim, self.conv_width

    @property
    def ssm_shape(self) -> tuple[int, int, int]:
        return self.num_v_heads, self.head_v_dim, self.head_k_dim

    @property
    def pending_shape(self) -> tuple[int, int] | None:
        """Per slot ``(1 + k, P)``, or None without speculative decoding."""
        return (self.num_verify_tokens, self.pending_width) if self.has_pending else None

    @property
    def pending_pos_shape(self) -> tuple[int] | None:
        """Per slot ``(1,)`` (int32, the position of pending token 0), or None without speculative decoding."""
        return (1,) if self.has_pending else None

    def check_layout(self, layout, where: str) -> None:
        """Raise ``ValueError`` (naming ``where``, e.g. the layer and whose state this is) unless this
        geometry holds the key / value heads of ``layout``'s rank (a :class:`~atom_models.parallel.TPLayout`)."""
        held = (self.num_k_heads, self.num_v_heads)
        if held != (layout.linear_num_key_heads, layout.linear_num_value_heads):
            raise ValueError(
                f"{where} holds {held[0]} key / {held[1]} value heads, but tensor-parallel rank {layout.rank} "
                f"of {layout.world_size} has {layout.linear_num_key_heads} / {layout.linear_num_value_heads}"
            )

    def split_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Post-conv ``x[..., C]`` -> ``q[..., Hk, Dk]``, ``k[..., Hk, Dk]``, ``v[..., Hv, Dv]`` (views)."""
        q, k, v = torch.split(x, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return (
            q.unflatten(-1, (self.num_k_heads, self.head_k_dim)),
            k.unflatten(-1, (self.num_k_heads, self.head_k_dim)),
            v.unflatten(-1, (self.num_v_heads, self.head_v_dim)),
        )


@dataclass(frozen=True)
class GDNLayerState:
    """One GDN layer's state tensors over ``S`` slots (views into whatever memory holds them)."""

    conv: torch.Tensor  # [S, C, W], any strides (vLLM stores [S, W, C] and passes the transposed view)
    ssm: torch.Tensor  # [S, Hv, Dv, Dk] float32 or bf16: the committed recurrent state
    pending: torch.Tensor | None = None  # [S, 1 + k, P] float32 with speculative decoding, else None
    pending_pos: torch.Tensor | None = None  # [S, 1] int32 with speculative decoding: position of pending[0]

    def __post_init__(self) -> None:
        if self.pending_pos is not None and self.pending is None:
            raise ValueError("GDNLayerState: pending_pos without pending tokens")

    @classmethod
    def allocate(
        cls,
        geometry: GDNGeometry,
        num_slots: int,
        *,
        conv_dtype: torch.dtype,
        ssm_dtype: torch.dtype,
        device: torch.device | str,
    ) -> GDNLayerState:
        """Zero-filled state for ``num_slots`` slots (channel-major conv)."""
        pend = geometry.pending_shape
        return cls(
            conv=torch.zeros(num_slots, *geometry.conv_shape, dtype=conv_dtype, device=device),
            ssm=torch.zeros(num_slots, *geometry.ssm_shape, dtype=ssm_dtype, device=device),
            pending=None
            if pend is None
            else torch.zeros(num_slots, *pend, dtype=torch.float32, device=device),
            pending_pos=None if pend is None else torch.zeros(num_slots, 1, dtype=torch.int32, device=device),
        )

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """``(conv, ssm)``, plus ``pending`` and ``pending_pos`` (where present) with speculative decoding."""
        extra = tuple(t for t in (self.pending, self.pending_pos) if t is not None)
        return (self.conv, self.ssm, *extra)
