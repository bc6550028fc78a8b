from __future__ import annotations

import torch

from atom_kernels.ops._checks import FLOAT_DTYPES, Checker

INDEX_DTYPES = (torch.int32,)


def _gates(
    c: Checker, g: torch.Tensor, beta: torch.Tensor, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None
) -> None:
    """``g``/``beta`` ``[N, Q, Hv]``; with fused gating (``A_log`` and ``dt_bias`` ``[Hv]`` given, both or
    neither) they are the raw gate inputs ``a``/``b`` and are named so in the errors."""
    c.require(
        (A_log is None) == (dt_bias is None),
        "fused gating needs both A_log and dt_bias (or neither), got "
        f"A_log={'None' if A_log is None else 'a tensor'}, dt_bias={'None' if dt_bias is None else 'a tensor'}",
    )
    fused = A_log is not None
    c.tensor("a (passed as g)" if fused else "g", g, ("N", "Q", "Hv"), FLOAT_DTYPES)
    c.tensor("b (passed as beta)" if fused else "beta", beta, ("N", "Q", "Hv"), FLOAT_DTYPES)
    if fused:
        c.tensor("A_log", A_log, ("Hv",), FLOAT_DTYPES)
        c.tensor("dt_bias", dt_bias, ("Hv",), FLOAT_DTYPES)


def _common(c: Checker, ssm_state: torch.Tensor, scale: float, use_qk_l2norm: bool) -> None:
    c.tensor("ssm_state", ssm_state, ("S", "Hv", "Dv", "Dk"), FLOAT_DTYPES)
    hk, hv = c.dim("Hk"), c.dim("Hv")
    c.require(hv % hk == 0, f"the value heads Hv={hv} must be a multiple of the key heads Hk={hk}")
    c.positive_float("scale", scale)
    c.require(isinstance(use_qk_l2norm, bool), f"use_qk_l2norm must be a bool, got {use_qk_l2norm!r}")


def check_gated_delta_rule_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    ssm_state: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    scale: float,
    use_qk_l2norm: bool,
    chunk_size: int,
) -> None:
    c = Checker("gated_delta_rule_chunked")
    c.tensor("q", q, ("T", "Hk", "Dk"), FLOAT_DTYPES)
    c.tensor("k", k, ("T", "Hk", "Dk"), (q.dtype,))
    c.tensor("v", v, ("T", "Hv", "Dv"), FLOAT_DTYPES)
    c.tensor("g", g, ("T", "Hv"), FLOAT_DTYPES)
    c.tensor("beta", beta, ("T", "Hv"), FLOAT_DTYPES)
    c.tensor("state_indices", state_indices, ("N",), INDEX_DTYPES)
    c.dims["N+1"] = c.dim("N") + 1
    c.tensor("cu_seqlens", cu_seqlens, ("N+1",), INDEX_DTYPES)
    c.tensor("has_initial_state", has_initial_state, ("N",), (torch.bool,))
    _common(c, ssm_state, scale, use_qk_l2norm)
    c.positive_int("chunk_size", chunk_size)


def check_gated_delta_rule_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_state: torch.Tensor,
    state_indices: torch.Tensor,
    scale: float,
    use_qk_l2norm: bool,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
) -> None:
    c = Checker("gated_delta_rule_recurrent")
    c.tensor("q", q, ("N", "Q", "Hk", "Dk"), FLOAT_DTYPES)
    c.tensor("k", k, ("N", "Q", "Hk", "Dk"), (q.dtype,))
    c.tensor("v", v, ("N", "Q", "Hv", "Dv"), FLOAT_DTYPES)
    _gates(c, g, beta, A_log, dt_bias)
    c.tensor("state_indices", state_indices, ("N",), INDEX_DTYPES)
    _common(c, ssm_state, scale, use_qk_l2norm)


def pending_width(num_k_heads: int, head_k_dim: int, num_v_heads: int, head_v_dim: int) -> int:
    """Floats per pending token of :func:`gated_delta_rule_verify`: ``[k (Hk*Dk) | u (Hv*Dv) | g (Hv)]``."""
    return num_k_heads * head_k_dim + num_v_heads * head_v_dim + num_v_heads


def check_gated_delta_rule_verify(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_state: torch.Tensor,
    pending: torch.Tensor,
    state_indices: torch.Tensor,
    num_commit: torch.Tensor,
    scale: float,
    use_qk_l2norm: bool,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    pending_pos: torch.Tensor | None = None,
) -> None:
    c = Checker("gated_delta_rule_verify")
    c.tensor("q", q, ("N", "Q", "Hk", "Dk"), FLOAT_DTYPES)
    c.tensor("k", k, ("N", "Q", "Hk", "Dk"), (q.dtype,))
    c.tensor("v", v, ("N", "Q", "Hv", "Dv"), FLOAT_DTYPES)
    _gates(c, g, beta, A_log, dt_bias)
    c.tensor("state_indices", state_indices, ("N",), INDEX_DTYPES)
    c.tensor("num_commit", num_commit, ("N",), INDEX_DTYPES)
    _common(c, ssm_state, scale, use_qk_l2norm)
    c.dims["P"] = pending_width(c.dim("Hk"), c.dim("Dk"), c.dim("Hv"), c.dim("Dv"))
    c.tensor("pending", pending, ("S", "R", "P"), (torch.float32,))
    c.require(
        c.dim("Q") <= c.dim("R"),
        f"the verify tokens Q={c.dim('Q')} must fit the pending buffer (R={c.dim('R')} tokens per slot)",
    )
    c.optional("pending_pos", pending_pos, ("S", 1), (torch.int32,))
