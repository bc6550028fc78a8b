"""Fixtures of atom-models' tests. This folder goes on ``sys.path`` so that tests import the shared
builders of ``_helpers.py`` (pytest runs with --import-mode=importlib, which does not put it there)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from atom_core import Qwen3NextConfig, testing
from atom_kernels import select_kernels
from atom_models import DenseCoreFactory, Qwen3NextForCausalLM, Qwen3NextMTP, load_mtp, load_target
from safetensors.torch import load_file

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)


@pytest.fixture(scope="session")
def model_dir():
    return testing.model_dir()


@pytest.fixture(scope="session")
def ref_dir():
    return testing.reference_dir()


@pytest.fixture(scope="session")
def golden():
    return load_file(str(testing.reference_file("golden.safetensors")))


@pytest.fixture(scope="session")
def greedy_cases():
    return json.loads(testing.reference_file("greedy.json").read_text())


@pytest.fixture(scope="session")
def kernels32():
    return select_kernels(torch.device("cpu"), torch.float32)


@pytest.fixture(scope="session")
def dense_models(model_dir, kernels32):
    """(target, mtp) of the fixture in float32 with dense cores."""
    cfg = Qwen3NextConfig.from_hf(model_dir)
    cores = DenseCoreFactory(kernels32)
    target = Qwen3NextForCausalLM(cfg, cores, kernels32)
    load_target(target, model_dir)
    mtp = Qwen3NextMTP(cfg, cores, kernels32, target.model.embed_tokens, target.lm_head)
    load_mtp(mtp, model_dir)
    return target.eval(), mtp.eval()


@pytest.fixture(autouse=True, scope="package")
def _one_thread():
    """The tiny model's ops are far too small for intra-op threads: on a loaded 2-core machine OpenMP
    synchronisation made them ~30x slower. Restored after this package's tests."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
