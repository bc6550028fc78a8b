from __future__ import annotations

import torch

from atom_kernels.ops._checks import FLOAT_DTYPES, Checker

INDEX_DTYPES = (torch.int32,)


def _weights(c: Checker, weight: torch.Tensor, bias: torch.Tensor | None, activation: object) -> None:
    c.tensor("weight", weight, ("C", "K"), FLOAT_DTYPES)
    c.optional("bias", bias, ("C",), FLOAT_DTYPES)
    c.activation(activation)


def check_causal_conv1d_varlen(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    conv_state: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    activation: str | None,
) -> None:
    c = Checker("causal_conv1d_varlen")
    c.tensor("x", x, ("T", "C"), FLOAT_DTYPES)
    _weights(c, weight, bias, activation)
    c.tensor("state_indices", state_indices, ("N",), INDEX_DTYPES)
    c.dims["N+1"] = c.dim("N") + 1
    c.tensor("cu_seqlens", cu_seqlens, ("N+1",), INDEX_DTYPES)
    c.tensor("has_initial_state", has_initial_state, ("N",), (torch.bool,))
    c.tensor("conv_state", conv_state, ("S", "C", "W"), FLOAT_DTYPES)
    c.require(
        c.dim("W") >= c.dim("K") - 1,
        f"conv_state must have shape [S, C, W] with W >= K - 1 = {c.dim('K') - 1}, got {tuple(conv_state.shape)}",
    )


def check_causal_conv1d_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    state_indices: torch.Tensor,
    num_accepted: torch.Tensor | None,
    activation: str | None,
) -> None:
    c = Checker("causal_conv1d_update")
    c.tensor("x", x, ("N", "Q", "C"), FLOAT_DTYPES)
    _weights(c, weight, bias, activation)
    c.tensor("conv_state", conv_state, ("S", "C", "W"), FLOAT_DTYPES)
    c.tensor("state_indices", state_indices, ("N",), INDEX_DTYPES)
    c.optional("num_accepted", num_accepted, ("N",), INDEX_DTYPES)
    k, q, w = c.dim("K"), c.dim("Q"), c.dim("W")
    c.require(
        w >= k - 2 + q,
        f"conv_state must have shape [S, C, W] with W >= K - 2 + Q = {k - 2 + q} (W = K - 1 + num "
        f"speculative tokens), got {tuple(conv_state.shape)}",
    )
