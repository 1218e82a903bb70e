"""Test setup for musecore-tpu: the package is importable from this checkout without installing it, jax runs on
the CPU, and tests that need jax skip with the reason when it is not installed (the rest of the suite is
unaffected: nothing here is collected by the root tests)."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

PACKAGE_ROOT = Path(__file__).resolve().parents[1]
if str(PACKAGE_ROOT) not in sys.path:
    sys.path.insert(0, str(PACKAGE_ROOT))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

JAX_REASON = ("jax not installed: pip install 'jax==0.10.2' (Python 3.11) or 'jax>=0.12' (Python >= 3.12) to run "
              "the Pallas kernels in TPU interpret mode")


@pytest.fixture
def jax_available() -> None:
    """Skips the test with the reason when jax is missing; modules use it through
    ``pytestmark = pytest.mark.usefixtures("jax_available")`` (the root run imports test modules with
    ``--import-mode=importlib``, where ``from conftest import ...`` does not work)."""
    if importlib.util.find_spec("jax") is None:
        pytest.skip(JAX_REASON)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: takes more than a few seconds in TPU interpret mode on a 2-core CPU")
