"""Shared parts of the verify experiments (exp_verify_kmajor.py, exp_verify_wy.py): one case's inputs and
float32 reference, the check of a candidate against it, and side-by-side timing next to our decode and
our verify op."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

SMOKE_DIMS, MODEL_DIMS = (2, 4, 32, 16), (16, 32, 128, 128)  # (Hk, Hv, Dk, Dv): CPU smoke, Qwen3-Next-80B


def verify_case(B: int, Q: int, sd: torch.dtype, dev: torch.device, smoke: bool) -> dict:
    """Inputs of one verify step (every pending token committed) and the float32 reference's outputs,
    committed state and pending buffer."""
    from atom_kernels.ops.gated_delta_rule import pending_width, reference

    hk, hv, dk, dv = SMOKE_DIMS if smoke else MODEL_DIMS
    scale = dk**-0.5
    gen = torch.Generator(device="cpu").manual_seed(B * 10 + Q)
    act = torch.float32 if smoke else torch.bfloat16
    q, k = (torch.randn(B, Q, hk, dk, generator=gen).to(dev, act) for _ in range(2))
    v = torch.randn(B, Q, hv, dv, generator=gen).to(dev, act)
    g = (-torch.rand(B, Q, hv, generator=gen) * 0.5).to(dev)
    beta = torch.rand(B, Q, hv, generator=gen).to(dev)
    pool = (torch.randn(B, hv, dv, dk, generator=gen) * 0.3).to(dev, sd)
    P = pending_width(hk, dk, hv, dv)
    pend = (torch.randn(B, Q, P, generator=gen) * 0.3).to(dev)
    pend[..., hk * dk + hv * dv :] = -torch.rand(B, Q, hv, generator=gen).to(dev) * 0.5
    idx = torch.arange(B, dtype=torch.int32, device=dev)
    na = torch.full((B,), Q, dtype=torch.int32, device=dev)
    args_ = (q, k, v, g, beta)
    pr, er = pool.float().clone(), pend.clone()  # float32 state: the reference writes it
    o_r = reference.gated_delta_rule_verify(*(x.float() for x in args_), pr, er, idx, na, scale)
    tol = 2e-2 if sd == torch.bfloat16 or act == torch.bfloat16 else 1e-4
    return dict(args=args_, pool=pool, pend=pend, idx=idx, na=na, scale=scale, ref=(o_r, pr, er), tol=tol,
                name=f"B={B} Q={Q} state={str(sd)[6:]}")  # fmt: skip


def check(case: dict, label: str, o_t: torch.Tensor, pool_t: torch.Tensor, pend_t: torch.Tensor) -> bool:
    """Max errors of a candidate's outputs, committed state and pending buffer against the reference."""
    o_r, pr, er = case["ref"]
    errs = {
        "out": (o_t.float() - o_r).abs().max().item(),
        "state": (pool_t.float() - pr).abs().max().item(),
        "pending": (pend_t - er).abs().max().item(),
    }
    ok = all(e <= case["tol"] for e in errs.values())
    print(f"check {case['name']} {label}: {errs} {'ok' if ok else 'FAIL'}")
    return ok


def time_candidates(args_, pool, pend, idx, na, scale, cands, case, ceil) -> list[dict]:
    """CUDA-graph replay times of our decode (Q=1), our verify and ``cands`` (name -> call) on one case."""
    from atom_kernels.ops.gated_delta_rule import triton as gdr_triton
    from atom_kernels.ops.gated_delta_rule import triton_verify

    q, k, v, g, beta = args_
    B = q.shape[0]
    nbytes = 2 * pool[0].numel() * pool.element_size() * B
    cands = {
        "decode (recurrent Q=1)": lambda: gdr_triton.gated_delta_rule_recurrent(
            q[:, :1], k[:, :1], v[:, :1], g[:, :1], beta[:, :1], pool, idx[:, None], None, scale
        ),
        "verify (ours)": lambda: triton_verify.gated_delta_rule_verify(*args_, pool, pend, idx, na, scale),
        **cands,
    }
    rows = []
    for name, fn in cands.items():
        ms = common.time_ms(fn, graph=True)
        frac = nbytes / (ms * 1e-3) / 1e9 / ceil["copy_gbps"]
        rows.append({"case": case, "impl": name, "us": ms * 1e3, "frac_copy": frac})
        print(f"time {case:28s} {name:28s} {ms * 1e3:8.1f} us  {frac:.0%} of copy BW (state r+w)")
    return rows
