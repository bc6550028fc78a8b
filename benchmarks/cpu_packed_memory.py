"""Resident memory of the bundled model in bf16 on the cpu kernels, after ``hold_packed_linears``: the
original weights released once packed (what it does) against kept beside the packed copies (what it did).

Each variant runs in its own process: build and load the target (and the MTP draft, sharing the target's
embedding and lm_head as the engine does), read the RSS, pack, read it again. Also the bytes the parameters
hold (``untyped_storage`` sizes, shared storage once) and the bytes of the packed copies. oneDNN packs bf16
only on CPUs with AVX512-BW/VL/DQ or AVX-NE-CONVERT; on another CPU the packed copy is a same-size clone
(``"packing": "stand-in clone"`` in the result), which holds the same bytes.

    uv run --no-sync python benchmarks/cpu_packed_memory.py
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _held(modules) -> int:
    storages = {}
    for mod in modules:
        for p in mod.parameters():
            st = p.untyped_storage()
            storages[st.data_ptr()] = st.nbytes()
    return sum(storages.values())


def measure(release: bool) -> dict:
    import torch
    from atom_core import Qwen3NextConfig, testing
    from atom_kernels import select_kernels
    from atom_kernels.ops.linear import cpu as linear_cpu
    from atom_models import DenseCoreFactory, Qwen3NextForCausalLM, load_target
    from atom_models.loader import load_mtp
    from atom_models.parallel import linear as linear_mod
    from atom_models.qwen3_next_mtp import Qwen3NextMTP

    packing = "oneDNN"
    if not linear_cpu.packing_supported(torch.bfloat16):
        packing = "stand-in clone"
        linear_mod.pack_linear_weight = lambda w: w.detach().clone()
    model_dir = testing.model_dir()
    config = Qwen3NextConfig.from_hf(model_dir)
    kernels = select_kernels("cpu", torch.bfloat16)
    bf16 = torch.bfloat16
    target = Qwen3NextForCausalLM(config, DenseCoreFactory(kernels), kernels, dtype=bf16)
    load_target(target, model_dir)
    shared = (target.model.embed_tokens, target.lm_head)
    mtp = Qwen3NextMTP(config, DenseCoreFactory(kernels), kernels, *shared, dtype=bf16)
    load_mtp(mtp, model_dir)
    gc.collect()
    rss_loaded, held_loaded = _rss(), _held((target, mtp))
    if not release:  # what hold_packed_linears did: every wide linear packed (the router too), none released
        packed = 0
        for model in (target, mtp):
            for m in model.modules():
                if isinstance(m, linear_mod.Linear) and m.packed is None:
                    m.pack = True
                    packed += m.hold_packed(kernels, release=False)
    else:
        packed = sum(linear_mod.hold_packed_linears(model, kernels) for model in (target, mtp))
    gc.collect()
    return {
        "release": release,
        "packing": packing,
        "rss_loaded_bytes": rss_loaded,
        "rss_packed_bytes": _rss(),
        "parameter_bytes_loaded": held_loaded,
        "parameter_bytes_packed": _held((target, mtp)),
        "packed_copy_bytes": packed,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--one", choices=["release", "keep"], help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "cpu_packed_memory.json")
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure(args.one == "release")))
        return 0
    rows = []
    for one in ("keep", "release"):
        out = subprocess.run(
            [sys.executable, __file__, "--one", one], check=True, capture_output=True, text=True
        ).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    keep, rel = rows
    result = {
        "bench": "cpu_packed_memory",
        "model": "bundled (target + MTP draft), bf16",
        "rows": rows,
        "rss_saved_bytes": keep["rss_packed_bytes"] - rel["rss_packed_bytes"],
        "parameter_bytes_saved": keep["parameter_bytes_packed"] - rel["parameter_bytes_packed"],
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
