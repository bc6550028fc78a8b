"""Gated DeltaNet kernels at the Qwen3-Next-80B-A3B layer shape (TP 1): correctness and speed.

Shape: 16 key heads and 32 value heads of dim 128, conv kernel 4 over 2*16*128 + 32*128 = 8192
channels, bf16 activations, recurrent state float32 or bf16 in the ``[S, Hv, Dv, Dk]`` pool.

Cases: decode (Q = 1) and Q = 1 + k tokens (k = 1..4) at B = 1, 8, 64, 256; prefill 1 x 4096 and
16 x 512; conv1d update and varlen prefill; gating. Bench ``recurrent``: ``gated_delta_rule_recurrent``,
Q tokens from and back to one slot per sequence (final state only: Q = 1 is a decode, Q > 1 the traffic
floor of a verify step). Bench ``verify``: ``gated_delta_rule_verify`` (deferred commit, one state per
sequence plus the pending tokens; ``triton-verify`` commits all Q pending tokens of the previous step, the
most commit work, ``triton-verify-a1`` commits one; ``-bv8`` / ``-seq`` other launch settings through the
op's private ``_launch_verify``). Implementations in the same run: ``triton`` (ours), ``reference``
(atom-kernels' torch spec, on the GPU), fla-core's ``fused_recurrent_gated_delta_rule`` and
``chunk_gated_delta_rule`` (dense states, final state only).

Every case is first checked against the reference run in float32 (inputs upcast, float32 state):
outputs and final states (verify: outputs, the committed state and the pending tokens), with the
tolerances in :data:`TOL`.
Timing: decode/verify through CUDA-graph replay (how vLLM runs decode), prefill eagerly; both median.

Writes ``<out>/gdn.json`` and ``<out>/gdn.png``; exits non-zero if a check fails.

``--fused`` runs only the fused-gating comparison (:func:`gdn_harness.fused_case`): decode and verify
k = 1, 3 at B = 1, 8, 64, float32 state, CUDA-graph replay; vLLM's own kernel (``vllm-fused``, and
``vllm-packed_decode`` for decode), ours unfused (gating op + op), ours fused; writes
``<out>/gdn_fused.json``. vLLM's kernels come from ``--vllm-fla DIR`` (default
``benchmarks/results/local/vllm_fla``, git-ignored), filled on a machine with vLLM installed by
``--export-vllm-fla DIR``; carry that folder to the GPU machine.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import gdn_conv  # noqa: E402
import gdn_harness  # noqa: E402
from gdn_harness import BF16, FP32, QUICK, QWEN3_NEXT_80B, SMOKE, Run, get_impl  # noqa: E402

# fla-core 0.6.0's fused_recurrent_gated_delta_rule hit an illegal memory access at B=256 with 4 tokens per
# sequence on the H200 (batch and varlen calls, runs 1 and 2), which ends the CUDA context: not run there.
FLA_RECURRENT_FAULT_TOKENS = 1024
SWEEP_CONFIGS = ((8, 1), (8, 2), (16, 1), (16, 2), (32, 2), (32, 4), (64, 4))
# (BV, num_warps, max registers per thread) of the verify kernel: capping the registers (uncapped: 168 on
# Triton 3.6) gained at most 4% (bf16 pool, 128) and lost up to 60% (80); two warps per program were 3-5x
# slower (cross-warp conversions of the token tiles).
VERIFY_SWEEP_CONFIGS = ((8, 1, None), (16, 1, None), (32, 1, None), (8, 1, 128))
# (what, state dtype) -> (atol, rtol) of the bf16-activation Triton result against the float32 reference.
# Measured worst max abs error over every shape on the H200 (results/gdn_h200.json and its predecessors) in
# the comments.
TOL = {
    ("recurrent_out", FP32): (2e-2, 2e-2),  # 4.9e-04 (bf16 output rounding)
    ("recurrent_state", FP32): (1e-4, 1e-4),  # 8.3e-07 (per-token states; now the final state)
    ("recurrent_out", BF16): (3e-2, 3e-2),  # 4.9e-04
    ("recurrent_state", BF16): (3e-2, 2e-2),  # 7.8e-03 (one bf16 ulp of |S| ~ 1-2)
    ("verify_out", FP32): (2e-2, 2e-2),  # 4.9e-04 (bf16 outputs)
    ("verify_state", FP32): (1e-4, 1e-4),  # 8.3e-07 (committed state after Q replayed tokens)
    ("verify_out", BF16): (3e-2, 3e-2),  # 6.6e-04
    ("verify_state", BF16): (3e-2, 2e-2),  # 7.8e-03 (one bf16 ulp of |S| ~ 1-2)
    # Pending tokens: k and g are exact copies; u = beta (v - S k) is computed.
    ("verify_pending", FP32): (1e-5, 1e-5),  # 7.2e-07
    ("verify_pending", BF16): (2e-2, 2e-2),  # 1.2e-02 (u from the bf16-rounded state)
    ("chunked_out", FP32): (3e-2, 3e-2),  # 7.9e-04
    ("chunked_state", FP32): (3e-2, 3e-2),  # 7.5e-03 (fla-core multiplies bf16 operands)
    ("chunked_out", BF16): (3e-2, 3e-2),  # 7.9e-04
    ("chunked_state", BF16): (4e-2, 3e-2),  # 8.2e-03
    ("conv_out", BF16): (2e-2, 1e-2),  # 2.9e-02 (one bf16 ulp of |y| ~ 4-8, inside rtol)
    ("conv_state", BF16): (0.0, 0.0),  # 0 (a copy)
    ("gating", FP32): (1e-5, 1e-5),  # 1.1e-05 (|g| up to ~60, inside rtol)
    # --fused (fp32 state, bf16 activations): ours fused vs unfused (the same gate expression) and vs vLLM's
    # kernel (other reduction order); measured under the interpreter at --smoke shapes, not yet on the H200.
    ("fused_out", FP32): (2e-2, 2e-2),  # 0; a bf16 output may round apart (as verify_out)
    ("fused_state", FP32): (1e-5, 1e-5),  # 0
    ("fused_pending", FP32): (1e-5, 1e-5),  # 0
    ("vllm_out", FP32): (2e-2, 2e-2),  # 0 (bf16 outputs; one ulp may differ, as verify_out)
    ("vllm_state", FP32): (1e-4, 1e-4),  # 2.4e-07
}


class GdnRun(Run):
    """The delta-rule cases; conv1d and gating are in gdn_conv.py (methods here keep the case names that
    :meth:`Run.guarded` records)."""

    # ---------------------------------------------------------------- recurrent (decode / verify)
    def recurrent_inputs(self, sd: torch.dtype, B: int, Q: int):
        dev = self.device
        sh = self.shape
        HK, HV, DK, DV = sh.hk, sh.hv, sh.dk, sh.dv
        gen = torch.Generator(device=dev).manual_seed(1000 * B + Q)

        def rn(*s, scale=1.0):
            return torch.randn(*s, generator=gen, device=dev) * scale

        q, k = rn(B, Q, HK, DK).to(BF16), rn(B, Q, HK, DK).to(BF16)
        v = rn(B, Q, HV, DV).to(BF16)
        g = -torch.rand(B, Q, HV, generator=gen, device=dev) * 0.5
        beta = torch.rand(B, Q, HV, generator=gen, device=dev)
        S = B * Q  # each sequence's slot scattered among more slots than sequences
        idx = torch.randperm(S, generator=gen, device=dev)[:B].to(torch.int32)
        pool = rn(S, HV, DV, DK, scale=0.5).to(sd)
        sbytes = HV * DV * DK * pool.element_size() * B
        act = B * Q * (2 * HK * DK * 2 + 2 * HV * DV * 2 + 2 * HV * 4)
        return q, k, v, g, beta, idx, pool, sbytes, act

    def recurrent(self, sd: torch.dtype, B: int, Q: int) -> None:
        dev = self.device
        SCALE = self.shape.scale
        q, k, v, g, beta, idx, pool, sbytes, act = self.recurrent_inputs(sd, B, Q)
        case = f"B={B} Q={Q} state={str(sd)[6:]}"
        tri = get_impl("gated_delta_rule_recurrent", "triton", dev, BF16)
        ref = get_impl("gated_delta_rule_recurrent", "reference", dev, BF16)
        ref32 = get_impl("gated_delta_rule_recurrent", "reference", dev, FP32)
        if tri is None or ref32 is None:
            return
        # correctness: every output and the final states against the float32 reference
        pool_t, pool_r = pool.clone(), pool.float()
        o_t = tri(q, k, v, g, beta, pool_t, idx, SCALE, True)
        o_r = ref32(q.float(), k.float(), v.float(), g, beta, pool_r, idx, SCALE, True)
        self.check("recurrent_out", sd, case, o_t, o_r)
        written = idx.long()
        self.check("recurrent_state", sd, case, pool_t[written].float(), pool_r[written])
        del pool_r
        extra = dict(B=B, Q=Q, state_dtype=str(sd)[6:])
        self.add(
            "recurrent",
            case,
            "triton",
            lambda: tri(q, k, v, g, beta, pool, idx, SCALE, True),
            2 * sbytes + act,
            **extra,
        )
        if ref is not None and not self.quick:
            self.add(
                "recurrent",
                case,
                "reference",
                lambda: ref(q, k, v, g, beta, pool, idx, SCALE, True),
                2 * sbytes + act,
                graph=False,
                **extra,
            )

    # ---------------------------------------------------------------- verify with deferred commit
    def verify(self, sd: torch.dtype, B: int, Q: int) -> None:
        """``gated_delta_rule_verify``: Q tokens per sequence, one slot per sequence, pending [S, Q, P]
        holding raw random tokens of a previous step; ``num_commit`` = Q (every pending token
        committed) and = 1. Checked: outputs, committed states and the pending tokens after the stash."""
        from atom_kernels.ops.gated_delta_rule import pending_width
        from atom_kernels.ops.gated_delta_rule.triton_verify import _launch_verify, verify_launch_config

        dev, sh = self.device, self.shape
        q, k, v, g, beta, idx, pool, sbytes, act = self.recurrent_inputs(sd, B, Q)
        S = pool.shape[0]  # B * Q slots: each sequence's slot is scattered among them
        gen = torch.Generator(device=dev).manual_seed(77 * B + Q)
        P = pending_width(sh.hk, sh.dk, sh.hv, sh.dv)
        pend = torch.randn(S, Q, P, generator=gen, device=dev)
        kd, vd = sh.hk * sh.dk, sh.hv * sh.dv
        pend[..., kd : kd + vd] *= 0.3  # u = beta (v - S k): |u| below |v|
        pend[..., kd + vd :] = -torch.rand(S, Q, sh.hv, generator=gen, device=dev) * 0.5  # g
        case = f"B={B} Q={Q} state={str(sd)[6:]}"
        tri = get_impl("gated_delta_rule_verify", "triton", dev, BF16)
        ref32 = get_impl("gated_delta_rule_verify", "reference", dev, FP32)
        if tri is None or ref32 is None:
            return
        na = torch.full((B,), Q, dtype=torch.int32, device=dev)
        na1 = torch.ones_like(na)
        default = verify_launch_config(B, sh.hv, sh.dv, Q)
        # (impl, launch (None: the op itself), num_commit, checked): num_commit = Q commits every pending
        # token, = 1 one.
        variants = [
            ("triton-verify", None, na, True),
            ("triton-verify-a1", None, na1, False),
            ("triton-verify-bv8", default._replace(block_v=8), na, True),
            ("triton-verify-seq", default._replace(wy=False, max_registers=None), na, True),
        ]

        def run_op(launch, *args):
            return tri(*args) if launch is None else _launch_verify(*args, launch=launch)

        pbytes = B * P * 4  # one pending token of every sequence
        for impl, launch, acc, checked in variants:
            if checked:
                pool_t, pool_r, pend_t, pend_r = pool.clone(), pool.float(), pend.clone(), pend.clone()
                o_t = run_op(launch, q, k, v, g, beta, pool_t, pend_t, idx, acc, sh.scale, True)
                o_r = ref32(
                    q.float(), k.float(), v.float(), g, beta, pool_r, pend_r, idx, acc, sh.scale, True
                )
                self.check("verify_out", sd, f"{case} {impl}", o_t, o_r)
                self.check(
                    "verify_state", sd, f"{case} {impl}", pool_t[idx.long()].float(), pool_r[idx.long()]
                )
                self.check("verify_pending", sd, f"{case} {impl}", pend_t, pend_r)
                del pool_t, pool_r, pend_t, pend_r
            self.add(
                "verify",
                case,
                impl,
                lambda acc=acc, launch=launch: run_op(
                    launch, q, k, v, g, beta, pool, pend, idx, acc, sh.scale, True
                ),
                2 * sbytes + (int(acc[0]) + Q) * pbytes + act,  # state r+w, pending read + stash, q/k/v/o
                B=B,
                Q=Q,
                state_dtype=str(sd)[6:],
                num_commit=int(acc[0]),
            )

    def fla_recurrent(self, sd: torch.dtype, B: int, Q: int) -> None:
        """fla-core's fused_recurrent_gated_delta_rule on the same inputs: varlen call (B*Q tokens, as vLLM
        calls it), dense initial state gathered beforehand, final state only. Runs after every other part:
        a fault in it cannot take our rows with it."""
        if self.fla_rec is None:
            return
        sh = self.shape
        if B * Q >= FLA_RECURRENT_FAULT_TOKENS and sh == QWEN3_NEXT_80B:
            self.rows.append(
                {
                    "bench": "recurrent",
                    "case": f"B={B} Q={Q} state={str(sd)[6:]}",
                    "impl": "fla-fused_recurrent",
                    "ms": None,
                    "B": B,
                    "Q": Q,
                    "state_dtype": str(sd)[6:],
                    "timing": "skipped: fla-core 0.6.0 faults here",
                }
            )
            return
        q, k, v, g, beta, idx, pool, sbytes, act = self.recurrent_inputs(sd, B, Q)
        h0 = pool[idx.long()].contiguous()
        del pool
        cu = torch.arange(0, B * Q + 1, Q, device=self.device, dtype=torch.long)
        flat = [t.reshape(1, B * Q, *t.shape[2:]) for t in (q, k, v, g, beta)]
        fla = self.fla_rec
        self.add(
            "recurrent",
            f"B={B} Q={Q} state={str(sd)[6:]}",
            "fla-fused_recurrent",
            lambda: fla(
                *flat,
                scale=sh.scale,
                initial_state=h0,
                output_final_state=True,
                use_qk_l2norm_in_kernel=True,
                state_v_first=True,
                cu_seqlens=cu,
            ),
            2 * sbytes + act,
            B=B,
            Q=Q,
            state_dtype=str(sd)[6:],
        )

    # ---------------------------------------------------------------- chunked prefill
    def chunked(self, sd: torch.dtype, N: int, L: int) -> None:
        dev = self.device
        sh = self.shape
        HK, HV, DK, DV, SCALE = sh.hk, sh.hv, sh.dk, sh.dv, sh.scale
        gen = torch.Generator(device=dev).manual_seed(7 * N + L)
        T = N * L
        q = torch.randn(T, HK, DK, generator=gen, device=dev).to(BF16)
        k = torch.randn(T, HK, DK, generator=gen, device=dev).to(BF16)
        v = torch.randn(T, HV, DV, generator=gen, device=dev).to(BF16)
        g = -torch.rand(T, HV, generator=gen, device=dev) * 0.5
        beta = torch.rand(T, HV, generator=gen, device=dev)
        cu = torch.arange(0, T + 1, L, device=dev, dtype=torch.int32)
        S = 2 * N
        idx = torch.randperm(S, generator=gen, device=dev)[:N].to(torch.int32)
        has = torch.arange(N, device=dev) % 2 == 1
        pool = (torch.randn(S, HV, DV, DK, generator=gen, device=dev) * 0.5).to(sd)
        case = f"{N}x{L} state={str(sd)[6:]}"
        tri = get_impl("gated_delta_rule_chunked", "triton", dev, BF16)
        ref = get_impl("gated_delta_rule_chunked", "reference", dev, BF16)
        ref32 = get_impl("gated_delta_rule_chunked", "reference", dev, FP32)
        if tri is None or ref32 is None:
            return
        pool_t, pool_r = pool.clone(), pool.float()
        o_t = tri(q, k, v, g, beta, cu, pool_t, idx, has, SCALE, True, 64)
        o_r = ref32(q.float(), k.float(), v.float(), g, beta, cu, pool_r, idx, has, SCALE, True, 64)
        self.check("chunked_out", sd, case, o_t, o_r)
        self.check("chunked_state", sd, case, pool_t[idx.long()].float(), pool_r[idx.long()])
        del pool_r
        sbytes = HV * DV * DK * pool.element_size() * N
        nbytes = 2 * sbytes + T * (2 * HK * DK * 2 + 2 * HV * DV * 2 + 2 * HV * 4)
        # matmul FLOPs of the chunked form (chunk C=64): per token and value head ~ 6*Dk*Dv + 8*C*D
        flops = T * HV * (6 * DK * DV + 8 * 64 * DK)
        extra = dict(N=N, L=L, state_dtype=str(sd)[6:])
        self.add(
            "chunked",
            case,
            "triton",
            lambda: tri(q, k, v, g, beta, cu, pool, idx, has, SCALE, True, 64),
            nbytes,
            flops,
            graph=False,
            **extra,
        )
        if self.fla_chunk is not None:
            h0 = pool[idx.long()].float()  # dense float32 initial states, as our wrapper hands fla
            cu64 = cu.long()
            fla = self.fla_chunk
            self.add(
                "chunked",
                case,
                "fla-chunk",
                lambda: fla(
                    q[None],
                    k[None],
                    v[None],
                    g[None],
                    beta[None],
                    scale=SCALE,
                    initial_state=h0,
                    output_final_state=True,
                    use_qk_l2norm_in_kernel=True,
                    state_v_first=True,
                    cu_seqlens=cu64,
                ),
                nbytes,
                flops,
                graph=False,
                **extra,
            )
        if ref is not None and not self.quick:
            self.add(
                "chunked",
                case,
                "reference",
                lambda: ref(q, k, v, g, beta, cu, pool, idx, has, SCALE, True, 64),
                nbytes,
                flops,
                graph=False,
                **extra,
            )

    # ---------------------------------------------------------------- conv1d, gating (gdn_conv.py)
    def conv_update(self, B: int, Q: int) -> None:
        gdn_conv.conv_update(self, B, Q)

    def conv_varlen(self, N: int, L: int) -> None:
        gdn_conv.conv_varlen(self, N, L)

    def gating(self, T: int) -> None:
        gdn_conv.gating(self, T)


def summarize(rows: list[dict]) -> list[dict]:
    """Goal figures: verify(k=3) / decode time at the same batch, and triton vs fla prefill."""
    t = {(r["bench"], r["case"], r["impl"]): r.get("ms") for r in rows}
    out = []
    for r in rows:
        verify_impls = (
            "triton",
            "triton-verify",
            "triton-verify-a1",
            "triton-verify-bv8",
            "fla-fused_recurrent",
        )
        if r["bench"] in ("recurrent", "verify") and r["Q"] > 1 and r["impl"] in verify_impls:
            base = t.get(("recurrent", r["case"].replace(f"Q={r['Q']}", "Q=1"), "triton"))
            if base and r.get("ms"):
                out.append(
                    {
                        "goal": f"verify k={r['Q'] - 1} / decode" + (" <= 1.3" if r["Q"] == 4 else ""),
                        "case": r["case"],
                        "impl": r["impl"],
                        "value": r["ms"] / base,
                    }
                )
        if r["bench"] == "chunked" and r["impl"] == "triton":
            fla = t.get(("chunked", r["case"], "fla-chunk"))
            if fla and r.get("ms"):
                out.append(
                    {
                        "goal": "prefill triton / fla <= 1.0",
                        "case": r["case"],
                        "impl": "triton",
                        "value": r["ms"] / fla,
                    }
                )
    return out


def sweep(run: GdnRun) -> list[dict]:
    """Block size / warps of the recurrent and verify kernels (fp32 state), to choose the launch heuristic."""
    sh, dev = run.shape, run.device
    from atom_kernels.ops.gated_delta_rule import pending_width

    tri = get_impl("gated_delta_rule_recurrent", "triton", dev, BF16)
    ver = get_impl("gated_delta_rule_verify", "triton", dev, BF16)
    if tri is None:
        return []
    from atom_kernels.ops.gated_delta_rule.triton import _launch_recurrent
    from atom_kernels.ops.gated_delta_rule.triton_verify import _launch_verify, verify_launch_config

    rows = []
    for B in (64, 256):
        for Q in (1, 4):
            q = torch.randn(B, Q, sh.hk, sh.dk, device=dev).to(BF16)
            k = torch.randn(B, Q, sh.hk, sh.dk, device=dev).to(BF16)
            v = torch.randn(B, Q, sh.hv, sh.dv, device=dev).to(BF16)
            g = -torch.rand(B, Q, sh.hv, device=dev) * 0.5
            beta = torch.rand(B, Q, sh.hv, device=dev)
            idx = torch.arange(B, device=dev, dtype=torch.int32)
            pool = torch.randn(B, sh.hv, sh.dv, sh.dk, device=dev)
            nbytes = 2 * B * sh.hv * sh.dv * sh.dk * 4
            for bv, nw in SWEEP_CONFIGS:
                ms, mode = run.time(
                    lambda bv=bv, nw=nw, q=q, k=k, v=v, g=g, beta=beta, pool=pool, idx=idx: _launch_recurrent(
                        q, k, v, g, beta, pool, idx, sh.scale, True, block_v=bv, num_warps=nw
                    ),
                    graph=True,
                )
                rows.append(
                    common.row(
                        bench="sweep",
                        case=f"B={B} Q={Q}",
                        impl=f"BV={bv} w={nw}",
                        ms=ms,
                        ceil=run.ceil,
                        nbytes=nbytes,
                        timing=mode,
                    )
                )
            if ver is not None:  # the deferred-commit op, every pending token committed
                vidx = idx
                pend = torch.randn(B, Q, pending_width(sh.hk, sh.dk, sh.hv, sh.dv), device=dev) * 0.1
                na = torch.full((B,), Q, device=dev, dtype=torch.int32)
                for sd in (FP32, BF16):
                    vpool = pool.to(sd)
                    vbytes = 2 * vpool[:B].numel() * vpool.element_size() + 2 * Q * B * pend.shape[-1] * 4
                    for bv, nw, regs in VERIFY_SWEEP_CONFIGS:
                        launch = verify_launch_config(B, sh.hv, sh.dv, Q)._replace(
                            block_v=bv, num_warps=nw, max_registers=regs
                        )
                        ms, mode = run.time(
                            lambda launch=launch, q=q, k=k, v=v, g=g, beta=beta, vpool=vpool, pend=pend, vidx=vidx, na=na: (
                                _launch_verify(
                                    q, k, v, g, beta, vpool, pend, vidx, na, sh.scale, True, launch=launch
                                )
                            ),
                            graph=True,
                        )
                        rows.append(
                            common.row(
                                bench="sweep",
                                case=f"verify B={B} Q={Q} state={str(sd)[6:]}",
                                impl=f"BV={bv} w={nw} maxnreg={regs}",
                                ms=ms,
                                ceil=run.ceil,
                                nbytes=vbytes,
                                timing=mode,
                            )
                        )
                    del vpool
                del pend
            del pool
            torch.cuda.empty_cache()
    best = {}
    for r in rows:
        if r.get("ms") and (r["case"] not in best or r["ms"] < best[r["case"]]["ms"]):
            best[r["case"]] = r
    common.print_table(list(best.values()), ["case", "impl", "ms", "frac_copy"])
    return rows


def fused_main(run: GdnRun, vllm_dir: Path) -> None:
    """``--fused``: the fused-gating cases, ``<out>/gdn_fused.json``, a table; exits (1 if a check failed)."""
    vllm = gdn_harness.load_vllm_fla(vllm_dir)
    run.rep_ms = 10  # a short budget: ~11 graph replays of ~10 ms per timing
    batches = gdn_harness.FUSED_BATCHES if run.timed else run.shape.batches
    for Q in gdn_harness.FUSED_QS:
        for B in batches:
            run.guarded(gdn_harness.fused_case, run, vllm, B, Q)
    summary = gdn_harness.fused_summary(run.rows)
    payload = {"env": common.environment(), "ceilings": run.ceil, "shape": {**run.shape.__dict__},
               "vllm": None if vllm is None else vllm.version, "rows": run.rows, "checks": run.checks,
               "summary": summary}  # fmt: skip
    common.write_json(run.out / "gdn_fused.json", payload)
    common.print_table(run.rows, ["case", "impl", "ms", "frac_copy", "timing"])
    print()
    cols = ["case", "vllm-fused_us", "vllm-packed_decode_us", "ours-unfused_us", "ours-fused_us"]
    common.print_table(summary, [*cols, "vllm/fused", "unfused/fused"])
    bad = [c for c in run.checks if not c["ok"]]
    print(f"\nchecks: {len(run.checks) - len(bad)} ok, {len(bad)} failed")
    for c in run.checks:
        print(f"  {c['what']:14s} {c['case']:20s} max abs err {c.get('max_abs_err', 0.0):.3e}")
    sys.exit(1 if run.failed else 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="fewer shapes, no reference timings")
    ap.add_argument(
        "--smoke", action="store_true", help="tiny shapes on CPU (TRITON_INTERPRET=1), no timings"
    )
    ap.add_argument("--sweep", action="store_true", help="also sweep the recurrent kernel's block sizes")
    ap.add_argument(
        "--only",
        default="",
        help="comma list of: recurrent (decode + verify), chunked, conv, gating, fla (fla's recurrent op)",
    )
    ap.add_argument("--deadline-s", type=float, default=float("inf"), help="skip cases started after this")
    ap.add_argument("--fused", action="store_true", help="only the fused-gating comparison with vLLM")
    ap.add_argument("--vllm-fla", type=Path, default=gdn_harness.VLLM_FLA_DEFAULT, help="vLLM kernel files")
    ap.add_argument("--export-vllm-fla", type=Path, default=None, help="copy vLLM's kernel files here, exit")
    args = ap.parse_args()
    if args.export_vllm_fla is not None:
        gdn_harness.export_vllm_fla(args.export_vllm_fla)
        return
    out = common.out_dir(args.out)
    if args.smoke:
        device, shape = torch.device("cpu"), SMOKE
    else:
        device, shape = common.require_cuda(), QUICK if args.quick else QWEN3_NEXT_80B
    run = GdnRun(out, device, shape, args.quick or args.smoke, TOL)
    if args.fused:
        fused_main(run, args.vllm_fla)
    parts = set(args.only.split(",")) if args.only else {"recurrent", "chunked", "conv", "gating", "fla"}
    sweep_rows: list[dict] = []

    def save() -> None:  # after every part, so a run cut short still leaves its results
        payload = {
            "env": common.environment(),
            "ceilings": run.ceil,
            "shape": {**shape.__dict__, "conv_dim": shape.conv_dim},
            "rows": run.rows,
            "checks": run.checks,
            "goals": summarize(run.rows),
            "sweep": sweep_rows,
        }
        common.write_json(out / "gdn.json", payload)

    run.deadline_s = args.deadline_s
    if "recurrent" in parts:
        for sd in (FP32, BF16):
            for B in shape.batches:
                for Q in shape.qs:
                    run.guarded(run.recurrent, sd, B, Q)
                    run.guarded(run.verify, sd, B, Q)
        save()
    if "chunked" in parts:
        for sd in (FP32, BF16):
            for N, L in shape.prefills:
                run.guarded(run.chunked, sd, N, L)
        save()
    if "conv" in parts:
        for B in shape.batches:
            for Q in shape.qs:
                run.guarded(run.conv_update, B, Q)
        for N, L in shape.prefills:
            run.guarded(run.conv_varlen, N, L)
        save()
    if "gating" in parts:
        for T in (256, 4096):
            run.guarded(run.gating, T)
        save()
    if "fla" in parts and run.timed:  # after our parts: see Run.fla_recurrent
        for sd in (FP32, BF16):
            for B in shape.batches:
                for Q in shape.qs:
                    run.guarded(run.fla_recurrent, sd, B, Q)
        save()
    if args.sweep and run.timed and time.monotonic() - run.t0 < run.deadline_s:
        sweep_rows.extend(sweep(run))
        save()
    goals = summarize(run.rows)
    if run.timed:
        common.plot_rows(
            out / "gdn.png",
            [r for r in run.rows if r["bench"] in ("recurrent", "verify", "chunked")],
            value="frac_copy",
            title="GDN (Qwen3-Next-80B TP1): fraction of measured copy bandwidth",
            xlabel="achieved bytes/s / device copy bytes/s",
        )
    cols = ["bench", "case", "impl", "ms", "gbps", "frac_copy", "tflops", "timing"]
    common.print_table(run.rows, cols)
    print()
    common.print_table(goals, ["goal", "case", "impl", "value"])
    bad = [c for c in run.checks if not c["ok"]]
    print(f"\nchecks: {len(run.checks) - len(bad)} ok, {len(bad)} failed")
    worst: dict[tuple, float] = {}
    for c in run.checks:
        key = (c["what"], c.get("state_dtype"))
        worst[key] = max(worst.get(key, 0.0), c.get("max_abs_err", 0.0) or 0.0)
    for key, err in sorted(worst.items(), key=str):
        print(f"  worst {key}: {err:.3e}")
    sys.exit(1 if run.failed else 0)


if __name__ == "__main__":
    main()
