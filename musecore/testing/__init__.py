"""musecore's conformance suite: any backend's ops against the reference, ggml test-backend-ops style.

Every op of :mod:`musecore.ops` x weight format (bf16, fp8, nvfp4, mxfp4, int4; W8A8 and W4A4
activation formats for linear and moe) x shapes taken from the presets (``tiny`` = muse-tiny,
``small`` = muse-small, ``816b`` = the full model's layer: q 8192->10240 ... experts 8192->2048)
at small token counts, plus the vision and audio towers' ops at the presets' tower sizes
(varlen attention over packed segments, depthwise causal conv with streaming state, LayerNorm, GELU,
RoPE); attention in prefill and decode, full and sliding windows, GQA, BF16 and
FP8 KV, left padding and empty (-1) cache slots. Each case builds its inputs deterministically
(seeded by its id), has the backend and the reference backend prepare the *same* QTensor and run
the op, and requires NMSE <= ``musecore.ops.tolerance(op, spec)``, finite outputs, the contract's
shape and dtype and identical ids. A case the backend's ``supports`` declines is skipped with the
backend's reason, never failed. DESIGN.md: "a new plugin proves itself with the same tests".

A backend package reuses it in one line (``backends/<name>/tests/test_conformance.py``)::

    from musecore.testing import make_conformance_tests
    from musecore_cuda import CudaBackend

    test_cuda_matches_reference = make_conformance_tests(lambda: CudaBackend("cuda"))
    # a CPU run of Triton kernels in the interpreter (no bf16 there), small shapes only:
    # test_interpreted = make_conformance_tests(lambda: CudaBackend("cpu"), dtype=torch.float16,
    #                                           sizes=["tiny", "small"])

Select sizes with ``sizes=`` or the environment (``MUSECORE_CONFORMANCE_SIZES=tiny,small`` for a
fast CPU run; the 816b cases need a few GiB and seconds each), or ``pytest -k "not 816b"``.

This package is the conformance suite only. End-to-end accuracy against BF16 (perplexity, KL,
top-1 agreement, logit error) lives in :mod:`musecore.evaluate`, calibration (AutoRound, static
activation scales for W4A4 checkpoints) in :mod:`musecore.calibrate`; ``musecore matrix``
(:mod:`musecore.matrix`) uses both.

Without pytest (what ``musecore matrix`` does for its per-op table)::

    from musecore.testing import check_op, conformance_cases, run_conformance
    for result in run_conformance(MyBackend(), sizes=["tiny"]):
        print(result.message())
"""

from musecore.testing.blocks import fused_blocks, through_separate_ops
from musecore.testing.cases import SIZES, SIZES_ENV, ConformanceCase, conformance_cases, projection_shapes
from musecore.testing.check import CaseResult, assert_nmse, check_op, compare, nmse, run_conformance
from musecore.testing.conformance import make_conformance_tests
from musecore.testing.inputs import BuiltCase, build
from musecore.testing.serving import Collector, serve_all

__all__ = ["SIZES", "SIZES_ENV", "BuiltCase", "CaseResult", "Collector", "assert_nmse", "ConformanceCase", "build", "check_op", "compare",
           "conformance_cases", "fused_blocks", "make_conformance_tests", "nmse", "projection_shapes", "run_conformance",
           "serve_all", "through_separate_ops"]
