"""The one declarative table of checkpoint -> parameter renames, fuses and stacks.

Names are relative to a *scope*: ``model.`` for the target trunk, ``mtp.`` for the MTP head (whose
``mtp.layers.j`` become ``layers.{num_hidden_layers + j}``). ``{layer}`` and ``{expert}`` are integers.
A rule writes the whole checkpoint tensor into ``param`` or, with ``expert``, into ``param[expert]``,
and with ``shard=(i, n)`` into the i-th of n row blocks (dim 0) of that: the i-th part of a fused linear
(its ``LinearShard.local_parts``; FP8 block scales: ``ceil(rows / block)`` scale rows per part, as
:class:`~atom_models.modules.Fp8Linear` holds them), equal blocks otherwise (stacked experts).

The ``tp`` column says which part of the checkpoint tensor tensor-parallel rank r reads (the parameter
holds only that part; the loader reads it with ``get_slice``). Routed experts partitioned over
expert-parallel ranks are the exception: a rank reads its own experts' tensors whole (``param[expert -
expert_start]``) and no other expert's (``Experts.expert_start``, applied by the loader):

- ``None``: replicated, every rank reads the whole tensor;
- ``ROWS`` / ``COLS``: dim 0 / dim 1 split in ``world_size`` equal contiguous ranges, rank r reads the r-th
  (column-parallel rows, row-parallel columns, vocabulary rows, per-head vectors);
- ``KV_ROWS``: the rows of this rank's KV heads (``TPLayout.kv_head_start``, ``num_kv_heads``; a KV head
  is read by every rank that replicates it);
- ``CONV_QKV_ROWS``: the GDN conv channels ``[q | k | v]``, each of the three split in equal ranges, rank r
  reads the r-th of each (three slices, stacked).

The ``regroup`` column names a row layout transform the loader applies to the part a rank read: those rows
are G groups of the same parts (:func:`group_parts`), stored part-major (the first part of every group,
then the second, ...). ``GDN_QKVZ``: ``[q_g | k_g | v_g | z_g]`` per key head g becomes ``[q | k | v | z]``;
``GDN_BA``: ``[b_g | a_g]`` becomes ``[b | a]``. FP8 block scales move with their rows (whole row blocks,
so every part must be a multiple of the block's rows).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

ROWS = "rows"
COLS = "cols"
KV_ROWS = "kv_rows"
CONV_QKV_ROWS = "conv_qkv_rows"
TP_SPLITS = (ROWS, COLS, KV_ROWS, CONV_QKV_ROWS)
GDN_QKVZ = "gdn_qkvz"
GDN_BA = "gdn_ba"
REGROUPS = (GDN_QKVZ, GDN_BA)


@dataclass(frozen=True)
class Rule:
    src: str  # checkpoint name template (relative to the scope)
    dst: str  # parameter name template (relative to the module's scope)
    shard: tuple[int, int] | None = None  # (part, parts) of dim 0 of the destination (module docstring)
    tp: str | None = None  # what rank r reads of the checkpoint tensor (module docstring); None: all of it
    regroup: str | None = None  # row layout transform of the rank's part (module docstring); None: as read

    @property
    def stacks_experts(self) -> bool:
        return "{expert}" in self.src


_L = "layers.{layer}."

RULES: tuple[Rule, ...] = (
    # --- trunk / MTP head (fc replicated: see Qwen3NextMTP) ----------------------------------------------
    Rule("embed_tokens.weight", "embed_tokens.weight", tp=ROWS),
    Rule("norm.weight", "norm.weight"),
    Rule("fc.weight", "fc.weight"),
    Rule("pre_fc_norm_embedding.weight", "pre_fc_norm_embedding.weight"),
    Rule("pre_fc_norm_hidden.weight", "pre_fc_norm_hidden.weight"),
    # --- decoder layer norms ------------------------------------------------------------------------------
    Rule(_L + "input_layernorm.weight", _L + "input_layernorm.weight"),
    Rule(_L + "post_attention_layernorm.weight", _L + "post_attention_layernorm.weight"),
    # --- gated full attention: q_proj / k_proj / v_proj fused into qkv_proj's rows [q | k | v] (q keeps
    #     HF's per-head [query | gate] packing: a head's rows are contiguous); o_proj's bias is added once,
    #     on rank 0 ----------------------------------------------------------------------------------------
    *(
        Rule(_L + f"self_attn.{p}_proj.{w}", _L + f"self_attn.qkv_proj.{w}", shard=(i, 3), tp=tp)
        for i, (p, tp) in enumerate((("q", ROWS), ("k", KV_ROWS), ("v", KV_ROWS)))
        for w in ("weight", "bias")
    ),
    Rule(_L + "self_attn.o_proj.weight", _L + "self_attn.o_proj.weight", tp=COLS),
    Rule(_L + "self_attn.o_proj.bias", _L + "self_attn.o_proj.bias"),
    Rule(_L + "self_attn.q_norm.weight", _L + "self_attn.q_norm.weight"),
    Rule(_L + "self_attn.k_norm.weight", _L + "self_attn.k_norm.weight"),
    # --- Gated DeltaNet (in_proj_qkvz / in_proj_ba: HF's per-key-head-group layout makes a rank's groups
    #     contiguous rows, regrouped part-major after reading so that the projection outputs split into
    #     views; the norm weight is per channel of one head: replicated) -----------------------------------
    *(
        Rule(_L + f"linear_attn.{n}", _L + f"linear_attn.{n}", tp=tp, regroup=rg)
        for n, tp, rg in (
            ("in_proj_qkvz.weight", ROWS, GDN_QKVZ),
            ("in_proj_ba.weight", ROWS, GDN_BA),
            ("conv1d.weight", CONV_QKV_ROWS, None),
            ("A_log", ROWS, None),
            ("dt_bias", ROWS, None),
            ("norm.weight", None, None),
            ("out_proj.weight", COLS, None),
        )
    ),
    # --- MoE: router replicated, per-expert tensors stacked and split over the intermediate dim, shared
    #     expert gate/up fused (column) and down (row), shared_expert_gate replicated ---------------------
    Rule(_L + "mlp.gate.weight", _L + "mlp.gate.weight"),
    Rule(_L + "mlp.experts.{expert}.gate_proj.weight", _L + "mlp.experts.w13", shard=(0, 2), tp=ROWS),
    Rule(_L + "mlp.experts.{expert}.up_proj.weight", _L + "mlp.experts.w13", shard=(1, 2), tp=ROWS),
    Rule(_L + "mlp.experts.{expert}.down_proj.weight", _L + "mlp.experts.w2", tp=COLS),
    Rule(
        _L + "mlp.shared_expert.gate_proj.weight",
        _L + "mlp.shared_expert.gate_up_proj.weight",
        shard=(0, 2),
        tp=ROWS,
    ),
    Rule(
        _L + "mlp.shared_expert.up_proj.weight",
        _L + "mlp.shared_expert.gate_up_proj.weight",
        shard=(1, 2),
        tp=ROWS,
    ),
    Rule(_L + "mlp.shared_expert.down_proj.weight", _L + "mlp.shared_expert.down_proj.weight", tp=COLS),
    Rule(_L + "mlp.shared_expert_gate.weight", _L + "mlp.shared_expert_gate.weight"),
    # --- dense MLP (mlp_only_layers / decoder_sparse_step) ----------------------------------------------
    Rule(_L + "mlp.gate_proj.weight", _L + "mlp.gate_up_proj.weight", shard=(0, 2), tp=ROWS),
    Rule(_L + "mlp.up_proj.weight", _L + "mlp.gate_up_proj.weight", shard=(1, 2), tp=ROWS),
    Rule(_L + "mlp.down_proj.weight", _L + "mlp.down_proj.weight", tp=COLS),
)

# The shared expert folded into the routed experts (``SparseMoeBlock.num_shared = m > 0``): its gate / up
# rows and down columns go to the m pseudo-experts stacked after the E routed ones (slice j of the
# intermediate dim to pseudo-expert E + j, each split over tensor-parallel ranks as a routed expert), and
# ``shared_expert_gate`` is the router's last row; the loader places the slices (``folded_shared.plan_copies``).
# These apply instead of RULES' shared-expert rows where the model has no ``mlp.shared_expert`` module.
FOLDED_SHARED_RULES: tuple[Rule, ...] = (
    Rule(_L + "mlp.shared_expert.gate_proj.weight", _L + "mlp.experts.w13", shard=(0, 2), tp=ROWS),
    Rule(_L + "mlp.shared_expert.up_proj.weight", _L + "mlp.experts.w13", shard=(1, 2), tp=ROWS),
    Rule(_L + "mlp.shared_expert.down_proj.weight", _L + "mlp.experts.w2", tp=COLS),
    Rule(_L + "mlp.shared_expert_gate.weight", _L + "mlp.gate.weight"),
)

# The untied LM head (outside the trunk's scope): vocabulary rows, as embed_tokens.
LM_HEAD = Rule("lm_head.weight", "lm_head.weight", tp=ROWS)


def _regex(template: str) -> re.Pattern[str]:
    out = re.escape(template)
    out = out.replace(re.escape("{layer}"), r"(?P<layer>\d+)").replace(
        re.escape("{expert}"), r"(?P<expert>\d+)"
    )
    return re.compile(out + r"\Z")


_SRC = tuple((_regex(r.src), r) for r in RULES)
_DST = tuple((_regex(r.dst), r) for r in RULES)
_FOLDED_SRC = tuple((_regex(r.src), r) for r in FOLDED_SHARED_RULES)
_FOLDED_DST = tuple((_regex(r.dst), r) for r in FOLDED_SHARED_RULES)


@dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor goes: ``param[expert][shard rows]``; ``tp``: the part a rank reads;
    ``regroup``: the row layout transform of that part."""

    param: str
    expert: int | None
    shard: tuple[int, int] | None
    tp: str | None = None
    regroup: str | None = None


def map_name(name: str, folded: bool = False) -> Target | None:
    """Checkpoint name (scope-relative) -> destination, or None if no rule knows it; ``folded``: the
    destination in a MoE block with the shared expert folded in (``FOLDED_SHARED_RULES``), None for names
    those rules do not know."""
    for rx, rule in _FOLDED_SRC if folded else _SRC:
        m = rx.match(name)
        if m:
            groups = m.groupdict()
            dst = rule.dst.format(layer=groups.get("layer"))
            expert = int(groups["expert"]) if "expert" in groups else None
            return Target(dst, expert, rule.shard, rule.tp, rule.regroup)
    return None


def group_parts(regroup: str, config) -> tuple[tuple[str, int], ...]:
    """The parts of one group of a ``regroup`` layout, in checkpoint order: ``(what, rows)`` pairs, ``what``
    naming the config dims the row count comes from (``config``: a ``Qwen3NextConfig``)."""
    r = config.linear_num_value_heads // config.linear_num_key_heads
    dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
    if regroup == GDN_QKVZ:
        k, v = f"linear_key_head_dim={dk}", f"(Hv/Hk)*linear_value_head_dim={r * dv}"
        return (("q: " + k, dk), ("k: " + k, dk), ("v: " + v, r * dv), ("z: " + v, r * dv))
    if regroup == GDN_BA:
        return (("b: Hv/Hk", r), ("a: Hv/Hk", r))
    raise ValueError(f"unknown regroup {regroup!r} (weight_map.RULES); known: {REGROUPS}")


def sources_for(param: str, num_rows: int, folded: bool = False, first_expert: int = 0) -> list[str]:
    """The checkpoint names (scope-relative) that together fill parameter ``param``.

    ``num_rows`` is ``param.shape[0]`` (the number of routed experts for stacked expert parameters: the
    checkpoint's experts ``first_expert .. first_expert + num_rows - 1``, a slice of them when the experts
    are partitioned over expert-parallel ranks). ``folded``: ``param`` belongs to a MoE block with the
    shared expert folded in; the shared expert's tensors (``FOLDED_SHARED_RULES``) are sources too.
    """
    names: list[str] = []
    for rx, rule in _DST + (_FOLDED_DST if folded else ()):
        m = rx.match(param)
        if not m:
            continue
        layer = m.groupdict().get("layer")
        if rule.stacks_experts:
            experts = range(first_expert, first_expert + num_rows)
            names.extend(rule.src.format(layer=layer, expert=e) for e in experts)
        else:
            names.append(rule.src.format(layer=layer))
    return names
