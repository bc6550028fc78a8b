"""Test helpers shared by the atom-kernels suites and the GPU backends' tests (tolerance asserts,
seeded random tensors). No pytest dependency."""

from __future__ import annotations

import os

import torch

REPORT_ENV = "ATOM_KERNELS_REPORT_ERRORS"


def max_errors(actual: torch.Tensor, expected: torch.Tensor) -> tuple[float, float]:
    """(max abs error, max error relative to max |expected|) in float64."""
    a, e = actual.double().cpu(), expected.double().cpu()
    if a.numel() == 0:
        return 0.0, 0.0
    abs_err = (a - e).abs().max().item()
    scale = max(e.abs().max().item(), 1e-12)
    return abs_err, abs_err / scale


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: tuple[float, float], what: str) -> None:
    """``|actual - expected| <= atol + rtol * |expected|`` elementwise; the message gives the max errors.
    With env ``ATOM_KERNELS_REPORT_ERRORS=1`` every call prints its max errors (run pytest with -s)."""
    atol, rtol = tol
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a, e = actual.double().cpu(), expected.double().cpu()
    abs_err, rel_err = max_errors(a, e)
    if os.environ.get(REPORT_ENV) == "1":  # measuring the tolerance tables: pytest -s shows these lines
        print(f"\n[max-error] {what}: abs {abs_err:.2e} rel {rel_err:.2e} (atol {atol:g}, rtol {rtol:g})")
    bad = ((a - e).abs() > atol + rtol * e.abs()) | (a.isnan() != e.isnan())
    assert not bool(bad.any()), (
        f"{what}: max abs error {abs_err:.3e} (relative to max |expected| {rel_err:.3e}) "
        f"exceeds atol={atol:g}, rtol={rtol:g} at {int(bad.sum())} of {a.numel()} elements"
    )


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(
    *shape: int, seed: int, dtype: torch.dtype, device: torch.device, scale: float = 1.0
) -> torch.Tensor:
    """Seeded normal tensor, drawn on CPU in float32 (the same values on every device), then cast."""
    return (torch.randn(*shape, generator=gen(seed)) * scale).to(device=device, dtype=dtype)


def row_strided(x: torch.Tensor, pad: int = 5) -> torch.Tensor:
    """``x [R, W]`` (same values) as a view ``buf[:, pad : pad + W]`` of a wider ``[R, W + 2 pad]`` buffer
    whose other columns hold NaN: row stride ``W + 2 pad``, unit last stride, like a column slice of a fused
    projection output; a kernel that reads outside the view sees NaN."""
    rows, width = x.shape
    buf = torch.full((rows, width + 2 * pad), float("nan"), dtype=x.dtype, device=x.device)
    view = buf[:, pad : pad + width]
    view.copy_(x)
    return view


def gdn_inputs(
    shape: tuple[int, ...],
    seed: int,
    dtype: torch.dtype,
    device: torch.device,
    heads: tuple[int, int, int, int],
):
    """Delta-rule inputs: q, k ``[*shape, Hk, Dk]``, v ``[*shape, Hv, Dv]`` in dtype; g (log decay, <= 0),
    beta ``[*shape, Hv]`` float32 as the model's gating makes them. ``heads = (Hk, Hv, Dk, Dv)``."""
    hk, hv, dk, dv = heads
    q = randn(*shape, hk, dk, seed=seed, dtype=dtype, device=device)
    k = randn(*shape, hk, dk, seed=seed + 1, dtype=dtype, device=device)
    v = randn(*shape, hv, dv, seed=seed + 2, dtype=dtype, device=device)
    a = randn(*shape, hv, seed=seed + 3, dtype=torch.float32, device=device)
    g = -torch.exp(torch.linspace(-4.0, 0.5, hv, device=device)) * torch.nn.functional.softplus(a)
    beta = torch.sigmoid(randn(*shape, hv, seed=seed + 4, dtype=torch.float32, device=device))
    return q, k, v, g, beta


def gate_inputs(shape: tuple[int, ...], seed: int, dtype: torch.dtype, device: torch.device, hv: int):
    """Raw gate inputs as the model hands them over: ``a``, ``b`` ``[*shape, Hv]`` column slices of one
    ``[*shape, 2 Hv]`` projection (strided), ``A_log``, ``dt_bias`` ``[Hv]``, all in dtype. Value head 0 has
    ``a + dt_bias > 20`` (softplus's linear branch)."""
    ba = randn(*shape, 2 * hv, seed=seed, dtype=torch.float32, device=device, scale=3.0)
    ba[..., hv] = 24.0
    ba = ba.to(dtype)
    A_log = torch.linspace(-2.0, 1.5, hv, device=device).to(dtype)
    dt_bias = randn(hv, seed=seed + 1, dtype=dtype, device=device, scale=0.5)
    return ba[..., hv:], ba[..., :hv], A_log, dt_bias


def reference_gates(a, b, A_log, dt_bias):
    """The reference gating op on ``[N, Q, Hv]`` raw inputs: float32 ``(g, beta)`` ``[N, Q, Hv]``."""
    from atom_kernels.ops.gdn_gating.reference import gdn_gating

    hv = a.shape[-1]
    g, beta = gdn_gating(A_log, a.reshape(-1, hv), dt_bias, b.reshape(-1, hv))
    return g.view(a.shape), beta.view(a.shape)


def gated_delta_rule_loop(q, k, v, g, beta, state, scale: float, l2: bool = True):
    """float64 token loop for one sequence (the test oracle): q, k ``[L, Hk, Dk]``, v ``[L, Hv, Dv]``,
    state ``[Hv, Dv, Dk]``. Returns ``(o [L, Hv, Dv], [state after each token])``."""
    q, k, v, g, beta, s = (t.double().cpu() for t in (q, k, v, g, beta, state))
    if l2:
        q, k = (x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
    rep = v.shape[1] // q.shape[1]
    q, k = q.repeat_interleave(rep, 1), k.repeat_interleave(rep, 1)
    outs, states = [], []
    for t in range(q.shape[0]):
        s = s * g[t].exp()[:, None, None]
        kv = torch.einsum("hvk,hk->hv", s, k[t])
        s = s + torch.einsum("hv,hk->hvk", beta[t][:, None] * (v[t] - kv), k[t])
        outs.append(torch.einsum("hvk,hk->hv", s, q[t]) * scale)
        states.append(s)
    o = torch.stack(outs) if outs else torch.zeros(0, v.shape[1], v.shape[2], dtype=torch.float64)
    return o, states
