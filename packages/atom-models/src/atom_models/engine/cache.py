"""Cache memory of the standalone engine: paged KV blocks and GDN state slots, with their allocators."""

from __future__ import annotations

import torch
from atom_core import Qwen3NextConfig

from atom_models.gdn_state import GDNGeometry, GDNLayerState
from atom_models.parallel import TPLayout

KV_CACHE_DTYPES = {"auto": None, "bfloat16": torch.bfloat16, "float32": torch.float32}
KV_CACHE_DTYPES.update(dict.fromkeys(("fp8", "fp8_e4m3"), torch.float8_e4m3fn))


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The storage dtype of the paged KV cache for ``kv_cache_dtype`` (vLLM's names): ``auto`` is the
    model dtype; ``fp8`` / ``fp8_e4m3`` store ``k / k_scale`` and ``v / v_scale`` as float8_e4m3fn
    (per-tensor scales; the engine's are 1.0, vLLM's default without calibrated scales)."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {sorted(KV_CACHE_DTYPES)}, got {name!r}")
    return KV_CACHE_DTYPES[name] or model_dtype


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
    """GDN state slots, one per sequence: slot ``s`` is row ``s`` of every GDN layer's conv state, recurrent
    state and (with MTP) pending pool."""

    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self._allocated: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError("GDN state slots exhausted")
        s = self._free.pop()
        self._allocated.add(s)
        return s

    def free(self, slot: int) -> None:
        if slot not in self._allocated:
            raise RuntimeError(f"slots: freeing slot {slot}, not allocated (double free?)")
        self._allocated.remove(slot)
        self._free.append(slot)


class EngineCaches:
    """Per-layer tensors of one tensor-parallel rank (``layout``; default: the whole model), for
    ``S = max_num_seqs`` sequences (one GDN slot each):

    - ``kv[layer] = (key_cache, value_cache)`` ``[num_blocks, block_size, Hkv, D]`` (``Hkv``: the rank's
      KV heads) in ``kv_dtype`` (default:
      ``dtype``; float8_e4m3fn for an FP8 cache) for every full-attention layer (target and MTP);
    - ``gdn[layer]``: a :class:`~atom_models.gdn_state.GDNLayerState` for every GDN layer, shaped by
      ``gdn_geometry`` (the rank's key / value heads; conv ``[S, C, K - 1 + k]``, ONE committed recurrent state ``[S, Hv, Dv, Dk]`` per
      sequence, and with MTP (k > 0) the float32 pending tokens ``[S, 1 + k, P]`` of the sequence's last
      verify step);
    - ``kv_scales``: the FP8 cache's per-tensor ``(k_scale, v_scale)`` (0-d float32, 1.0), None otherwise.
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
        kv_dtype: torch.dtype | None = None,
        layout: TPLayout | None = None,
    ):
        layout = TPLayout.from_config(config) if layout is None else layout
        self.layout = layout
        self.block_size = block_size
        self.num_blocks = num_blocks
        kv_shape = (num_blocks, block_size, layout.num_kv_heads, config.head_dim)
        attn_layers = list(config.full_attention_layers)
        if with_mtp:
            attn_layers += [config.mtp_layer_index(j) for j in range(config.num_mtp_layers)]
        self.kv = {
            i: (
                torch.zeros(kv_shape, dtype=kv_dtype or dtype, device=device),
                torch.zeros(kv_shape, dtype=kv_dtype or dtype, device=device),
            )
            for i in attn_layers
        }
        # per-tensor K / V scales of an FP8 cache (1.0), held as tensors so that no step creates them
        quantised = kv_dtype is not None and kv_dtype.itemsize == 1
        self.kv_scales: tuple[torch.Tensor, torch.Tensor] | None = (
            (torch.ones((), device=device), torch.ones((), device=device)) if quantised else None
        )
        self.gdn_geometry = GDNGeometry.from_config(config, num_speculative_tokens, layout=layout)
        self.gdn = {
            i: GDNLayerState.allocate(
                self.gdn_geometry, max_num_seqs, conv_dtype=dtype, ssm_dtype=ssm_dtype, device=device
            )
            for i in config.linear_attention_layers
        }
        self.blocks = BlockAllocator(num_blocks)
        self.slots = SlotAllocator(max_num_seqs)

    def gdn_bytes_per_seq(self) -> dict[str, int]:
        """Bytes of GDN state one sequence holds, summed over the GDN layers: conv rows, recurrent state,
        pending tokens (one slot's row of each tensor)."""

        def row_bytes(t: torch.Tensor | None) -> int:
            return 0 if t is None else t[0].numel() * t.element_size()

        return {
            "conv": sum(row_bytes(s.conv) for s in self.gdn.values()),
            "ssm": sum(row_bytes(s.ssm) for s in self.gdn.values()),
            "pending": sum(row_bytes(s.pending) for s in self.gdn.values()),
        }
