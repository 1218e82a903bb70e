"""The shared conformance suite (``musecore.testing``) on the TPU backend on the CPU: every op and format on the
muse-tiny preset's shapes against the reference. Unsupported cases (W4A4 / W8A8 activation formats, FP8 weights)
skip with the backend's reason. The kernels run in Pallas' generic interpreter here (39 s instead of 134 s in
JAX's TPU interpreter on the 2-core CPU, same numbers: both passed); ``test_kernels.py`` runs every kernel in the
TPU interpreter. ``MUSECORE_CONFORMANCE_SIZES=tiny,small`` widens the shapes."""

from __future__ import annotations

import os

import pytest

from musecore.testing import SIZES_ENV, make_conformance_tests

SIZES = os.environ.get(SIZES_ENV, "tiny").split(",")
# Pallas' generic interpreter by default (~2 min -> see INTEGRATION.md); MUSECORE_TPU_INTERPRETER=tpu
# runs the same cases in JAX's TPU interpreter (TPU memory model), which test_kernels.py uses for every kernel.
INTERPRETER = os.environ.get("MUSECORE_TPU_INTERPRETER", "jax")


def _backend():
    from musecore_tpu import TpuBackend
    return TpuBackend("cpu", interpret=INTERPRETER)


pytestmark = [pytest.mark.usefixtures("jax_available"), pytest.mark.slow]
test_tpu_interpret_matches_reference = make_conformance_tests(_backend, sizes=SIZES, device_name="tpu-v6e")
