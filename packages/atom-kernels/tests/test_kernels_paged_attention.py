"""kv_cache_write and paged_attention against dense causal attention on the gathered sequences."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from atom_kernels.testing import assert_close, gen, randn

# (what, dtype) -> (atol, rtol) against a float64 dense oracle; measured max abs error in the comments.
TOL = {
    ("attn", torch.float32): (1e-5, 1e-5),  # measured 1.6e-06
    ("attn", torch.bfloat16): (
        1.5e-2,
        1e-2,
    ),  # measured 7.8e-03 (half a bf16 ulp of |o| ~ 2: output rounding)
    ("attn_fp8", torch.float32): (1e-5, 1e-5),  # measured 7.7e-07 vs the oracle on the dequantised cache
    # e4m3 round to nearest: rel. error <= 2^-4 for normals, abs error <= scale * 2^-10 for subnormals
    # (scales 0.02 / 0.015 here); measured 1.6e-01 at |x| ~ 4 (rel 3.7e-02).
    ("fp8_roundtrip", torch.float32): (0.02 * 2**-10, 2**-4),
}
DTYPES = [torch.float32, torch.bfloat16]
HQ, HKV, BLOCK = 8, 2, 16

# (cached prefix, new queries): prefill with cached prefix, decode, verify (1 + k), fresh prefill,
# a 1-token sequence, a verify at a block boundary and an empty slot (q_len 0) in the middle.
MIXED = [(5, 65), (256, 1), (37, 3), (0, 63), (0, 1), (29, 3), (10, 0), (0, 257)]


def dense_oracle(q, keys, values, scale):
    """float64 causal SDPA of q [L, Hq, D] (the last L positions) over keys/values [S, Hkv, D]."""
    q, keys, values = (t.double().cpu() for t in (q, keys, values))
    length, seq_len = q.shape[0], keys.shape[0]
    rep = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(rep, 1), values.repeat_interleave(rep, 1)
    allowed = torch.arange(seq_len)[None, :] <= (seq_len - length + torch.arange(length))[:, None]
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1), attn_mask=allowed, scale=scale
    )
    return o.transpose(0, 1)


def build_batch(layout, head_dim, dtype, device, cache_dtype=None, seed=0):
    """Random sequences scattered over shuffled blocks; returns everything paged_attention needs plus
    the dense per-sequence K/V (as stored, i.e. after any fp8 rounding)."""
    cache_dtype = cache_dtype or dtype
    seq_lens = [prefix + new for prefix, new in layout]
    blocks_per_seq = [-(-s // BLOCK) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks, generator=gen(seed)).tolist()
    max_blocks = max(blocks_per_seq) + 1
    tables = torch.zeros(len(layout), max_blocks, dtype=torch.int32)
    used = 0
    for n, nb in enumerate(blocks_per_seq):
        tables[n, :nb] = torch.tensor(perm[used : used + nb], dtype=torch.int32)
        used += nb
    key_cache = torch.zeros(num_blocks, BLOCK, HKV, head_dim, device=device).to(cache_dtype)
    value_cache = torch.zeros_like(key_cache)
    keys = [
        randn(s, HKV, head_dim, seed=seed + 10 + n, dtype=dtype, device=device)
        for n, s in enumerate(seq_lens)
    ]
    values = [
        randn(s, HKV, head_dim, seed=seed + 50 + n, dtype=dtype, device=device)
        for n, s in enumerate(seq_lens)
    ]
    q_lens = [new for _, new in layout]
    q = randn(sum(q_lens), HQ, head_dim, seed=seed + 1, dtype=dtype, device=device)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    slot_mapping = torch.cat(
        [
            tables[n, torch.arange(s) // BLOCK].long() * BLOCK + torch.arange(s) % BLOCK
            for n, s in enumerate(seq_lens)
        ]
    ).to(device)
    return dict(
        q=q,
        key_cache=key_cache,
        value_cache=value_cache,
        block_tables=tables.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=qsl,
        keys=keys,
        values=values,
        slot_mapping=slot_mapping,
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 256])
def test_mixed_batch_matches_dense(impl, tol, device, dtype, head_dim):
    write, attend = impl("kv_cache_write", dtype), impl("paged_attention", dtype)
    b = build_batch(MIXED, head_dim, dtype, device, seed=head_dim)
    write(torch.cat(b["keys"]), torch.cat(b["values"]), b["key_cache"], b["value_cache"], b["slot_mapping"])
    scale = head_dim**-0.5
    out = attend(
        b["q"],
        b["key_cache"],
        b["value_cache"],
        b["block_tables"],
        b["seq_lens"],
        b["query_start_loc"],
        scale,
    )
    assert out.shape == b["q"].shape and out.dtype == dtype
    qsl = b["query_start_loc"].tolist()
    for n in range(len(MIXED)):
        s, e = qsl[n], qsl[n + 1]
        expected = dense_oracle(b["q"][s:e], b["keys"][n], b["values"][n], scale)
        assert_close(
            out[s:e], expected, tol("attn", dtype), f"paged vs dense, seq {n} {MIXED[n]} D={head_dim}"
        )


@pytest.mark.parametrize("pad", [0, 256, 40], ids=["contiguous", "row_aligned_page", "unaligned_page"])
def test_cache_views_with_a_block_stride(impl, device, pad):
    """Caches that are views with a per-block stride of their own (vLLM's hybrid pages, padded to the GDN
    state's page) give the same outputs as contiguous copies."""
    attend = impl("paged_attention", torch.float32)
    b = build_batch(MIXED, 64, torch.float32, device, seed=3)
    num_blocks, per_block = b["key_cache"].shape[0], BLOCK * HKV * 64
    pages = torch.full((num_blocks, 2 * per_block + pad), float("nan"), device=device)
    key_view = pages[:, :per_block].view(num_blocks, BLOCK, HKV, 64)
    value_view = pages[:, per_block : 2 * per_block].view(num_blocks, BLOCK, HKV, 64)
    key_view.copy_(b["key_cache"])
    value_view.copy_(b["value_cache"])
    args = (b["block_tables"], b["seq_lens"], b["query_start_loc"], 64**-0.5)
    expected = attend(b["q"], b["key_cache"], b["value_cache"], *args)
    assert torch.equal(attend(b["q"], key_view, value_view, *args), expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pad", [0, 96], ids=["packed_pages", "padded_pages"])
def test_interleaved_key_value_views(impl, device, dtype, pad):
    """vLLM's attention page ``[block, token, head, K | V]``: key and value caches are views of one memory,
    each token's keys and values in one row (optionally with a per-block padding); the outputs equal
    those of contiguous copies."""
    attend = impl("paged_attention", dtype)
    b = build_batch(MIXED, 64, dtype, device, seed=5)
    num_blocks = b["key_cache"].shape[0]
    pages = torch.full((num_blocks, BLOCK * HKV * 128 + pad), float("nan"), device=device).to(dtype)
    kv = pages[:, : BLOCK * HKV * 128].view(num_blocks, BLOCK, HKV, 128)
    key_view, value_view = kv[..., :64], kv[..., 64:]
    key_view.copy_(b["key_cache"])
    value_view.copy_(b["value_cache"])
    args = (b["block_tables"], b["seq_lens"], b["query_start_loc"], 64**-0.5)
    expected = attend(b["q"], b["key_cache"], b["value_cache"], *args)
    assert torch.equal(attend(b["q"], key_view, value_view, *args), expected)


def test_kv_cache_write_skips_negative_slots_and_accepts_views(impl, device):
    write = impl("kv_cache_write", torch.float32)
    kv = torch.zeros(2, 4, BLOCK, HKV, 8, device=device)  # vLLM-style [2, B, block, H, D]; pass views
    k, v = (
        randn(3, HKV, 8, seed=1, dtype=torch.float32, device=device),
        randn(3, HKV, 8, seed=2, dtype=torch.float32, device=device),
    )
    write(k, v, kv[0], kv[1], torch.tensor([17, -1, 63], device=device))
    assert torch.equal(kv[0, 1, 1], k[0]) and torch.equal(kv[1, 3, 15], v[2])
    assert int((kv != 0).any(-1).any(-1).sum()) == 4, "exactly two slots in each cache written"


def test_fp8_cache(impl, tol, device):
    write, attend = impl("kv_cache_write", torch.float32), impl("paged_attention", torch.float32)
    layout = [(20, 3), (0, 17), (40, 1)]
    b = build_batch(layout, 64, torch.float32, device, cache_dtype=torch.float8_e4m3fn, seed=7)
    k_scale = torch.tensor([0.02], device=device)
    v_scale = 0.015
    keys, values = torch.cat(b["keys"]), torch.cat(b["values"])
    write(keys, values, b["key_cache"], b["value_cache"], b["slot_mapping"], k_scale=k_scale, v_scale=v_scale)
    slots = b["slot_mapping"]
    stored_k = b["key_cache"][slots // BLOCK, slots % BLOCK].float() * 0.02
    stored_v = b["value_cache"][slots // BLOCK, slots % BLOCK].float() * v_scale
    assert_close(stored_k, keys, tol("fp8_roundtrip", torch.float32), "fp8 K round trip")
    assert_close(stored_v, values, tol("fp8_roundtrip", torch.float32), "fp8 V round trip")
    out = attend(
        b["q"],
        b["key_cache"],
        b["value_cache"],
        b["block_tables"],
        b["seq_lens"],
        b["query_start_loc"],
        0.125,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    lens = [p + n for p, n in layout]
    qsl, offs = b["query_start_loc"].tolist(), [0, *torch.tensor(lens).cumsum(0).tolist()]
    for n in range(len(layout)):
        s, e = qsl[n], qsl[n + 1]
        expected = dense_oracle(
            b["q"][s:e], stored_k[offs[n] : offs[n + 1]], stored_v[offs[n] : offs[n + 1]], 0.125
        )
        assert_close(out[s:e], expected, tol("attn_fp8", torch.float32), f"fp8 paged vs dense seq {n}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_out_is_written_in_place_padding_rows_zeroed(impl, device, dtype):
    """``out=`` (NaN-filled, with padding rows past ``query_start_loc[N]`` as a padded batch has) receives
    exactly the returned attention, the padding rows as zeros, and is the tensor returned."""
    write, attend = impl("kv_cache_write", dtype), impl("paged_attention", dtype)
    b = build_batch(MIXED[:4], 64, dtype, device, seed=5)
    write(torch.cat(b["keys"]), torch.cat(b["values"]), b["key_cache"], b["value_cache"], b["slot_mapping"])
    args = (b["key_cache"], b["value_cache"], b["block_tables"], b["seq_lens"], b["query_start_loc"], 0.125)
    t = b["q"].shape[0]
    q = torch.cat([b["q"], randn(5, HQ, 64, seed=9, dtype=dtype, device=device)])  # 5 padding rows
    expected = attend(b["q"], *args)
    out = torch.full_like(q, float("nan"))
    got = attend(q, *args, out=out)
    assert got is out
    assert torch.equal(out[:t], expected) and bool((out[t:] == 0).all())
    with pytest.raises(ValueError, match="out must have dtype"):
        attend(q, *args, out=out.to(torch.float16))


def test_bad_inputs(impl, device):
    write, attend = impl("kv_cache_write", torch.float32), impl("paged_attention", torch.float32)
    b = build_batch([(3, 2), (0, 4)], 32, torch.float32, device)
    args = [b[n] for n in ("q", "key_cache", "value_cache", "block_tables", "seq_lens", "query_start_loc")]
    with pytest.raises(ValueError, match=r"query_start_loc must have shape \[N\+1=3\]"):
        attend(*args[:5], args[5][:2], 0.1)
    with pytest.raises(ValueError, match="block_tables must have dtype int32"):
        attend(*args[:3], args[3].long(), *args[4:], 0.1)
    with pytest.raises(ValueError, match=r"Hq=8 must be a multiple of the KV heads Hkv=3"):
        cache = torch.zeros(4, BLOCK, 3, 32, device=device)
        attend(args[0], cache, cache, *args[3:], 0.1)
    with pytest.raises(ValueError, match="key_cache must have q's dtype torch.float32"):
        attend(args[0], args[1].bfloat16(), args[2].bfloat16(), *args[3:], 0.1)
    with pytest.raises(ValueError, match="k_scale must hold one element"):
        attend(*args, 0.1, k_scale=torch.ones(2, device=device))
    if device.type == "cpu":
        with pytest.raises(ValueError, match=r"seq_lens\[1\]=2 is shorter than its 4 queries"):
            attend(*args[:4], torch.tensor([5, 2], dtype=torch.int32), args[5], 0.1)
    k = torch.randn(2, HKV, 32, device=device)
    with pytest.raises(ValueError, match="slot_mapping must have dtype int64"):
        write(k, k, args[1], args[2], torch.zeros(2, dtype=torch.int32, device=device))
    with pytest.raises(
        ValueError, match=r"value_cache must have shape \[B=\d+, block_size=16, Hkv=2, D=32\]"
    ):
        write(k, k, args[1], args[2][:, :8], torch.zeros(2, dtype=torch.int64, device=device))
