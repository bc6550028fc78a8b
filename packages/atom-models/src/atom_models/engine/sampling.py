"""Sampling and speculative verification (greedy argmax match, or rejection sampling for temperature > 0).

Rejection sampling (Leviathan et al. / Chen et al.): draft token d_j drawn from q_j is accepted with
probability ``min(1, p_j(d_j) / q_j(d_j))``; at the first rejection a token is drawn from
``normalize(max(0, p_j - q_j))``; if every draft is accepted a bonus token is drawn from ``p_{k+1}``.
The emitted tokens are then distributed exactly as sampling from the target alone. ``p`` and ``q`` are
the *processed* distributions (temperature, top-p) of target and draft.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    num_speculative_tokens: int | None = None  # None: the engine's k; else 0 <= k <= the engine's k

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """``[..., V]`` float32 probabilities after temperature and top-p (nucleus) filtering."""
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # drop a token when the mass strictly before it already reaches top_p (the top token always stays)
        drop = (sorted_p.cumsum(dim=-1) - sorted_p) >= params.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator).item())


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None):
    """One token from ``logits[V]``; returns ``(token, probs)`` (probs None when greedy)."""
    if params.greedy:
        return int(torch.argmax(logits).item()), None
    probs = probs_from_logits(logits, params)
    return sample(probs, generator), probs


def verify(
    target_logits: torch.Tensor,
    drafts: list[int],
    draft_probs: list[torch.Tensor] | None,
    params: SamplingParams,
    generator: torch.Generator | None,
) -> tuple[int, list[int]]:
    """Verify ``k`` drafts against ``target_logits[k + 1, V]``.

    Returns ``(accepted, emitted)``: how many drafts were accepted and the tokens to emit
    (the accepted drafts followed by one corrected/bonus token, so ``len(emitted) == accepted + 1``).
    """
    k = len(drafts)
    if target_logits.shape[0] != k + 1:
        raise ValueError(
            f"target_logits: expected {k + 1} rows (1 + number of drafts), got {target_logits.shape[0]}"
        )
    if params.greedy:
        return verify_greedy(torch.argmax(target_logits, dim=-1).tolist(), drafts)
    return verify_probs(probs_from_logits(target_logits, params), drafts, draft_probs, generator)


def verify_greedy_rows(
    best: torch.Tensor, input_ids: torch.Tensor, q: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification of ``b`` sequences at once, on the device (no host sync): sequence ``i`` holds
    rows ``i*q .. i*q + q - 1`` of ``input_ids[b*q]`` (its pending token, then ``q - 1`` drafts) and of the
    target argmax ``best[b*q]``. Returns ``accepted[b]`` (int64: leading drafts equal to the argmax of the
    row before them) and ``tokens[b, q]`` = ``best`` per sequence: its emitted tokens are
    ``tokens[i, :accepted[i] + 1]`` (the accepted drafts equal their argmax, then the corrected / bonus
    token). The one definition of greedy acceptance: :func:`verify_greedy` is its host form."""
    tokens = best.view(-1, q)
    match = input_ids.view(-1, q)[:, 1:] == tokens[:, :-1]  # [b, q - 1]
    accepted = match.long().cumprod(dim=1).sum(dim=1)
    return accepted, tokens


def verify_greedy(best: list[int], drafts: list[int]) -> tuple[int, list[int]]:
    """Greedy verification of one sequence from the target's argmax ids ``best[k + 1]`` (read from the
    device): :func:`verify_greedy_rows` on the host. Returns ``(accepted, emitted)`` as :func:`verify`."""
    if len(best) != len(drafts) + 1:
        raise ValueError(f"best: expected {len(drafts) + 1} ids (1 + number of drafts), got {len(best)}")
    rows = torch.tensor([0, *drafts], dtype=torch.int64)  # the pending token's id is not compared
    accepted, _ = verify_greedy_rows(torch.tensor(best, dtype=torch.int64), rows, len(best))
    a = int(accepted[0])
    return a, drafts[:a] + [best[a]]


def verify_probs(
    p: torch.Tensor,
    drafts: list[int],
    draft_probs: list[torch.Tensor] | None,
    generator: torch.Generator | None,
) -> tuple[int, list[int]]:
    """Rejection sampling from the target's processed probabilities ``p[k + 1, V]``."""
    k = len(drafts)
    if p.shape[0] != k + 1:
        raise ValueError(f"p: expected {k + 1} rows (1 + number of drafts), got {p.shape[0]}")
    if draft_probs is None or len(draft_probs) != k:
        raise ValueError("draft_probs: rejection sampling needs the draft distribution of every draft token")
    for j, d in enumerate(drafts):
        q = draft_probs[j]
        u = torch.rand((), generator=generator, device=p.device).item()
        if q[d] > 0 and u * float(q[d]) < float(p[j, d]):
            continue
        residual = torch.clamp(p[j] - q, min=0.0)
        total = residual.sum()
        token = sample(residual / total if total > 0 else p[j], generator)
        return j, drafts[:j] + [token]
    return k, drafts + [sample(p[k], generator)]
