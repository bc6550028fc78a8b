"""Gated DeltaNet core for vLLM: a vLLM Mamba layer whose forward is ``atom_models``' GDN pipeline.

atom-models' ``GatedDeltaNet`` calls ``core(mixed_qkv, b, a, weights, ctx)`` with the pre-conv q|k|v.
State (allocated by vLLM, one page per slot, see ``gdn_state``): conv state stored ``[S, K - 1 + k, C]``
(vLLM's "SD" layout; the pipeline takes the transposed ``[S, C, W]`` view), the committed recurrent state
``[S, Hv, Dv, Dk]`` and, with MTP (k > 0), ``pending [S, 1 + k, P]`` float32 and ``pending_pos [S, 1]``.

Everything of a request's step lives in one slot: ``get_kv_cache_spec`` asks vLLM for no speculative state
blocks (vLLM's default is ``1 + k`` per request, one per verify token). Without prefix caching the
block-table row has that single column; with it (Mamba "align" mode) the row has one column per
``block_size`` tokens and the step computes in the column of its last token, after the whole-slot copies
that ``gdn_snapshots`` plans (moving the state there, keeping shared blocks valid at their boundary).

Verification uses deferred commit (``gated_delta_rule_verify``): a verify step first
commits the ``num_accepted`` tokens of the previous step that vLLM accepted, verifies its own tokens without
storing any per-token state, and stashes them as the new pending tokens; a rejected draft is never applied
and nothing has to be copied back. A prefill writes the committed state and zeroes ``pending[s, 0]`` (an
identity token): vLLM passes ``num_accepted = 1`` to the first verify after a prefill.

The per-step record (``GDNStepMeta``) is built once per step by the metadata builder (``gdn_backend``);
the forward only reads it.
"""

from __future__ import annotations

import dataclasses

import torch
from atom_models.gdn_meta import GDNWeights
from atom_models.gdn_pipeline import gdn_forward
from atom_models.gdn_state import GDNLayerState
from atom_models.gdn_warmup import warm_up_prefill
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

from atom_vllm_plugin.layers.custom_ops import register_ops
from atom_vllm_plugin.layers.forward_context import layer_metadata
from atom_vllm_plugin.layers.gdn_backend import AtomGDNAttentionBackend, AtomGDNAttentionMetadata
from atom_vllm_plugin.layers.gdn_snapshots import SnapshotSchedule
from atom_vllm_plugin.layers.gdn_state import GDNStateSpec


class AtomGDNCore(nn.Module, MambaBase):
    """One GDN layer's state binding; ``forward(mixed_qkv[T, C], b[T, Hv], a[T, Hv], weights, ctx) -> [T, Hv, Dv]``."""

    def __init__(
        self, prefix: str, state: GDNStateSpec, kernels, snapshot_schedule: SnapshotSchedule | None = None
    ) -> None:
        super().__init__()
        register_ops()
        self.layer_name = prefix
        self.prefix = prefix
        self.state = state
        self.kernels = kernels
        # the model's schedule of whole-slot copies (prefix caching), shared by its GDN layers
        self.snapshot_schedule = snapshot_schedule if snapshot_schedule is not None else SnapshotSchedule()
        self.kv_cache = tuple(torch.tensor([]) for _ in state.shapes())  # replaced by bind_kv_cache
        # set by the first profiling run: Triton compiles, fla-core autotunes the prefill kernels there
        self.prefill_warmed_up = False

    # ---- vLLM's MambaBase ----------------------------------------------------------------------
    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        return MambaAttentionBackendEnum.GDN_ATTN

    def get_state_shape(self) -> tuple[tuple[int, ...], ...]:
        return self.state.shapes()

    def get_state_dtype(self) -> tuple[torch.dtype, ...]:
        return self.state.dtypes

    def get_attn_backend(self) -> type[AtomGDNAttentionBackend]:
        return AtomGDNAttentionBackend

    def get_kv_cache_spec(self, vllm_config: VllmConfig):
        """vLLM's Mamba spec, but no speculative state blocks (vLLM's default reserves ``k`` per request).

        ``MambaBase`` reserves ``num_speculative_blocks = k`` extra blocks per request for per-token verify
        states; deferred commit keeps a step's state, pending tokens included, in one block, so they would
        be dead memory. Without them vLLM's GDN metadata builder's ``spec_state_indices_tensor``
        (``1 + k`` columns from the step's state block on) has one column, which is all the verify part
        reads; in "align" mode (prefix caching) vLLM places the step's state block at the column of its
        last token, and the blocks it shares are the snapshots ``gdn_snapshots`` keeps valid.
        """
        spec = super().get_kv_cache_spec(vllm_config)
        if spec.num_speculative_blocks > 0:
            spec = dataclasses.replace(spec, num_speculative_blocks=0)
        return spec

    # ---- state views -----------------------------------------------------------------------------
    def layer_state(self) -> GDNLayerState:
        """The bound tensors as the pipeline's state (conv as the ``[S, C, W]`` view)."""
        return self._as_layer_state(self.kv_cache)

    def scratch_state(self, num_slots: int, device: torch.device) -> GDNLayerState:
        """Zeroed state of ``num_slots`` slots in this layer's storage layout and dtypes (not vLLM's cache)."""
        return self._as_layer_state(
            tuple(
                torch.zeros(num_slots, *shape, dtype=dtype, device=device)
                for shape, dtype in zip(self.state.shapes(), self.state.dtypes, strict=True)
            )
        )

    def _as_layer_state(self, tensors: tuple[torch.Tensor, ...]) -> GDNLayerState:
        conv = tensors[0] if self.state.conv_dim_first else tensors[0].transpose(1, 2)
        if not self.state.has_pending:
            return GDNLayerState(conv=conv, ssm=tensors[1])
        return GDNLayerState(conv=conv, ssm=tensors[1], pending=tensors[2], pending_pos=tensors[3])

    # ---- the core ----------------------------------------------------------------------------------
    def forward(
        self, mixed_qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor, weights: GDNWeights, ctx=None
    ):
        # Through the opaque op vllm::atom_gdn_core (a splitting op of vLLM's compiled graph), which calls
        # run_into with this step's metadata; the weights travel as the op's tensor arguments.
        geo = self.state.geometry
        out = mixed_qkv.new_empty(mixed_qkv.shape[0], geo.num_v_heads, geo.head_v_dim)
        w = weights
        torch.ops.vllm.atom_gdn_core(
            mixed_qkv, b, a, w.conv_weight, w.conv_bias, w.A_log, w.dt_bias, out, self.layer_name
        )
        return out

    def run_into(
        self,
        out: torch.Tensor,
        mixed_qkv: torch.Tensor,
        b: torch.Tensor,
        a: torch.Tensor,
        weights: GDNWeights,
    ) -> None:
        """The op's body: ``out`` = the core with this step's metadata."""
        out.copy_(self.run(layer_metadata(self.layer_name), mixed_qkv, b, a, weights))

    def run(
        self,
        md: AtomGDNAttentionMetadata | None,
        mixed_qkv: torch.Tensor,
        b: torch.Tensor,
        a: torch.Tensor,
        weights: GDNWeights,
    ) -> torch.Tensor:
        """The core for explicit metadata (``None``: vLLM's profiling or dummy run, zeros out; the first one
        warms the prefill kernels up on scratch state, see :mod:`atom_models.gdn_warmup`)."""
        geo = self.state.geometry
        if md is None:
            if not self.prefill_warmed_up:
                make_state = lambda n: self.scratch_state(n, mixed_qkv.device)  # noqa: E731
                warm_up_prefill(self.kernels, geo, weights, mixed_qkv, b, a, make_state)
                self.prefill_warmed_up = True
            return mixed_qkv.new_zeros(mixed_qkv.shape[0], geo.num_v_heads, geo.head_v_dim)
        if not isinstance(md, AtomGDNAttentionMetadata) or md.step is None:
            raise TypeError(
                f"{self.layer_name}: expected AtomGDNAttentionMetadata with its step record, got "
                f"{type(md).__name__}"
            )
        return gdn_forward(self.kernels, geo, weights, self.layer_state(), mixed_qkv, b, a, md.step)

    def extra_repr(self) -> str:
        return f"{self.layer_name}, {self.state}"
