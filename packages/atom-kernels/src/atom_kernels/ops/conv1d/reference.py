"""Reference causal depthwise conv1d with the channel-major, left-aligned window state.

State layout ``conv_state[S, C, W]``, ``W = K - 1 + k`` (k speculative tokens), any strides (vLLM
passes a transposed view of its ``[S, W, C]`` buffer). The valid history of a sequence is the ``K - 1``
columns starting at ``num_accepted - 1``; see docs/kernel-api.md. Math in float32; outputs in x.dtype,
states stored in conv_state.dtype. ``state_indices`` entries < 0 (padding) read zeros and write nothing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from atom_kernels.ops._checks import check_cu_seqlens_values, check_num_accepted_values, check_slot_values
from atom_kernels.ops.conv1d.checks import check_causal_conv1d_update, check_causal_conv1d_varlen


def _activate(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    return F.silu(y) if activation in ("silu", "swish") else y


def causal_conv1d_varlen(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    conv_state: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Prefill: causal conv over each sequence of a flat varlen batch, resuming from its state.

    Args:
        x: ``[T, C]`` tokens of N sequences back to back.
        weight: ``[C, K]`` depthwise taps (``conv1d.weight[:, 0, :]``); bias: ``[C]`` or None.
        cu_seqlens: ``[N+1]`` int32 sequence offsets into T.
        conv_state: ``[S, C, W]`` (W >= K - 1), updated in place.
        state_indices: ``[N]`` int32 slot of each sequence.
        has_initial_state: ``[N]`` bool; where set, the history is ``conv_state[slot, :, 0:K-1]``,
            else zeros.
        activation: "silu"/"swish" or None.

    Returns:
        ``out [T, C]`` in x.dtype; ``conv_state[slot, :, 0:K-1]`` becomes the last K - 1 inputs of
        ``history ++ x_n`` (columns ``>= K - 1`` are left as they were).
    """
    check_causal_conv1d_varlen(
        x, weight, bias, cu_seqlens, conv_state, state_indices, has_initial_state, activation
    )
    op = "causal_conv1d_varlen"
    check_slot_values(op, "state_indices", state_indices, conv_state.shape[0])
    check_cu_seqlens_values(op, cu_seqlens, x.shape[0])
    channels, width = weight.shape
    w32 = weight.float()[:, None, :]
    b32 = None if bias is None else bias.float()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    offsets = cu_seqlens.tolist()
    slots = state_indices.tolist()
    has_init = has_initial_state.tolist()
    for n, slot in enumerate(slots):
        start, end = offsets[n], offsets[n + 1]
        if slot >= 0 and has_init[n]:
            history = conv_state[slot, :, : width - 1].float()
        else:
            history = torch.zeros(channels, width - 1, dtype=torch.float32, device=x.device)
        full = torch.cat([history, x[start:end].float().t()], dim=1)  # [C, K - 1 + L]
        y = F.conv1d(full[None], w32, b32, groups=channels)[0]  # [C, L]
        out[start:end] = _activate(y, activation).t().to(x.dtype)
        if slot >= 0:
            conv_state[slot, :, : width - 1] = full[:, full.shape[1] - (width - 1) :].to(conv_state.dtype)
    return out


def causal_conv1d_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    state_indices: torch.Tensor,
    num_accepted: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Decode / verify: Q = 1 + k new tokens per sequence against the left-aligned window state.

    Args:
        x: ``[N, Q, C]``.
        weight: ``[C, K]``; bias: ``[C]`` or None.
        conv_state: ``[S, C, W]`` with ``W >= K - 2 + Q``, updated in place.
        state_indices: ``[N]`` int32 slot of each sequence (< 0: padding, skipped).
        num_accepted: ``[N]`` int32 in ``[1, W - K + 2]``: tokens of the previous step that were
            accepted; the history is columns ``[num_accepted - 1, num_accepted - 1 + K - 1)``. None: 1.
        activation: "silu"/"swish" or None.

    Returns:
        ``out [N, Q, C]`` in x.dtype; ``(history ++ x_0..x_{Q-1})[1:]`` is written left-aligned to
        columns ``[0, K - 2 + Q)`` of the slot.
    """
    check_causal_conv1d_update(x, weight, bias, conv_state, state_indices, num_accepted, activation)
    num_seqs, q_len, channels = x.shape
    width = weight.shape[1]
    num_slots, _, state_width = conv_state.shape
    check_slot_values("causal_conv1d_update", "state_indices", state_indices, num_slots)
    limit = state_width - width + 2
    check_num_accepted_values("causal_conv1d_update", num_accepted, limit, f"W - K + 2 = {limit}")
    if num_accepted is None:
        start = torch.zeros(num_seqs, dtype=torch.int64, device=x.device)
    else:
        start = num_accepted.long() - 1
    slots = state_indices.long()
    valid = slots >= 0
    states = conv_state[slots.clamp(min=0)].float() * valid[:, None, None]  # [N, C, W]
    cols = start[:, None] + torch.arange(width - 1, device=x.device)[None, :]  # [N, K - 1]
    history = torch.gather(states, 2, cols[:, None, :].expand(num_seqs, channels, width - 1))
    full = torch.cat([history, x.float().transpose(1, 2)], dim=2)  # [N, C, K - 1 + Q]
    w32 = weight.float()
    y = sum(w32[None, :, i, None] * full[:, :, i : i + q_len] for i in range(width))  # [N, C, Q]
    if bias is not None:
        y = y + bias.float()[None, :, None]
    out = _activate(y, activation).transpose(1, 2).to(x.dtype)
    keep = valid.nonzero().squeeze(1)
    conv_state[slots[keep], :, : width - 2 + q_len] = full[keep, :, 1:].to(conv_state.dtype)
    return out
