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

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"KV cache out of blocks: asked for {n}, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))


class SlotAllocator:
    """GDN state slots, handed out in groups of ``group`` (1 + k slots per sequence for verification)."""

    def __init__(self, num_groups: int, group: int):
        self.group = group
        self.num_groups = num_groups
        self._free = list(range(num_groups - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> list[int]:
        if not self._free:
            raise RuntimeError("GDN state slots exhausted")
        g = self._free.pop()
        return list(range(g * self.group, (g + 1) * self.group))

    def free(self, slots: list[int]) -> None:
        self._free.append(slots[0] // self.group)


class EngineCaches:
    """Per-layer tensors: ``kv[layer] = (key_cache, value_cache)`` ``[num_blocks, block_size, Hkv, D]`` for
    every full-attention layer (target and MTP), and ``gdn[layer] = (conv_state[S, C, K - 1 + k],
    ssm_state[S, Hv, Dv, Dk])`` for every GDN layer, ``S = max_num_seqs * (1 + k)``.
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
                torch.zeros(s, config.linear_conv_dim, width, dtype=dtype, device=device),
                torch.zeros(ssm_shape, dtype=ssm_dtype, device=device),
            )
            for i in config.linear_attention_layers
        }
        self.blocks = BlockAllocator(num_blocks)
        self.slots = SlotAllocator(max_num_seqs, self.slots_per_seq)
