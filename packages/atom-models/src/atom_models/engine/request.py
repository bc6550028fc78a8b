"""A generation request and its speculative-decoding statistics."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from atom_models.engine.sampling import SamplingParams


@dataclass
class SpecStats:
    """Acceptance statistics, counted like vLLM's spec-decode metrics."""

    num_drafts: int = 0  # verification steps that carried drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, num_drafts: int, accepted: int) -> None:
        if len(self.accepted_per_position) < num_drafts:
            self.accepted_per_position.extend([0] * (num_drafts - len(self.accepted_per_position)))
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += accepted
        for j in range(accepted):
            self.accepted_per_position[j] += 1

    def merge(self, other: SpecStats) -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        n = max(len(self.accepted_per_position), len(other.accepted_per_position))
        a = self.accepted_per_position + [0] * (n - len(self.accepted_per_position))
        for j, v in enumerate(other.accepted_per_position):
            a[j] += v
        self.accepted_per_position = a

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """1 + accepted drafts per verification step (vLLM's definition)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    def as_dict(self) -> dict:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_position": list(self.accepted_per_position),
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
        }


@dataclass
class Request:
    request_id: int
    prompt_ids: list[int]
    params: SamplingParams
    num_spec: int  # drafts per verification step for this request
    generator: torch.Generator | None = None
    output_ids: list[int] = field(default_factory=list)
    stats: SpecStats = field(default_factory=SpecStats)
    # cache state
    blocks: list[int] = field(default_factory=list)
    slot: int = -1  # GDN state slot (conv row, recurrent state, pending row); -1: none held
    num_computed: int = 0  # tokens whose target KV / GDN state is final (positions 0..num_computed-1)
    # tokens of the previous target step that were accepted: the pending tokens the next verify commits
    # and the conv history offset; 0 right after the prefill (its state is already committed)
    num_accepted: int = 0
    drafts: list[int] = field(default_factory=list)
    draft_probs: list[torch.Tensor] | None = None
    finished: bool = False
    finish_reason: str | None = None
    num_steps: int = 0

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    def token_slice(self, start: int, stop: int) -> list[int]:
        """``all_ids[start:stop]`` (``0 <= start <= stop``) without concatenating the whole sequence."""
        n = len(self.prompt_ids)
        if stop <= n:
            return self.prompt_ids[start:stop]
        if start >= n:
            return self.output_ids[start - n : stop - n]
        return self.prompt_ids[start:] + self.output_ids[: stop - n]

    @property
    def prefilled(self) -> bool:
        return self.num_computed > 0
