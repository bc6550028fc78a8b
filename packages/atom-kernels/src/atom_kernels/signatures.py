"""The call signature of every op, one :class:`~typing.Protocol` per op, as fields of :class:`Kernels`.

Each protocol's ``__call__`` is the reference implementation's signature (the spec); every backend
accepts the same parameters (a backend may add keyword-only tuning knobs with defaults).
``tests/test_kernels_registry.py`` checks both. Semantics: docs/kernel-api.md.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor


class RmsNorm(Protocol):
    """``rms_norm``: Zero-centred RMS norm: ``y = x_hat * (1 + weight)`` with ``x_hat = x / sqrt(mean(x^2) + eps)``. Spec: :func:`atom_kernels.ops.norm.reference.rms_norm`."""

    def __call__(
        self, x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None
    ) -> Tensor | tuple[Tensor, Tensor]: ...


class GatedRmsNorm(Protocol):
    """``gated_rms_norm``: GDN output norm, NOT zero-centred: ``weight * x_hat * silu(z)`` (HF ``Qwen3NextRMSNormGated``). Spec: :func:`atom_kernels.ops.norm.reference.gated_rms_norm`."""

    def __call__(self, x: Tensor, z: Tensor, weight: Tensor, eps: float) -> Tensor: ...


class Rope(Protocol):
    """``rope``: Neox RoPE on the first ``rotary_dim`` channels of every head; the rest is copied unchanged. Spec: :func:`atom_kernels.ops.rope.reference.rope`."""

    def __call__(
        self, q: Tensor, k: Tensor, positions: Tensor, rotary_dim: int, theta: float
    ) -> tuple[Tensor, Tensor]: ...


class SiluAndMul(Protocol):
    """``silu_and_mul``: ``silu(x[..., :I]) * x[..., I:]``. Spec: :func:`atom_kernels.ops.activation.reference.silu_and_mul`."""

    def __call__(self, x: Tensor) -> Tensor: ...


class Linear(Protocol):
    """``linear``: Dense ``x @ weight.T + bias`` in x.dtype (``torch.nn.functional.linear``). Spec: :func:`atom_kernels.ops.linear.reference.linear`."""

    def __call__(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor: ...


class MoeRouter(Protocol):
    """``moe_router``: Softmax (float32) over the routed experts, top-k, optionally renormalised to sum 1; with ``num_shared = m > 0`` also ``m`` shared columns gated by ``sigmoid(logits[:, E])``. Spec: :func:`atom_kernels.ops.moe.reference.moe_router`."""

    def __call__(
        self, logits: Tensor, top_k: int, renormalize: bool, num_shared: int = 0
    ) -> tuple[Tensor, Tensor]: ...


class MoeGateRouter(Protocol):
    """``moe_gate_router``: The router's Linear and :func:`moe_router` in one op: ``moe_router((x @ gate_weight.T)[:, :C], top_k, renormalize, num_shared)``, the logits rounded to x.dtype as a Linear's output, ``C = E`` or ``E + 1`` with ``num_shared > 0``. Spec: :func:`atom_kernels.ops.moe.reference.moe_gate_router`."""

    def __call__(
        self,
        x: Tensor,
        gate_weight: Tensor,
        num_experts: int,
        top_k: int,
        renormalize: bool,
        num_shared: int = 0,
        *,
        tickets: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]: ...


class MoeExperts(Protocol):
    """``moe_experts``: ``out[t] = sum_j weights[t, j] * (silu_and_mul(x[t] @ w13[e].T) @ w2[e].T)``, ``e = ids[t, j]``; a slot with ``e = -1`` (an expert this rank does not hold: expert parallelism, ids mapped by ``local_expert_ids``) contributes zero. Spec: :func:`atom_kernels.ops.moe.reference.moe_experts`."""

    def __call__(self, x: Tensor, weights: Tensor, ids: Tensor, w13: Tensor, w2: Tensor) -> Tensor: ...


class MoeExpertsFp8(Protocol):
    """``moe_experts_fp8``: :class:`MoeExperts` with FP8 block-scaled expert weights (W8A8, dynamic activation scales); id -1 contributes zero, as in :class:`MoeExperts`. Spec: :func:`atom_kernels.ops.moe.reference.moe_experts_fp8`."""

    def __call__(
        self,
        x: Tensor,
        weights: Tensor,
        ids: Tensor,
        w13: Tensor,
        w13_scale: Tensor,
        w2: Tensor,
        w2_scale: Tensor,
        block: tuple[int, int] = (128, 128),
        *,
        tickets: Tensor | None = None,
    ) -> Tensor: ...


class GdnGating(Protocol):
    """``gdn_gating``: Per-token decay (log space) and write strength of the gated delta rule. Spec: :func:`atom_kernels.ops.gdn_gating.reference.gdn_gating`."""

    def __call__(self, A_log: Tensor, a: Tensor, dt_bias: Tensor, b: Tensor) -> tuple[Tensor, Tensor]: ...


class L2Norm(Protocol):
    """``l2norm``: ``x / sqrt(sum(x^2, -1) + eps)``. Spec: :func:`atom_kernels.ops.l2norm.reference.l2norm`."""

    def __call__(self, x: Tensor, eps: float = 1e-06) -> Tensor: ...


class CausalConv1dVarlen(Protocol):
    """``causal_conv1d_varlen``: Prefill: causal conv over each sequence of a flat varlen batch, resuming from its state. Spec: :func:`atom_kernels.ops.conv1d.reference.causal_conv1d_varlen`."""

    def __call__(
        self,
        x: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        cu_seqlens: Tensor,
        conv_state: Tensor,
        state_indices: Tensor,
        has_initial_state: Tensor,
        activation: str | None = "silu",
    ) -> Tensor: ...


class CausalConv1dUpdate(Protocol):
    """``causal_conv1d_update``: Decode / verify: Q = 1 + k new tokens per sequence against the left-aligned window state. Spec: :func:`atom_kernels.ops.conv1d.reference.causal_conv1d_update`."""

    def __call__(
        self,
        x: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        conv_state: Tensor,
        state_indices: Tensor,
        num_accepted: Tensor | None = None,
        activation: str | None = "silu",
    ) -> Tensor: ...


class GatedDeltaRuleChunked(Protocol):
    """``gated_delta_rule_chunked``: Prefill of a flat varlen batch, chunked; vectorised over sequences and heads. Spec: :func:`atom_kernels.ops.gated_delta_rule.reference.gated_delta_rule_chunked`."""

    def __call__(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        g: Tensor,
        beta: Tensor,
        cu_seqlens: Tensor,
        ssm_state: Tensor,
        state_indices: Tensor,
        has_initial_state: Tensor,
        scale: float,
        use_qk_l2norm: bool = True,
        chunk_size: int = 64,
    ) -> Tensor: ...


class GatedDeltaRuleRecurrent(Protocol):
    """``gated_delta_rule_recurrent``: Decode: Q tokens per sequence from its slot's state, the final state written back to the slot. Spec: :func:`atom_kernels.ops.gated_delta_rule.reference.gated_delta_rule_recurrent`."""

    def __call__(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        g: Tensor,
        beta: Tensor,
        ssm_state: Tensor,
        state_indices: Tensor,
        scale: float,
        use_qk_l2norm: bool = True,
        *,
        A_log: Tensor | None = None,
        dt_bias: Tensor | None = None,
    ) -> Tensor: ...


class GatedDeltaRuleVerify(Protocol):
    """``gated_delta_rule_verify``: MTP verify with deferred commit: commit the accepted pending tokens, verify Q new ones, stash them. Spec: :func:`atom_kernels.ops.gated_delta_rule.reference.gated_delta_rule_verify`."""

    def __call__(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        g: Tensor,
        beta: Tensor,
        ssm_state: Tensor,
        pending: Tensor,
        state_indices: Tensor,
        num_commit: Tensor,
        scale: float,
        use_qk_l2norm: bool = True,
        *,
        A_log: Tensor | None = None,
        dt_bias: Tensor | None = None,
    ) -> Tensor: ...


class KvCacheWrite(Protocol):
    """``kv_cache_write``: Scatter the new tokens' K/V into the paged caches (in place). Spec: :func:`atom_kernels.ops.paged_attention.reference.kv_cache_write`."""

    def __call__(
        self,
        k: Tensor,
        v: Tensor,
        key_cache: Tensor,
        value_cache: Tensor,
        slot_mapping: Tensor,
        k_scale: float | Tensor | None = None,
        v_scale: float | Tensor | None = None,
    ) -> None: ...


class PagedAttention(Protocol):
    """``paged_attention``: Causal attention of each sequence's new queries over its whole cached sequence. Spec: :func:`atom_kernels.ops.paged_attention.reference.paged_attention`."""

    def __call__(
        self,
        q: Tensor,
        key_cache: Tensor,
        value_cache: Tensor,
        block_tables: Tensor,
        seq_lens: Tensor,
        query_start_loc: Tensor,
        scale: float,
        k_scale: float | Tensor | None = None,
        v_scale: float | Tensor | None = None,
    ) -> Tensor: ...


class Fp8BlockDequant(Protocol):
    """``fp8_block_dequant``: Dequantise a block-scaled FP8 weight. Spec: :func:`atom_kernels.ops.fp8.reference.fp8_block_dequant`."""

    def __call__(
        self,
        w: Tensor,
        scale_inv: Tensor,
        block: tuple[int, int] = (128, 128),
        dtype: torch.dtype = torch.bfloat16,
    ) -> Tensor: ...


class Fp8ActQuant(Protocol):
    """``fp8_act_quant``: Dynamic per-token-group FP8 quantisation of activations. Spec: :func:`atom_kernels.ops.fp8.reference.fp8_act_quant`."""

    def __call__(self, x: Tensor, group: int = 128) -> tuple[Tensor, Tensor]: ...


class Fp8Linear(Protocol):
    """``fp8_linear``: W8A8 block-scaled linear: ``dequant(fp8_act_quant(x, bk)) @ dequant(w_fp8).T + bias``. Spec: :func:`atom_kernels.ops.fp8.reference.fp8_linear`."""

    def __call__(
        self,
        x: Tensor,
        w_fp8: Tensor,
        scale_inv: Tensor,
        block: tuple[int, int] = (128, 128),
        bias: Tensor | None = None,
        *,
        tickets: Tensor | None = None,
    ) -> Tensor: ...


class GatedNormFp8Linear(Protocol):
    """``gated_norm_fp8_linear``: The Gated-DeltaNet output: its gated RMS norm, then the W8A8 block-scaled ``out_proj``. Spec: :func:`atom_kernels.ops.fp8.reference.gated_norm_fp8_linear`."""

    def __call__(
        self,
        o: Tensor,
        z: Tensor,
        norm_weight: Tensor,
        eps: float,
        w_fp8: Tensor,
        scale_inv: Tensor,
        block: tuple[int, int] = (128, 128),
        bias: Tensor | None = None,
        *,
        tickets: Tensor | None = None,
    ) -> Tensor: ...


class Fp8KvQuant(Protocol):
    """``fp8_kv_quant``: Per-tensor scaled quantisation: ``clamp(x / scale, -448, 448)`` as float8_e4m3fn (any shape). Spec: :func:`atom_kernels.ops.fp8.reference.fp8_kv_quant`."""

    def __call__(self, x: Tensor, scale: float | Tensor) -> Tensor: ...


class Fp8KvDequant(Protocol):
    """``fp8_kv_dequant``: ``x_fp8 * scale`` in ``dtype`` (float32 math), any shape. Spec: :func:`atom_kernels.ops.fp8.reference.fp8_kv_dequant`."""

    def __call__(self, x_fp8: Tensor, scale: float | Tensor, dtype: torch.dtype) -> Tensor: ...
