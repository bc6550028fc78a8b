"""``copy_rows``: rows of many tensors copied at once (the GDN state slots of every layer), per backend.

The tensors are views into one byte pool per test, laid out like vLLM's Mamba state pages (rows a page
apart, a page larger than the rows, a transposed conv view); the expected pool is the same copies made row by
row in Python, so any byte written outside a destination row (page padding, another tensor) fails."""

from __future__ import annotations

import pytest
import torch
from atom_kernels.ops.copy_rows import CHUNK_BYTES, RowTable
from atom_kernels.ops.copy_rows.table import copy_unit, dense_row

SLOTS = 6


def page_pool(specs, device, slots: int = SLOTS, pad: int = 24, seed: int = 0):
    """One random byte pool of ``slots + 1`` pages and a view per ``(shape, dtype, offset)`` of ``specs``
    (row ``r`` in page ``r + 1``; ``offset`` in bytes within the page; a 2-D shape ``(W, C)`` with ``"T"``
    is returned transposed)."""
    ends = [
        off + torch.Size(shape).numel() * torch.empty(0, dtype=dt).element_size()
        for shape, dt, off, _ in specs
    ]
    page = max(ends) + pad
    page += -page % 16
    g = torch.Generator().manual_seed(seed)
    # one spare page before slot 0: a write to "row -1" (a padding pair that copied) lands inside the pool
    pool = torch.randint(0, 256, ((slots + 1) * page,), generator=g, dtype=torch.uint8).to(device)
    views = []
    for shape, dt, off, flag in specs:
        es = torch.empty(0, dtype=dt).element_size()
        assert off % es == 0 and page % es == 0
        strides, acc = [], 1
        for n in reversed(shape):
            strides.insert(0, acc)
            acc *= n
        t = torch.as_strided(pool.view(dt), (slots, *shape), (page // es, *strides), (page + off) // es)
        views.append(t.transpose(1, 2) if flag == "T" else t)
    return pool, views


# (shape, dtype, byte offset within the page, "T" = transposed view): an 80B-like slot in miniature
GDN_LIKE = [
    ((4, 40), torch.bfloat16, 0, "T"),  # conv, stored [W, C], viewed [C, W]
    ((3, 8, 8), torch.float32, 336, ""),  # ssm
    ((2, 37), torch.float32, 336 + 768, ""),  # pending (row bytes 296: 8-byte unit)
    ((1,), torch.int32, 336 + 768 + 296, ""),  # pending_pos
    ((5,), torch.bfloat16, 1414, ""),  # odd bf16 row at a 2-byte offset: 2-byte unit
    ((3,), torch.uint8, 1427, ""),  # odd byte offset: 1-byte unit
]


def expected_pool(pool, views, pairs):
    """The copies made one row at a time on a clone of the pool (views rebuilt on the clone)."""
    out = pool.clone()
    for v in views:
        w = torch.as_strided(out.view(v.dtype), v.shape, v.stride(), v.storage_offset())
        for s, d in pairs:
            if s >= 0 and d >= 0 and s != d:
                w[d] = w[s].clone()
    return out


def run(fn, pool, views, src, dst, device):
    rows = RowTable.build(views)
    expect = expected_pool(pool, views, list(zip(src, dst)))
    fn(
        rows,
        torch.tensor(src, dtype=torch.int64, device=device),
        torch.tensor(dst, dtype=torch.int64, device=device),
    )
    assert torch.equal(pool.cpu(), expect.cpu()), "pool differs from the row-by-row copies"


def test_table_units_and_chunks():
    pool, views = page_pool(GDN_LIKE + [((5000,), torch.float32, 2048, "")], "cpu")
    rows = RowTable.build(views, names=[f"t{i}" for i in range(len(views))])
    units = {}
    for e in rows.chunks.tolist():
        units.setdefault((e[1], e[3]), []).append(e[2])
    by_tensor = [
        copy_unit(v.data_ptr(), v.stride(0) * v.element_size(), b) for v, b in zip(views, rows.row_bytes)
    ]
    assert by_tensor == [16, 16, 8, 4, 2, 1, 16]
    assert rows.row_bytes[-1] == 20000 and rows.chunks.shape[0] == len(views) - 1 + 2  # 20000 B: 2 chunks
    assert rows.chunks[-1].tolist()[2] == 20000 - CHUNK_BYTES
    assert rows.num_rows == SLOTS and dense_row(views[0]) and rows.names[0] == "t0"


@pytest.mark.parametrize(
    "src, dst",
    [
        ([1, 4], [0, 2]),  # plain
        ([3, -1, 5, 2, 1], [0, 4, 5, -1, 1]),  # padding (-1 either side) and src == dst copy nothing
        ([2, 2, 2], [0, 1, 5]),  # one source, several destinations
        ([], []),  # n = 0
        ([-1, -1, -1, -1], [-1, -1, -1, -1]),  # only padding
    ],
)
def test_copies_rows_of_every_tensor(impl, device, src, dst):
    fn = impl("copy_rows", torch.float32)
    pool, views = page_pool(GDN_LIKE, device)
    run(fn, pool, views, src, dst, device)


def test_rows_over_one_chunk(impl, device):
    """Rows of several chunks (the last one partial) next to one-unit rows."""
    fn = impl("copy_rows", torch.float32)
    specs = [
        ((5000,), torch.float32, 0, ""),
        ((9000,), torch.bfloat16, 20000, ""),
        ((1,), torch.int32, 38000, ""),
    ]
    pool, views = page_pool(specs, device, slots=4)
    run(fn, pool, views, [0, 3, -1], [1, 2, 0], device)


def test_many_pairs_grouped_per_program(impl, device, monkeypatch, backend):
    """Fixed-size padded indices with more pairs than one program per pair allows (the triton plan then
    loops over groups of pairs in each program)."""
    fn = impl("copy_rows", torch.float32)
    if backend == "triton":
        from atom_kernels.ops.copy_rows import triton as tr

        monkeypatch.setattr(tr, "TARGET_PROGRAMS", 12)
        assert tr.pairs_per_program(20, len(GDN_LIKE)) == 16  # 6 chunks x 2 groups, the second partial
    pool, views = page_pool(GDN_LIKE, device, slots=12)
    src = [-1] * 20
    dst = [-1] * 20
    src[3], dst[3] = 1, 7
    src[9], dst[9] = 1, 8
    src[17], dst[17] = 11, 0
    src[18], dst[18] = 4, 4
    run(fn, pool, views, src, dst, device)


def test_pairs_per_program_plan():
    pytest.importorskip("triton")
    from atom_kernels.ops.copy_rows.triton import MAX_PAIRS, TARGET_PROGRAMS, pairs_per_program

    assert pairs_per_program(2, 4932) == 2  # an 80B-like table (36 layers x 137 chunks), two pairs
    assert pairs_per_program(1, TARGET_PROGRAMS) == 1
    assert pairs_per_program(1 << 20, 4932) == MAX_PAIRS


def test_invalid_arguments(impl, device):
    fn = impl("copy_rows", torch.float32)
    pool, views = page_pool(GDN_LIKE[:2], device)
    rows = RowTable.build(views)
    i64 = lambda v: torch.tensor(v, dtype=torch.int64, device=device)  # noqa: E731
    with pytest.raises(ValueError, match="copy_rows: src must have dtype int64"):
        fn(rows, i64([0]).int(), i64([1]))
    with pytest.raises(ValueError, match=r"copy_rows: dst must have shape \[N=2\]"):
        fn(rows, i64([0, 1]), i64([1]))
    with pytest.raises(ValueError, match="rows must be a RowTable"):
        fn(views, i64([0]), i64([1]))
    if device.type == "cpu":  # value checks read the indices: CPU only for the triton backend
        with pytest.raises(ValueError, match=f"indices must be < {SLOTS}"):
            fn(rows, i64([0]), i64([SLOTS]))
        with pytest.raises(ValueError, match="a destination row appears twice"):
            fn(rows, i64([0, 1]), i64([2, 2]))
        with pytest.raises(ValueError, match=r"rows \[2\] are both a destination and a source"):
            fn(rows, i64([0, 2]), i64([2, 3]))
        before = pool.clone()
        fn(rows, i64([0, -1]), i64([-1, 0]))  # padding may repeat and reuse any index
        assert torch.equal(pool, before)


def test_table_rejects_rows_it_cannot_copy_as_bytes():
    x = torch.zeros(4, 6, 8)
    with pytest.raises(ValueError, match=r"the rows of ssm of layer 3 .* are not dense"):
        RowTable.build([x[:, :, :4]], names=["ssm of layer 3"])
    with pytest.raises(ValueError, match="the rows of tensor 0 overlap"):
        RowTable.build([torch.zeros(10).as_strided((4, 4), (2, 1))])
    with pytest.raises(ValueError, match="no tensors"):
        RowTable.build([])
    with pytest.raises(ValueError, match="tensor 1 must be a tensor of at least one dim"):
        RowTable.build([x, torch.tensor(1.0)])
    assert RowTable.build([x.transpose(1, 2)]).row_bytes == (6 * 8 * 4,)  # transposed rows are dense


def test_kernel_compiles_for_sm90_with_vector_copies():
    """The one-launch kernel through Triton's NVIDIA pipeline for sm_90 (no GPU needed): 16- and 8-byte units
    move as 128- / 64-bit vectors, 2- and 1-byte units as 16- / 8-bit accesses."""
    pytest.importorskip("triton", reason="atom-kernels' Triton backend is optional: triton is not installed")
    from atom_kernels.ops._triton_env import interpreting

    if interpreting():
        pytest.skip(
            "under TRITON_INTERPRET=1 the kernels are interpreted functions, which Triton cannot compile"
        )
    import triton
    from atom_kernels.ops.copy_rows import triton as tr
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = dict(
        chunks_ptr="*i64",
        src_ptr="*i64",
        dst_ptr="*i64",
        n_pairs="i32",
        PAIRS="constexpr",
        BLOCK_BYTES="constexpr",
    )
    src = ASTSource(tr._copy_rows_kernel, sig, dict(PAIRS=4, BLOCK_BYTES=tr.BLOCK_BYTES))
    try:
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
    except (RuntimeError, FileNotFoundError) as exc:
        if "ptxas" not in str(exc):
            raise
        pytest.skip(f"no usable ptxas for sm_90 here: {exc}")
    ptx = kernel.asm["ptx"]
    for op in ("ld.global.v4.b32", "st.global.v4.b32", "ld.global.v2.b32", "st.global.b16", "st.global.b8"):
        assert op in ptx, op


def test_graph_replay_takes_new_pairs(device):
    """On a GPU the triton op is captured once in a CUDA graph and replayed with other pairs written into
    the same fixed-size index buffers (padding included): each replay equals the reference on a copy."""
    if device.type != "cuda":
        pytest.skip("CUDA graphs need a GPU: run with --device cuda")
    from atom_kernels import registry

    fn = registry.resolve("copy_rows", device, torch.float32, "triton").fn
    ref = registry.resolve("copy_rows", device, torch.float32, "reference").fn
    pool, views = page_pool(GDN_LIKE, device, slots=8)
    rows = RowTable.build(views)
    src = torch.full((6,), -1, dtype=torch.int64, device=device)
    dst = src.clone()
    fn(rows, src, dst)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(rows, src, dst)
    for pairs in ([(1, 0), (2, 3)], [(7, 5)], [], [(4, 6), (4, 1), (0, 2)]):
        src.fill_(-1)
        dst.fill_(-1)
        for i, (s, d) in enumerate(pairs):
            src[i], dst[i] = s, d
        expect_pool = pool.clone()
        expect_views = [
            torch.as_strided(expect_pool.view(v.dtype), v.shape, v.stride(), v.storage_offset())
            for v in views
        ]
        ref(RowTable.build(expect_views), src, dst)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(pool, expect_pool), f"replay with pairs {pairs}"
