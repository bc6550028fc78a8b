"""Experiment: the cpu backend's GDN decode / verify ops on a float32 vs a bf16 state pool (bf16 tokens, bundled
shapes, one thread). Kept in git history only."""

import time

import torch
from atom_kernels.ops.gated_delta_rule import cpu as gdr

torch.set_num_threads(1)
HK, HV, D = 2, 4, 128


def case(n, k, ssm_dtype):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(n, 1 + k, HK, D, generator=g).bfloat16()
    kk = torch.randn(n, 1 + k, HK, D, generator=g).bfloat16()
    v = torch.randn(n, 1 + k, HV, D, generator=g).bfloat16()
    a = torch.randn(n, 1 + k, HV, generator=g).bfloat16()
    b = torch.randn(n, 1 + k, HV, generator=g).bfloat16()
    A_log = torch.randn(HV, generator=g)
    dt = torch.randn(HV, generator=g).bfloat16()
    ssm = (torch.randn(2 * n, HV, D, D, generator=g) * 0.05).to(ssm_dtype)
    idx = torch.arange(0, 2 * n, 2, dtype=torch.int32)
    from atom_kernels.ops.gated_delta_rule import pending_width

    P = pending_width(HK, D, HV, D)
    pend = torch.zeros(2 * n, 1 + k, P)
    pos = torch.zeros(2 * n, 1, dtype=torch.int32)
    nc = torch.ones(n, dtype=torch.int32)
    if k == 0:
        return lambda: gdr.gated_delta_rule_recurrent(
            q, kk, v, a, b, ssm, idx, D**-0.5, True, A_log=A_log, dt_bias=dt
        )
    return lambda: gdr.gated_delta_rule_verify(
        q, kk, v, a, b, ssm, pend, idx, nc, D**-0.5, True, A_log=A_log, dt_bias=dt, pending_pos=pos
    )


for n in (1, 16):
    for k in (0, 1):
        fs = {dt: case(n, k, dt) for dt in (torch.float32, torch.bfloat16)}
        t = {dt: [] for dt in fs}
        for _ in range(3):
            for f in fs.values():
                f()
        for _ in range(41):
            for dt, f in fs.items():
                t0 = time.process_time_ns()
                f()
                t[dt].append(time.process_time_ns() - t0)
        med = {str(dt).split(".")[-1]: sorted(v)[len(v) // 2] / 1e3 for dt, v in t.items()}
        print(
            f"N={n} {'decode' if k == 0 else 'verify k=1'}: us per call (median of 41, CPU time, 1 thread)",
            med,
        )
