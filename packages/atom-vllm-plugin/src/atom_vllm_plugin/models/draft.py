"""vLLM's ``Qwen3NextMTP`` draft architecture, served by atom-models' MTP head with vLLM-bound cores.

vLLM's MTP proposer builds this class under the model tag ``eagle_head``, loads it, then replaces
``draft.model.embed_tokens`` and ``draft.lm_head`` with the target's modules
(``SpecDecodeBaseProposer._maybe_share_embeddings`` / ``_maybe_share_lm_head``). Until then the draft holds
weightless placeholders, so no second copy of the embedding or lm_head is ever allocated; the
``lm_head`` assignment on the wrapper is forwarded to the atom MTP module that computes with it.
Under tensor parallelism the draft is sharded like the target (same TP group, same layout) and the shared
modules are the target's shards.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from typing import Any

import torch
from atom_core import ConfigError
from atom_models import (
    CheckpointError,
    Qwen3NextMTP,
    checkpoint_files,
    hold_float32_experts,
    hold_packed_linears,
    load_mtp,
)
from atom_models.engine.model_runner import materialize
from atom_models.folded_shared import sources
from atom_models.loader import convert_mtp_fp8
from torch import nn
from vllm.compilation.decorators import support_torch_compile

from atom_vllm_plugin.config import DRAFT_ARCH, DRAFT_MODEL_TAG, from_vllm, model_tag
from atom_vllm_plugin.cores import VllmCoreFactory
from atom_vllm_plugin.models.common import (
    DRAFT_DYNAMIC_ARG_DIMS,
    all_parameter_names,
    checkpoint_dir,
    kernels_for,
    log_compilation,
    log_rank_memory,
    model_device,
    start_vllm_load_clock,
)
from atom_vllm_plugin.parallel import VllmTensorParallel

logger = logging.getLogger("vllm.atom_vllm_plugin")


class AwaitingTarget(nn.Module):
    """Stands for the target's embedding / lm_head until vLLM's proposer shares the real module."""

    def __init__(self, what: str) -> None:
        super().__init__()
        self.what = what

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise RuntimeError(
            f"ATOM MTP draft: {self.what} is the target model's and has not been shared yet "
            "(vLLM's proposer shares it right after loading the draft)"
        )


@support_torch_compile(dynamic_arg_dims=DRAFT_DYNAMIC_ARG_DIMS)
class AtomQwen3NextMTP(nn.Module):
    """The MTP draft: ``.model`` is the atom ``Qwen3NextMTP`` (vLLM replaces ``.model.embed_tokens``).

    Compiled by vLLM like its ``Qwen3NextMultiTokenPredictor`` (``support_torch_compile``, under the model
    tag ``eagle_head``). ``spec_step_idx`` picks the MTP layer (``spec_step % num_mtp_layers``): vLLM's trace
    drops guards, so with more than one MTP layer the traced choice would stick; Qwen3-Next has one.
    """

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        super().__init__()
        tag = model_tag()
        if tag != DRAFT_MODEL_TAG:
            raise ConfigError(
                "architectures",
                DRAFT_ARCH,
                "vllm model_config",
                f"{DRAFT_ARCH} is vLLM's name for the MTP draft and is built by the MTP proposer under model "
                f"tag {DRAFT_MODEL_TAG!r} (got {tag!r}); serve the Qwen3NextForCausalLM checkpoint with "
                "speculative_config={'method': 'mtp', ...} instead",
            )
        self.atom_config = from_vllm(vllm_config, "draft")
        self.draft_model_config = vllm_config.speculative_config.draft_model_config
        kernels = kernels_for(vllm_config, self.atom_config.dtype)
        device = model_device(vllm_config)
        self.cores = VllmCoreFactory(self.atom_config, kernels, gdn_state=None, device=device)
        self.parallel = VllmTensorParallel()
        # meta device, FP8 conversion, one allocation: as the target (models/target.py)
        with torch.device("meta"):
            mtp = Qwen3NextMTP(
                self.atom_config.model,
                self.cores,
                kernels,
                embed_tokens=AwaitingTarget("embed_tokens"),
                lm_head=AwaitingTarget("lm_head"),
                dtype=self.atom_config.dtype,
                parallel=self.parallel,
                expert_parallel=self.atom_config.expert_parallel,
            )
        convert_mtp_fp8(mtp)
        materialize([mtp], device)
        self.model = mtp
        self.lm_head = mtp.lm_head
        # vLLM's proposer takes the argmax of these logits for every draft token. On a CPU they go out in
        # float32 (the model dtype's values widened: the same argmax): ATen's CPU argmax over a bf16 row
        # is several times slower than over float32 (benchmarks/cpu_argmax.py).
        self.logits_dtype = torch.float32 if device.type == "cpu" else None
        self._sharing_checked = False
        log_compilation("ATOM Qwen3-Next MTP draft", vllm_config)

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        # vLLM's proposer does `draft.lm_head = target.lm_head`; the atom MTP computes with its own
        # attribute, so forward the assignment (one module, shared, no copy).
        if name == "lm_head" and isinstance(value, nn.Module) and "model" in self._modules:
            self.model.lm_head = value

    def _check_sharing(self) -> None:
        if not self.shares_target_modules:
            raise RuntimeError(
                "ATOM MTP draft: vLLM did not share the target's embed_tokens / lm_head with the draft "
                "(expected from SpecDecodeBaseProposer.load_model); refusing to run with placeholders"
            )
        logger.info(
            "ATOM MTP draft uses the target's embed_tokens and lm_head (shared modules, no copy); "
            "its attention layer is %s",
            ", ".join(self.cores.built),
        )
        self._sharing_checked = True

    @property
    def config(self):
        return self.draft_model_config.hf_config

    @property
    def shares_target_modules(self) -> bool:
        """Whether vLLM has handed the target's embedding and lm_head to this draft."""
        return not isinstance(self.model.embed_tokens, AwaitingTarget) and not isinstance(
            self.model.lm_head, AwaitingTarget
        )

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        intermediate_tensors: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        spec_step_idx: int = 0,
        **kwargs: object,
    ) -> torch.Tensor:
        if inputs_embeds is not None or input_ids is None:
            raise NotImplementedError("ATOM Qwen3-Next MTP: inputs_embeds are not supported; pass token ids")
        # Checked here in eager mode; under vLLM's compilation the first (traced) call skips it and
        # compute_logits, which is never compiled, checks before any draft token is produced.
        if not self._sharing_checked and not torch.compiler.is_compiling():
            self._check_sharing()
        return self.model(input_ids, positions, hidden_states, spec_step=spec_step_idx)

    def compute_logits(self, hidden_states: torch.Tensor, spec_step_idx: int = 0) -> torch.Tensor:
        if not self._sharing_checked:
            self._check_sharing()
        return self.model.compute_logits(hidden_states, self.logits_dtype)

    def expected_checkpoint_names(self) -> list[str]:
        """The ``mtp.*`` tensors this draft reads (checkpoint names: MTP layer j is ``mtp.layers.j``)."""
        offset = self.atom_config.model.num_hidden_layers
        names: list[str] = []
        for pname, p in self.model.named_parameters():
            if pname.split(".")[0] in ("embed_tokens", "lm_head"):
                continue
            for src in sources(self.model, pname, pname, p.shape[0]):  # a folded shared expert's too
                src = re.sub(r"^layers\.(\d+)\.", lambda m: f"layers.{int(m.group(1)) - offset}.", src)
                names.append("mtp." + src)
        return names

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        # Only mtp.* is read (atom-models raises a CheckpointError naming what is missing); the shared
        # embedding / lm_head are the target's and arrive through vLLM's proposer.
        ckpt = checkpoint_dir(self.draft_model_config)
        if not any(name.startswith("mtp.") for name in checkpoint_files(ckpt)):
            expected = self.expected_checkpoint_names()
            shown = ", ".join(expected[:12]) + (
                f", ... ({len(expected)} in all)" if len(expected) > 12 else ""
            )
            raise CheckpointError(
                ckpt,
                [
                    "speculative_config method 'mtp' needs the MTP head, but the checkpoint has no mtp.* "
                    f"tensors; missing: {shown}"
                ],
            )
        start_vllm_load_clock(weights)
        load_mtp(self.model, ckpt)
        hold_float32_experts(self.model, self.cores.kernels)  # as the target's (models/target.py)
        hold_packed_linears(self.model, self.cores.kernels)  # its own linears; the lm_head is the target's
        log_rank_memory("ATOM Qwen3-Next MTP draft", self.model.layout, self, self.cores, self.vllm_config)
        return all_parameter_names(self)
