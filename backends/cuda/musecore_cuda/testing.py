"""Device choice and NMSE checks used by the CUDA backend's tests (importable in any pytest import mode)."""

from __future__ import annotations

import torch

HAS_GPU = torch.cuda.is_available() and torch.version.hip is None
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
