"""The tile-config sweep of the portable Triton W4A16 GEMM (it chose ``musecore_triton.kernels.fp4_gemm``'s
``TILE_REGIMES``): a lab case, run by ``lab/scripts/cuda_bench.py --cases sweep``."""

from __future__ import annotations

import torch
import triton

from musecore.benchmarking import cycle
from musecore_cuda import CudaBackend
from musecore_cuda.bench import LINEAR_SHAPES, _rotating, random_fp4, time_us
from musecore_triton.kernels.fp4_gemm import GemmConfig, launch_gemm
from musecore_triton.layouts import Fp4Resident


def sweep_linear_configs(shapes: tuple[str, ...] = ("q_proj", "expert_down"),
                         ms: tuple[int, ...] = (1, 16, 64, 256, 4096)) -> list[dict]:
    """Time candidate tile configs per M regime (used to choose ``pick_config``'s table)."""
    rows = []
    for name in shapes:
        n, k = LINEAR_SHAPES[name]
        ws = _rotating(lambda: CudaBackend("cuda").prepare_weight(random_fp4("nvfp4", (n, k)), name).data,
                       n * k // 2)
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            for cfg in _candidates(m, n, k):
                out = torch.zeros(m, n, device="cuda", dtype=torch.float32 if cfg.split_k > 1 else torch.bfloat16)

                def call(w: Fp4Resident, cfg=cfg, out=out) -> None:
                    launch_gemm(x, w.packed, w.scales, w.out_scale, wfmt=w.wfmt, group=w.group,
                                fold_log2=w.fold_log2, n=n, k=k, out=out, cfg=cfg)
                try:
                    t = time_us(cycle(ws, call)) / len(ws)
                except Exception as exc:  # a config that does not compile is a row, not a crash
                    rows.append({"case": "sweep", "shape": name, "M": m, "config": str(cfg), "error": repr(exc)[:200]})
                    continue
                rows.append({"backend": "cuda", "case": "sweep", "shape": name, "M": m, "config": cfg.__dict__,
                             "time_us": round(t, 2),
                             "pct_memory_ceiling_of_4300": round(100 * ws[0].nbytes / t / 1e3 / 4300, 1)})
        del ws
    return rows


def _candidates(m: int, n: int, k: int) -> list[GemmConfig]:
    chunks = k // 128
    splits = [s for s in (1, 2, 4, 8, 16) if chunks % s == 0 and chunks // s >= 2]
    if m <= 16:
        return [GemmConfig(16, bn, s, 1, w, st) for bn in (64, 128) for s in splits
                for w, st in ((4, 4), (8, 3)) if triton.cdiv(n, bn) * s <= 2048]
    if m <= 64:
        return [GemmConfig(bm, bn, s, 1, 4, 4) for bm in (32, 64) for bn in (64, 128) for s in splits[:3]]
    if m <= 256:
        return [GemmConfig(bm, bn, s, 8, w, 3) for bm, bn in ((64, 128), (128, 128)) for s in (1, 2)
                for w in (4, 8)]
    return [GemmConfig(bm, bn, 1, 8, w, st) for bm, bn in ((128, 128), (128, 256), (256, 128))
            for w, st in ((8, 3), (8, 4), (4, 3))]
