import pytest
import torch

from musecore.testing import nmse  # noqa: F401  (the core tests import it from here)


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
