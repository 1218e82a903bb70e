"""The shared conformance suite (``musecore.testing``) on the TPU backend, every kernel in JAX's TPU interpreter on
the CPU: every op and format on the muse-tiny preset's shapes against the reference. Unsupported cases (W4A4 / W8A8
activation formats, FP8 weights) skip with the backend's reason. Interpret mode costs about a second per new shape
on a 2-core CPU, so this file runs ``tiny`` only; ``MUSECORE_CONFORMANCE_SIZES=tiny,small`` widens it."""

from __future__ import annotations

import os

import pytest

from conftest import needs_jax
from musecore.testing import SIZES_ENV, make_conformance_tests

SIZES = os.environ.get(SIZES_ENV, "tiny").split(",")


def _backend():
    from musecore_tpu import TpuBackend
    return TpuBackend("cpu", interpret=True)


test_tpu_interpret_matches_reference = pytest.mark.slow(needs_jax(
    make_conformance_tests(_backend, sizes=SIZES, device_name="tpu-v6e")))
