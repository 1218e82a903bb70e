"""``musecore bench --backend rocm``: kernel timings on an AMD GPU, measured the way PERF.md asks.

Without a ROCm GPU every case stops with the reason (timing Triton's interpreter would measure the
interpreter). Never run yet: the first MI355X/MI300X host to run it fills ``benchmarks/results/``.
Each time is the median of event-timed calls after warm-up, weights rotated among copies so that
the numbers are HBM, not the 256 MB Infinity Cache; ratios are taken in the same process: against
BF16 hipBLASLt on the same shape, and against the memory ceiling measured here (a large device copy).
Rows: ``case, format, shape, M, time_us, speedup_vs_bf16, pct_memory_ceiling`` plus ``arch``.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from musecore.benchmarking import cycle, rotating
from musecore.cli import UsageError

LINEAR_SHAPES = {  # name: (N, K) of the 816B preset (MODEL.md)
    "q_proj": (8192, 8192), "k_proj": (1024, 8192), "pooler": (4096, 8192), "unpooler": (8192, 4096),
    "expert_gate_up": (8192, 4096), "expert_down": (4096, 4096),
}
M_SWEEP = (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096)
ROTATE_BYTES = 1 << 30  # beyond MI355X's 256 MB Infinity Cache


class Skip(UsageError):
    """Raised by a case that cannot run here; the message is the reason (``musecore bench`` prints it as one
    line, exit 2: the core has no skip protocol for benchmark cases yet)."""


def _backend():
    from musecore_rocm import RocmBackend
    be = RocmBackend("cuda")
    probe = be.probe()
    if not probe.available:
        raise Skip(f"musecore bench --backend rocm needs an AMD GPU: {probe.reason}")
    return be, probe


def time_us(fn: Callable[[], object], reps: int = 20) -> float:
    """Median microseconds of one ``fn()``, timed with device events after warm-up."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    times.sort()
    return times[len(times) // 2]


def memory_ceiling_gbps() -> float:
    """GB/s of a 2 GiB device-to-device copy (read + write bytes)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = time_us(lambda: dst.copy_(src), reps=10)
    return 2 * src.numel() / t / 1e3


def bench_linear() -> list[dict]:
    """MXFP4 W4A4 (gfx950) / W4A16 and BF16 on the 816B shapes over the M sweep."""
    import musecore_quant
    be, probe = _backend()
    arch = probe.details["arch"]
    ceiling = memory_ceiling_gbps()
    rows = []
    acts = ("mxfp4", None) if arch == "gfx950" else (None,)
    for name, (n, k) in LINEAR_SHAPES.items():
        w = torch.randn(n, k, device="cuda") * k ** -0.5
        dense = rotating(lambda: be.prepare_weight(w.to(torch.bfloat16), name), n * k * 2, ROTATE_BYTES)
        qt = musecore_quant.quantize(w, "mxfp4")
        for act in acts:
            mx = rotating(lambda: be.prepare_weight(qt, name, act_format=act), qt.data.numel() + qt.scale.numel(),
                          ROTATE_BYTES)
            for m in M_SWEEP:
                x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
                t_mx = time_us(cycle(mx, lambda wt: be.linear(x, wt))) / len(mx)
                t_bf = time_us(cycle(dense, lambda wt: F.linear(x, wt.data))) / len(dense)
                nbytes = qt.data.numel() + qt.scale.numel() + 2 * m * (k + n)
                rows.append({"backend": "rocm", "arch": arch, "case": "linear",
                             "format": "mxfp4" + (f"/a{act}" if act else " w4a16"), "shape": f"{name} {n}x{k}",
                             "M": m, "time_us": t_mx, "speedup_vs_bf16": t_bf / t_mx,
                             "pct_memory_ceiling": 100 * nbytes / (t_mx * 1e3) / ceiling})
    return rows


def bench_moe() -> list[dict]:
    """The MXFP4 MoE of one 816B layer (256 experts of 4096x4096, top-8) at decode and prefill batches."""
    import musecore_quant
    be, probe = _backend()
    arch = probe.details["arch"]
    act = "mxfp4" if arch == "gfx950" else None
    E, h, inter, k = 256, 4096, 4096, 8
    stacks = [musecore_quant.quantize(torch.randn(E, o, i, device="cuda") * i ** -0.5, "mxfp4")
              for o, i in ((inter, h), (inter, h), (h, inter))]
    experts = be.prepare_experts(*stacks, act_format=act)
    post = torch.ones(h, device="cuda", dtype=torch.bfloat16)
    ceiling = memory_ceiling_gbps()
    rows = []
    for T in (1, 4, 16, 64, 256, 1024):
        z = torch.randn(T, h, device="cuda").to(torch.bfloat16)
        weights, ids = torch.rand(T, E, device="cuda").topk(k)
        t = time_us(lambda: be.moe(z, weights, ids, experts, post, 1e-6))
        touched = ids.unique().numel()
        nbytes = touched * 3 * inter * h * 17 // 32  # 4.25 bits per weight, routed experts only
        rows.append({"backend": "rocm", "arch": arch, "case": "moe", "format": "mxfp4" + (f"/a{act}" if act else ""),
                     "shape": f"{E} experts {h}x{inter} top-{k}", "M": T, "time_us": t, "speedup_vs_bf16": float("nan"),
                     "pct_memory_ceiling": 100 * nbytes / (t * 1e3) / ceiling})
    return rows


def benchmarks() -> dict[str, Callable[..., list[dict]]]:
    """Case name -> benchmark callable (each raises :class:`Skip` with the reason without a ROCm GPU)."""
    return {"linear": bench_linear, "moe": bench_moe}
