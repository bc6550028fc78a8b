"""vLLM's ``Qwen3NextForCausalLM`` architecture, served by atom-models' target with vLLM-bound cores."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any, ClassVar, Literal

import torch
from atom_models import Qwen3NextForCausalLM, hold_float32_experts, hold_packed_linears, load_target
from atom_models.engine.model_runner import materialize
from atom_models.loader import check_files, convert_target_fp8
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.model_executor.layers.mamba.mamba_utils import MambaCopySpec

from atom_vllm_plugin.config import from_vllm
from atom_vllm_plugin.cores import VllmCoreFactory
from atom_vllm_plugin.models.common import (
    TARGET_DYNAMIC_ARG_DIMS,
    all_parameter_names,
    checkpoint_dir,
    gdn_state_spec,
    kernels_for,
    log_compilation,
    log_rank_memory,
    model_device,
    start_vllm_load_clock,
)
from atom_vllm_plugin.parallel import VllmTensorParallel

logger = logging.getLogger("vllm.atom_vllm_plugin")


def whole_block_copy(state: torch.Tensor, block_ids: list[int], cur_block_idx: int, num_accepted_tokens: int):
    """vLLM's ``MambaStateCopyFunc`` for a GDN block: the whole block of ``state`` at ``cur_block_idx``."""
    src = state[block_ids[cur_block_idx]]
    return MambaCopySpec(start_addr=src.data_ptr(), num_elements=src.numel())


@support_torch_compile(dynamic_arg_dims=TARGET_DYNAMIC_ARG_DIMS)
class AtomQwen3NextForCausalLM(nn.Module):
    """The target. vLLM sees ``.model.embed_tokens`` and ``.lm_head`` (the MTP proposer shares both with
    the draft), the hybrid-model classmethods, ``forward`` -> hidden states and ``compute_logits``.

    Compiled by vLLM like its own ``Qwen3NextModel`` (``support_torch_compile``; the token dimension is
    dynamic): everything between the attention / GDN layers, which are opaque splitting ops
    (:mod:`atom_vllm_plugin.layers.custom_ops`), is traced into vLLM's graph. ``compute_logits`` stays eager.

    Tensor parallel: each rank builds and loads its shard (atom-models' ``TPLayout``) and communicates
    through vLLM's TP group (:class:`~atom_vllm_plugin.parallel.VllmTensorParallel`); ``compute_logits``
    returns the full vocabulary on every rank.
    """

    # vLLM's IsHybrid / HasInnerState / SupportsMambaPrefixCaching interfaces (checked by attribute, see
    # vllm.model_executor.models.interfaces). Prefix caching: the GDN state of a block is a self-describing
    # snapshot (atom_models.gdn_snapshot), copied whole between blocks (layers.gdn_snapshots).
    is_hybrid: ClassVar[Literal[True]] = True
    has_inner_state: ClassVar[Literal[True]] = True
    supports_mamba_prefix_caching: ClassVar[Literal[True]] = True
    supports_pp: ClassVar[Literal[False]] = False

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        super().__init__()
        self.atom_config = from_vllm(vllm_config, "target")
        self.vllm_model_config = vllm_config.model_config
        kernels = kernels_for(vllm_config, self.atom_config.dtype)
        device = model_device(vllm_config)
        gdn_state = gdn_state_spec(vllm_config, self.atom_config)
        self.cores = VllmCoreFactory(self.atom_config, kernels, gdn_state, device=device)
        self.parallel = VllmTensorParallel()
        # Built on the meta device, FP8 modules converted, then allocated once: an FP8 checkpoint's model
        # never exists in the model dtype (80B-A3B in bf16 would not fit on the one GPU its FP8 form fits).
        with torch.device("meta"):
            self.atom = Qwen3NextForCausalLM(
                self.atom_config.model,
                self.cores,
                kernels,
                dtype=self.atom_config.dtype,
                parallel=self.parallel,
                expert_parallel=self.atom_config.expert_parallel,
            )
        convert_target_fp8(self.atom)
        materialize([self.atom], device)
        log_compilation("ATOM Qwen3-Next", vllm_config)

    # vLLM's proposer reads target.model.embed_tokens and target.lm_head (see _maybe_share_embeddings)
    @property
    def model(self) -> nn.Module:
        return self.atom.model

    @property
    def lm_head(self) -> nn.Module:
        return self.atom.lm_head

    @property
    def config(self):
        return self.vllm_model_config.hf_config

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.atom.embed_input_ids(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: object,
    ) -> torch.Tensor:
        if inputs_embeds is not None or input_ids is None:
            raise NotImplementedError("ATOM Qwen3-Next: inputs_embeds are not supported; pass token ids")
        if intermediate_tensors is not None:
            raise NotImplementedError("ATOM Qwen3-Next: pipeline parallelism is not supported")
        return self.atom(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.atom.compute_logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        # atom-models reads the checkpoint itself (and raises one CheckpointError naming every missing,
        # unexpected, mis-shaped or non-finite tensor); of vLLM's lazy weight iterator only one tensor is
        # read, after every file's header has been checked, so that an unreadable shard is named.
        ckpt = checkpoint_dir(self.vllm_model_config)
        check_files(ckpt)
        start_vllm_load_clock(weights)
        load_target(self.atom, ckpt)
        # the cpu experts' float32 products: float32 copies of the loaded weights, made once
        hold_float32_experts(self.atom, self.cores.kernels)
        # the cpu linears' bf16 weights in oneDNN's packed layout, made once
        hold_packed_linears(self.atom, self.cores.kernels)
        log_rank_memory("ATOM Qwen3-Next", self.atom.layout, self, self.cores, self.vllm_config)
        return all_parameter_names(self)

    # ---- classmethods vLLM calls before building the model (IsHybrid) -----------------------------
    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: Any) -> tuple[torch.dtype, torch.dtype]:
        return gdn_state_spec(vllm_config).dtypes

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return gdn_state_spec(vllm_config).shapes()

    @classmethod
    def get_mamba_state_copy_func(cls):
        """Whole-block copies of ``conv`` and ``ssm``: a GDN block is a snapshot that moves as a whole,
        whatever the accepted count (the next verify commits the pending tokens). vLLM takes copy functions
        for a prefix of the state tensors (2 here: this classmethod does not know whether MTP adds
        ``pending`` and ``pending_pos``); the plugin runs the copies itself, of every tensor of the slot
        (``atom_models.gdn_snapshot.SlotCopier``): under vLLM's V1 runner from the runner functions it wraps
        (``patches.mamba_align``), under Model Runner V2 from its model state (:meth:`get_model_state_cls`),
        so vLLM's copy kernels never run on these functions."""
        return (whole_block_copy, whole_block_copy)

    @staticmethod
    def get_model_state_cls() -> type:
        """Model Runner V2's model state for this model (V2 asks the target only, never the draft):
        vLLM's hybrid state with the plugin's prefix-caching copies (:mod:`atom_vllm_plugin.model_state`).
        Imported here, so that vLLM's V1 runner and vLLM-CPU never import Model Runner V2."""
        from atom_vllm_plugin.model_state import AtomHybridModelState

        return AtomHybridModelState

    @classmethod
    def get_mamba_state_copy_funcs(cls, mamba_types):
        funcs = cls.get_mamba_state_copy_func()
        return {t: funcs for t in mamba_types}
