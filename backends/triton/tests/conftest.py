"""Test setup for the portable Triton kernels: on a machine without a GPU they run in Triton's
interpreter (``TRITON_INTERPRET=1``, which must be set before Triton is first imported; pytest
imports every conftest during collection, before any test runs) on small fp16/fp32 shapes;
tests marked ``gpu`` need a real device and are skipped with a reason otherwise. Shared helpers
live in ``musecore_triton.testing`` (the repository runs pytest with ``--import-mode=importlib``,
so sibling test modules are not importable)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

HAS_GPU = torch.cuda.is_available()  # as musecore_triton.testing.HAS_GPU
if not HAS_GPU and os.environ.get("TRITON_INTERPRET") != "1":
    if "triton.language" in sys.modules:
        raise RuntimeError("Triton was imported before backends/triton/tests/conftest.py could enable its "
                           "interpreter; run pytest with TRITON_INTERPRET=1 on machines without a GPU")
    os.environ["TRITON_INTERPRET"] = "1"

def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a GPU: torch.cuda.is_available() is False")
    for item in items:
        if "gpu" in item.keywords and not HAS_GPU:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
