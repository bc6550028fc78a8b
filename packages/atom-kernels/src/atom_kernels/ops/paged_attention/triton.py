"""Triton paged KV cache: ``kv_cache_write`` and ``paged_attention`` (one kernel family for prefill chunks,
plain decode and multi-token verification).

Layout of the work (see docs/kernel-api.md, ``paged_attention``):

- One program handles one *query block* (``BLOCK_Q`` consecutive query tokens of one sequence) for ALL
  query heads of one KV head (GQA group of ``G = Hq // Hkv`` heads), so every K/V tile is read once per
  group and used by ``BLOCK_Q * G`` query rows (row ``r`` = token ``r // G``, head ``r % G``).
- Query blocks of a flat varlen batch are enumerated without a host sync: sequence ``n`` owns global
  blocks ``[qsl[n] // BLOCK_Q + n, qsl[n + 1] // BLOCK_Q + n + 1)`` (an upper bound on its
  ``cdiv(q_len, BLOCK_Q)``; surplus blocks exit at once); a program finds its sequence by binary search.
- Causal masking is by position: query ``i`` of a sequence sits at ``seq_len - q_len + i`` and sees keys
  ``[0, position]``; a block only walks keys up to its last query's position.
- Split-KV (flash-decoding): with ``num_splits > 1`` each program covers one contiguous slice of the
  keys and writes a normalised partial output and its log-sum-exp (base 2); a second kernel merges them.
  The host picks the split count from shapes only (no device sync, CUDA-graph safe).
- FP8 caches: K/V tiles are widened to the query dtype (exact), ``k_scale`` folds into the scores and
  ``v_scale`` into the output.

``kv_cache_write``: one program per token writes all of its KV heads for K and V (negative slots are
padding and are skipped). FP8 caches quantise as the reference does, ``clamp(x / scale, -448, 448)``
rounded to nearest-even e4m3, with per-tensor float32 scales read from device memory.

Value checks that need the data on the host (slot ranges, ``seq_lens >= q_len``) run only for CPU
tensors (Triton's interpreter): on a GPU they would synchronise and break CUDA-graph capture.
Only ``tl`` primitives are used (no inline PTX), so the kernels also compile for ROCm.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_kernels.ops._fp8_math import scale_tensor
from atom_kernels.ops._pdl import launch_options, pdl_enter
from atom_kernels.ops.paged_attention.checks import (
    check_kv_cache_write,
    check_paged_attention,
    check_paged_attention_values,
    check_slot_mapping_values,
)

LOG2E = 1.4426950408889634


@triton.jit
def _find_seq(qsl_ptr, num_seqs, qb, BLOCK_Q: tl.constexpr):
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
        if first <= qb:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _paged_attn_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    qsl_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    k_scale_ptr,
    v_scale_ptr,
    qk_scale,
    num_seqs,
    num_tokens,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_ot,
    stride_oh,
    G: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    KV_BLOCK: tl.constexpr,
    num_splits,
    SPLIT: tl.constexpr,
    HAS_SCALES: tl.constexpr,
    PREC: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)  # first: wait for the previous kernel (PDL launches)
    qb = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    num_hq = tl.num_programs(1) * G

    if (qb == tl.num_programs(0) - 1) & (kvh == 0) & (split == 0):
        # padding rows past query_start_loc[N] (CUDA-graph batches) are zero, as in the reference
        row_elems = num_hq * HEAD_D
        offs_z = tl.arange(0, 1024)
        for z0 in range(tl.load(qsl_ptr + num_seqs).to(tl.int64) * row_elems, num_tokens * row_elems, 1024):
            zi = z0 + offs_z
            tl.store(
                out_ptr + zi, tl.zeros([1024], out_ptr.dtype.element_ty), mask=zi < num_tokens * row_elems
            )
    seq = _find_seq(qsl_ptr, num_seqs, qb, BLOCK_Q)
    q_first = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_first
    local_block = qb - (q_first // BLOCK_Q + seq)
    q_tok0 = local_block * BLOCK_Q
    if q_tok0 >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx0 = seq_len - q_len  # position of this sequence's first query token

    rows = tl.arange(0, BLOCK_M)
    row_tok = q_tok0 + rows // G
    row_head = kvh * G + rows % G
    row_ok = (rows < BLOCK_Q * G) & (row_tok < q_len)
    row_pos = ctx0 + row_tok
    offs_d = tl.arange(0, HEAD_D)

    q_ptrs = (
        q_ptr + (q_first + row_tok)[:, None] * stride_qt + row_head[:, None] * stride_qh + offs_d[None, :]
    )
    q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)

    # keys this block needs: [0, last query position]; this split's slice of them
    kv_end = tl.minimum(seq_len, ctx0 + q_tok0 + BLOCK_Q)
    if not SPLIT:
        lo = 0
        hi = kv_end
    else:
        per_split = tl.cdiv(tl.cdiv(kv_end, num_splits), BLOCK_N) * BLOCK_N
        lo = split * per_split
        hi = tl.minimum(lo + per_split, kv_end)

    scale = qk_scale
    if HAS_SCALES:
        scale = scale * tl.load(k_scale_ptr)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_D], tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi
        phys = tl.load(bt_row + offs_n // KV_BLOCK, mask=n_ok, other=0).to(tl.int64)
        slot_in = offs_n % KV_BLOCK
        k_off = phys * stride_kb + slot_in * stride_ks + kvh * stride_kh
        v_off = phys * stride_vb + slot_in * stride_vs + kvh * stride_vh
        kt = tl.load(k_cache_ptr + k_off[None, :] + offs_d[:, None], mask=n_ok[None, :], other=0.0)
        s = tl.dot(q, kt.to(q.dtype), input_precision=PREC) * scale
        causal = (offs_n[None, :] <= row_pos[:, None]) & n_ok[None, :]
        s = tl.where(causal, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + v_off[:, None] + offs_d[None, :], mask=n_ok[:, None], other=0.0)
        acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc * alpha[:, None], input_precision=PREC)
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    if HAS_SCALES:
        o = o * tl.load(v_scale_ptr)
    tok = q_first + row_tok
    if not SPLIT:
        o_ptrs = out_ptr + tok[:, None] * stride_ot + row_head[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
        base = (split * num_tokens + tok).to(tl.int64) * num_hq + row_head
        tl.store(part_lse_ptr + base, lse, mask=row_ok)
        if lo < hi:
            tl.store(part_out_ptr + base[:, None] * HEAD_D + offs_d[None, :], o, mask=row_ok[:, None])


@triton.jit
def _merge_splits_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    end_ptr,
    num_tokens,
    num_hq,
    stride_ot,
    stride_oh,
    NUM_SPLITS: tl.constexpr,
    SPLITS_P2: tl.constexpr,
    HEAD_D: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)  # first: wait for the previous kernel (PDL launches)
    t = tl.program_id(0)
    h = tl.program_id(1)
    if t >= tl.load(end_ptr):  # padding rows past query_start_loc[N]: left zero
        return
    offs_s = tl.arange(0, SPLITS_P2)
    offs_d = tl.arange(0, HEAD_D)
    s_ok = offs_s < NUM_SPLITS
    base = (offs_s * num_tokens + t).to(tl.int64) * num_hq + h
    lse = tl.load(part_lse_ptr + base, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.where(lse == float("-inf"), 0.0, tl.exp2(lse - m))
    o = tl.load(part_out_ptr + base[:, None] * HEAD_D + offs_d[None, :], mask=(w > 0.0)[:, None], other=0.0)
    o = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty))


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132


def _floor_pow2(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def plan(
    num_tokens: int,
    num_seqs: int,
    num_kv_heads: int,
    group: int,
    head_d: int,
    elem_bytes: int,
    max_ctx: int,
    device: torch.device,
    config: dict | None = None,
) -> dict:
    """Launch parameters from shapes alone (no device sync): query block, tiles, warps, stages, splits.

    Decode/verify (few queries per sequence): one query block holds all of a sequence's queries for the
    whole GQA group. Prefill: ``BLOCK_M * D`` accumulator elements are capped (32k for 16-bit inputs,
    8k for float32) to keep the accumulator in registers. Split-KV when the query blocks alone would
    not fill the GPU twice over.
    """
    avg_q = max(1, -(-num_tokens // max(num_seqs, 1)))
    budget = 32768 if elem_bytes <= 2 else 8192
    cfg: dict = {}
    block_m = max(16, triton.next_power_of_2(avg_q * group))
    if avg_q * group <= 64 and block_m * head_d <= budget:
        cfg.update(BLOCK_Q=avg_q, BLOCK_N=64 if elem_bytes <= 2 else 32, num_stages=2)
        cfg["num_warps"] = 4 if block_m * head_d <= 8192 else 8
        if elem_bytes <= 2 and block_m == 16:
            # decode (and k=1 with 8-head groups): 3 stages measured +6-9% (H200 sweep, bench_attention)
            cfg["num_stages"] = 3
        elif elem_bytes <= 2 and block_m * head_d > 8192:
            # e.g. k=4 at D=256 (64 rows): 32-key tiles, 4 warps, 3 stages measured 1.4x over 64/8/2
            cfg.update(BLOCK_N=32, num_warps=4, num_stages=3)
    else:
        rows = max(16, min(128, budget // head_d))
        # prefill: BLOCK_N=64 measured 17% faster than 32 at 4096 tokens (H200)
        cfg.update(BLOCK_Q=max(1, rows // group), BLOCK_N=64 if elem_bytes <= 2 else 32, num_stages=2)
        cfg["num_warps"] = (
            4 if max(16, triton.next_power_of_2(cfg["BLOCK_Q"] * group)) * head_d <= 8192 else 8
        )
    if config:
        cfg.update({k: v for k, v in config.items() if k != "num_splits"})
    cfg["BLOCK_M"] = max(16, triton.next_power_of_2(cfg["BLOCK_Q"] * group))
    q_blocks = num_seqs * max(1, -(-avg_q // cfg["BLOCK_Q"])) * num_kv_heads
    target = 2 * _num_sms(device)
    splits = 1
    if q_blocks < target:
        # a power of two (few compiled variants of the merge kernel) that keeps the programs at or under
        # twice the SM count, each split >= 64 keys, at most 32 (H200 sweep at 16q/2kv heads, D = 256,
        # benchmarks/results/attention_splits_h200.json: B = 1 ctx 1k 16 splits 10 us vs 4 splits 18 us;
        # B = 64 ctx 1k-8k 2 splits beat 4 by 2-10%)
        splits = min(_floor_pow2(target // q_blocks), _floor_pow2(max(1, max_ctx // 64)), 32)
    if config and "num_splits" in config:
        splits = int(config["num_splits"])
    cfg["num_splits"] = max(1, splits)
    return cfg


def paged_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | float | None = None,
    v_scale: torch.Tensor | float | None = None,
    *,
    out: torch.Tensor | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """Triton paged attention (see the module docstring; semantics in docs/kernel-api.md).

    ``config`` overrides the launch plan (keys of :func:`plan`); benchmarks use it to sweep tiles.
    """
    check_paged_attention(
        q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, k_scale, v_scale, out
    )
    if q.device.type == "cpu":  # reads values: only under the interpreter (no device sync on a GPU)
        check_paged_attention_values(block_tables, seq_lens, query_start_loc, key_cache.shape[1], q.shape[0])
    num_tokens, num_hq, head_d = q.shape
    _, kv_block, num_hkv, _ = key_cache.shape
    num_seqs = block_tables.shape[0]
    group = num_hq // num_hkv
    if head_d & (head_d - 1):
        raise ValueError(f"paged_attention (triton): head dim D must be a power of two, got {head_d}")
    if q.stride(-1) != 1 or key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise ValueError("paged_attention (triton): q, key_cache and value_cache need a unit last-dim stride")
    # rows past query_start_loc[N] are zeroed by the kernel (no separate memset launch)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_seqs == 0:
        return out.zero_()
    has_scales = key_cache.dtype != q.dtype or k_scale is not None or v_scale is not None
    ks = scale_tensor(k_scale, q.device) if has_scales else None
    vs = scale_tensor(v_scale, q.device) if has_scales else None
    max_ctx = block_tables.shape[1] * kv_block
    cfg = plan(num_tokens, num_seqs, num_hkv, group, head_d, q.element_size(), max_ctx, q.device, config)
    splits = cfg["num_splits"]
    if splits > 1:
        part_out = torch.empty((splits, num_tokens, num_hq, head_d), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((splits, num_tokens, num_hq), dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused
    grid = (num_tokens // cfg["BLOCK_Q"] + num_seqs, num_hkv, splits)
    _paged_attn_kernel[grid](
        q,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        out,
        part_out,
        part_lse,
        ks if has_scales else out,
        vs if has_scales else out,
        float(scale) * LOG2E,
        num_seqs,
        num_tokens,
        q.stride(0),
        q.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        G=group,
        BLOCK_Q=cfg["BLOCK_Q"],
        BLOCK_M=cfg["BLOCK_M"],
        HEAD_D=head_d,
        BLOCK_N=cfg["BLOCK_N"],
        KV_BLOCK=kv_block,
        num_splits=splits,
        SPLIT=splits > 1,
        HAS_SCALES=has_scales,
        PREC="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
        **launch_options(q.device),
    )
    if splits > 1:
        _merge_splits_kernel[(num_tokens, num_hq)](
            part_out,
            part_lse,
            out,
            query_start_loc[num_seqs:],
            num_tokens,
            num_hq,
            out.stride(0),
            out.stride(1),
            NUM_SPLITS=splits,
            SPLITS_P2=triton.next_power_of_2(splits),
            HEAD_D=head_d,
            num_warps=4,
            **launch_options(part_out.device),
        )
    return out


@triton.jit
def _kv_cache_write_kernel(
    k_ptr,
    v_ptr,
    kc_ptr,
    vc_ptr,
    slot_ptr,
    k_scale_ptr,
    v_scale_ptr,
    num_heads,
    head_d,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    KV_BLOCK: tl.constexpr,
    QUANT: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)  # first: wait for the previous kernel (PDL launches)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t)
    if slot < 0:
        return
    blk = slot // KV_BLOCK
    off = slot % KV_BLOCK
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    m = (h < num_heads)[:, None] & (d < head_d)[None, :]
    k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=m, other=0.0)
    v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=m, other=0.0)
    if QUANT:
        ks = tl.load(k_scale_ptr)
        vs = tl.load(v_scale_ptr)
        k = tl.clamp(tl.div_rn(k.to(tl.float32), tl.zeros_like(k.to(tl.float32)) + ks), -448.0, 448.0)
        v = tl.clamp(
            tl.div_rn(v.to(tl.float32), tl.zeros_like(v.to(tl.float32)) + vs), -448.0, 448.0
        )  # e4m3 max
    kc = kc_ptr + blk * stride_kcb + off * stride_kcs + h[:, None] * stride_kch + d[None, :]
    vc = vc_ptr + blk * stride_vcb + off * stride_vcs + h[:, None] * stride_vch + d[None, :]
    tl.store(kc, k.to(kc_ptr.dtype.element_ty), mask=m)
    tl.store(vc, v.to(vc_ptr.dtype.element_ty), mask=m)


def kv_cache_write(
    k: torch.Tensor,
    v: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | float | None = None,
    v_scale: torch.Tensor | float | None = None,
) -> None:
    """Write ``k[t], v[t]`` into slot ``slot_mapping[t]`` of the paged caches (in place)."""
    check_kv_cache_write(k, v, key_cache, value_cache, slot_mapping, k_scale, v_scale)
    num_tokens, num_heads, head_d = k.shape
    num_blocks, kv_block = key_cache.shape[:2]
    if k.device.type == "cpu":  # reads values: only under the interpreter (no device sync on a GPU)
        check_slot_mapping_values(slot_mapping, num_blocks, kv_block)
    if num_tokens == 0:
        return
    if k.stride(-1) != 1 or v.stride(-1) != 1 or key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise ValueError("kv_cache_write (triton): k, v and the caches need a unit last-dim stride")
    quant = key_cache.dtype == torch.float8_e4m3fn
    ks = scale_tensor(k_scale, k.device) if quant else key_cache
    vs = scale_tensor(v_scale, k.device) if quant else value_cache
    _kv_cache_write_kernel[(num_tokens,)](
        k, v, key_cache, value_cache, slot_mapping, ks, vs, num_heads, head_d,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        KV_BLOCK=kv_block, QUANT=quant, BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_D=triton.next_power_of_2(head_d), num_warps=4, **launch_options(k.device),
    )  # fmt: skip
