"""Reference RoPE (neox layout: ``rotate_half`` on the two halves of the rotated slice)."""

from __future__ import annotations

import torch

from atom_kernels.ops.rope.checks import check_rope


def rope_cos_sin(positions: torch.Tensor, rotary_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin [T, rotary_dim // 2]`` in float32 for int64 ``positions [T]``.

    ``inv_freq`` is HF's float32 ``1 / theta ** (2i / rotary_dim)`` with the power correctly rounded (in
    float64, rounded once), the same value on every device, as the Triton kernel computes it. CUDA's
    float32 pow can be an ulp off, and 1 ulp of inv_freq moves the angle at position 40000 by up to ~3e-4
    (on an H200 a float32-pow version missed the op's 1e-5 tolerance by that much). CPU torch's float32 pow
    agrees except in rare near-halfway cases (none for Qwen3-Next's theta 1e7 and rotary_dim 64; 3 of
    256 exponents at rotary_dim 512).
    """
    exponent = torch.arange(0, rotary_dim, 2, device=positions.device, dtype=torch.int64).float() / rotary_dim
    inv_freq = 1.0 / (theta ** exponent.double()).float()
    freqs = positions.float()[:, None] * inv_freq[None, :]
    return freqs.cos(), freqs.sin()


def _apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    half = rotary_dim // 2
    x32 = x.float()
    x1, x2 = x32[..., :half], x32[..., half:rotary_dim]
    c, s = cos[:, None, :], sin[:, None, :]
    out = x32.clone()
    out[..., :half] = x1 * c - x2 * s
    out[..., half:rotary_dim] = x2 * c + x1 * s
    return out.to(x.dtype)


def rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, rotary_dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox RoPE on the first ``rotary_dim`` channels of every head; the rest is copied unchanged.

    Args:
        q: ``[T, Hq, D]``; k: ``[T, Hk, D]`` (float32/bf16/fp16).
        positions: ``[T]`` int64.
        rotary_dim: even, ``<= D`` (Qwen3-Next: ``D * partial_rotary_factor``).
        theta: the RoPE base; frequencies ``theta ** (-2i / rotary_dim)``.

    Returns:
        new ``(q, k)`` of the input shapes and dtypes (rotation computed in float32 with ``cos`` / ``sin``
        rounded to q.dtype first).
    """
    check_rope(q, k, positions, rotary_dim, theta)
    # cos / sin rounded to the activations' dtype, as stock vLLM's cos_sin_cache (float32: unchanged)
    cos, sin = (c.to(q.dtype).float() for c in rope_cos_sin(positions, rotary_dim, theta))
    return _apply(q, cos, sin, rotary_dim), _apply(k, cos, sin, rotary_dim)
