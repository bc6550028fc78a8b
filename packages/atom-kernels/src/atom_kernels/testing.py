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
