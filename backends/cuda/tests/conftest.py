"""Test setup for the CUDA backend: on a machine without a GPU the Triton kernels run in the
interpreter (``TRITON_INTERPRET=1``, set before Triton is imported) on small fp16/fp32 shapes;
tests marked ``gpu`` need a real device and are skipped with a reason otherwise."""

from __future__ import annotations

import os

import pytest
import torch

HAS_GPU = torch.cuda.is_available() and torch.version.hip is None
if not HAS_GPU:
    os.environ["TRITON_INTERPRET"] = "1"

DEVICE = torch.device("cuda" if HAS_GPU else "cpu")
# The interpreter has no bf16; on a GPU the small tests also cover bf16.
SMALL_DTYPES = [torch.float16, torch.bfloat16] if HAS_GPU else [torch.float16]


def nmse(reference: torch.Tensor, actual: torch.Tensor) -> float:
    reference, actual = reference.double(), actual.double()
    return float(((reference - actual) ** 2).sum() / (reference ** 2).sum().clamp_min(1e-30))


def assert_nmse(reference: torch.Tensor, actual: torch.Tensor, tol: float, what: str) -> None:
    assert actual.shape == reference.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(reference.shape)}"
    assert torch.isfinite(actual.float()).all(), f"{what}: output has NaN/Inf"
    err = nmse(reference.cpu(), actual.cpu())
    assert err <= tol, f"{what}: NMSE {err:.3e} > tolerance {tol:.1e}"


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU: torch.cuda.is_available() is False")
    for item in items:
        if "gpu" in item.keywords and not HAS_GPU:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
