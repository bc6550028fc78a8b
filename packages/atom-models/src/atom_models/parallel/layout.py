"""Per-rank sizes of a Qwen3-Next model under tensor parallelism, checked once against the config.

Sharding (the scheme of vLLM's ``qwen3_next.py``, the anchor):
- attention: query heads split across ranks; KV heads split when there are at least as many as ranks,
  otherwise each KV head is replicated on ``world_size / num_key_value_heads`` consecutive ranks (rank r
  holds KV head ``r // kv_head_replicas``), keeping GQA groups whole on every rank;
- Gated DeltaNet: key heads split across ranks, each with its ``num_v_heads / num_k_heads`` value heads
  (the checkpoint's per-key-head-group layout makes a rank's rows of ``in_proj_qkvz`` / ``in_proj_ba``
  contiguous; the conv channels of q, k and v are three slices);
- MoE: every rank holds every expert, sharded over the expert intermediate dimension (as the shared expert
  and dense MLPs are): one all-reduce per MoE block, every rank routes every token, no token shuffling.
  With ``expert_parallel`` the routed experts are partitioned instead: rank r holds experts
  ``[r * E / tp, (r + 1) * E / tp)`` whole (``expert_start``, ``num_local_experts``), computes them for
  every token (the router still runs on all ``E`` logits everywhere), and the same all-reduce sums the
  ranks' partial outputs; the shared expert stays split over its intermediate dimension;
- vocabulary: ``embed_tokens`` and ``lm_head`` rows split in contiguous ranges.
"""

from __future__ import annotations

from dataclasses import dataclass

from atom_core import ConfigError, Qwen3NextConfig


@dataclass(frozen=True)
class TPLayout:
    """Sizes one rank holds (``world_size == 1``: the whole model)."""

    rank: int
    world_size: int
    num_heads: int  # query heads on this rank
    num_kv_heads: int  # KV heads on this rank
    kv_head_replicas: int  # ranks that hold the same KV head (1 when KV heads are split)
    linear_num_key_heads: int
    linear_num_value_heads: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    intermediate_size: int  # dense MLP layers
    vocab_size: int  # rows of embed_tokens / lm_head on this rank
    expert_parallel: bool = False  # routed experts partitioned over the ranks (whole), not split
    num_local_experts: int = 0  # routed experts this rank holds (all of them without expert_parallel)
    expert_start: int = 0  # the first of them (the checkpoint's expert index)

    @classmethod
    def from_config(
        cls, config: Qwen3NextConfig, rank: int = 0, world_size: int = 1, expert_parallel: bool = False
    ) -> TPLayout:
        """Raise :class:`~atom_core.ConfigError` naming the field that ``world_size`` does not divide
        (``num_experts`` with ``expert_parallel``; ``moe_intermediate_size`` without)."""
        if not isinstance(expert_parallel, bool):
            raise ValueError(f"expert_parallel must be a bool, got {expert_parallel!r}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"tensor parallel rank {rank} of world size {world_size} is not a valid rank")
        tp = world_size

        def split(name: str, value: int) -> int:
            if value % tp:
                raise ConfigError(
                    name, value, config.source, f"must be divisible by the tensor parallel size {tp}"
                )
            return value // tp

        kv = config.num_key_value_heads
        if kv >= tp:
            kv_local, replicas = split("num_key_value_heads", kv), 1
        elif tp % kv:
            raise ConfigError(
                "num_key_value_heads", kv, config.source,
                f"must divide the tensor parallel size {tp} (KV heads are replicated when fewer than ranks)",
            )  # fmt: skip
        else:
            kv_local, replicas = 1, tp // kv
        dense = any(not config.is_moe_layer(i) for i in range(config.num_hidden_layers))
        experts = split("num_experts", config.num_experts) if expert_parallel else config.num_experts
        return cls(
            rank=rank,
            world_size=tp,
            num_heads=split("num_attention_heads", config.num_attention_heads),
            num_kv_heads=kv_local,
            kv_head_replicas=replicas,
            linear_num_key_heads=split("linear_num_key_heads", config.linear_num_key_heads),
            # a multiple of the key heads (the config checks it), so divisible whenever they are
            linear_num_value_heads=config.linear_num_value_heads // tp,
            moe_intermediate_size=0
            if not config.num_experts
            else config.moe_intermediate_size
            if expert_parallel
            else split("moe_intermediate_size", config.moe_intermediate_size),
            shared_expert_intermediate_size=split(
                "shared_expert_intermediate_size", config.shared_expert_intermediate_size
            ),
            intermediate_size=split("intermediate_size", config.intermediate_size)
            if dense
            else config.intermediate_size // tp,  # no dense MLP layer: the size is never used
            vocab_size=split("vocab_size", config.vocab_size),
            expert_parallel=expert_parallel,
            num_local_experts=experts,
            expert_start=rank * experts if expert_parallel else 0,
        )

    @classmethod
    def of(cls, config: Qwen3NextConfig, parallel, layout: TPLayout | None = None) -> TPLayout:
        """``layout`` (checked to be ``parallel``'s rank and world size), or the layout of ``parallel``'s
        rank when None (experts split, not partitioned): what a module given both ``layout=`` and
        ``parallel=`` uses."""
        if layout is None:
            return cls.from_config(config, parallel.rank, parallel.world_size)
        if (layout.rank, layout.world_size) != (parallel.rank, parallel.world_size):
            raise ValueError(
                f"TPLayout of rank {layout.rank} of {layout.world_size} passed with a parallel context of "
                f"rank {parallel.rank} of {parallel.world_size}"
            )
        return layout

    @property
    def kv_head_start(self) -> int:
        """The first KV head (of the checkpoint's) this rank holds."""
        return (self.rank // self.kv_head_replicas) * self.num_kv_heads

    def row_range(self, total: int) -> tuple[int, int]:
        """This rank's ``[start, end)`` of ``total`` rows split evenly (``total`` divisible by the world size)."""
        n = total // self.world_size
        return self.rank * n, (self.rank + 1) * n
