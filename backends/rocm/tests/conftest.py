"""Test setup for the ROCm backend. Without a GPU the Triton kernels run in Triton's interpreter
(``TRITON_INTERPRET=1``, set here before Triton is first imported) on small fp16 shapes, standing
in for gfx950/gfx942; tests marked ``rocm`` need an AMD GPU and are skipped with a reason
otherwise; tests marked ``gpu`` run the portable kernels on whatever GPU torch sees (on an NVIDIA
machine: through Triton's CUDA target, which checks numerics at scale, not AMD speed). The
compile-only tests (gfx950/gfx942 code objects) need no GPU at all."""

from __future__ import annotations

import os
import sys

import pytest
import torch

ROCM = torch.version.hip is not None
HAS_GPU = torch.cuda.is_available()
HAS_ROCM_GPU = ROCM and HAS_GPU
if not HAS_GPU and os.environ.get("TRITON_INTERPRET") != "1":
    if "triton.language" in sys.modules:
        raise RuntimeError("Triton was imported before backends/rocm/tests/conftest.py could enable its "
                           "interpreter; run pytest with TRITON_INTERPRET=1 on machines without a GPU")
    os.environ["TRITON_INTERPRET"] = "1"


def pytest_collection_modifyitems(config, items):
    no_rocm = pytest.mark.skip(reason="needs an AMD GPU with a ROCm build of torch "
                                      f"(torch.version.hip is {torch.version.hip!r}, GPU visible: {HAS_GPU})")
    no_gpu = pytest.mark.skip(reason="needs a GPU: torch.cuda.is_available() is False")
    for item in items:
        if item.get_closest_marker("rocm") and not HAS_ROCM_GPU:  # a marker, not a keyword: the folder is "rocm"
            item.add_marker(no_rocm)
        elif item.get_closest_marker("gpu") and not HAS_GPU:
            item.add_marker(no_gpu)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
