"""The decode GEMV's lean path against its plain one (session 55's code), in one process (issue 26): the same plans and
launches, the kernels compiled from ``csrc/fp4_gemv.cu`` as shipped (new) or with ``MUSECORE_GEMV_PLAIN`` defined
(old), each captured in its own CUDA graph and timed in interleaved rounds (``bench.time_calls``). Rows: NVFP4 linears through the MMA decode
kernel at M = 1..16 (816B shapes, weights rotated past L2), and the 816B MoE layer (256 experts, top-8) at decode
batches. Outputs of old and new are compared bit for bit (the arithmetic is the same). ``--variants`` adds other
sources, ``lab/csrc/s56_variants/NAME.cu`` without ``pdl.cuh`` (session 56's, run 78: restore them with
``git show 49e7704:backends/cuda/lab/csrc/s56_variants/NAME.cu``)::

    python3 backends/cuda/lab/scripts/cuda_gemv_ab.py [--shapes q_proj,k_proj,expert_down] [--ms 1,4,16]
        [--batches 1,4,16] [--out cuda_gemv_ab.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from musecore_cuda import CudaBackend
from musecore_cuda.backend import fp4_decode_linear
from musecore_cuda.bench import (LINEAR_SHAPES, _rotating, copy_resident, gpu_name, memory_ceiling_gbps, random_fp4,
                                 time_calls)
from musecore_cuda.kernels import fp4_gemv_cuda, sources

CSRC = Path(__file__).resolve().parents[1] / "csrc"
SOURCES = {"old": "#define MUSECORE_GEMV_PLAIN 1\n" + fp4_gemv_cuda.SOURCE, "new": fp4_gemv_cuda.SOURCE}
ACTIVE = {"source": "new"}
_compiled: dict = {}


def _kernel(name: str):
    """fp4_gemv_cuda._kernel, per source: the one ACTIVE names when a launch (or its graph capture) asks."""
    key = (ACTIVE["source"], name)
    if key not in _compiled:
        _compiled[key] = torch.cuda._compile_kernel(SOURCES[ACTIVE["source"]], name)
    return _compiled[key]


def with_source(source: str, fn):
    def call():
        ACTIVE["source"] = source
        try:
            return fn()
        finally:
            ACTIVE["source"] = "new"
    return call


def row_times(times: dict, nbytes: int, ceiling: dict) -> dict:
    """Each source's time, its speedup over the old kernel, and the new kernel's share of the ceiling."""
    return {"us": {v: round(t, 2) for v, t in times.items()},
            "speedup_vs_old": {v: round(times["old"] / t, 3) for v, t in times.items()},
            "new_pct_ceiling": round(100 * nbytes / times["new"] / 1e3 / ceiling["ceiling_gbps"], 1)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="q_proj,k_proj,expert_up,expert_down")
    p.add_argument("--ms", default="1,2,4,8,16")
    p.add_argument("--batches", default="1,4,16")
    p.add_argument("--out", default="cuda_gemv_ab.json")
    p.add_argument("--variants", default="", help="more sources: names of lab/csrc/s56_variants/NAME.cu")
    args = p.parse_args()
    for v in filter(None, args.variants.split(",")):
        SOURCES[v] = sources.read("pdl.cuh") + (CSRC / "s56_variants" / f"{v}.cu").read_text()
    fp4_gemv_cuda._kernel = _kernel  # (launch looks the name up through the module)
    be = CudaBackend("cuda")
    ceiling = memory_ceiling_gbps()
    rows = []
    for name in args.shapes.split(","):
        n, k = LINEAR_SHAPES[name]
        w0 = be.prepare_weight(random_fp4("nvfp4", (n, k)), name).data
        ws = _rotating(lambda: copy_resident(w0), n * k // 2)
        for m in [int(v) for v in args.ms.split(",")]:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            call = lambda w: fp4_decode_linear(x, w, "mma")  # noqa: E731
            ref = with_source("old", lambda: call(w0))()
            same = all(torch.equal(ref, with_source(v, lambda: call(w0))()) for v in SOURCES)
            times = time_calls({v: (ws, lambda w, v=v: with_source(v, lambda: call(w))()) for v in SOURCES},
                               interleave=True)
            row = {"case": "linear", "shape": f"{name} {k}->{n}", "M": m, **row_times(times, w0.nbytes, ceiling),
                   "bit_equal": same}
            rows.append(row)
            print(json.dumps(row), flush=True)
        del ws
        torch.cuda.empty_cache()
    experts, topk, width, inter, hidden = 256, 8, 4096, 4096, 8192
    fp4 = be.prepare_experts(random_fp4("nvfp4", (experts, inter, width)), random_fp4("nvfp4", (experts, inter, width)),
                             random_fp4("nvfp4", (experts, width, inter)))
    per_expert = sum(s.nbytes for s in (fp4.gate, fp4.up, fp4.down)) // experts
    post_norm = torch.ones(width, device="cuda", dtype=torch.bfloat16)
    router = torch.randn(experts, hidden, device="cuda") * hidden ** -0.5
    bias = torch.randn(experts, device="cuda") * 0.01
    for t in [int(v) for v in args.batches.split(",")]:
        hid = torch.randn(t, hidden, device="cuda", dtype=torch.bfloat16)
        weights, ids = be.router_topk(hid, router, bias, topk, (hidden / 256) ** -0.5, 1.0)
        z = torch.randn(t, width, device="cuda", dtype=torch.bfloat16)
        call = lambda: be.moe(z, weights, ids, fp4, post_norm, 1e-8)  # noqa: E731
        ref = with_source("old", call)()
        same = all(torch.equal(ref, with_source(v, call)()) for v in SOURCES)
        times = time_calls({v: ([0], lambda _, v=v: with_source(v, call)()) for v in SOURCES}, interleave=True)
        nbytes = int(ids.unique().numel()) * per_expert
        row = {"case": "moe", "batch": t, **row_times(times, nbytes, ceiling), "bit_equal": same}
        rows.append(row)
        print(json.dumps(row), flush=True)
    with open(args.out, "w") as f:
        json.dump({"meta": {"gpu": gpu_name(), "torch": torch.__version__, **ceiling}, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
