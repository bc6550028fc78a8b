"""The FP8 decode linear's per-shape config table: validation, loading, and the entries ``plan`` picks."""

from __future__ import annotations

import json

import pytest
from atom_kernels.ops.fp8.decode_table import decode_table, load_decode_table

SMS = 132  # H200
QKVZ = (12288, 2048)
O_PROJ = (2048, 4096)


def _plan():
    pytest.importorskip("triton", reason="atom-kernels' Triton backend is optional: triton is not installed")
    from atom_kernels.ops.fp8.triton import plan

    return plan


def test_plan_picks_table_entries():
    plan = _plan()
    entry = dict(BLOCK_N=32, SPLIT_K=2, SWAP_AB=True, num_warps=4, num_stages=3)
    table = decode_table([dict(n=QKVZ[0], k=QKVZ[1], rows=2, config=entry)])
    for m in (1, 2):  # both run with two token rows: one entry serves both
        heuristic = plan(m, *QKVZ, 128, SMS)
        assert any(heuristic[key] != value for key, value in entry.items())  # the entry changes the plan
        assert plan(m, *QKVZ, 128, SMS, table=table) == {**heuristic, **entry}
    for m, shape in ((4, QKVZ), (1, O_PROJ), (64, QKVZ), (4096, QKVZ)):  # other rows / shapes: the heuristic
        assert plan(m, *shape, 128, SMS, table=table) == plan(m, *shape, 128, SMS)
    # the caller's config still overrides the table
    assert plan(1, *QKVZ, 128, SMS, {"BLOCK_N": 64}, table)["BLOCK_N"] == 64
    assert plan(1, *QKVZ, 128, SMS, {"ONE_LAUNCH": False}, table)["ONE_LAUNCH"] is False


def test_table_picks_the_plan_kind():
    plan = _plan()
    table = decode_table(
        [
            dict(n=O_PROJ[0], k=O_PROJ[1], rows=8, config=dict(ONE_LAUNCH=True, BLOCK_N=64, SPLIT_K=4)),
            dict(n=O_PROJ[0], k=O_PROJ[1], rows=2, config=dict(ONE_LAUNCH=False)),
        ]
    )
    for m in (5, 8):  # above ONE_LAUNCH_MAX_M: the entry makes it one launch, 8 rows
        cfg = plan(m, *O_PROJ, 128, SMS, table=table)
        assert (cfg["ONE_LAUNCH"], cfg["ROWS"], cfg["BLOCK_N"], cfg["SPLIT_K"]) == (True, 8, 64, 4)
        assert {**cfg, "BLOCK_N": 0, "SPLIT_K": 0} == {
            **plan(m, *O_PROJ, 128, SMS, {"ONE_LAUNCH": True}),
            "BLOCK_N": 0,
            "SPLIT_K": 0,
        }
    for m in (1, 2):  # the three-launch plan as the heuristic makes it
        assert plan(m, *O_PROJ, 128, SMS, table=table) == plan(m, *O_PROJ, 128, SMS, {"ONE_LAUNCH": False})
    # scale blocks wider than 256 channels keep the three-launch plan whatever the table says
    wide = decode_table([dict(n=O_PROJ[0], k=O_PROJ[1], rows=2, config=dict(ONE_LAUNCH=True))])
    assert plan(1, *O_PROJ, 512, SMS, table=wide)["ONE_LAUNCH"] is False


def test_load_decode_table_reads_the_tuning_result(tmp_path):
    """The ``decode_table`` list of a tuning result file (extra keys per entry ignored), or a bare list."""
    entries = [
        dict(n=12288, k=2048, rows=2, m=2, config=dict(BLOCK_N=64, SPLIT_K=4), us=9.5, default_us=10.1),
        dict(n=2048, k=4096, rows=4, m=4, config=dict(ONE_LAUNCH=True, num_stages=6), us=8.0, default_us=9.0),
    ]
    path = tmp_path / "tune.json"
    path.write_text(json.dumps({"env": {}, "decode_table": entries, "rows": []}))
    table = load_decode_table(path)
    assert dict(table[(12288, 2048, 2)]) == dict(BLOCK_N=64, SPLIT_K=4)
    assert dict(table[(2048, 4096, 4)]) == dict(ONE_LAUNCH=True, num_stages=6)
    assert len(table) == 2
    path.write_text(json.dumps(entries))
    assert load_decode_table(path) == table
    with pytest.raises(TypeError):
        table[(1, 1, 2)] = {}  # read-only
    with pytest.raises(TypeError):
        table[(12288, 2048, 2)]["BLOCK_N"] = 16


@pytest.mark.parametrize(
    "entry, message",
    [
        (dict(n=64, k=128, rows=2, config=dict(BLOCK_M=16)), "unknown keys"),
        (dict(n=64, k=128, rows=2, config=dict(ROWS=4)), "unknown keys"),
        (dict(n=64, k=128, rows=3, config=dict(BLOCK_N=32)), "rows must be a power of two"),
        (dict(n=64, k=128, rows=1, config=dict(BLOCK_N=32)), "rows must be a power of two"),
        (dict(n=64, k=128, rows=2, config=dict(BLOCK_N=48)), "BLOCK_N must be a power of two"),
        (dict(n=64, k=128, rows=2, config=dict(SPLIT_K=0)), "SPLIT_K must be a positive int"),
        (dict(n=64, k=128, rows=2, config=dict(num_stages=2.0)), "num_stages must be a positive int"),
        (dict(n=64, k=128, rows=2, config=dict(SWAP_AB=1)), "SWAP_AB must be a bool"),
        (dict(n=64, k=128, rows=2, config=dict(ONE_LAUNCH=False, BLOCK_N=32)), "takes no other keys"),
        (dict(n=0, k=128, rows=2, config={}), "n must be a positive int"),
    ],
)
def test_decode_table_rejects_bad_entries(entry, message):
    with pytest.raises(ValueError, match=message):
        decode_table([entry])


def test_decode_table_rejects_a_key_given_twice():
    entry = dict(n=64, k=128, rows=2, config=dict(BLOCK_N=32))
    with pytest.raises(ValueError, match="given twice"):
        decode_table([entry, {**entry, "config": dict(BLOCK_N=64)}])


def test_shipped_tables_load_and_name_their_device():
    """Every table shipped in ``decode_tables/`` validates, is found under the device name it records,
    and only sets keys the one-launch plan takes; a device without a file gets the empty table."""
    from atom_kernels.ops.fp8.decode_table import EMPTY, TABLES_DIR, table_path, tuned_table

    files = sorted(TABLES_DIR.glob("*.json"))
    assert files, f"no shipped decode tables in {TABLES_DIR}"
    for path in files:
        name = json.loads(path.read_text())["device"]
        assert table_path(name) == path
        table = tuned_table(name)
        assert table and table == load_decode_table(path)
        for (n, k, rows), cfg in table.items():
            assert n > 0 and k > 0 and rows >= 2 and cfg
    assert tuned_table("cpu") is EMPTY
    assert tuned_table("Some Future GPU") is EMPTY


def test_a_broken_shipped_table_names_its_file(tmp_path, monkeypatch):
    import atom_kernels.ops.fp8.decode_table as dt

    bad = tmp_path / "Broken_GPU.json"
    bad.write_text(json.dumps({"decode_table": [{"n": 2048, "k": 4096, "rows": 3, "config": {}}]}))
    monkeypatch.setattr(dt, "TABLES_DIR", tmp_path)
    dt.tuned_table.cache_clear()
    try:
        with pytest.raises(ValueError, match="Broken_GPU.json.*rows must be a power of two"):
            dt.tuned_table("Broken GPU")
    finally:
        dt.tuned_table.cache_clear()


def test_fp8_linear_takes_the_device_table_by_default(monkeypatch):
    """``table=None`` asks :func:`tuned_table` for the tensor's device; ``{}`` is the heuristic alone."""
    pytest.importorskip("triton", reason="atom-kernels' Triton backend is optional: triton is not installed")
    import atom_kernels.ops.fp8.triton as ft
    import torch

    seen = []
    monkeypatch.setattr(ft, "tuned_table", lambda name: seen.append(name) or {})
    monkeypatch.setattr(ft, "launch_decode", lambda x2, w, *_: torch.zeros(x2.shape[0], w.shape[0]))
    x = torch.zeros(1, 256)
    w = torch.zeros(128, 256).to(torch.float8_e4m3fn)
    s = torch.ones(1, 2)
    assert ft.fp8_linear(x, w, s).shape == (1, 128)
    assert seen == ["cpu"]
    ft.fp8_linear(x, w, s, table={})
    assert seen == ["cpu"]
