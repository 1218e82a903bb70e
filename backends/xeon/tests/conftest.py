"""Fixtures of the xeon backend tests: a one-thread backend, the reference, and a fixed crossover
(NMSE checks come from ``musecore.testing.assert_nmse``)."""

from __future__ import annotations

import pytest
import torch

from musecore import compile_cache
from musecore.backends.reference import ReferenceBackend
from musecore_xeon import XeonBackend
from musecore_xeon.kernels import native
from musecore_xeon.kernels.crossover import BF16_CROSSOVER_ENV, BF16_GEMV_CROSSOVER_ENV, INT4_CROSSOVER_ENV


@pytest.fixture(scope="session")
def xeon():
    """One thread: the tests time nothing, and on a shared 2-core host two OpenMP threads stall
    each other behind other processes (a 40 ms MoE call took 0.5-1.8 s at load average 9)."""
    before = torch.get_num_threads()
    yield XeonBackend(num_threads=1)
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def reference() -> ReferenceBackend:
    return ReferenceBackend()


@pytest.fixture(autouse=True)
def _seed_and_fixed_crossover(monkeypatch: pytest.MonkeyPatch):
    """Seeded, and fixed crossovers so tests reach every path without timing anything (BF16: the native GEMV
    below M=16, F.linear up to 63, tiles from 64); the calibration itself is tested where a test deletes these
    variables."""
    torch.manual_seed(0)
    monkeypatch.setenv(INT4_CROSSOVER_ENV, "64")
    monkeypatch.setenv(BF16_CROSSOVER_ENV, "64")
    monkeypatch.setenv(BF16_GEMV_CROSSOVER_ENV, "16")


@pytest.fixture
def no_c_compiler(monkeypatch: pytest.MonkeyPatch, tmp_path):
    """Neither cc nor gcc on PATH and an empty kernel cache: the native library cannot be built (loaded again
    afterwards with the real environment)."""
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "cache"))
    native.load.cache_clear()
    yield
    native.load.cache_clear()
    monkeypatch.undo()
    assert native.available() or native.UNAVAILABLE
