"""Causal depthwise conv1d for CPUs: the reference's contract and float32 math, sequences batched.

- :func:`causal_conv1d_varlen` (prefill): the reference convolves one sequence at a time (a handful of
  ops per sequence). Here the tokens are laid out once as ``[N, Lmax, C]`` float32 (zero padding after
  the shorter sequences; causal, so it reaches no real output) and the ``K`` taps are ``K`` shifted
  multiply-adds along contiguous channels (the history's columns added to the first ``K - 1``
  positions), in groups of consecutive sequences of about
  :data:`~atom_kernels.ops._groups.GROUP_TOKENS` tokens (cache-sized temporaries); the new window
  states are one gather and one indexed copy. The same depthwise
  sums as the reference's ``F.conv1d``, possibly added in another order.
- :func:`causal_conv1d_update` (decode / verify): one C call (:mod:`.cpu_native`) for float32 / bf16
  tokens and states where a C compiler builds it; otherwise the reference's computation, but the window
  states are read and written in the state buffer's own memory order (vLLM stores ``[S, W, C]`` and passes the
  ``[S, C, W]`` view): rows gathered by ``index_select`` and stored by ``index_copy_`` instead of
  advanced indexing of a transposed view, and the taps summed along contiguous channels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from atom_kernels.ops._checks import check_cu_seqlens_values, check_num_accepted_values, check_slot_values
from atom_kernels.ops._groups import sequence_groups
from atom_kernels.ops.conv1d import cpu_native
from atom_kernels.ops.conv1d.checks import check_causal_conv1d_update, check_causal_conv1d_varlen
from atom_kernels.ops.conv1d.reference import _activate


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
    """:func:`atom_kernels.ops.conv1d.reference.causal_conv1d_varlen` (same contract).

    Args:
        x: ``[T, C]`` tokens of N sequences back to back.
        weight: ``[C, K]``; bias: ``[C]`` or None.
        cu_seqlens: ``[N+1]`` int32 offsets into T.
        conv_state: ``[S, C, W]`` (W >= K - 1, any strides), updated in place.
        state_indices: ``[N]`` int32 slots (< 0: zero history, nothing written).
        has_initial_state: ``[N]`` bool; where set the history is ``conv_state[slot, :, 0:K-1]``.
        activation: "silu"/"swish" or None.

    Returns:
        ``out [T, C]`` in x.dtype; ``conv_state[slot, :, 0:K-1]`` becomes the last K - 1 inputs of
        ``history ++ x_n``.
    """
    check_causal_conv1d_varlen(
        x, weight, bias, cu_seqlens, conv_state, state_indices, has_initial_state, activation
    )
    op = "causal_conv1d_varlen"
    check_slot_values(op, "state_indices", state_indices, conv_state.shape[0])
    check_cu_seqlens_values(op, cu_seqlens, x.shape[0])
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    offsets = cu_seqlens.tolist()
    for lo, hi in sequence_groups(offsets):
        t0, t1 = offsets[lo], offsets[hi]
        out[t0:t1] = _varlen(
            x[t0:t1],
            weight,
            bias,
            cu_seqlens[lo : hi + 1] - cu_seqlens[lo],
            conv_state,
            state_indices[lo:hi],
            has_initial_state[lo:hi],
            activation,
        )
    return out


def _varlen(x, weight, bias, cu_seqlens, conv_state, state_indices, has_initial_state, activation):
    """The conv of one group of sequences (checked arguments, ``cu_seqlens`` from 0); returns ``out``."""
    total, channels = x.shape
    width = weight.shape[1]
    hist = width - 1
    num_seqs = state_indices.shape[0]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if num_seqs == 0 or total == 0:
        return out
    offsets = cu_seqlens.long()
    lens = offsets[1:] - offsets[:-1]
    lens_host = lens.tolist()
    max_len = max(lens_host)
    dense = all(n == max_len for n in lens_host)
    slots = state_indices.long()
    valid = slots >= 0
    use = has_initial_state & valid

    history = torch.zeros(num_seqs, hist, channels, dtype=torch.float32, device=x.device)
    if bool(use.any()):
        rows = conv_state.transpose(1, 2).index_select(0, slots.clamp(min=0))[:, :hist]  # [N, K - 1, C]
        history.copy_(rows).mul_(use[:, None, None])
    if dense:
        xs = x.view(num_seqs, max_len, channels).float()
        seq_id = pos = None
    else:
        seq_id = torch.repeat_interleave(torch.arange(num_seqs, device=x.device), lens)
        pos = torch.arange(total, device=x.device) - offsets[seq_id]
        xs = x.new_zeros(num_seqs, max_len, channels, dtype=torch.float32)
        xs[seq_id, pos] = x.float()
    # y_t = sum_i w_i full_{t+i}, full = history ++ x: tap i reads x shifted by K - 1 - i, history before it
    w32 = weight.float().t()  # [K, C]
    y = xs * w32[hist]
    for i in range(hist):
        shift = hist - i
        if shift < max_len:
            y[:, shift:].addcmul_(xs[:, : max_len - shift], w32[i])
        span = min(shift, max_len)
        y[:, :span].addcmul_(history[:, i : i + span], w32[i])
    if bias is not None:
        y += bias.float()
    y = F.silu(y, inplace=True) if activation in ("silu", "swish") else y
    if dense:
        out.view(num_seqs, max_len, channels).copy_(y)
    else:
        out.copy_(y[seq_id, pos])

    # New window: columns L_n .. L_n + K - 2 of history ++ x_n.
    full = torch.cat([history, xs], dim=1) if max_len < hist else None
    cols = lens[:, None] + torch.arange(hist, device=x.device)[None, :]  # [N, K - 1] in history ++ x
    if full is None:  # every window lies in x unless L_n < K - 1: take those columns from history ++ x
        short = bool((lens < hist).any())
        if short:
            full = torch.cat([history, xs], dim=1)
        else:
            cols = cols - hist
    src = full if full is not None else xs
    new = src.gather(1, cols[:, :, None].expand(num_seqs, hist, channels))  # [N, K - 1, C]
    target = conv_state.transpose(1, 2)[:, :hist]  # [S, K - 1, C] view
    if bool(valid.all()):
        target.index_copy_(0, slots, new.to(conv_state.dtype))
    else:
        keep = valid.nonzero().squeeze(1)
        target.index_copy_(0, slots[keep], new[keep].to(conv_state.dtype))
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
    """:func:`atom_kernels.ops.conv1d.reference.causal_conv1d_update` (same contract).

    Args:
        x: ``[N, Q, C]``.
        weight: ``[C, K]``; bias: ``[C]`` or None.
        conv_state: ``[S, C, W]`` with ``W >= K - 2 + Q`` (any strides), updated in place.
        state_indices: ``[N]`` int32 slots (< 0: padding, skipped).
        num_accepted: ``[N]`` int32 in ``[1, W - K + 2]``; the history is columns
            ``[num_accepted - 1, num_accepted - 1 + K - 1)``. None: 1.
        activation: "silu"/"swish" or None.

    Returns:
        ``out [N, Q, C]`` in x.dtype; ``(history ++ x_0..x_{Q-1})[1:]`` is written left-aligned to
        columns ``[0, K - 2 + Q)`` of the slot.
    """
    check_causal_conv1d_update(x, weight, bias, conv_state, state_indices, num_accepted, activation)
    num_seqs, q_len, channels = x.shape
    width = weight.shape[1]
    num_slots, _, state_width = conv_state.shape
    if cpu_native.usable(x, weight, conv_state, activation):  # checks the value ranges itself
        return cpu_native.conv_update(x, weight, bias, conv_state, state_indices, num_accepted, activation)
    check_slot_values("causal_conv1d_update", "state_indices", state_indices, num_slots)
    limit = state_width - width + 2
    check_num_accepted_values("causal_conv1d_update", num_accepted, limit, f"W - K + 2 = {limit}")
    slots = state_indices.long()
    valid = slots >= 0
    all_valid = bool(valid.all())
    rows = conv_state.transpose(1, 2).index_select(0, slots.clamp(min=0))  # [N, W, C]
    if num_accepted is None:
        history = rows[:, : width - 1]
    else:
        cols = (num_accepted.long() - 1)[:, None] + torch.arange(width - 1, device=x.device)[None, :]
        history = rows.gather(1, cols[:, :, None].expand(num_seqs, width - 1, channels))  # [N, K - 1, C]
    full = torch.cat([history.float(), x.float()], dim=1)  # [N, K - 1 + Q, C]
    if not all_valid:
        full[:, : width - 1] *= valid[:, None, None]
    w32 = weight.float().t()  # [K, C]
    y = full[:, 0:q_len] * w32[0]
    for i in range(1, width):
        y += full[:, i : i + q_len] * w32[i]
    if bias is not None:
        y += bias.float()
    out = _activate(y, activation).to(x.dtype)
    target = conv_state.transpose(1, 2)[:, : width - 2 + q_len]  # [S, K - 2 + Q, C] view
    new = full[:, 1:].to(conv_state.dtype)
    if all_valid:
        target.index_copy_(0, slots, new)
    else:
        keep = valid.nonzero().squeeze(1)
        target.index_copy_(0, slots[keep], new[keep])
    return out
