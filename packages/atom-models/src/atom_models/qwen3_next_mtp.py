"""Qwen3-Next MTP draft head: ``fc([norm(embed(t[i+1])), norm(h[i])])`` -> one full-attention layer -> norm."""

from __future__ import annotations

import torch
from atom_core import FULL_ATTENTION, Qwen3NextConfig
from torch import nn

from atom_models.modules import Linear, RMSNorm
from atom_models.parallel import SINGLE_PROCESS, ParallelContext, TPLayout, VocabParallelEmbedding
from atom_models.qwen3_next import CoreFactory, Qwen3NextDecoderLayer, _check_inputs, gather_logits


class Qwen3NextMTP(nn.Module):
    """The MTP draft; shares (never copies) the target's ``embed_tokens`` and ``lm_head`` modules.

    Row i takes the target's final post-norm hidden state ``h_i`` and token ``t_{i+1}``, at position i,
    and predicts ``t_{i+2}``. MTP layer j has the absolute decoder index ``num_hidden_layers + j`` and is
    stored as ``layers[str(num_hidden_layers + j)]`` (checkpoint ``mtp.layers.j``); step ``spec_step``
    runs layer ``spec_step % num_mtp_layers``; for k > 1 a step's input hidden state is the previous
    step's output.

    Tensor parallel (``parallel``, the target's group): the layers are sharded as the target's; the
    vocabulary-parallel ``embed_tokens`` / ``lm_head`` are the target's modules; ``compute_logits``
    all-gathers the full vocabulary. ``fc`` (``[H, 2H]``) is replicated, not column-parallel with a
    gather as in vLLM: it is ``2 H^2`` parameters (8 MiB in bf16 at H = 2048, kept bf16 by the published
    FP8 checkpoint), and replicating it spares the draft step one all-gather on its critical path, for
    ``(tp - 1) / tp`` of that memory per rank. ``expert_parallel``: the MoE layer's routed experts are
    partitioned over the ranks, as in the target (:class:`TPLayout`).
    """

    def __init__(
        self,
        config: Qwen3NextConfig,
        cores: CoreFactory,
        kernels,
        embed_tokens: VocabParallelEmbedding,
        lm_head: Linear,
        dtype: torch.dtype | None = None,
        parallel: ParallelContext = SINGLE_PROCESS,
        expert_parallel: bool = False,
    ):
        super().__init__()
        if config.num_mtp_layers < 1:
            raise ValueError(
                f"config {config.source}: mtp_num_hidden_layers is {config.num_mtp_layers}; the checkpoint has no MTP head"
            )
        dtype = kernels.dtype if dtype is None else dtype
        self.config = config
        self.kernels = kernels
        self.parallel = parallel
        self.layout = TPLayout.from_config(config, parallel.rank, parallel.world_size, expert_parallel)
        if getattr(embed_tokens, "parallel", parallel).world_size != parallel.world_size:
            raise ValueError(
                f"Qwen3NextMTP: the shared embed_tokens is split over {embed_tokens.parallel.world_size} ranks, "
                f"but parallel has world size {parallel.world_size} (pass the target's parallel)"
            )
        h, eps = config.hidden_size, config.rms_norm_eps
        self.embed_tokens = embed_tokens
        self.lm_head = lm_head
        self.fc = Linear(2 * h, h, dtype=dtype)
        self.pre_fc_norm_embedding = RMSNorm(h, eps, kernels, dtype=dtype)
        self.pre_fc_norm_hidden = RMSNorm(h, eps, kernels, dtype=dtype)
        self.layers = nn.ModuleDict()
        for j in range(config.num_mtp_layers):
            idx = config.mtp_layer_index(j)
            self.layers[str(idx)] = Qwen3NextDecoderLayer(
                config, idx, FULL_ATTENTION, f"mtp.layers.{idx}", cores, kernels, dtype, self.layout, parallel
            )
        self.norm = RMSNorm(h, eps, kernels, dtype=dtype)

    @property
    def shared_parameter_names(self) -> tuple[str, ...]:
        """Parameters owned by the target (not loaded by the draft)."""
        return ("embed_tokens.weight", "lm_head.weight")

    def layer_for_step(self, spec_step: int) -> Qwen3NextDecoderLayer:
        return self.layers[str(self.config.mtp_layer_index(spec_step % self.config.num_mtp_layers))]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        ctx=None,
        spec_step: int = 0,
    ) -> torch.Tensor:
        _check_inputs(input_ids, positions)
        if hidden_states.shape != (input_ids.shape[0], self.config.hidden_size):
            raise ValueError(
                f"hidden_states: expected shape ({input_ids.shape[0]}, {self.config.hidden_size}), "
                f"got {tuple(hidden_states.shape)}"
            )
        emb = self.pre_fc_norm_embedding(self.embed_tokens(input_ids))
        hid = self.pre_fc_norm_hidden(hidden_states)
        x = self.fc(torch.cat([emb, hid], dim=-1))
        x, residual = self.layer_for_step(spec_step)(positions, x, None, ctx)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden_states: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        return gather_logits(self.lm_head, self.parallel, hidden_states, dtype)
