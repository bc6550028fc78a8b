"""Cache memory of the standalone engine: paged KV blocks and GDN state slots, with their allocators."""

from __future__ import annotations

import torch
from atom_core import Qwen3NextConfig


class BlockAllocator:
    """Free list of KV-cache block ids (``num_blocks`` blocks of ``block_size`` tokens)."""

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self._allocated: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"KV cache out of blocks: asked for {n}, {len(self._free)} free")
        out = [self._free.pop() for _ in range(n)]
        self._allocated.update(out)
        return out

    def free(self, blocks: list[int]) -> None:
        bad = [b for b in blocks if b not in self._allocated]
        if bad or len(set(blocks)) != len(blocks):
            raise RuntimeError(f"blocks: freeing {sorted(bad) or blocks} not allocated (double free?)")
        self._allocated.difference_update(blocks)
        self._free.extend(reversed(blocks))


class SlotAllocator:
    """GDN state slots, handed out in groups of ``group`` (1 + k slots per sequence for verification).

    Group ``g`` owns recurrent-state slots ``g * group .. (g + 1) * group - 1`` and conv-state row ``g``.
    """

    def __init__(self, num_groups: int, group: int):
        self.group = group
        self.num_groups = num_groups
        self._free = list(range(num_groups - 1, -1, -1))
        self._allocated: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> list[int]:
        if not self._free:
            raise RuntimeError("GDN state slots exhausted")
        g = self._free.pop()
        self._allocated.add(g)
        return list(range(g * self.group, (g + 1) * self.group))

    def group_of(self, slots: list[int]) -> int:
        """The group id (conv-state row) of a sequence's slots."""
        return slots[0] // self.group

    def free(self, slots: list[int]) -> None:
        g = self.group_of(slots) if slots else None
        if g not in self._allocated or list(slots) != list(range(g * self.group, (g + 1) * self.group)):
            raise RuntimeError(f"slots: freeing {list(slots)}, not an allocated group (double free?)")
        self._allocated.remove(g)
        self._free.append(g)


class EngineCaches:
    """Per-layer tensors: ``kv[layer] = (key_cache, value_cache)`` ``[num_blocks, block_size, Hkv, D]`` for
    every full-attention layer (target and MTP), and ``gdn[layer] = (conv_state[max_num_seqs, C, K - 1 + k],
    ssm_state[max_num_seqs * (1 + k), Hv, Dv, Dk])`` for every GDN layer: one conv row per sequence (the
    conv update keeps the last ``K - 1 + k`` inputs and resumes at ``num_accepted``), 1 + k recurrent states.
    """

    def __init__(
        self,
        config: Qwen3NextConfig,
        *,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        num_speculative_tokens: int,
        dtype: torch.dtype,
        device: torch.device,
        ssm_dtype: torch.dtype = torch.float32,
        with_mtp: bool = True,
    ):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.slots_per_seq = 1 + num_speculative_tokens
        kv_shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        attn_layers = list(config.full_attention_layers)
        if with_mtp:
            attn_layers += [config.mtp_layer_index(j) for j in range(config.num_mtp_layers)]
        self.kv = {
            i: (
                torch.zeros(kv_shape, dtype=dtype, device=device),
                torch.zeros(kv_shape, dtype=dtype, device=device),
            )
            for i in attn_layers
        }
        s = max_num_seqs * self.slots_per_seq
        width = config.linear_conv_kernel_dim - 1 + num_speculative_tokens
        ssm_shape = (
            s,
            config.linear_num_value_heads,
            config.linear_value_head_dim,
            config.linear_key_head_dim,
        )
        self.gdn = {
            i: (
                torch.zeros(max_num_seqs, config.linear_conv_dim, width, dtype=dtype, device=device),
                torch.zeros(ssm_shape, dtype=ssm_dtype, device=device),
            )
            for i in config.linear_attention_layers
        }
        self.blocks = BlockAllocator(num_blocks)
        self.slots = SlotAllocator(max_num_seqs, self.slots_per_seq)
