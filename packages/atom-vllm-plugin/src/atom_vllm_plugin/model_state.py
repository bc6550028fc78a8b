"""The target's model state under vLLM's Model Runner V2: vLLM's hybrid state, with prefix caching's GDN
copies replaced by the plugin's.

Model Runner V2 (``vllm/v1/worker/gpu/``) asks the model for its model state class
(``model.get_model_state_cls()``, ``model_states/__init__.py``) and otherwise gives hybrid models
``MambaHybridModelState``. That state passes the accepted-token counts to the GDN metadata builders,
which the plugin needs unchanged; but with prefix caching (Mamba "align" mode) it also moves each
request's state between blocks with vLLM's fused copy kernels, which assume one state per token: they
copy the two state tensors vLLM knows of, shift the conv window by the accepted count and reset the
accepted count to 1 at a block boundary. The plugin's deferred-commit GDN state has four tensors and
commits its pending tokens in the next step, so those copies would corrupt it.

:class:`AtomHybridModelState` keeps vLLM's state and, in align mode, never builds vLLM's copy context;
instead :class:`~atom_vllm_plugin.layers.gdn_align_state.AlignSnapshots` plans every step on the device
(atom-models' block-snapshot plan), copies whole slots of every GDN layer before the forward, and after
sampling (once vLLM has recorded the accepted counts, which the slots keep) copies the step's snapshot
into the block that vLLM shares. vLLM's ``prepare_attn`` hands precomputed aligned state indices only to
builders that ask for them; the plugin's GDN builder does not, and reads the block of each request's last
token itself, which is the column the plan computes in.

This module imports Model Runner V2 and is imported only from the target's ``get_model_state_cls``
(``models.target``), which Model Runner V2 alone calls.
"""

from __future__ import annotations

import numpy as np
import torch
from atom_models.gdn_snapshot import SlotCopier
from vllm.v1.worker.gpu.model_states.mamba_hybrid import MambaHybridModelState
from vllm.v1.worker.mamba_utils import get_mamba_groups

from atom_vllm_plugin.layers.gdn_align_state import AlignSnapshots
from atom_vllm_plugin.layers.host_copy import to_device
from atom_vllm_plugin.patches.mamba_align import atom_groups


def verify_rows(is_prefilling: np.ndarray, prefill_runs_as_decode: np.ndarray | None) -> np.ndarray:
    """Rows that vLLM's GDN builder runs as spec-decode rows (bool): every row but a prompt chunk; a prompt
    tail that Model Runner V2 runs as a decode (one new prompt token, possibly with placeholder drafts)
    is a spec-decode row too."""
    prefill = np.asarray(is_prefilling, dtype=bool)
    if prefill_runs_as_decode is not None:
        prefill = prefill & ~np.asarray(prefill_runs_as_decode, dtype=bool)
    return ~prefill


class AtomHybridModelState(MambaHybridModelState):
    """vLLM's hybrid model state with the plugin's align-mode GDN snapshots (see the module docstring)."""

    def __init__(self, vllm_config, model, encoder_cache, device) -> None:
        super().__init__(vllm_config, model, encoder_cache, device)
        self.snapshots: AlignSnapshots | None = None

    def add_request(self, req_index: int, new_req_data) -> None:
        super().add_request(req_index, new_req_data)
        if self._align_mode:
            if self.snapshots is None:
                raise RuntimeError("AtomHybridModelState: a request was added before the KV cache")
            self.snapshots.seed(req_index, new_req_data.num_computed_tokens)

    def initialize_kv_cache(self, kv_cache_config, block_tables) -> None:
        """Align mode: the copier of each Mamba group's GDN layers (built over the state tensors bound now:
        vLLM calls this again after it binds new ones) and its device block table. vLLM's copy context is not
        built, so vLLM's align copies never run."""
        if not self._align_mode:
            return
        forward_context = self.vllm_config.compilation_config.static_forward_context
        groups = atom_groups(kv_cache_config, forward_context)
        if groups is None:
            raise TypeError(
                "AtomHybridModelState serves models whose Mamba layers are ATOM GDN cores; this model has none"
            )
        sizes = {spec.block_size for spec in get_mamba_groups(kv_cache_config)}
        if len(sizes) != 1:
            raise ValueError(f"Mamba groups of different block sizes {sorted(sizes)}: align mode needs one")
        self.snapshots = AlignSnapshots(
            self.max_num_reqs,
            sizes.pop(),
            self.device,
            [
                (
                    block_tables.block_tables[gid].gpu,
                    SlotCopier(cores[0].kernels, [core.layer_state() for core in cores], names),
                )
                for gid, names, cores in groups
            ],
        )

    def preprocess_state(self, input_batch, block_tables, kv_cache_config, num_computed_tokens) -> None:
        """Align mode: plan the step on the device and copy the states due before its forward."""
        if not self._align_mode or input_batch.num_reqs == 0:
            return
        if self.snapshots is None:
            raise RuntimeError("AtomHybridModelState: a step ran before the KV cache was initialised")
        n = input_batch.num_reqs
        verify = verify_rows(
            input_batch.is_prefilling_np[:n], _head(input_batch.prefill_runs_as_decode_np, n)
        )
        self.snapshots.before_step(
            input_batch.idx_mapping[:n],
            num_computed_tokens,
            input_batch.query_start_loc,
            to_device(verify, self.device),
        )

    def postprocess_state(
        self,
        idx_mapping: torch.Tensor,
        num_sampled: torch.Tensor | int,
        num_computed_tokens: torch.Tensor | None = None,
    ) -> None:
        """vLLM's (records the accepted counts; no align copies without its copy context), then the
        step's copies due after it."""
        super().postprocess_state(idx_mapping, num_sampled, num_computed_tokens)
        if self._align_mode and self.snapshots is not None:
            self.snapshots.after_step()


def _head(a: np.ndarray | None, n: int) -> np.ndarray | None:
    return None if a is None else a[:n]
