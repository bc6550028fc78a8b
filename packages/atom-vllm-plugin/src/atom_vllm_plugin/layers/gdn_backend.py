"""ATOM's Gated DeltaNet backend for vLLM: vLLM's GDN metadata format, our builder class.

vLLM's ``GDNAttentionMetadata`` already describes exactly what our GDN core needs (prefill / decode /
spec-decode split, per-request state slots (one column: ``AtomGDNCore.get_kv_cache_spec`` asks for no
speculative state blocks, and deferred-commit verification needs only the request's own slot),
``num_accepted_tokens``, spec / non-spec token index lists for mixed batches), and the model runner passes
``num_accepted_tokens`` / ``num_decode_draft_tokens_cpu`` only to builders that are instances of
``GDNAttentionMetadataBuilder``. So our builder subclasses it; the backend is ours so the layers name
their own builder and never reach vLLM's kernels.
"""

from __future__ import annotations

from vllm.v1.attention.backends.gdn_attn import GDNAttentionBackend, GDNAttentionMetadataBuilder


class AtomGDNAttentionMetadataBuilder(GDNAttentionMetadataBuilder):
    """vLLM's GDN metadata; the reorder threshold is 1 + k (a verification batch counts as a decode)."""


class AtomGDNAttentionBackend(GDNAttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "GDN_ATTN"

    @staticmethod
    def get_builder_cls() -> type[AtomGDNAttentionMetadataBuilder]:
        return AtomGDNAttentionMetadataBuilder
