"""The per-step metadata of the GDN pipeline: which rows of the flat batch are prefill, decode or verify
tokens, and their state slots. Built ONCE per step by whoever runs the model (the engine from its batch,
the vLLM plugin from vLLM's GDN metadata), then read by every GDN layer unchanged.

Decode and verify parts hold only device tensors and Python ints fixed by the batch's shape, so a layer
reads nothing back from the device (capturable in a CUDA graph). Tensors may be views into persistent
buffers that the builder refills each step.

State convention (one for every caller): a prefill or a plain decode writes a slot's committed state
directly and zeroes ``pending[s, 0]`` (an identity token), so the first verify after it passes
``num_accepted = 1`` like any verify after a step that accepted one token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GDNWeights:
    """What the pipeline needs of a GDN layer's parameters."""

    conv_weight: torch.Tensor  # [C, K] depthwise conv weight
    conv_bias: torch.Tensor | None  # [C] or None
    A_log: torch.Tensor  # [Hv]
    dt_bias: torch.Tensor  # [Hv]


@dataclass(frozen=True)
class GDNPrefillMeta:
    """``num_seqs`` prompt chunks (varlen): conv from offset-0 history, chunked delta rule, final states to
    the slots. Their tokens are rows ``[token_start, token_start + num_tokens)`` of the flat batch, or the
    rows ``token_index`` lists (sequence after sequence) when they are not contiguous."""

    num_seqs: int
    num_tokens: int
    cu_seqlens: torch.Tensor  # [num_seqs + 1] int32, offsets within the prefill tokens
    state_indices: torch.Tensor  # [num_seqs] int32 slots (< 0: padding)
    has_initial_state: torch.Tensor  # [num_seqs] bool: continue from the slot's state (a later chunk)
    token_start: int = 0
    token_index: torch.Tensor | None = None  # [num_tokens] int64 rows of the flat batch
    # With pending tokens (k > 0): the tokens each sequence had before this chunk ([num_seqs] int32), so the
    # chunk can resume from a snapshot (commit ``context_lens - pending_pos`` pending tokens first) and
    # record its own ``pending_pos``. ``resume_pending``: some sequence has an initial state (host-known).
    context_lens: torch.Tensor | None = None
    resume_pending: bool = False


@dataclass(frozen=True)
class GDNSnapshotMeta:
    """Whole-slot copies around one step (every state tensor of the slot: conv, ssm, pending, pending_pos).

    ``before_src[i] -> before_dst[i]`` run before any part of the step (a sequence moving to a new state
    slot, a block-boundary snapshot taken from the state a step starts from); ``after_src[i] ->
    after_dst[i]`` after the step (a snapshot of the state a verify leaves). int64 ``[n]`` device tensors;
    no destination repeats within a list and no destination is a source of the same list."""

    before_src: torch.Tensor
    before_dst: torch.Tensor
    after_src: torch.Tensor
    after_dst: torch.Tensor

    def __post_init__(self) -> None:
        for name, src, dst in (
            ("before", self.before_src, self.before_dst),
            ("after", self.after_src, self.after_dst),
        ):
            if src.shape != dst.shape or src.dim() != 1:
                raise ValueError(
                    f"GDNSnapshotMeta: {name}_src {tuple(src.shape)} and {name}_dst {tuple(dst.shape)} must be equal 1-D"
                )


@dataclass(frozen=True)
class GDNDecodeMeta:
    """``num_seqs`` plain one-token decodes (no speculative decoding for them), rows
    ``[token_start, token_start + num_seqs)``: conv update and recurrent rule, in place in each slot."""

    num_seqs: int
    state_indices: torch.Tensor  # [num_seqs] int32 slots (< 0: padding)
    token_start: int = 0


@dataclass(frozen=True)
class GDNVerifyMeta:
    """``num_seqs`` verifications of up to ``q_len`` tokens each (the last accepted token plus the drafts),
    through ``gated_delta_rule_verify`` (deferred commit).

    ``num_accepted[n]`` (1 ..= ``1 + k``) is how many tokens of the sequence's previous step were accepted:
    the conv op reads the history at that offset, and the verify op commits that many pending tokens.

    Rows: with ``gather_index`` None, the tokens are rows ``[token_start, token_start + num_seqs * q_len)``
    in (sequence, token) order. Otherwise ``gather_index[n * q_len + j]`` is the row of token j of
    sequence n (a shorter sequence is padded after its last token with any valid row) and
    ``scatter_index`` the output row it goes to (-1 for padding: dropped).
    """

    num_seqs: int
    q_len: int
    state_indices: torch.Tensor  # [num_seqs] int32 slots (< 0: padding row)
    num_accepted: torch.Tensor  # [num_seqs] int32 in [1, 1 + k]
    token_start: int = 0
    gather_index: torch.Tensor | None = None  # [num_seqs * q_len] int64
    scatter_index: torch.Tensor | None = None  # [num_seqs * q_len] int64, -1 = padding

    def __post_init__(self) -> None:
        if (self.gather_index is None) != (self.scatter_index is None):
            raise ValueError("GDNVerifyMeta: gather_index and scatter_index go together")


@dataclass(frozen=True)
class GDNStepMeta:
    """Everything the GDN layers need for one forward; parts cover disjoint rows of the flat batch, rows
    covered by none (batch padding) come out as zeros."""

    prefill: GDNPrefillMeta | None = None
    decodes: tuple[GDNDecodeMeta, ...] = ()
    verifies: tuple[GDNVerifyMeta, ...] = ()
    snapshots: GDNSnapshotMeta | None = None

    @property
    def capturable(self) -> bool:
        """No prefill part: the forward reads nothing from the host (decode / verify only)."""
        return self.prefill is None
