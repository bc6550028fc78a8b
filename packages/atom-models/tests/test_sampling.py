"""Sampling and speculative verification on synthetic distributions."""

from __future__ import annotations

import pytest
import torch
from atom_models.engine.sampling import SamplingParams, probs_from_logits, verify


def test_greedy_verify_accepts_matching_prefix():
    logits = torch.full((4, 6), -1.0)
    for row, best in enumerate([2, 5, 1, 3]):
        logits[row, best] = 1.0
    params = SamplingParams(temperature=0.0)
    assert verify(logits, [2, 5, 1], None, params, None) == (3, [2, 5, 1, 3])
    assert verify(logits, [2, 4, 1], None, params, None) == (1, [2, 5])
    assert verify(logits, [0, 5, 1], None, params, None) == (0, [2])
    assert verify(logits[:1], [], None, params, None) == (0, [2])


def test_top_p_keeps_smallest_nucleus():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    p = probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=0.75))
    assert torch.allclose(p, torch.tensor([0.5, 0.3, 0.0, 0.0]) / 0.8)
    p = probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=0.5))
    assert torch.allclose(p, torch.tensor([1.0, 0.0, 0.0, 0.0]))


@pytest.mark.parametrize("top_p", [0.8])
def test_rejection_sampling_reproduces_target_distribution(top_p):
    """Drafts from q, verified against p: the emitted first and second tokens follow p exactly."""
    torch.manual_seed(0)
    vocab, k, trials = 5, 2, 5000
    params = SamplingParams(temperature=1.0, top_p=top_p)
    target_logits = torch.randn(k + 1, vocab) * 1.5
    p = probs_from_logits(target_logits, params)
    # the draft is deliberately different, and its second-step distribution does not depend on the first
    q = probs_from_logits(torch.randn(k, vocab) * 1.5, SamplingParams(temperature=1.0))
    gen = torch.Generator().manual_seed(1)
    first = torch.zeros(vocab)
    second_after = torch.zeros(vocab, vocab)
    all_drafts = torch.stack(
        [torch.multinomial(q[j], trials, replacement=True, generator=gen) for j in range(k)], 1
    )
    for drafts in all_drafts.tolist():
        _, emitted = verify(target_logits, drafts, [q[0], q[1]], params, gen)
        first[emitted[0]] += 1
        if len(emitted) > 1:
            second_after[emitted[0], emitted[1]] += 1
    err = (first / trials - p[0]).abs().max().item()
    print(f"max |empirical - p| of the first token: {err:.4f}")
    assert err < 0.03, f"first token distribution off by {err:.4f}\nempirical {first / trials}\ntarget {p[0]}"
    # given the first token was the accepted draft, the second follows p[1] (checked on the most common one)
    t0 = int(first.argmax())
    row = second_after[t0]
    assert row.sum() > 1000, f"only {int(row.sum())} second tokens after token {t0}: too few to test"
    err2 = (row / row.sum() - p[1]).abs().max().item()
    print(f"max |empirical - p| of the second token after {t0}: {err2:.4f} ({int(row.sum())} samples)")
    assert err2 < 0.05, f"second token distribution off by {err2:.4f}"
