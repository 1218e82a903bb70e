"""Test support for the GPU backends' kernel tests (this package's, musecore-cuda's, musecore-rocm's):
the device to test on and the NMSE checks. Public so that plugin test suites, which run with
``--import-mode=importlib`` where sibling test modules are not importable, share it."""

from __future__ import annotations

import os
import sys

import torch

from musecore.testing import assert_nmse, nmse  # noqa: F401  (re-exported for the tests)

HAS_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_GPU else "cpu")
# The interpreter has no bf16 arithmetic, and it rounds fp32 to a bf16 store toward zero where a GPU rounds to
# nearest (session 74: a bf16 GEMV's NMSE about 10x the GPU's); on a GPU the small tests also cover bf16.
SMALL_DTYPES = [torch.float16, torch.bfloat16] if HAS_GPU else [torch.float16]


def use_interpreter_without_gpu(conftest: str, has_gpu: bool = HAS_GPU) -> None:
    """From a tests folder's ``conftest.py`` (pytest imports every conftest before any test module):
    without a GPU, run the Triton kernels in Triton's interpreter. ``TRITON_INTERPRET=1`` only takes
    effect when it is set before Triton is first imported; past that point this raises, naming
    ``conftest``, instead of letting kernels fail to launch."""
    if has_gpu or os.environ.get("TRITON_INTERPRET") == "1":
        return
    if "triton.language" in sys.modules:
        raise RuntimeError(f"Triton was imported before {conftest} could enable its interpreter; run pytest with "
                           "TRITON_INTERPRET=1 on machines without a GPU")
    os.environ["TRITON_INTERPRET"] = "1"


def skip_gpu_tests(items: list, has_gpu: bool = HAS_GPU, reason: str = "needs a GPU: torch.cuda.is_available() "
                   "is False") -> None:
    """From ``pytest_collection_modifyitems``: skip the tests marked ``gpu`` when there is none, with ``reason``."""
    import pytest

    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip)


def check_decode_embed(got: tuple, want: tuple, got_next: torch.Tensor, want_next: torch.Tensor) -> None:
    """``MuseModel.embed``'s ``(x, a, positions, rope)`` through the one-launch decode embed against its ops (both GPU
    backends' tests): the cache's next positions equal, the residual stream and the first norm within NMSE 1e-5 (the
    same norm helper, so bit-equal where the reduction tree matches), the rotary rows within 2e-6."""
    assert torch.equal(got_next, want_next), (got_next, want_next)
    for name, g, w in (("x", got[0], want[0]), ("a", got[1], want[1])):
        assert g.shape == w.shape and g.dtype == w.dtype, (name, g.shape, w.shape, g.dtype, w.dtype)
        err = nmse(w.float(), g.float())
        assert err <= 1e-5, f"{name}: NMSE {err:.3g} > 1e-5 (bit-equal: {torch.equal(g, w)})"
    err = max((g - w).abs().max().item() for g, w in zip(got[3], want[3]))
    assert err <= 2e-6, f"rotary rows: max |error| {err:.3g} > 2e-6"


def count_kernels(fn) -> int:
    """The GPU kernels ``fn()`` launches, counted under the profiler (copies left out)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type.name == "CUDA" and not e.name.startswith("Memcpy"))
