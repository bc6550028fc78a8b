"""Prefix caching for ATOM's GDN state: the runner's Mamba "align" state copies, replaced for ATOM's layers.

Why: with prefix caching (vLLM's default) vLLM keeps the GDN state in the Mamba "align" mode, and before
each step its V1 model runner copies every request's state into the block of the step's last token
(``mamba_utils.preprocess_mamba``), then, with speculative decoding, copies the state of the last accepted
token into the block that vLLM shares (``mamba_utils.postprocess_mamba_align_gpu``). Both assume one
state per token (stock GDN writes ``1 + k``), shift the conv state by the accepted count and reset
``num_accepted_tokens`` to 1; both run Triton kernels, which vLLM-CPU lacks (its first request fails).
ATOM's deferred-commit state keeps the accepted count's pending tokens to commit in the next step, so a
copy must move the whole slot and keep ``num_accepted`` (``atom_models.gdn_snapshot``). vLLM has no hook to
replace these runner functions (they are module functions the runner calls directly), so this patch wraps
them: for a model whose Mamba layers are ATOM's GDN cores, ``preprocess_mamba`` records each request's
state block (as vLLM does), plans the step's whole-slot copies (``layers.gdn_snapshots``), runs the ones
due before the step and defers the rest on the model's schedule; the postprocess runs those once the
forward is done and hands the accepted counts to the next step, as vLLM does without prefix caching. Both
run outside the forward (so outside any CUDA graph), as vLLM's own copies. Other models get vLLM's
functions unchanged.
"""

from __future__ import annotations

import functools
from typing import Any

from atom_vllm_plugin.layers.gdn_snapshots import (
    RequestStep,
    SnapshotSchedule,
    StepCopies,
    plan_step_copies,
    run_copies,
)

_ORIGINAL_ATTR = "_atom_original"


def atom_groups(kv_cache_config, forward_context) -> list[tuple[int, list[str], list]] | None:
    """``(group id, layer names, GDN cores)`` of every Mamba group if all are ATOM GDN cores, else None
    (a model of stock layers). A model mixing both is an error."""
    from vllm.v1.worker import mamba_utils

    from atom_vllm_plugin.layers.gdn import AtomGDNCore

    out = []
    for gid in mamba_utils.get_mamba_group_ids(mamba_utils.get_mamba_groups(kv_cache_config)):
        names = list(kv_cache_config.kv_cache_groups[gid].layer_names)
        out.append((gid, names, [forward_context[n] for n in names]))
    ours = [isinstance(layer, AtomGDNCore) for _, _, layers in out for layer in layers]
    if not any(ours):
        return None
    if not all(ours):
        raise TypeError(
            "a model mixes ATOM GDN cores with other Mamba layers; prefix caching cannot serve it"
        )
    return out


def _schedule(cores) -> SnapshotSchedule:
    return cores[0].snapshot_schedule


def run_deferred(groups) -> None:
    """Run (and withdraw) the "after" copies each group's schedule holds."""
    for _, names, cores in groups:
        schedule = _schedule(cores)
        copies = schedule.take(names)
        if copies is not None:
            run_copies(schedule.copier(names, cores), copies.after_src, copies.after_dst)


def plan_and_publish(
    groups, block_size: int, scheduler_output, mamba_state_idx: dict[str, int], input_batch, requests
) -> None:
    """Record each request's state column in ``mamba_state_idx`` (vLLM's runner dictionary), run each
    group's copies due before the step and defer its copies due after it on the group's schedule."""
    steps, rows = [], [[] for _ in groups]
    spec_tokens = scheduler_output.scheduled_spec_decode_tokens
    for req_id in input_batch.req_ids:
        rs = requests[req_id]
        prev = mamba_state_idx.get(req_id)
        if prev is None:  # new or resumed: the prefix hit's last block, or none (-1)
            prev = (rs.num_computed_tokens - 1) // block_size
        steps.append(
            RequestStep(
                computed=rs.num_computed_tokens,
                scheduled=scheduler_output.num_scheduled_tokens[req_id],
                prev_col=prev,
                is_verify=len(spec_tokens.get(req_id, ())) > 0,
            )
        )
        for j, (gid, _, _) in enumerate(groups):
            rows[j].append(rs.block_ids[gid])
    cols, copies = plan_step_copies(steps, rows, block_size)
    for req_id, col in zip(input_batch.req_ids, cols):
        mamba_state_idx[req_id] = col
    for (_, names, cores), c in zip(groups, copies):
        schedule = _schedule(cores)
        if c.before_src.size:
            run_copies(schedule.copier(names, cores), c.before_src, c.before_dst)
        if c.after_src.size:
            empty = c.before_src[:0]
            schedule.publish(names, StepCopies(empty, empty, c.after_src, c.after_dst))


def _preprocess(
    original,
    scheduler_output,
    kv_cache_config,
    cache_config,
    mamba_state_idx,
    input_batch,
    requests,
    forward_context,
    mamba_state_copy_funcs,
    copy_bufs,
    align_ctx=None,
):
    groups = atom_groups(kv_cache_config, forward_context)
    if groups is None:
        return original(
            scheduler_output,
            kv_cache_config,
            cache_config,
            mamba_state_idx,
            input_batch,
            requests,
            forward_context,
            mamba_state_copy_funcs,
            copy_bufs,
            align_ctx=align_ctx,
        )
    from vllm.v1.worker import mamba_utils

    mamba_utils.cleanup_mamba_state_idx(scheduler_output, mamba_state_idx)
    copy_bufs.offset = 0
    run_deferred(groups)  # a step whose postprocess did not run (none does without speculative decoding)
    plan_and_publish(
        groups, copy_bufs.mamba_spec.block_size, scheduler_output, mamba_state_idx, input_batch, requests
    )


def _postprocess(original, **kw: Any):
    groups = atom_groups(kw["kv_cache_config"], kw["forward_context"])
    if groups is None:
        return original(**kw)
    run_deferred(groups)
    n = kw["num_reqs"]
    kw["num_accepted_tokens_cpu_tensor"][:n].copy_(kw["num_accepted_tokens_gpu"][:n], non_blocking=True)


def apply() -> bool:
    """Wrap vLLM's two align-mode runner functions; return True (every platform needs it)."""
    from vllm.v1.worker import mamba_utils

    for name, wrapper in (("preprocess_mamba", _preprocess), ("postprocess_mamba_align_gpu", _postprocess)):
        current = getattr(mamba_utils, name, None)
        if current is None:
            raise RuntimeError(
                f"vllm.v1.worker.mamba_utils.{name} is gone; atom_vllm_plugin.patches.mamba_align must be "
                "revisited for this vLLM version"
            )
        if getattr(current, _ORIGINAL_ATTR, None) is not None:
            continue
        patched = functools.wraps(current)(functools.partial(wrapper, current))
        setattr(patched, _ORIGINAL_ATTR, current)
        setattr(mamba_utils, name, patched)
    return True
