"""Load HF Qwen3-Next checkpoints (sharded with ``model.safetensors.index.json``, or one ``model.safetensors``).

Everything is validated from the safetensors headers first (missing, unexpected and mis-shaped tensors
are collected into ONE :class:`CheckpointError`); then tensors are streamed one at a time (``safe_open``)
straight into the parameters (stacked experts and fused gate/up and q/k/v rows are written in place, no
second full copy). The renames/fuses/stacks, and the part-major regrouping of the GDN input projections'
rows (with their FP8 block scales), come from :mod:`atom_models.weight_map`; a MoE block with the shared
expert folded in gets that expert's tensors as slices of its stacked experts and the shared gate row as the
router's last row (:mod:`atom_models.folded_shared`). The plan's types are in :mod:`atom_models.load_plan`.

FP8 block-quantised checkpoints (``quantization_config.quant_method: fp8``): by default the weights stay
FP8. Before planning, :func:`convert_fp8_modules` replaces every :class:`~atom_models.modules.Linear` and
:class:`~atom_models.moe.Experts` whose checkpoint modules the config does not list in
``modules_to_not_convert`` by :class:`~atom_models.modules.Fp8Linear` / :class:`~atom_models.moe.Fp8Experts`
(e4m3 weights + float32 ``*_scale_inv`` block scales, copied as they are); listed modules stay in the model
dtype and read their bf16 tensors. With ``dequantize_fp8=True`` nothing is converted and every FP8 weight is
dequantised on load with ``kernels.fp8_block_dequant`` into the model dtype (weight-only).

Every tensor is checked for NaN/Inf after it lands in its parameter (so a value that only overflows in the
model dtype is caught too): one float32 sum per tensor (for FP8 parameters: whether any e4m3 NaN code is
present, plus the sum of its block scales), read back once per file, and an exact count only for the
tensors whose sum is not finite. A file safetensors cannot read (truncated, corrupt header) is reported
with its path and size.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections import defaultdict
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from atom_models import folded_shared
from atom_models.load_plan import (
    FP8_DTYPES,
    FP8_FILE_DTYPES,
    SCALE_SUFFIX,
    Copy,
    Plan,
    PlanState,
    ScaleCheck,
    Scope,
)
from atom_models.modules import Fp8Linear, Linear
from atom_models.moe import Experts, Fp8Experts
from atom_models.parallel import slices
from atom_models.parallel.layout import TPLayout
from atom_models.parallel.shard import COLUMN, check_fp8_shard
from atom_models.weight_map import LM_HEAD, Target, group_parts, map_name

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class CheckpointError(ValueError):
    """A checkpoint does not fit the model; ``problems`` lists every missing/unexpected/mis-shaped tensor."""

    def __init__(self, ckpt_dir: str, problems: list[str]):
        self.ckpt_dir = ckpt_dir
        self.problems = list(problems)
        lines = "\n  ".join(self.problems)
        super().__init__(f"checkpoint {ckpt_dir}: {len(self.problems)} problem(s):\n  {lines}")


def _open(ckpt_dir: str | os.PathLike[str], fname: str, **kwargs):
    """``safe_open`` of one checkpoint file; an unreadable file raises :class:`CheckpointError` naming it."""
    path = Path(ckpt_dir) / fname
    try:
        return safe_open(str(path), framework="pt", **kwargs)
    except Exception as e:  # safetensors raises its own SafetensorError (and OSError) for bad files
        raise CheckpointError(str(ckpt_dir), [_unreadable(path, e)]) from e


def _unreadable(path: Path, e: Exception) -> str:
    size = path.stat().st_size if path.is_file() else None
    return f"file {path.name} cannot be read ({size} bytes; truncated or not safetensors?): {e}"


def checkpoint_files(ckpt_dir: str | os.PathLike[str]) -> dict[str, str]:
    """Tensor name -> file name (relative to ``ckpt_dir``)."""
    d = Path(ckpt_dir)
    if (d / INDEX_FILE).is_file():
        try:
            weight_map = json.loads((d / INDEX_FILE).read_text()).get("weight_map")
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(str(d), [f"{INDEX_FILE} is not valid JSON: {e}"]) from e
        if not isinstance(weight_map, dict):
            raise CheckpointError(str(d), [f"{INDEX_FILE}: no 'weight_map' object"])
        absent = sorted({f for f in weight_map.values() if not (d / f).is_file()})
        if absent:
            raise CheckpointError(
                str(d), [f"{INDEX_FILE} names file {f}, which does not exist" for f in absent]
            )
        return dict(weight_map)
    if (d / SINGLE_FILE).is_file():
        with _open(d, SINGLE_FILE) as f:
            return dict.fromkeys(f.keys(), SINGLE_FILE)
    raise CheckpointError(str(d), [f"neither {INDEX_FILE} nor {SINGLE_FILE} found"])


def check_files(ckpt_dir: str | os.PathLike[str]) -> dict[str, str]:
    """Read every checkpoint file's header (no tensor data); raise :class:`CheckpointError` naming each file
    that cannot be read. Returns :func:`checkpoint_files`."""
    files = checkpoint_files(ckpt_dir)
    problems = []
    for fname in sorted(set(files.values())):
        try:
            with _open(ckpt_dir, fname):
                pass
        except CheckpointError as e:
            problems += e.problems
    if problems:
        raise CheckpointError(str(ckpt_dir), problems)
    return files


SHARED_MODULES = ("lm_head", "embed_tokens")  # shared by the target and the MTP draft: never converted


def _skipped(ckpt_module: str, not_convert: tuple[str, ...]) -> bool:
    """``modules_to_not_convert`` as transformers matches it: an entry contained in the module name."""
    return any(entry in ckpt_module for entry in not_convert)


def convert_fp8_modules(module: nn.Module, scope: Scope, quant, kernels) -> list[str]:
    """Replace the linears and routed experts that the checkpoint quantises by their FP8 forms, in place.

    A module is quantised unless every checkpoint module behind it (through ``weight_map``: fused gate/up
    rows, stacked experts) matches ``quant.modules_to_not_convert``; a module with some sources listed and
    some not cannot be represented and raises ``ValueError`` naming it. Linears with a bias, a folded MoE
    block's router (its rows come from two checkpoint tensors; quantised ones are dequantised on load) and
    ``lm_head`` stay as they are (the MTP draft holds the target's ``lm_head`` module; a quantised ``lm_head`` in the
    checkpoint is dequantised on load). The new parameters are created on the old weight's device (uninitialised;
    the loader fills them). Returns the names of the converted modules.
    """
    block = tuple(quant.weight_block_size)
    converted: list[str] = []
    for name, mod in list(module.named_modules()):
        if not isinstance(mod, (Linear, Experts)) or (isinstance(mod, Linear) and mod.bias is not None):
            continue
        pname = f"{name}.w13" if isinstance(mod, Experts) else f"{name}.weight"
        if not pname.startswith(scope.param_prefix):
            srcs = [pname]  # outside the scope (lm_head): the checkpoint name is the parameter name
        else:
            local = pname[len(scope.param_prefix) :]
            rows = mod.num_experts if isinstance(mod, Experts) else mod.weight.shape[0]
            srcs = [scope.to_ckpt(s) for s in folded_shared.sources(module, pname, local, rows)]
        if not srcs or name.split(".")[0] in SHARED_MODULES:
            continue
        folded = folded_shared.folded_block(module, pname)
        if folded is not None and mod is folded.gate:
            continue  # the router with the shared gate row: unquantised (a quantised one is dequantised on load)
        skipped = [_skipped(s.rsplit(".", 1)[0], quant.modules_to_not_convert) for s in srcs]
        if all(skipped):
            continue
        if any(skipped):
            listed = [s for s, k in zip(srcs, skipped) if k]
            raise ValueError(
                f"{name}: modules_to_not_convert lists {listed[:3]} but not the other sources of this fused "
                "parameter; it cannot be half FP8"
            )
        dev = mod.w13.device if isinstance(mod, Experts) else mod.weight.device
        if isinstance(mod, Experts):
            new: nn.Module = Fp8Experts(
                mod.num_experts,
                mod.w13.shape[2],
                mod.w2.shape[2],
                block,
                device=dev,
                intermediate_range=mod.intermediate_range,
                full_intermediate_size=mod.full_intermediate_size,
                name=name,
                num_shared=mod.num_shared,
                expert_start=mod.expert_start,
            )
        else:
            if mod.shard is not None:
                check_fp8_shard(name, mod.shard, block)
            new = Fp8Linear(mod.in_features, mod.out_features, block, kernels, device=dev, shard=mod.shard)
        parent_name, _, attr = name.rpartition(".")
        setattr(module.get_submodule(parent_name) if parent_name else module, attr, new)
        converted.append(name)
    return converted


def _part_rows(module: nn.Module, pname: str, t: Target, scale: bool) -> tuple[int, ...] | None:
    """The row counts of the ``t.shard`` parts of parameter ``pname`` when its module is a fused
    column-parallel linear with that many parts (``LinearShard.local_parts``; its FP8 block scales'
    ``ceil(rows / block)`` per part when ``scale``), else None (equal blocks)."""
    if t.shard is None:
        return None
    owner = module.get_submodule(pname.rsplit(".", 1)[0]) if "." in pname else module
    shard = getattr(owner, "shard", None)
    if not isinstance(owner, (Linear, Fp8Linear)) or shard is None or shard.kind != COLUMN:
        return None
    if len(shard.parts) != t.shard[1]:
        return None
    rows = shard.local_parts
    if scale:
        bn = owner.block[0]
        rows = tuple(-(-n // bn) for n in rows)
    return rows


def _dest_view(param: torch.Tensor, t: Target, part_rows: tuple[int, ...] | None = None) -> torch.Tensor:
    """``param[t.expert]``, then its ``t.shard`` part: rows ``part_rows`` (see :func:`_part_rows`) or
    equal blocks."""
    view = param
    if t.expert is not None:
        view = view[t.expert]
    if t.shard is not None:
        part, parts = t.shard
        if part_rows is None:
            rows = view.shape[0] // parts
            view = view[part * rows : (part + 1) * rows]
        else:
            start = sum(part_rows[:part])
            view = view[start : start + part_rows[part]]
    return view


def _plan(
    module: nn.Module,
    ckpt_dir: str,
    files: dict[str, str],
    scopes: list[Scope],
    extra: dict[str, str],
    skip_params: set[str],
    ignore: tuple[str, ...],
    what: str,
    layout: TPLayout,
    fp8_block: tuple[int, int] | None = None,
) -> Plan:
    """Map every checkpoint tensor in scope to a parameter slice and this rank's part of the tensor
    (``weight_map`` ``tp`` column, ``layout``); collect every problem."""
    config = module.config
    all_params = dict(module.named_parameters())
    params = {n: p for n, p in all_params.items() if n not in skip_params and not n.endswith(SCALE_SUFFIX)}
    problems: list[str] = []
    # expected checkpoint names (from the parameters), so that missing ones can be named
    expected: dict[str, str] = {}
    for pname, p in params.items():
        if pname in extra.values():
            srcs = [k for k, v in extra.items() if v == pname]
        else:
            scope = next((s for s in scopes if pname.startswith(s.param_prefix)), None)
            local = pname[len(scope.param_prefix) :] if scope else pname
            srcs = (
                [scope.to_ckpt(s) for s in folded_shared.sources(module, pname, local, p.shape[0])]
                if scope
                else []
            )
        if not srcs:
            problems.append(f"parameter {pname} of the {what} has no checkpoint rule (weight_map.RULES)")
        for s in srcs:
            expected[s] = pname
    copies: dict[str, list[Copy]] = defaultdict(list)
    by_file: dict[str, list[str]] = defaultdict(list)
    for name, fname in files.items():
        if not name.endswith(SCALE_SUFFIX):
            by_file[fname].append(name)
    scales = {n: f for n, f in files.items() if n.endswith(SCALE_SUFFIX) and not n.startswith(ignore)}
    if scales and fp8_block is None:
        problems.extend(
            f"unexpected tensor {n} in {f} (FP8 scales, but config.json has no FP8 quantization_config)"
            for n, f in sorted(scales.items())
        )
    used_scales: set[str] = set()
    scale_shapes: dict[str, tuple[int, ...]] = {}  # from the headers, while each file is open anyway
    scale_checks: list[ScaleCheck] = []
    state = PlanState(
        all_params=all_params, layout=layout, fp8_block=fp8_block, copies=copies, scales=scales,
        used_scales=used_scales, scale_checks=scale_checks,
    )  # fmt: skip
    for fname in sorted(set(by_file) | set(scales.values())):
        with _open(ckpt_dir, fname) as f:
            scale_shapes.update(
                (n, tuple(f.get_slice(n).get_shape())) for n, sf in scales.items() if sf == fname
            )
            for name in sorted(by_file.get(fname, ())):
                if name.startswith(ignore):
                    continue
                if name in extra:
                    tp = LM_HEAD.tp if extra[name] == LM_HEAD.dst else None
                    target: Target | None = Target(extra[name], None, None, tp)
                else:
                    scope = next((s for s in scopes if s.from_ckpt(name) is not None), None)
                    if scope is None:
                        problems.append(f"unexpected tensor {name} in {fname} (not part of the {what})")
                        continue
                    target = map_name(scope.from_ckpt(name))
                    if target is not None:
                        target = dataclasses.replace(target, param=scope.param_prefix + target.param)
                    first = None if target is None else folded_shared.expert_start(module, target.param)
                    if first is not None and target.expert is not None and target.param in params:  # EP
                        held = first <= target.expert < first + params[target.param].shape[0]
                        if not held:  # another expert-parallel rank's expert: not read here
                            if name + SCALE_SUFFIX in scales:
                                used_scales.add(name + SCALE_SUFFIX)
                            continue
                        target = dataclasses.replace(target, expert=target.expert - first, tp=None)
                    block = folded_shared.folded_block(module, expected[name]) if name in expected else None
                    if block is not None:
                        found = folded_shared.plan_copies(
                            f, fname, name, local=scope.from_ckpt(name), block=block, pname=expected[name],
                            state=state,
                        )  # fmt: skip
                        if found is not None:
                            problems += found
                            continue
                if target is None or target.param not in params or name not in expected:
                    problems.append(
                        f"unexpected tensor {name} in {fname} (no parameter of the {what} takes it)"
                    )
                    continue
                view = _dest_view(
                    params[target.param], target, _part_rows(module, target.param, target, False)
                )
                shape = tuple(f.get_slice(name).get_shape())
                full = slices.full_shape(target.tp, tuple(view.shape), layout, config)
                if shape != full:
                    problems.append(
                        f"tensor {name} in {fname} has shape {list(shape)}, expected {list(full)} "
                        f"(for {target.param}{_rank_note(layout, target.tp, view)})"
                    )
                    continue
                fp8_dest = params[target.param].dtype in FP8_DTYPES
                is_fp8 = f.get_slice(name).get_dtype() in FP8_FILE_DTYPES
                copy = Copy(name, view, pieces=slices.rank_pieces(target.tp, shape, layout, config))
                parts = None if target.regroup is None else group_parts(target.regroup, config)
                if parts is not None:
                    copy.rows = tuple(n for _, n in parts)
                if name + SCALE_SUFFIX in scales and fp8_block is not None:
                    copy.scale = name + SCALE_SUFFIX
                    used_scales.add(copy.scale)
                    sparam = target.param + SCALE_SUFFIX
                    if fp8_dest:
                        scale_rows = _part_rows(module, target.param, target, True)
                        copy.scale_view = _dest_view(all_params[sparam], target, scale_rows)
                    want = tuple(copy.scale_view.shape) if fp8_dest else None
                    copy.scale_pieces = slices.scale_pieces(
                        target.param.rsplit(".", 1)[0], copy.pieces, fp8_block, layout.world_size
                    )
                    if fp8_dest and parts is not None:
                        try:
                            copy.scale_rows = slices.regroup_scale_parts(name, parts, fp8_block[0])
                        except ValueError as e:
                            problems.append(str(e))
                            continue
                    scale_checks.append((copy.scale, shape, want, sparam, copy.scale_pieces))
                elif is_fp8:
                    problems.append(f"tensor {name} in {fname} is FP8 but {name + SCALE_SUFFIX} is missing")
                    continue
                if fp8_dest and not is_fp8:
                    problems.append(
                        f"tensor {name} in {fname} has dtype {f.get_slice(name).get_dtype()}, but "
                        f"{target.param} is FP8 (quantization_config does not list it in modules_to_not_convert)"
                    )
                    continue
                copies[fname].append(copy)
    for sname, wshape, want, sparam, spieces in scale_checks:
        why = _check_scale(scales[sname], sname, scale_shapes[sname], wshape, fp8_block)
        got = tuple(scale_shapes[sname]) if spieces is None else spieces.shape(tuple(scale_shapes[sname]))
        if why is None and want is not None and got != want:
            part = "" if spieces is None else f" (this rank's part: {list(got)})"
            why = (
                f"tensor {sname} in {scales[sname]} has shape {list(scale_shapes[sname])}{part}, expected "
                f"{list(want)} (for {sparam})"
            )
        if why:
            problems.append(why)
    if fp8_block is not None:
        problems.extend(
            f"unexpected tensor {n} in {scales[n]} (no FP8 weight {n[: -len(SCALE_SUFFIX)]} takes it)"
            for n in sorted(set(scales) - used_scales)
        )
    present = set(files)
    for name in sorted(set(expected) - present):
        problems.append(f"missing tensor {name} (for {expected[name]}) in {ckpt_dir}")
    if problems:
        raise CheckpointError(ckpt_dir, problems)
    return Plan(dict(copies), {n: scales[n] for n in used_scales})


def _rank_note(layout: TPLayout, tp: str | None, view: torch.Tensor) -> str:
    if tp is None or layout.world_size == 1:
        return ""
    return f"; tensor parallel rank {layout.rank} of {layout.world_size} holds {list(view.shape)} of it"


def _check_scale(fname, sname, shape, wshape, block) -> str | None:
    """A ``weight_scale_inv`` must be ``[ceil(N/bn), ceil(K/bk)]`` (checked from the header)."""
    if len(wshape) != 2:
        return f"tensor {sname} in {fname}: FP8 block scales for a {len(wshape)}-d weight"
    want = (-(-wshape[0] // block[0]), -(-wshape[1] // block[1]))
    if tuple(shape) != want:
        return (
            f"tensor {sname} in {fname} has shape {list(shape)}, expected {list(want)} "
            f"(weight {list(wshape)}, block {list(block)})"
        )
    return None


def _read(ckpt_dir: str, fname: str, f, name: str, pieces: slices.Pieces | None = None) -> torch.Tensor:
    """The tensor, or only this rank's ``pieces`` of it (never the whole of a sharded tensor)."""
    try:
        return slices.read(f, name, pieces)
    except Exception as e:  # a header that promises more bytes than the file holds
        raise CheckpointError(ckpt_dir, [f"tensor {name}: {_unreadable(Path(ckpt_dir) / fname, e)}"]) from e


def _suspect_sum(c: Copy) -> torch.Tensor:
    """A float32 scalar that is not finite if the destination of ``c`` holds a NaN or Inf: the sum of the
    values; for an FP8 parameter, NaN if any e4m3 NaN code (0x7F / 0xFF) is present, plus the scales' sum."""
    if c.scale_view is None:
        return c.view.sum(dtype=torch.float32)
    nan_code = ((c.view.view(torch.uint8) & 0x7F) == 0x7F).any()
    return torch.where(nan_code, float("nan"), 0.0) + c.scale_view.sum(dtype=torch.float32)


def _non_finite(ckpt_dir: str, fname: str, loaded: list[Copy], plan: Plan) -> list[str]:
    """Problems for the tensors of one file whose destination holds NaN or Inf (one device read per file)."""
    floating = [c for c in loaded if c.view.is_floating_point()]
    if not floating:
        return []
    suspects = (~torch.isfinite(torch.stack([_suspect_sum(c) for c in floating]))).cpu()
    problems = []
    for c, suspect in zip(floating, suspects):
        if not suspect:
            continue
        if c.scale_view is not None:
            codes = int(((c.view.view(torch.uint8) & 0x7F) == 0x7F).sum())
            if codes:
                problems.append(
                    f"tensor {c.name} in {fname} has {codes} NaN values (as {c.view.dtype}) in {ckpt_dir}"
                )
            view, name, where = c.scale_view, c.scale, plan.scale_files[c.scale]
        else:
            view, name, where = c.view, c.name, fname
        nan, inf = int(torch.isnan(view).sum()), int(torch.isinf(view).sum())
        if nan or inf:  # a finite tensor whose float32 sum overflowed is fine
            problems.append(
                f"tensor {name} in {where} has {nan} NaN and {inf} Inf values (as {view.dtype}) in {ckpt_dir}"
            )
    return problems


@torch.no_grad()
def _execute(ckpt_dir: str, plan: Plan, kernels, block: tuple[int, int] | None) -> int:
    """Stream every planned tensor into its parameter; each file is opened once (scales read through the
    handle of their file, usually the weight's own). Non-finite values are collected over all files into
    one :class:`CheckpointError`."""
    read: set[str] = set()  # a folded shared expert's tensor lands in several pseudo-experts: counted once
    problems: list[str] = []
    with ExitStack() as stack:
        handles: dict[str, object] = {}

        def handle(fname: str):
            if fname not in handles:
                handles[fname] = stack.enter_context(_open(ckpt_dir, fname, device="cpu"))
            return handles[fname]

        for fname, items in plan.copies.items():
            f = handle(fname)
            loaded: list[Copy] = []
            for c in items:
                t = _read(ckpt_dir, fname, f, c.name, c.pieces)
                if c.scale is not None:
                    sfile = plan.scale_files[c.scale]
                    scale = _read(ckpt_dir, sfile, handle(sfile), c.scale, c.scale_pieces)
                    if c.scale_view is not None:  # FP8 parameter: weight and block scales as they are
                        c.scale_view.copy_(
                            scale if c.scale_rows is None else slices.regroup_rows(scale, c.scale_rows)
                        )
                    else:  # dequantise (weight-only) into the parameter's dtype
                        t = kernels.fp8_block_dequant(
                            t.to(c.view.device), scale.to(c.view.device), block=block, dtype=c.view.dtype
                        )
                c.view.copy_(t if c.rows is None else slices.regroup_rows(t, c.rows))
                loaded.append(c)
                read.add(c.name)
            problems += _non_finite(ckpt_dir, fname, loaded, plan)
    if problems:
        raise CheckpointError(ckpt_dir, problems)
    return len(read)


def _fp8_block(config) -> tuple[int, int] | None:
    q = config.quantization
    return None if q is None else tuple(q.weight_block_size)


TARGET_SCOPE = Scope("model.", "model.", 0)


def _mtp_scope(config) -> Scope:
    return Scope("", "mtp.", config.num_hidden_layers)


def convert_target_fp8(model: nn.Module) -> list[str]:
    """:func:`convert_fp8_modules` for a :class:`Qwen3NextForCausalLM` whose config has an FP8
    ``quantization_config`` (nothing to do otherwise); modules already FP8 are left as they are."""
    q = model.config.quantization
    return [] if q is None else convert_fp8_modules(model, TARGET_SCOPE, q, model.kernels)


def convert_mtp_fp8(mtp: nn.Module) -> list[str]:
    """:func:`convert_target_fp8` for a :class:`Qwen3NextMTP`."""
    q = mtp.config.quantization
    return [] if q is None else convert_fp8_modules(mtp, _mtp_scope(mtp.config), q, mtp.kernels)


def load_target(model: nn.Module, ckpt_dir: str | os.PathLike[str], *, dequantize_fp8: bool = False) -> int:
    """Fill a :class:`Qwen3NextForCausalLM` from a HF checkpoint; ``mtp.*`` tensors are ignored.

    Tensor parallel: each rank reads only its part of every sharded tensor (``model.layout``, the
    ``tp`` column of ``weight_map.RULES``); shapes are checked against the full checkpoint shapes.

    FP8 checkpoints: the quantised modules are first converted to their FP8 forms (module docstring),
    unless ``dequantize_fp8``. Returns the number of checkpoint tensors read.
    """
    ckpt_dir = str(ckpt_dir)
    config = model.config
    files = checkpoint_files(ckpt_dir)
    extra = {} if config.tie_word_embeddings else {"lm_head.weight": "lm_head.weight"}
    ignore: tuple[str, ...] = ("mtp.",)
    if config.tie_word_embeddings:
        ignore += ("lm_head.weight",)  # tied: the embedding is the head
    block = _fp8_block(config)
    scope = TARGET_SCOPE
    if not dequantize_fp8:
        convert_target_fp8(model)
    plan = _plan(model, ckpt_dir, files, [scope], extra, set(), ignore, "target model", model.layout, block)
    return _execute(ckpt_dir, plan, model.kernels, block)


def load_mtp(mtp: nn.Module, ckpt_dir: str | os.PathLike[str], *, dequantize_fp8: bool = False) -> int:
    """Fill a :class:`Qwen3NextMTP` from the ``mtp.*`` tensors of a HF checkpoint.

    ``mtp.layers.j`` goes to the layer with absolute index ``num_hidden_layers + j``. The shared
    embedding and lm_head belong to the target (already loaded there) and are not read again. FP8
    checkpoints: as :func:`load_target`.
    """
    ckpt_dir = str(ckpt_dir)
    config = mtp.config
    files = checkpoint_files(ckpt_dir)
    mtp_files = {n: f for n, f in files.items() if n.startswith("mtp.")}
    if not mtp_files:
        raise CheckpointError(ckpt_dir, ["no mtp.* tensors: this checkpoint has no MTP head"])
    skip = {n for n, _ in mtp.named_parameters() if n.split(".")[0] in ("embed_tokens", "lm_head")}
    block = _fp8_block(config)
    scope = _mtp_scope(config)
    if not dequantize_fp8:
        convert_mtp_fp8(mtp)
    plan = _plan(mtp, ckpt_dir, mtp_files, [scope], {}, skip, (), "MTP draft", mtp.layout, block)
    return _execute(ckpt_dir, plan, mtp.kernels, block)
