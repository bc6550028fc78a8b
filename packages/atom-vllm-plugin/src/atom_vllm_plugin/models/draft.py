"""vLLM's ``Qwen3NextMTP`` draft architecture, served by atom-models' MTP head with vLLM-bound cores.

vLLM's MTP proposer builds this class under the model tag ``eagle_head``, loads it, then replaces
``draft.model.embed_tokens`` and ``draft.lm_head`` with the target's modules
(``SpecDecodeBaseProposer._maybe_share_embeddings`` / ``_maybe_share_lm_head``). Until then the draft holds
weightless placeholders, so no second copy of the embedding or lm_head is ever allocated; the
``lm_head`` assignment on the wrapper is forwarded to the atom MTP module that computes with it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from atom_core import ConfigError
from atom_models import Qwen3NextMTP, load_mtp
from torch import nn

from atom_vllm_plugin.config import DRAFT_ARCH, DRAFT_MODEL_TAG, from_vllm, model_tag
from atom_vllm_plugin.cores import VllmCoreFactory
from atom_vllm_plugin.models.common import all_parameter_names, checkpoint_dir, kernels_for


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


class AtomQwen3NextMTP(nn.Module):
    """The MTP draft: ``.model`` is the atom ``Qwen3NextMTP`` (vLLM replaces ``.model.embed_tokens``)."""

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
        self.cores = VllmCoreFactory(self.atom_config, kernels, gdn_state=None)
        mtp = Qwen3NextMTP(
            self.atom_config.model,
            self.cores,
            kernels,
            embed_tokens=AwaitingTarget("embed_tokens"),
            lm_head=AwaitingTarget("lm_head"),
            dtype=self.atom_config.dtype,
        )
        self.model = mtp
        self.lm_head = mtp.lm_head

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        # vLLM's proposer does `draft.lm_head = target.lm_head`; the atom MTP computes with its own
        # attribute, so forward the assignment (one module, shared, no copy).
        if name == "lm_head" and isinstance(value, nn.Module) and "model" in self._modules:
            self.model.lm_head = value

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
        return self.model(input_ids, positions, hidden_states, spec_step=spec_step_idx)

    def compute_logits(self, hidden_states: torch.Tensor, spec_step_idx: int = 0) -> torch.Tensor:
        return self.model.compute_logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        # Only mtp.* is read (atom-models raises a CheckpointError naming what is missing); the shared
        # embedding / lm_head are the target's and arrive through vLLM's proposer.
        load_mtp(self.model, checkpoint_dir(self.draft_model_config))
        return all_parameter_names(self)
