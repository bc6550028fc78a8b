"""Gated DeltaNet core for vLLM: a vLLM Mamba layer over vLLM's conv / recurrent state, computed by atom_kernels.

atom-models' ``GatedDeltaNet`` calls ``core(mixed_qkv, b, a, layer, ctx)`` with the pre-conv q|k|v.
State (allocated by vLLM, one page per slot, see ``gdn_state``): conv state stored ``[S, K - 1 + k, C]``
(vLLM's "SD" layout; the kernels take the transposed ``[S, C, W]`` view), the committed recurrent state
``[S, Hv, Dv, Dk]`` and, with MTP (k > 0), ``pending [S, 1 + k, P]`` float32.

Everything of a request lives in one slot: its block-table row has a single column, since
``get_kv_cache_spec`` asks vLLM for no speculative state blocks (vLLM's default is ``1 + k`` per request,
one per verify token). Verification uses deferred commit
(``gated_delta_rule_verify``): a verify step first commits the ``num_accepted`` tokens of the previous
step that vLLM accepted (replaying what it stashed for them on the committed state), verifies its own
``1 + drafts`` tokens without storing any per-token state, and stashes them as the new pending tokens. So a
rejected draft is never applied and nothing has to be copied back. The conv history stays rolled per
atom_kernels' convention (the next step reads it at offset ``num_accepted - 1``). A prefill writes the
committed state and zeroes ``pending[s, 0]`` (an identity token): vLLM passes ``num_accepted = 1`` to the
first verify after a prefill. Without MTP there is no pending tensor and decodes use the plain recurrent op.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

from atom_vllm_plugin.layers.forward_context import layer_metadata
from atom_vllm_plugin.layers.gdn_backend import AtomGDNAttentionBackend
from atom_vllm_plugin.layers.gdn_state import GDNStateSpec


class AtomGDNCore(nn.Module, MambaBase):
    """One GDN layer's state binding; ``forward(mixed_qkv[T, C], b[T, Hv], a[T, Hv], layer, ctx) -> [T, Hv, Dv]``."""

    def __init__(self, prefix: str, state: GDNStateSpec, kernels) -> None:
        super().__init__()
        self.layer_name = prefix
        self.prefix = prefix
        self.state = state
        self.kernels = kernels
        self.kv_cache = tuple(torch.tensor([]) for _ in state.shapes())  # replaced by bind_kv_cache

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
        """vLLM's Mamba spec, but one state block per request instead of ``1 + k``.

        ``MambaBase`` reserves ``num_speculative_blocks = k`` extra blocks per request for per-token
        verify states; deferred commit keeps everything in column 0, so they would be dead memory. With
        none of them, vLLM's block tables have one column, and its GDN metadata builder's
        ``spec_state_indices_tensor`` (``block_table[:, :1 + k]``) has one column, which is all ``_verify``
        reads. Only for ``mamba_cache_mode == "none"``: "align" (prefix caching) positions its blocks and
        copies states around the speculative blocks, which this core does not support either way.
        """
        spec = super().get_kv_cache_spec(vllm_config)
        if vllm_config.cache_config.mamba_cache_mode == "none" and spec.num_speculative_blocks > 0:
            spec = dataclasses.replace(spec, num_speculative_blocks=0)
        return spec

    # ---- state views -----------------------------------------------------------------------------
    def conv_state(self) -> torch.Tensor:
        """``[S, C, W]`` view of the conv state (vLLM stores ``[S, W, C]`` unless the DS layout is forced)."""
        conv = self.kv_cache[0]
        return conv if is_conv_state_dim_first() else conv.transpose(1, 2)

    def ssm_state(self) -> torch.Tensor:
        return self.kv_cache[1]

    def pending(self) -> torch.Tensor:
        """``[S, 1 + k, P]`` float32: the previous verify step's stashed tokens per slot (MTP only)."""
        if not self.state.has_pending:
            raise RuntimeError(
                f"{self.layer_name}: no pending-token state without speculative decoding (k = 0)"
            )
        return self.kv_cache[2]

    # ---- the core ----------------------------------------------------------------------------------
    def forward(self, mixed_qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor, layer: nn.Module, ctx=None):
        return self.run(layer_metadata(self.layer_name), mixed_qkv, b, a, layer)

    def run(
        self,
        md: GDNAttentionMetadata | None,
        mixed_qkv: torch.Tensor,
        b: torch.Tensor,
        a: torch.Tensor,
        layer,
    ):
        """The core for explicit metadata (``None``: profiling run, zeros out)."""
        s = self.state
        out = mixed_qkv.new_zeros(mixed_qkv.shape[0], s.num_v_heads, s.head_v_dim)
        if md is None:
            return out
        if not isinstance(md, GDNAttentionMetadata):
            raise TypeError(f"{self.layer_name}: expected GDNAttentionMetadata, got {type(md).__name__}")
        if md.num_actual_tokens == 0:
            return out
        weight = layer.conv1d.weight.view(s.conv_dim, s.conv_kernel)
        conv_args = (weight, layer.conv1d.bias)

        if md.spec_sequence_masks is None:
            nd, ndt = md.num_decodes, md.num_decode_tokens
            if nd > 0:
                idx = md.non_spec_state_indices_tensor[:nd]
                out[:ndt] = self._decode(mixed_qkv[:ndt], b[:ndt], a[:ndt], layer, conv_args, idx)
            if md.num_prefills > 0:
                lo, hi = ndt, ndt + md.num_prefill_tokens
                out[lo:hi] = self._prefill(mixed_qkv[lo:hi], b[lo:hi], a[lo:hi], layer, conv_args, md)
            return out

        # Speculative batch: verification rows (1 + drafts tokens each) and maybe prompt chunks.
        n_spec = md.num_spec_decodes
        qsl = md.spec_query_start_loc[: n_spec + 1].tolist()
        lens = [qsl[i + 1] - qsl[i] for i in range(n_spec)]
        mixed_only = md.num_prefills == 0 and md.num_decodes == 0
        if mixed_only:
            n_tok = qsl[-1]
            x_s, b_s, a_s = mixed_qkv[:n_tok], b[:n_tok], a[:n_tok]
        else:
            ti = md.spec_token_indx.long()
            x_s, b_s, a_s = mixed_qkv.index_select(0, ti), b.index_select(0, ti), a.index_select(0, ti)
        o_s = self._verify(
            x_s,
            b_s,
            a_s,
            layer,
            conv_args,
            md.spec_state_indices_tensor[:n_spec],
            md.num_accepted_tokens,
            lens,
        )
        if mixed_only:
            out[: o_s.shape[0]] = o_s
            return out
        out.index_copy_(0, md.spec_token_indx.long(), o_s)
        if md.num_prefills > 0:
            ni = md.non_spec_token_indx.long()
            o_p = self._prefill(
                mixed_qkv.index_select(0, ni),
                b.index_select(0, ni),
                a.index_select(0, ni),
                layer,
                conv_args,
                md,
            )
            out.index_copy_(0, ni, o_p)
        return out

    def _prefill(self, x, b, a, layer, conv_args, md: GDNAttentionMetadata) -> torch.Tensor:
        """Prompt chunks (varlen): conv from offset-0 history, chunked delta rule, final states to slot 0;
        then ``pending[s, 0]`` becomes an identity token (see ``_reset_pending``)."""
        kern, s = self.kernels, self.state
        n = md.num_prefills
        cu = md.prefill_query_start_loc[: n + 1].to(torch.int32)
        idx = md.prefill_state_indices[:n].to(torch.int32)
        has_init = md.prefill_has_initial_state[:n]
        x = kern.causal_conv1d_varlen(x, *conv_args, cu, self.conv_state(), idx, has_init, activation="silu")
        q, k, v = layer.split_qkv(x)
        g, beta = kern.gdn_gating(layer.A_log, a, layer.dt_bias, b)
        o = kern.gated_delta_rule_chunked(
            q, k, v, g, beta, cu, self.ssm_state(), idx, has_init, scale=s.scale, use_qk_l2norm=True
        )
        self._reset_pending(idx)
        return o

    def _decode(self, x, b, a, layer, conv_args, slots: torch.Tensor) -> torch.Tensor:
        """Plain one-token decodes (the non-speculative path): recurrent op from and to each row's slot.

        With MTP vLLM sends every decode row down the speculative path; only a one-token prompt chunk
        lands here. It leaves ``pending[s, 0]`` an identity token (as the prefill did before it), so the
        next verify's ``num_accepted = 1`` commits nothing new.
        """
        kern, s = self.kernels, self.state
        n = x.shape[0]
        idx = slots.to(torch.int32).contiguous()
        xc = kern.causal_conv1d_update(
            x.view(n, 1, -1), *conv_args, self.conv_state(), idx, None, activation="silu"
        )
        q, k, v = layer.split_qkv(xc)
        g, beta = kern.gdn_gating(layer.A_log, a, layer.dt_bias, b)
        o = kern.gated_delta_rule_recurrent(
            q, k, v, g.view(n, 1, -1), beta.view(n, 1, -1), self.ssm_state(), idx.view(n, 1), None,
            scale=s.scale, use_qk_l2norm=True,
        )  # fmt: skip
        self._reset_pending(idx)
        return o.reshape(n, s.num_v_heads, s.head_v_dim)

    def _verify(self, x, b, a, layer, conv_args, slots, num_accepted, lens: list[int]) -> torch.Tensor:
        """Verification rows of ``lens[i]`` tokens each (flat ``x``), padded to a uniform ``[N, Q]``.

        Deferred commit in each row's column-0 slot: ``gated_delta_rule_verify`` commits the first
        ``num_accepted[i]`` pending tokens of the previous step, verifies these tokens and stashes them.
        ``Q = max(lens)``: the initial state is always the committed one, so nothing has to reach back to a
        column beyond a row's own length (``num_accepted <= 1 + k`` fits the pending buffer regardless).
        Padding tokens follow a row's real tokens, so they never reach its real outputs; they are stashed
        and written to conv columns, but never used: the next step commits ``num_accepted' <= lens[i]``
        pending tokens (the accepted drafts plus one) and reads the conv history ending at token
        ``num_accepted' - 1``.
        """
        kern, s = self.kernels, self.state
        n = len(lens)
        acc = num_accepted[:n].to(torch.int32)
        q_max = max(max(lens), 1)
        uniform = all(ln == q_max for ln in lens)
        if uniform:
            xp, bp, ap = x.view(n, q_max, -1), b.view(n, q_max, -1), a.view(n, q_max, -1)
        else:
            rows = torch.tensor(
                [i for i, ln in enumerate(lens) for _ in range(ln)], dtype=torch.long, device=x.device
            )
            cols = torch.tensor([j for ln in lens for j in range(ln)], dtype=torch.long, device=x.device)
            xp = x.new_zeros(n, q_max, x.shape[-1])
            bp = b.new_zeros(n, q_max, b.shape[-1])
            ap = a.new_zeros(n, q_max, a.shape[-1])
            xp[rows, cols], bp[rows, cols], ap[rows, cols] = x, b, a
        idx = slots[:, 0].to(torch.int32).contiguous()
        xc = kern.causal_conv1d_update(xp, *conv_args, self.conv_state(), idx, acc, activation="silu")
        q, k, v = layer.split_qkv(xc)
        g, beta = kern.gdn_gating(
            layer.A_log, ap.reshape(n * q_max, -1), layer.dt_bias, bp.reshape(n * q_max, -1)
        )
        o = kern.gated_delta_rule_verify(
            q,
            k,
            v,
            g.view(n, q_max, -1),
            beta.view(n, q_max, -1),
            self.ssm_state(),
            self.pending(),
            idx,
            acc,
            scale=s.scale,
            use_qk_l2norm=True,
        )
        if uniform:
            return o.reshape(n * q_max, s.num_v_heads, s.head_v_dim)
        return o[rows, cols]

    def _reset_pending(self, slots: torch.Tensor) -> None:
        """Make ``pending[s, 0]`` an identity token (all zeros, per the verify op's contract) for every
        real slot (>= 0).

        Called after a step that wrote the committed state of ``s`` directly (prefill, plain decode): the
        next verify commits ``num_accepted = 1`` pending token, which must then change nothing. Padding
        rows (slot < 0) are never clamped onto a real slot's data: they write zeros into the largest real
        slot of the batch (zeroed anyway) or, in a batch of padding only, slot 0's own row back to it.
        Device ops only (no boolean indexing, no host sync), so a captured CUDA graph can replay it.
        """
        if not self.state.has_pending or slots.numel() == 0:
            return
        pending = self.pending()
        top = slots.max()
        target = torch.where(slots >= 0, slots, top.clamp(min=0)).long()
        keep = (slots < 0) & (top < 0)  # padding-only batch: write slot 0's row back unchanged
        pending[target, 0] = torch.where(keep[:, None], pending[target, 0], 0.0)

    def extra_repr(self) -> str:
        return f"{self.layer_name}, {self.state}"
