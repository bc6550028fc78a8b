"""rms_norm, gated_rms_norm, rope, silu_and_mul against float64 oracles (and transformers' modules)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from atom_kernels.testing import assert_close, randn, row_strided

# (op, dtype) -> (atol, rtol) against a float64 oracle. Measured max abs error (CPU, reference) in comments.
TOL = {
    ("rms_norm", torch.float32): (1e-5, 1e-5),  # measured 5.6e-07
    ("rms_norm", torch.bfloat16): (
        3e-2,
        1e-2,
    ),  # measured 1.6e-02 (x + residual sum, one bf16 ulp at |h| ~ 4)
    ("gated_rms_norm", torch.float32): (1e-5, 1e-5),  # measured 6.3e-07
    ("gated_rms_norm", torch.bfloat16): (2e-2, 1e-2),  # measured 1.5e-02 (rel 2.4e-03)
    ("rope", torch.float32): (1e-5, 1e-5),  # measured 4.0e-07
    ("rope", torch.bfloat16): (2e-2, 1e-2),  # measured 1.5e-02 (rel 3.8e-03)
    ("silu_and_mul", torch.float32): (1e-5, 1e-5),  # measured 2.6e-06 (|y| up to 30; rel 8e-08)
    ("silu_and_mul", torch.bfloat16): (2e-2, 1e-2),  # measured 1.2e-01 at |y| ~ 30 (rel 3.5e-03, passes rtol)
}
DTYPES = [torch.float32, torch.bfloat16]


def rms_oracle(x: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double().cpu()
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [0, 1, 63, 257])
def test_rms_norm(impl, tol, device, dtype, tokens):
    fn = impl("rms_norm", dtype)
    x = randn(tokens, 96, seed=1, dtype=dtype, device=device, scale=3.0)
    w = randn(96, seed=2, dtype=dtype, device=device, scale=0.2)
    y = fn(x, w, 1e-6)
    assert y.dtype == dtype and y.shape == x.shape
    expected = rms_oracle(x, 1e-6) * (1 + w.double().cpu())
    assert_close(y, expected, tol("rms_norm", dtype), f"rms_norm {dtype} T={tokens}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_residual(impl, tol, device, dtype):
    fn = impl("rms_norm", dtype)
    x = randn(65, 4, 32, seed=3, dtype=dtype, device=device)
    r = randn(65, 4, 32, seed=4, dtype=dtype, device=device)
    w = randn(32, seed=5, dtype=torch.float32, device=device, scale=0.1)
    y, h = fn(x, w, 1e-6, residual=r)
    assert h.dtype == dtype
    assert_close(h, x.double() + r.double(), tol("rms_norm", dtype), f"rms_norm residual sum {dtype}")
    y_plain = fn(h, w, 1e-6)
    assert_close(
        y, y_plain, tol("rms_norm", dtype), "rms_norm(x, residual=r) vs rms_norm(x + r)"
    )  # 0 (reference)
    assert_close(y, rms_oracle(h, 1e-6) * (1 + w.double().cpu()), tol("rms_norm", dtype), "rms_norm residual")


def test_rms_norm_float32_residual(impl, tol, device):
    """A bf16 x with a float32 residual stream: ``h`` is the float32 sum (not rounded to bf16), ``y`` the
    norm of that sum in bf16."""
    fn = impl("rms_norm", torch.bfloat16)
    x = randn(65, 4, 32, seed=3, dtype=torch.bfloat16, device=device)
    r = randn(65, 4, 32, seed=4, dtype=torch.float32, device=device)
    w = randn(32, seed=5, dtype=torch.float32, device=device, scale=0.1)
    y, h = fn(x, w, 1e-6, residual=r)
    assert h.dtype == torch.float32 and y.dtype == torch.bfloat16
    assert_close(h, x.double() + r.double(), tol("rms_norm", torch.float32), "float32 residual sum")
    expected = rms_oracle(x.double() + r.double(), 1e-6) * (1 + w.double().cpu())
    assert_close(y, expected, tol("rms_norm", torch.bfloat16), "rms_norm of the float32 sum")


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_strided_heads(impl, device, dtype):
    """``[T, H, D]`` views as the attention layer passes them (the query half of ``[T, Hq, 2D]`` and ``k`` of
    a fused q/k/v projection's output: row strides > H * D, NaN around them), for T = 1, 3, 65: exactly the
    contiguous call's output."""
    fn = impl("rms_norm", dtype)
    w = randn(64, seed=15, dtype=torch.float32, device=device, scale=0.1)
    for t in (1, 3, 65):
        qg = randn(t, 4 * 128, seed=16, dtype=dtype, device=device, scale=2.0)
        q = row_strided(qg).unflatten(1, (4, 128))[..., :64]
        assert q.stride()[1:] == (128, 1) and (t == 1 or q.stride(0) == 4 * 128 + 10)
        assert torch.equal(fn(q, w, 1e-6), fn(q.contiguous(), w, 1e-6)), f"T={t}: query half"
        k = randn(t, 2 * 64, seed=17, dtype=dtype, device=device, scale=2.0)
        ks = row_strided(k).unflatten(1, (2, 64))
        assert torch.equal(fn(ks, w, 1e-6), fn(k.view(t, 2, 64), w, 1e-6)), f"T={t}: row-strided k"


def test_rms_norm_matches_transformers(impl, tol, device):
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm

    fn = impl("rms_norm", torch.float32)
    mod = Qwen3NextRMSNorm(64, eps=1e-6)
    with torch.no_grad():
        mod.weight.copy_(torch.randn(64, generator=torch.Generator().manual_seed(0)) * 0.3)
    x = randn(17, 64, seed=6, dtype=torch.float32, device="cpu")
    expected = mod(x).detach()
    got = fn(x.to(device), mod.weight.detach().to(device), 1e-6)
    assert_close(got, expected, tol("rms_norm", torch.float32), "rms_norm vs transformers")


@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_rms_norm(impl, tol, device, dtype):
    fn = impl("gated_rms_norm", dtype)
    x = randn(63, 4, 64, seed=7, dtype=dtype, device=device, scale=2.0)
    z = randn(63, 4, 64, seed=8, dtype=dtype, device=device)
    w = 1.0 + randn(64, seed=9, dtype=torch.float32, device=device, scale=0.1)
    y = fn(x, z, w, 1e-6)
    assert y.dtype == dtype and y.shape == x.shape
    expected = rms_oracle(x, 1e-6) * w.double().cpu() * F.silu(z.double().cpu())
    assert_close(y, expected, tol("gated_rms_norm", dtype), f"gated_rms_norm {dtype}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_rms_norm_row_strided_z(impl, device, dtype):
    """``z[T, Hv, Dv]`` as the GDN layer passes it, a view of the wider projection output (row stride >
    Hv * Dv, NaN around it), for T = 1, 3, 65: exactly the contiguous call's output."""
    fn = impl("gated_rms_norm", dtype)
    w = 1.0 + randn(64, seed=12, dtype=torch.float32, device=device, scale=0.1)
    for t in (1, 3, 65):
        x = randn(t, 4, 64, seed=13, dtype=dtype, device=device, scale=2.0)
        z = randn(t, 4 * 64, seed=14, dtype=dtype, device=device)
        zs = row_strided(z).unflatten(1, (4, 64))
        assert zs.stride()[1:] == (64, 1) and (t == 1 or zs.stride(0) == 4 * 64 + 10)
        assert torch.equal(fn(x, zs, w, 1e-6), fn(x, z.view(t, 4, 64), w, 1e-6)), f"T={t}: strided z"


def test_gated_rms_norm_is_not_zero_centred(impl, tol, device):
    """weight = 1 must give x_hat * silu(z) (a zero-centred norm would give twice that)."""
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNormGated

    fn = impl("gated_rms_norm", torch.float32)
    x = randn(9, 2, 32, seed=10, dtype=torch.float32, device="cpu")
    z = randn(9, 2, 32, seed=11, dtype=torch.float32, device="cpu")
    mod = Qwen3NextRMSNormGated(32, eps=1e-6)
    expected = mod(x.reshape(-1, 32), z.reshape(-1, 32)).detach().reshape(x.shape)
    got = fn(x.to(device), z.to(device), torch.ones(32, device=device), 1e-6)
    assert_close(got, expected, tol("gated_rms_norm", torch.float32), "gated_rms_norm vs transformers")


def rope_oracle(x: torch.Tensor, positions: torch.Tensor, rotary_dim: int, theta: float) -> torch.Tensor:
    """Neox RoPE via transformers' apply_rotary_pos_emb (partial rotary): inv_freq and the angles are
    float32 as in HF and the contract (at position 40000 that alone moves outputs by ~3e-3), the
    rotation is in float64."""
    from transformers.models.qwen3_next.modeling_qwen3_next import apply_rotary_pos_emb

    inv_freq = 1.0 / theta ** (
        torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    )  # as HF
    freqs = (positions.cpu().float()[:, None] * inv_freq.float()[None]).double()
    emb = torch.cat([freqs, freqs], dim=-1)
    xt = x.double().cpu().transpose(0, 1)[None]  # [1, H, T, D]
    out, _ = apply_rotary_pos_emb(xt, xt, emb.cos()[None], emb.sin()[None])
    return out[0].transpose(0, 1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotary_dim", [64, 256])
def test_rope(impl, tol, device, dtype, rotary_dim):
    fn = impl("rope", dtype)
    tokens, dim = 65, 256
    q = randn(tokens, 4, dim, seed=12, dtype=dtype, device=device)
    k = randn(tokens, 2, dim, seed=13, dtype=dtype, device=device)
    positions = torch.randint(0, 40000, (tokens,), generator=torch.Generator().manual_seed(1)).to(device)
    q2, k2 = fn(q, k, positions, rotary_dim, 10000000.0)
    assert q2.dtype == dtype and q2.shape == q.shape and k2.shape == k.shape
    tol = tol("rope", dtype)
    assert_close(q2, rope_oracle(q, positions, rotary_dim, 1e7), tol, f"rope q {dtype} rd={rotary_dim}")
    assert_close(k2, rope_oracle(k, positions, rotary_dim, 1e7), tol, f"rope k {dtype} rd={rotary_dim}")
    assert torch.equal(q2[..., rotary_dim:], q[..., rotary_dim:]), (
        "channels past rotary_dim must be untouched"
    )


def test_rope_relative_positions(impl, device):
    """<rope(q, m), rope(k, n)> depends only on m - n; position 0 is the identity."""
    fn = impl("rope", torch.float32)
    q = randn(1, 1, 64, seed=14, dtype=torch.float32, device=device).expand(3, 1, 64).contiguous()
    k = randn(1, 1, 64, seed=15, dtype=torch.float32, device=device).expand(3, 1, 64).contiguous()
    pos = torch.tensor([0, 7, 1007], device=device)
    q2, k2 = fn(q, k, pos, 64, 10000.0)
    assert torch.equal(q2[0], q[0]) and torch.equal(k2[0], k[0])
    d1 = (q2[1] * k2[0]).sum()  # offset 7
    d2 = (q2[2] * k2[1]).sum()  # offset 1000: different
    d3 = (q2[1] * k2[1]).sum()  # offset 0
    d4 = (q2[2] * k2[2]).sum()
    assert abs(d3.item() - d4.item()) < 1e-4, f"equal offsets differ: {d3.item()} vs {d4.item()}"
    assert abs(d1.item() - d2.item()) > 1e-3, "different offsets should give different scores"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 257])
def test_silu_and_mul(impl, tol, device, dtype, tokens):
    fn = impl("silu_and_mul", dtype)
    x = randn(tokens, 2 * 80, seed=16, dtype=dtype, device=device, scale=2.0)
    y = fn(x)
    assert y.shape == (tokens, 80) and y.dtype == dtype
    x64 = x.double().cpu()
    assert_close(y, F.silu(x64[:, :80]) * x64[:, 80:], tol("silu_and_mul", dtype), f"silu_and_mul {dtype}")


# Bad input: every op raises ValueError naming the argument (checked on the meta device too).
def test_bad_inputs(impl, device):
    f32 = torch.float32
    rms = impl("rms_norm", f32)
    x = torch.randn(4, 8, device=device)
    with pytest.raises(ValueError, match=r"rms_norm: weight must have shape \[H=8\], got \(7,\)"):
        rms(x, torch.ones(7, device=device), 1e-6)
    with pytest.raises(ValueError, match="residual must have shape"):
        rms(x, torch.ones(8, device=device), 1e-6, residual=torch.randn(4, 9, device=device))
    with pytest.raises(ValueError, match="eps must be a positive number"):
        rms(x, torch.ones(8, device=device), 0.0)
    with pytest.raises(ValueError, match="weight is on meta"):
        rms(x, torch.ones(8, device="meta"), 1e-6)
    gated = impl("gated_rms_norm", f32)
    with pytest.raises(ValueError, match="z must have shape"):
        gated(
            torch.randn(3, 2, 8, device=device),
            torch.randn(3, 2, 4, device=device),
            torch.ones(8, device=device),
            1e-6,
        )
    rope = impl("rope", f32)
    q, k = torch.randn(5, 2, 16, device=device), torch.randn(5, 1, 16, device=device)
    with pytest.raises(ValueError, match="positions must have dtype int64"):
        rope(q, k, torch.arange(5, device=device, dtype=torch.int32), 16, 1e4)
    with pytest.raises(ValueError, match=r"positions must have shape \[T=5\]"):
        rope(q, k, torch.arange(4, device=device), 16, 1e4)
    with pytest.raises(ValueError, match="rotary_dim must be even"):
        rope(q, k, torch.arange(5, device=device), 18, 1e4)
    with pytest.raises(ValueError, match=r"k must have shape \[T=5, Hk, D=16\]"):
        rope(q, torch.randn(5, 1, 8, device=device), torch.arange(5, device=device), 16, 1e4)
    silu = impl("silu_and_mul", f32)
    with pytest.raises(ValueError, match="must be even"):
        silu(torch.randn(3, 7, device=device))
    with pytest.raises(ValueError, match="x must have dtype"):
        silu(torch.ones(3, 8, dtype=torch.int32, device=device))
