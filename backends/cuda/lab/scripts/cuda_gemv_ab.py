"""The decode GEMV's lean path against its plain one (session 55's code), in one process (issue 26): the same plans and
launches, the kernels compiled from ``csrc/fp4_gemv.cu`` as shipped (new) or with ``MUSECORE_GEMV_PLAIN`` defined
(old), each captured in its own CUDA graph and timed in interleaved rounds (``bench.time_calls``). Rows: NVFP4 linears
through the MMA decode kernel at M = 1..16 (816B shapes, weights rotated past L2), and the 816B MoE layer (256
experts, top-8) at decode batches. Outputs of old and new are compared bit for bit (the arithmetic is the same).
``--variants`` adds other sources, ``lab/csrc/s56_variants/NAME.cu`` without ``pdl.cuh`` (session 56's, run 78:
restore them with ``git show 49e7704:backends/cuda/lab/csrc/s56_variants/NAME.cu``).

``--cut NAME:FIELD=V,...`` (repeatable) adds a variant that runs the linears at M = 1 on another cut of the shipped
kernel: ``GemvPlan`` fields (``split_k``, ``k_warps``, ``prefetch``, ``tile``, ``lean``, ``min_blocks``: the kernel's
``__launch_bounds__`` minimum blocks per SM, which caps its registers: 8 -> 64), and ``on`` (``linear``, the default;
``up``, ``down`` or ``moe``: the 816B MoE's expert GEMVs instead, its gate/up, down or both). Session 57's question:
the q_proj M = 1 GEMV issues its instructions in ~7 us of the 18.6 it takes, with ~4 warps per scheduler (a 512-block
grid at 95 registers); ``--cut tlp:split_k=2,prefetch=1,min_blocks=8`` doubles its warps (1024 blocks, 8 per SM at 64
registers) with the same bytes in flight. A cut sums in another order, so its rows report the largest relative
difference from the old kernel instead of bit equality. Session 58's: the MoE's gate/up GEMV at batch 1 runs 512
blocks at 159 registers, 3 per SM: 1.29 waves; ``--cut up4:on=up,prefetch=1,min_blocks=4`` fits it in one wave (128
registers, no spill at one chunk in flight; NVRTC)::

    python3 backends/cuda/lab/scripts/cuda_gemv_ab.py [--shapes q_proj,k_proj,expert_down] [--ms 1,4,16]
        [--batches 1,4,16] [--cut NAME:split_k=2,min_blocks=8] [--cut NAME:on=up,prefetch=1,min_blocks=4]
        [--out cuda_gemv_ab.json]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import torch

from musecore_cuda import CudaBackend
from musecore_cuda.backend import fp4_decode_linear
from musecore_cuda.bench import (LINEAR_SHAPES, _rotating, copy_resident, gpu_name, memory_ceiling_gbps, random_fp4,
                                 time_calls)
from musecore_cuda.kernels import fp4_gemv_cuda, moe_decode, sources

CSRC = Path(__file__).resolve().parents[1] / "csrc"
SOURCES = {"old": "#define MUSECORE_GEMV_PLAIN 1\n" + fp4_gemv_cuda.SOURCE, "new": fp4_gemv_cuda.SOURCE}
ACTIVE = {"source": "new"}
CUTS: dict[str, dict] = {}  # --cut variants: the GemvPlan fields each forces, and on which plans ("on")
MOE_ON = ("up", "down", "moe")
_compiled: dict = {}
_make_plan = fp4_gemv_cuda.make_plan
_moe_plans = moe_decode._plans.__wrapped__  # (uncached: each source's graph is captured with its own plans)


def _plan(m, n, k, dtype, device, **kw):
    """fp4_gemv_cuda.make_plan, with the ACTIVE --cut variant's fields on linear M = 1 plans."""
    plan = _make_plan(m, n, k, dtype, device, **kw)
    cut = CUTS.get(ACTIVE["source"])
    if cut and cut["on"] == "linear" and m == 1 and kw.get("programs", 1) == 1:
        return replace(plan, **cut["fields"])
    return plan


def _moe_plans_cut(width, inter, dtype, device, programs, runs):
    """moe_decode._plans, with the ACTIVE --cut variant's fields on its gate/up and/or down plans."""
    up, down, on_runs = _moe_plans(width, inter, dtype, device, programs, runs)
    cut = CUTS.get(ACTIVE["source"])
    if cut and cut["on"] in MOE_ON:
        up = replace(up, **cut["fields"]) if cut["on"] in ("up", "moe") else up
        down = replace(down, **cut["fields"]) if cut["on"] in ("down", "moe") else down
    return up, down, on_runs


def add_cut(spec: str) -> None:
    """``NAME:FIELD=V,...``: the shipped source with other plan fields (``on``: which plans)."""
    name, _, fields = spec.partition(":")
    cut, on = {}, "linear"
    for item in filter(None, fields.split(",")):
        key, _, value = item.partition("=")
        if key == "on":
            if value not in ("linear", *MOE_ON):
                raise SystemExit(f"--cut {spec}: on={value}? (linear, {', '.join(MOE_ON)})")
            on = value
        else:
            cut[key] = value.lower() == "true" if key == "lean" else int(value)
    SOURCES[name], CUTS[name] = fp4_gemv_cuda.SOURCE, {"on": on, "fields": cut}


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


def max_rel_diffs(outs: dict, ref: torch.Tensor, cuts: list[str]) -> dict:
    """A cut may sum in another order: how far each is from the old kernel, relative to its largest output."""
    return {v: float((outs[v].float() - ref.float()).abs().max() / ref.float().abs().max()) for v in cuts}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="q_proj,k_proj,expert_up,expert_down")
    p.add_argument("--ms", default="1,2,4,8,16")
    p.add_argument("--batches", default="1,4,16")
    p.add_argument("--out", default="cuda_gemv_ab.json")
    p.add_argument("--variants", default="", help="more sources: names of lab/csrc/s56_variants/NAME.cu")
    p.add_argument("--cut", action="append", default=[], help="NAME:FIELD=V,...: the M = 1 linears on another cut")
    args = p.parse_args()
    for v in filter(None, args.variants.split(",")):
        SOURCES[v] = sources.read("pdl.cuh") + (CSRC / "s56_variants" / f"{v}.cu").read_text()
    for spec in args.cut:
        add_cut(spec)
    fp4_gemv_cuda._kernel = _kernel  # (launch looks the name up through the module)
    fp4_gemv_cuda.make_plan = _plan
    moe_decode._plans = _moe_plans_cut
    linear_sources = [v for v in SOURCES if CUTS.get(v, {}).get("on", "linear") == "linear"]
    moe_sources = [v for v in SOURCES if CUTS.get(v, {}).get("on", "moe") in MOE_ON]
    linear_cuts = [v for v in linear_sources if v in CUTS]
    moe_cuts = [v for v in moe_sources if v in CUTS]
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
            outs = {v: with_source(v, lambda: call(w0))() for v in linear_sources}
            same = all(torch.equal(ref, outs[v]) for v in linear_sources if v not in CUTS)
            times = time_calls({v: (ws, lambda w, v=v: with_source(v, lambda: call(w))()) for v in linear_sources},
                               interleave=True)
            row = {"case": "linear", "shape": f"{name} {k}->{n}", "M": m, **row_times(times, w0.nbytes, ceiling),
                   "bit_equal": same}
            if linear_cuts:
                row["cut_max_rel_diff"] = max_rel_diffs(outs, ref, linear_cuts)
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
        outs = {v: with_source(v, call)() for v in moe_sources}
        same = all(torch.equal(ref, outs[v]) for v in moe_sources if v not in CUTS)
        times = time_calls({v: ([0], lambda _, v=v: with_source(v, call)()) for v in moe_sources}, interleave=True)
        nbytes = int(ids.unique().numel()) * per_expert
        row = {"case": "moe", "batch": t, **row_times(times, nbytes, ceiling), "bit_equal": same}
        if moe_cuts:
            row["cut_max_rel_diff"] = max_rel_diffs(outs, ref, moe_cuts)
        rows.append(row)
        print(json.dumps(row), flush=True)
    with open(args.out, "w") as f:
        json.dump({"meta": {"gpu": gpu_name(), "torch": torch.__version__, **ceiling}, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
