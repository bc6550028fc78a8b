"""Undo a discarded sample's random draws on vLLM-CPU the way CPU generators allow (vLLM 0.32).

Why: when a step samples a token it then throws away (a request whose prompt is only partly prefilled, as
happens under load with chunked prefill), vLLM's model runner rewinds the request's seeded generator so
that the seed's output does not depend on how the prompt was chunked: ``_bookkeeping_sync`` calls
``gen.set_offset(gen.get_offset() - 4)``, the CUDA Philox offset of one sampling op. CPU generators
(Mersenne Twister) have no offset and raise "CPU Generator does not use offset": the worker fails and the
engine dies. On vLLM-CPU, any seeded request that arrives while the batch is busy takes the server down.

The CPU equivalent of the rewind: the generator state of each request whose sample will be discarded is
saved before sampling and restored after it, and ``_bookkeeping_sync`` runs without those generators so that
it does not try to rewind them.

Extension point: none; two methods of vLLM's ``GPUModelRunner`` (which vLLM-CPU's model runner inherits) are
wrapped, on CPU only.

vLLM bug: the CUDA-only offset rewind of vllm-project/vllm#10097 runs on CPU generators too (no upstream issue
for CPU found); ``tests/test_patches_still_needed.py`` fails once vLLM's model runner stops rewinding by an
offset.
"""

from __future__ import annotations

import functools

import numpy as np


def _discarded(runner) -> list[int]:
    num_reqs = runner.input_batch.num_reqs
    return [int(i) for i in np.nonzero(runner.discard_request_mask.np[:num_reqs])[0]]


def apply() -> bool:
    """Wrap ``_sample`` and ``_bookkeeping_sync`` of vLLM's model runner on CPU; return whether it was done."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False  # CUDA/ROCm generators have Philox offsets: vLLM's own rewind works there
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if getattr(GPUModelRunner._sample, "atom_patched", False):
        return True
    sample, bookkeeping = GPUModelRunner._sample, GPUModelRunner._bookkeeping_sync

    @functools.wraps(sample)
    def _sample(self, *args, **kwargs):
        gens = self.input_batch.generators
        # a batch without seeded requests (the usual one) has nothing to save: no host work per step
        self._atom_pre_sample_states = (
            {i: gens[i].get_state() for i in _discarded(self) if i in gens} if gens else {}
        )
        return sample(self, *args, **kwargs)

    @functools.wraps(bookkeeping)
    def _bookkeeping_sync(self, *args, **kwargs):
        gens = self.input_batch.generators
        states = getattr(self, "_atom_pre_sample_states", {})
        held = {i: gens.pop(i) for i in _discarded(self) if i in gens} if gens else {}
        try:
            return bookkeeping(self, *args, **kwargs)
        finally:
            for i, gen in held.items():
                if i in states:
                    gen.set_state(states[i])
                gens[i] = gen
            self._atom_pre_sample_states = {}

    _sample.atom_patched = True
    GPUModelRunner._sample = _sample
    GPUModelRunner._bookkeeping_sync = _bookkeeping_sync
    return True
