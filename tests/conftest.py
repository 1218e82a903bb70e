import pytest
import torch


def nmse(reference: torch.Tensor, actual: torch.Tensor) -> float:
    reference, actual = reference.double(), actual.double()
    return float(((reference - actual) ** 2).sum() / (reference ** 2).sum().clamp_min(1e-30))


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
