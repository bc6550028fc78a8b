"""Warm-up of the GDN prefill path: kernel compilation and autotuning before the first prompt.

Decode and verify kernels compile while CUDA graphs are captured. The prefill kernels (varlen conv, gating,
the chunked rule and, with pending tokens, the snapshot resume) compile on their first call, and fla-core's
chunked kernels autotune there too, so without a warm-up a server's first prompt waits for all of it
(on a GPU about a minute). A runner calls :func:`warm_up_prefill` once per layer configuration before
serving, with the layer's own weights and activations (kernels specialise on dtypes and strides) and a
factory of scratch state in its own storage layout; the real state is never touched.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import torch

from atom_models.gdn_meta import GDNPrefillMeta, GDNWeights
from atom_models.gdn_pipeline import gdn_prefill
from atom_models.gdn_state import GDNGeometry, GDNLayerState

# One token, a multiple of 16 tokens, and a varlen batch of mixed lengths (Triton specialises integer
# arguments equal to 1 and divisible by 16, so each is its own compiled variant).
WARMUP_BATCHES: tuple[tuple[int, ...], ...] = ((1,), (16,), (1, 2, 16, 80))


def warm_up_prefill(
    kernels,
    geometry: GDNGeometry,
    weights: GDNWeights,
    x: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    make_state: Callable[[int], GDNLayerState],
    batches: Sequence[Sequence[int]] = WARMUP_BATCHES,
) -> int:
    """Run :func:`~atom_models.gdn_pipeline.gdn_prefill` on each batch of sequence lengths in ``batches``
    twice on one scratch state from ``make_state(num_seqs)``: as fresh prompts, then as chunks continuing
    from that state (with pending tokens: resuming one pending token, the snapshot path).

    ``x[T, C]``, ``b``/``a`` ``[T, Hv]``: activations of the layer (their first rows are used; a batch
    longer than ``T`` is skipped). Returns the number of prefill calls made.
    """
    device = x.device
    calls = 0
    for lens in batches:
        total = sum(lens)
        if total > x.shape[0]:
            continue
        n = len(lens)
        state = make_state(n)
        cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=device)
        slots = torch.arange(n, dtype=torch.int32, device=device)
        lens_t = torch.tensor(lens, dtype=torch.int32, device=device)
        track = state.pending_pos is not None
        for continuing in (False, True):
            # a fresh prompt ends with pending_pos = len - 1; continuing at context len commits one token
            context = lens_t if continuing else torch.zeros_like(lens_t)
            meta = GDNPrefillMeta(
                num_seqs=n,
                num_tokens=total,
                cu_seqlens=cu,
                state_indices=slots,
                has_initial_state=torch.full((n,), continuing, dtype=torch.bool, device=device),
                context_lens=context if track else None,
                resume_pending=continuing and track,
            )
            gdn_prefill(kernels, geometry, weights, state, x[:total], b[:total], a[:total], meta)
            calls += 1
    return calls
