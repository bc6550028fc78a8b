"""Reference FP8 (float8_e4m3fn) ops. Quantisation rounds to nearest after clamping to +-448."""

from __future__ import annotations

import torch

from atom_kernels.ops._fp8_math import FP8_MAX, scale_tensor
from atom_kernels.ops.fp8.checks import (
    check_fp8_act_quant,
    check_fp8_block_dequant,
    check_fp8_kv_dequant,
    check_fp8_kv_quant,
    check_fp8_linear,
    check_gated_norm_fp8_linear,
    check_rms_norm_fp8_linear,
)
from atom_kernels.ops.norm.reference import gated_rms_norm, rms_norm

ACT_SCALE_EPS = 1e-10  # floor of a group's absmax (an all-zero group gets scale 1e-10 / 448)


def _expand_scales(scale_inv: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    """``[ceil(N/bn), ceil(K/bk)]`` block scales -> ``[N, K]`` float32."""
    bn, bk = block
    full = scale_inv.float().repeat_interleave(bn, 0).repeat_interleave(bk, 1)
    return full[: shape[0], : shape[1]]


def fp8_block_dequant(
    w: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int] = (128, 128),
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Dequantise a block-scaled FP8 weight.

    Args:
        w: ``[N, K]`` float8_e4m3fn.
        scale_inv: ``[ceil(N/bn), ceil(K/bk)]`` float32 (or bf16) multipliers (``weight_scale_inv``).
        block: ``(bn, bk)``, Qwen3-Next FP8: (128, 128); partial edge blocks allowed.
        dtype: output dtype.

    Returns:
        ``[N, K]`` ``w * scale_inv[n // bn, k // bk]`` (float32 math) in ``dtype``.
    """
    check_fp8_block_dequant(w, scale_inv, block, dtype)
    return (w.float() * _expand_scales(scale_inv, tuple(w.shape), tuple(block))).to(dtype)


def fp8_act_quant(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token-group FP8 quantisation of activations.

    Args:
        x: ``[T, K]`` (any leading dims) float32/bf16/fp16.
        group: channels per scale group (the last group may be partial).

    Returns:
        ``(x_fp8 [T, K] float8_e4m3fn, scales [T, ceil(K/group)] float32)`` with
        ``scales = max(absmax(group), 1e-10) / 448`` and ``x ~= x_fp8 * scales`` (per group).
    """
    check_fp8_act_quant(x, group)
    k = x.shape[-1]
    num_groups = -(-k // group)
    x32 = x.float()
    padded = torch.nn.functional.pad(x32, (0, num_groups * group - k))
    grouped = padded.reshape(*x.shape[:-1], num_groups, group)
    scales = grouped.abs().amax(-1).clamp(min=ACT_SCALE_EPS) / FP8_MAX
    q = (grouped / scales[..., None]).clamp(-FP8_MAX, FP8_MAX)
    q = q.reshape(*x.shape[:-1], num_groups * group)[..., :k].to(torch.float8_e4m3fn)
    return q, scales


def fp8_linear(
    x: torch.Tensor,
    w_fp8: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int] = (128, 128),
    bias: torch.Tensor | None = None,
    *,
    tickets: torch.Tensor | None = None,
) -> torch.Tensor:
    """W8A8 block-scaled linear: ``dequant(fp8_act_quant(x, bk)) @ dequant(w_fp8).T + bias``.

    Activations are quantised dynamically per token and per group of ``bk = block[1]`` input channels
    (:func:`fp8_act_quant`), as in the published FP8 checkpoints' ``activation_scheme: dynamic`` (vLLM's
    W8A8 block path); both operands are then dequantised and multiplied in float32. A backend that
    multiplies the e4m3 values and applies the two scales per K block computes the same sum up to
    float32 accumulation order.

    Args:
        x: ``[T, K]`` (any leading dims); w_fp8: ``[N, K]`` float8_e4m3fn;
        scale_inv: ``[ceil(N/bn), ceil(K/bk)]``; block: ``(bn, bk)``; bias: ``[N]`` or None.
        tickets: None, or an int32 ``[>= ceil(N/16)]`` tensor of zeros that a backend splitting K may use
            as its per-column-tile counters and must leave zero (the caller owns it, so that no launch
            has to zero fresh counters); never changes the result. The reference does not split K.

    Returns:
        ``[T, N]`` in x.dtype.
    """
    check_fp8_linear(x, w_fp8, scale_inv, block, bias, tickets)
    bk = int(block[1])
    x_fp8, x_scales = fp8_act_quant(x, bk)
    xd = x_fp8.float() * x_scales.repeat_interleave(bk, -1)[..., : x.shape[-1]]
    w = w_fp8.float() * _expand_scales(scale_inv, tuple(w_fp8.shape), tuple(block))
    y = xd @ w.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def gated_norm_fp8_linear(
    o: torch.Tensor,
    z: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    w_fp8: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int] = (128, 128),
    bias: torch.Tensor | None = None,
    *,
    tickets: torch.Tensor | None = None,
) -> torch.Tensor:
    """The Gated-DeltaNet output: its gated RMS norm, then the W8A8 block-scaled ``out_proj``.

    ``fp8_linear(gated_rms_norm(o, z, norm_weight, eps).flatten(-2), w_fp8, scale_inv, block, bias)``:
    each head normalised as :func:`~atom_kernels.ops.norm.reference.gated_rms_norm` does (float32 math,
    rounded to o.dtype), then quantised per token and group of ``bk`` channels as :func:`fp8_linear` does
    (with ``Dv == bk`` each group is one head).

    Args:
        o: ``[..., Hv, Dv]`` float32/bf16/fp16, the core output; z: the gate, same shape (may be a
            row-strided view); norm_weight: ``[Dv]`` (NOT zero-centred); eps: the norm's epsilon.
        w_fp8, scale_inv, block, bias, tickets: as for :func:`fp8_linear`, with ``K = Hv * Dv``.

    Returns:
        ``[..., N]`` in o.dtype.
    """
    check_gated_norm_fp8_linear(o, z, norm_weight, eps, w_fp8, scale_inv, block, bias, tickets)
    y = gated_rms_norm(o, z, norm_weight, eps)
    return fp8_linear(y.flatten(-2), w_fp8, scale_inv, block, bias, tickets=tickets)


def rms_norm_fp8_linear(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    w_fp8: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int] = (128, 128),
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    *,
    tickets: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """The decoder layer's input: residual add, zero-centred RMS norm, then the W8A8 block-scaled projection.

    :func:`~atom_kernels.ops.norm.reference.rms_norm` (``normed = x_hat * (1 + norm_weight)`` of the float32
    ``h = x + residual``, rounded to x.dtype; ``h`` rounded to residual.dtype), then
    ``fp8_linear(normed, w_fp8, scale_inv, block, bias)``. The normed activations are returned too, for a
    second projection of the same input that is not FP8 (the GDN ``in_proj_ba``).

    Args:
        x: ``[..., K]`` float32/bf16/fp16; norm_weight: ``[K]`` (zero-centred); eps: the norm's epsilon.
        w_fp8, scale_inv, block, bias, tickets: as for :func:`fp8_linear`.
        residual: None, or ``[..., K]`` in x.dtype or float32 (the residual stream).

    Returns:
        ``(y [..., N], normed [..., K])`` in x.dtype; with ``residual``: ``(y, normed, h)``, ``h`` in
        residual.dtype.
    """
    check_rms_norm_fp8_linear(x, norm_weight, eps, w_fp8, scale_inv, block, bias, residual, tickets)
    if residual is None:
        normed = rms_norm(x, norm_weight, eps)
        return fp8_linear(normed, w_fp8, scale_inv, block, bias, tickets=tickets), normed
    normed, h = rms_norm(x, norm_weight, eps, residual)
    return fp8_linear(normed, w_fp8, scale_inv, block, bias, tickets=tickets), normed, h


def fp8_kv_quant(x: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    """Per-tensor scaled quantisation: ``clamp(x / scale, -448, 448)`` as float8_e4m3fn (any shape)."""
    check_fp8_kv_quant(x, scale)
    return (x.float() / scale_tensor(scale, x.device)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def fp8_kv_dequant(x_fp8: torch.Tensor, scale: float | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x_fp8 * scale`` in ``dtype`` (float32 math), any shape."""
    check_fp8_kv_dequant(x_fp8, scale, dtype)
    return (x_fp8.float() * scale_tensor(scale, x_fp8.device)).to(dtype)
