"""The cpu backend's C paged attention (``paged_attention.cpu_native``) against the reference and the
torch group path.

Ragged batches of decode and verify rows (q_len 1 .. 8 and 16, an empty sequence, a sequence past
``MAX_Q`` that the torch path takes in the same call), GQA groups 1, 2 and 4, block sizes 16 and 5, float32,
bf16 and e4m3 caches (with scales), caches as contiguous tensors, as views with a per-block stride of
their own and as vLLM's shared ``[block, token, head, K | V]`` page; padding rows past
``query_start_loc[N]``; 1 or 2 threads.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from atom_kernels.ops.paged_attention import cpu, cpu_native
from atom_kernels.ops.paged_attention import reference as ref
from atom_kernels.testing import assert_close, gen, randn

# (what, cache dtype) -> (atol, rtol) of the C pass against the reference (float32 softmax in one pass,
# torch's exponential) and against the torch group path, max abs error over every case of the grid below.
TOL = {
    ("out", torch.float32): (3e-6, 3e-6),  # measured 1.1e-06 (online softmax, sum order, e^x)
    ("out", torch.bfloat16): (5e-4, 8e-3),  # measured 1.2e-04: one bf16 ulp where a float32 sum rounds
    ("out", torch.float8_e4m3fn): (3e-6, 3e-6),  # measured 9.5e-07: the dequantised rows are exact
}

pytestmark = pytest.mark.skipif(cpu_native.load() is None, reason="no C compiler builds the pass")
CPU = torch.device("cpu")
HKV, D = 2, 64
# (cached prefix, new queries): decodes and verifies on ragged contexts, one empty sequence, one
# sequence at MAX_Q queries and one past it (the torch path's, in the same call).
LAYOUT = [(40, 1), (0, 1), (7, 2), (100, 3), (31, 4), (0, 0), (64, 5), (3, 6), (17, 7), (200, 8), (5, 16)]
LONG = (9, 17)


def _batch(layout, block_size, group, dtype, cache_dtype, page, seed=0):
    """A batch with its caches filled through the reference's kv_cache_write; ``page``: ``contiguous``,
    ``strided`` (each cache a view with a padded per-block stride) or ``shared`` (one memory,
    ``[block, token, head, K | V]`` rows, padded blocks)."""
    seq_lens = [p + n for p, n in layout]
    per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(per_seq) + 2
    perm = torch.randperm(num_blocks, generator=gen(seed)).tolist()
    tables = torch.full((len(layout), max(per_seq) + 1), -1, dtype=torch.int32)
    used = 0
    for n, nb in enumerate(per_seq):
        tables[n, :nb] = torch.tensor(perm[used : used + nb], dtype=torch.int32)
        used += nb
    shape = (num_blocks, block_size, HKV, D)
    width = block_size * HKV * D
    if page == "contiguous":
        key_cache, value_cache = torch.zeros(shape, dtype=cache_dtype), torch.zeros(shape, dtype=cache_dtype)
    elif page == "strided":
        pages = torch.zeros(num_blocks, 2 * width + 40, dtype=cache_dtype)
        key_cache, value_cache = pages[:, :width].view(shape), pages[:, width : 2 * width].view(shape)
    else:
        pages = torch.zeros(num_blocks, 2 * width + 96, dtype=cache_dtype)
        kv = pages[:, : 2 * width].view(num_blocks, block_size, HKV, 2 * D)
        key_cache, value_cache = kv[..., :D], kv[..., D:]
    k = randn(sum(seq_lens), HKV, D, seed=seed + 1, dtype=dtype, device=CPU)
    v = randn(sum(seq_lens), HKV, D, seed=seed + 2, dtype=dtype, device=CPU)
    slots = torch.cat(
        [tables[n, torch.arange(s) // block_size].long() * block_size + torch.arange(s) % block_size
         for n, s in enumerate(seq_lens)]
    )  # fmt: skip
    fp8 = cache_dtype == torch.float8_e4m3fn
    scales = (torch.tensor([0.02]), 0.015) if fp8 else (None, None)
    ref.kv_cache_write(k, v, key_cache, value_cache, slots, *scales)
    q_lens = [n for _, n in layout]
    q = randn(sum(q_lens), group * HKV, D, seed=seed + 3, dtype=dtype, device=CPU)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return (
        q,
        key_cache,
        value_cache,
        tables,
        torch.tensor(seq_lens, dtype=torch.int32),
        qsl,
        D**-0.5,
    ), scales


def _native(args, scales, out=None):
    with mock.patch.object(cpu_native, "attend", wraps=cpu_native.attend) as spy:
        got = cpu.paged_attention(*args, *scales, out=out)
    assert spy.call_count == 1, "the C pass did not run"
    return got


def _torch(args, scales):
    with mock.patch.object(cpu_native, "usable", lambda *_: False):
        return cpu.paged_attention(*args, *scales)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("page", ["contiguous", "strided", "shared"])
@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize(
    ("dtype", "cache_dtype"),
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float8_e4m3fn)],
    ids=["f32", "bf16", "fp8"],
)
def test_native_equals_reference_and_torch(dtype, cache_dtype, group, block_size, page, threads):
    args, scales = _batch([*LAYOUT, LONG], block_size, group, dtype, cache_dtype, page, seed=block_size)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = _native(args, scales)
        expected, torch_path = ref.paged_attention(*args, *scales), _torch(args, scales)
    finally:
        torch.set_num_threads(before)
    tol = TOL["out", cache_dtype]
    assert got.dtype == dtype
    assert_close(got, expected, tol, f"C vs reference, group {group}, block {block_size}, {page}")
    assert_close(got, torch_path, tol, f"C vs torch path, group {group}, block {block_size}, {page}")
    s, e = args[5][-2:].tolist()  # the sequence past MAX_Q: the torch path's rows, bit for bit
    assert torch.equal(got[s:e], torch_path[s:e])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_fills_out_in_place_and_zeroes_padding_rows(dtype):
    """``out=`` (NaN-filled, 3 padding rows past ``query_start_loc[N]``): the reference's rows, the
    padding rows zero, the same tensor returned; q and out as strided views."""
    args, scales = _batch(LAYOUT[:5], 16, 2, dtype, dtype, "contiguous", seed=4)
    q = args[0]
    t = q.shape[0]
    wide = torch.full((t + 3, q.shape[1], 2 * D), float("nan"), dtype=dtype)
    wide[:t, :, D:] = q
    q_view = wide[:, :, D:]  # row-strided q with padding rows
    out_wide = torch.full_like(wide, float("nan"))
    out = out_wide[:, :, :D]
    got = _native((q_view, *args[1:]), scales, out=out)
    assert got is out
    assert_close(out[:t], ref.paged_attention(*args, *scales), TOL["out", dtype], "C out= vs reference")
    assert bool((out[t:] == 0).all()) and bool(out_wide[..., D:].isnan().all())


def test_native_rejects_bad_indices():
    args, scales = _batch([(10, 2), (3, 1)], 16, 2, torch.float32, torch.float32, "contiguous")
    q, kc, vc, tables, lens, qsl, scale = args
    with pytest.raises(ValueError, match=r"seq_lens\[1\]=0 is shorter than its 1 queries"):
        _native((q, kc, vc, tables, torch.tensor([12, 0], dtype=torch.int32), qsl, scale), scales)
    bad = tables.clone()
    bad[0, 0] = kc.shape[0]  # a block id past the cache
    with pytest.raises(ValueError, match="blocks outside the cache"):
        _native((q, kc, vc, bad, lens, qsl, scale), scales)
