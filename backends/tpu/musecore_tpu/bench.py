"""``musecore bench --backend tpu``: kernel timings on a TPU. Without one every case skips with the reason (timing
the TPU interpreter on a CPU would measure the interpreter, not a TPU).

Rows: ``case, format, shape, M, time_us, speedup_vs_bf16, pct_memory_ceiling`` (backends/README.md). Never run:
the first TPU host to run it fills ``benchmarks/results/``.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

import torch

from musecore.cli import UsageError

CASES = {  # case -> (format, (out, in)): the 816B model's expert and attention projections
    "linear-w4a16-int4-expert": ("int4", (4096, 4096)),
    "linear-w4a16-mxfp4-expert": ("mxfp4", (4096, 4096)),
    "linear-w4a16-nvfp4-expert": ("nvfp4", (4096, 4096)),
    "linear-bf16-q_proj": ("bf16", (8192, 8192)),
}


class Skip(UsageError):
    """Raised by a case that cannot run here; the message is the reason. A ``UsageError`` so ``musecore bench``
    prints it as one line (exit 2): the core has no skip protocol for benchmark cases yet (INTEGRATION.md)."""


def _no_tpu_reason(backend: Any) -> Optional[str]:
    probe = backend.probe()
    return None if probe.available else f"no TPU here: {probe.reason}"


def _linear_case(backend: Any, fmt: str, shape: tuple[int, int]) -> Callable[[], list[dict]]:
    def run() -> list[dict]:
        reason = _no_tpu_reason(backend)
        if reason:
            raise Skip(reason)
        from musecore_quant import quantize
        from musecore_tpu.chips import CHIPS
        out_f, in_f = shape
        w = torch.randn(out_f, in_f) * in_f ** -0.5
        chip = CHIPS[backend.probe().devices[0]]
        rows = []
        prepared = backend.prepare_weight(w.to(torch.bfloat16) if fmt == "bf16" else quantize(w, fmt), "bench")
        dense = backend.prepare_weight(w.to(torch.bfloat16), "bench")
        for M in (1, 16, 256):
            x = torch.randn(M, in_f).to(torch.bfloat16).to(backend.device)
            times = {}
            for label, weight in (("fmt", prepared), ("bf16", dense)):
                backend.linear(x, weight)  # compile
                start = time.perf_counter()
                for _ in range(20):
                    y = backend.linear(x, weight)
                y.cpu()
                times[label] = (time.perf_counter() - start) / 20
            nbytes = sum(t.numel() * t.element_size() for t in prepared.data.values() if t is not None)
            rows.append({"case": f"linear {fmt}", "format": fmt, "shape": f"{out_f}x{in_f}", "M": M,
                         "time_us": times["fmt"] * 1e6, "speedup_vs_bf16": times["bf16"] / times["fmt"],
                         "pct_memory_ceiling": 100 * nbytes / chip.hbm_bytes_per_s / times["fmt"]})
        return rows
    return run


def benchmarks(backend: Any = None) -> dict[str, Callable[[], list[dict]]]:
    """``{case: () -> rows}``; each case raises :class:`Skip` with the reason when no TPU is here."""
    if backend is None:
        from musecore_tpu import TpuBackend
        backend = TpuBackend("cpu")
    return {name: _linear_case(backend, fmt, shape) for name, (fmt, shape) in CASES.items()}
