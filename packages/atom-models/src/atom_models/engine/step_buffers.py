"""Host <-> device transfers of a bucketed decode / verify step: one copy each way.

:class:`StepMetadata` holds the step's metadata on the device as views of ONE allocation, filled from a
host staging buffer of the same layout (pinned on CUDA) by one ``copy_(non_blocking=True)``. Layout, in
bytes (each field 64-byte aligned): int64 ``input_ids`` / ``positions`` / ``slot_mapping`` (``max_tokens``
each), then int32 ``seq_lens`` / ``gdn_slots`` / ``num_accepted`` (``max_batch`` each) and the block
tables ``[max_batch, max_blocks]`` last, so a bucket of ``b`` sequences copies a prefix ending at table row ``b``.
The staging buffer is rewritten only after its previous copy has completed (a CUDA event).

:class:`ResultReader` reads a step's packed int64 results back into a pinned host buffer: one
device-to-host copy and one synchronisation (``reads`` counts them).
"""

from __future__ import annotations

import torch

from atom_models.engine.request import Request

_INT64 = ("input_ids", "positions", "slot_mapping")
_INT32 = ("seq_lens", "gdn_slots", "num_accepted")


_ALIGN = 64  # bytes: every field starts aligned (kernels may assume aligned pointers)


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _nbytes(max_tokens: int, max_batch: int, max_blocks: int) -> int:
    return 3 * _aligned(8 * max_tokens) + 3 * _aligned(4 * max_batch) + 4 * max_batch * max_blocks


class _Views:
    """Named int views of one uint8 buffer in the layout of :class:`StepMetadata`. With ``rows`` (the host
    staging side, which writes them), ``int64_rows`` / ``int32_rows`` too: the int64 (int32) fields, in
    ``_INT64`` (``_INT32``) order, as the rows of one strided ``[3, max_tokens]`` (``[3, max_batch]``) view, so
    that a step writes each group with one copy."""

    def __init__(self, buf: torch.Tensor, max_tokens: int, max_batch: int, max_blocks: int, *, rows: bool):
        off = 0
        for name in _INT64:
            setattr(self, name, buf[off : off + 8 * max_tokens].view(torch.int64))
            off += _aligned(8 * max_tokens)
        if rows:
            self.int64_rows = (
                buf[:off]
                .view(torch.int64)
                .as_strided((len(_INT64), max_tokens), (_aligned(8 * max_tokens) // 8, 1))
            )
        start = off
        for name in _INT32:
            setattr(self, name, buf[off : off + 4 * max_batch].view(torch.int32))
            off += _aligned(4 * max_batch)
        if rows:
            self.int32_rows = (
                buf[start:off]
                .view(torch.int32)
                .as_strided((len(_INT32), max_batch), (_aligned(4 * max_batch) // 4, 1))
            )
        self.tables_offset = off
        self.tables = (
            buf[off : off + 4 * max_batch * max_blocks].view(torch.int32).view(max_batch, max_blocks)
        )


def _event(device: torch.device):
    return torch.cuda.Event() if device.type == "cuda" else None


class StepMetadata:
    """The device metadata of bucketed steps (``input_ids`` ... ``tables``: device views, see the module
    docstring) and :meth:`fill`, which writes a step's values into them with one host-to-device copy."""

    def __init__(self, *, max_tokens: int, max_batch: int, max_blocks: int, block_size: int, device):
        self.max_blocks, self.block_size, self.device = max_blocks, block_size, device
        nbytes = _nbytes(max_tokens, max_batch, max_blocks)
        self._staging = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
        self._device = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self.host = _Views(self._staging, max_tokens, max_batch, max_blocks, rows=True)
        dev = _Views(self._device, max_tokens, max_batch, max_blocks, rows=False)
        for name in (*_INT64, *_INT32, "tables"):
            setattr(self, name, getattr(dev, name))
        self._row_owner: list[Request | None] = [None] * max_batch  # whose blocks a host table row holds
        self._copied = _event(device)  # recorded after the last copy out of the staging buffer
        self.h2d_copies = 0

    def fill(self, decodes: tuple[Request, ...], b: int, q: int) -> None:
        """Sequence i of ``decodes`` at rows ``i*q ..`` (its pending token, then its drafts, at positions
        ``num_computed ..``), rows ``len(decodes) .. b - 1`` padding (token 0, positions ``0 .. q - 1``, KV
        slot -1, GDN slot -1, ``seq_len = q``, block table row of zeros); one copy to the device."""
        if self._copied is not None:
            self._copied.synchronize()  # the previous copy has read the staging buffer
        h, n, t, bs = self.host, len(decodes), b * q, self.block_size
        for i in range(b):
            self._host_table_row(i, decodes[i] if i < n else None)
        # plain Python lists, then one copy per field group: a few microseconds per step at batch 1
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        self.check_blocks(decodes, q)
        for req in decodes:
            ids.append(req.last_token)
            ids += req.drafts
            start, blocks = req.num_computed, req.blocks
            for p in range(start, start + q):
                pos.append(p)
                slots.append(blocks[p // bs] * bs + p % bs)
        pad = b - n
        ids += [0] * (pad * q)
        pos += list(range(q)) * pad
        slots += [-1] * (pad * q)
        h.int64_rows[:, :t] = torch.tensor([ids, pos, slots], dtype=torch.int64)
        h.int32_rows[:, :b] = torch.tensor(
            [
                [r.num_computed + q for r in decodes] + [q] * pad,
                [r.slot for r in decodes] + [-1] * pad,
                [max(1, r.num_accepted) for r in decodes] + [1] * pad,
            ],
            dtype=torch.int32,
        )
        end = h.tables_offset + 4 * b * self.max_blocks
        self._device[:end].copy_(self._staging[:end], non_blocking=True)
        self.h2d_copies += 1
        if self._copied is not None:
            self._copied.record()

    def check_blocks(self, decodes: tuple[Request, ...], q: int) -> None:
        """Every request of ``decodes`` holds the KV blocks of its ``q`` positions from ``num_computed``."""
        bs = self.block_size
        for req in decodes:
            last = req.num_computed + q - 1
            if last // bs >= len(req.blocks):
                raise ValueError(
                    f"request {req.request_id}: positions up to {last} need block {last // bs}, but it "
                    f"holds {len(req.blocks)} blocks of {bs}"
                )

    def _host_table_row(self, i: int, req: Request | None) -> None:
        """Host table row ``i`` holds ``req``'s blocks (zeros for padding); a request's blocks are fixed from
        admission on, so a row is rewritten only when its request changes."""
        if self._row_owner[i] is req:
            return
        if req is not None and len(req.blocks) > self.max_blocks:
            raise ValueError(
                f"request {req.request_id}: {len(req.blocks)} blocks exceed the block tables' "
                f"{self.max_blocks} columns"
            )
        blocks = [] if req is None else req.blocks
        self.host.tables[i] = torch.tensor(blocks + [0] * (self.max_blocks - len(blocks)), dtype=torch.int32)
        self._row_owner[i] = req


class ResultReader:
    """Reads ``[n, w]`` int64 device results (``n * w <= capacity``) to the host: one copy into a pinned
    buffer, one synchronisation."""

    def __init__(self, capacity: int, device: torch.device):
        self._host = torch.zeros(capacity, dtype=torch.int64, pin_memory=device.type == "cuda")
        self._done = _event(device)
        self.reads = 0

    def read(self, values: torch.Tensor) -> list[list[int]]:
        n, w = values.shape
        host = self._host[: n * w].view(n, w)
        host.copy_(values, non_blocking=True)
        if self._done is not None:
            self._done.record()
            self._done.synchronize()
        self.reads += 1
        return host.tolist()
