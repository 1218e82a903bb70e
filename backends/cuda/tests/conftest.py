"""Test setup for the CUDA backend: on a machine without a GPU the Triton kernels run in Triton's
interpreter (``TRITON_INTERPRET=1``, which must be set before Triton is first imported; pytest
imports every conftest during collection, before any test runs) on small fp16/fp32 shapes;
tests marked ``gpu`` need a real device and are skipped with a reason otherwise. Shared helpers
(device choice, NMSE checks) come from ``musecore_triton.testing``, the GPU backends' test support
(the repository runs pytest with ``--import-mode=importlib``, so sibling test modules are not
importable). On a ROCm build of torch every test here is skipped: they test NVIDIA kernels."""

from __future__ import annotations

import os
import sys

import pytest
import torch

ROCM = torch.version.hip is not None
HAS_GPU = torch.cuda.is_available() and not ROCM
if not HAS_GPU and os.environ.get("TRITON_INTERPRET") != "1":
    if "triton.language" in sys.modules:
        raise RuntimeError("Triton was imported before backends/cuda/tests/conftest.py could enable its "
                           "interpreter; run pytest with TRITON_INTERPRET=1 on machines without a GPU")
    os.environ["TRITON_INTERPRET"] = "1"

def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU: torch.cuda.is_available() is False")
    rocm = pytest.mark.skip(reason="the CUDA backend's tests need an NVIDIA GPU or none (interpreter); "
                                   "this torch is a ROCm build")
    for item in items:
        if ROCM and str(item.path).startswith(str(config.rootpath / "backends" / "cuda")):
            item.add_marker(rocm)
        elif "gpu" in item.keywords and not HAS_GPU:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
