"""Sequence groups of a flat varlen batch, for CPU ops that work on cache-sized pieces of it."""

from __future__ import annotations

GROUP_TOKENS = 256
"""Tokens of one group (at least one sequence per group): a group's float32 temporaries of a few KiB per
token stay within a core's L2 cache, where an op over the whole batch streams each of them from memory."""


def sequence_groups(offsets: list[int], budget: int = GROUP_TOKENS) -> list[tuple[int, int]]:
    """``(lo, hi)`` ranges of consecutive sequences (``offsets``: the ``N + 1`` cumulative token offsets)
    of at most ``budget`` tokens each, or one sequence where a sequence alone is longer."""
    groups: list[tuple[int, int]] = []
    lo = 0
    num_seqs = len(offsets) - 1
    for n in range(num_seqs):
        if n > lo and offsets[n + 1] - offsets[lo] > budget:
            groups.append((lo, n))
            lo = n
    if num_seqs > 0:
        groups.append((lo, num_seqs))
    return groups
