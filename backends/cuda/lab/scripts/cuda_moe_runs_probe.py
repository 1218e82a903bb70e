"""Where the decode MoE's runs of one expert (``moe_decode_gemv`` with sorted assignments, session 42) stop paying
against the grouped Triton GEMM (``moe_forward``): one full-size 816B MoE layer (NVFP4, E 256, top-8, h = I = 4096)
at batches beyond ``use_gemv``'s limit (assignments <= E, set when each assignment re-read its expert), timed three
ways in one process: the GEMVs with runs, the GEMVs one program per assignment, the grouped GEMM. Each output is
checked against the grouped GEMM's (NMSE) before it is timed. The answer decides whether ``use_gemv`` may take more
tokens now that repeated experts stream once per run::

    python backends/cuda/lab/scripts/cuda_moe_runs_probe.py [--batches 8,16,32,48,64,96,128]
        [--out cuda_moe_runs_probe.json]
"""

from __future__ import annotations

import argparse
import json

import torch

from musecore.testing import nmse
from musecore_cuda import CudaBackend
from musecore_cuda.bench import memory_ceiling_gbps, random_fp4, time_us
from musecore_cuda.kernels.moe_decode import moe_decode_gemv
from musecore_triton.kernels.moe import moe_forward


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batches", default="8,16,32,48,64,96,128")
    p.add_argument("--out", default="cuda_moe_runs_probe.json")
    args = p.parse_args()
    experts, topk, width, inter, hidden = 256, 8, 4096, 4096, 8192
    be = CudaBackend("cuda")
    ceiling = memory_ceiling_gbps()["ceiling_gbps"]
    fp4 = be.prepare_experts(random_fp4("nvfp4", (experts, inter, width)), random_fp4("nvfp4", (experts, inter, width)),
                             random_fp4("nvfp4", (experts, width, inter)))
    per_expert = sum(s.nbytes for s in (fp4.gate, fp4.up, fp4.down)) // experts
    norm = torch.ones(width, device="cuda", dtype=torch.bfloat16)
    router = torch.randn(experts, hidden, device="cuda") * hidden ** -0.5
    bias = torch.randn(experts, device="cuda") * 0.01
    rows = []
    for t in (int(b) for b in args.batches.split(",")):
        weights, ids = be.router_topk(torch.randn(t, hidden, device="cuda", dtype=torch.bfloat16), router, bias, topk,
                                      (hidden / 256) ** -0.5, 1.0)
        z = torch.randn(t, width, device="cuda", dtype=torch.bfloat16)
        routed = int(ids.unique().numel())
        calls = {
            "gemv runs": lambda: moe_decode_gemv(z, weights, ids, fp4.gate, fp4.up, fp4.down, norm, 1e-8, runs=True),
            "gemv per assignment": lambda: moe_decode_gemv(z, weights, ids, fp4.gate, fp4.up, fp4.down, norm, 1e-8,
                                                           runs=False),
            "grouped": lambda: moe_forward(z, weights, ids, fp4.gate, fp4.up, fp4.down, experts, norm, 1e-8),
        }
        want = calls["grouped"]()
        row = {"batch": t, "assignments": t * topk, "routed_experts": routed}
        for name, fn in calls.items():
            err = nmse(want, fn())
            if err > 1e-4:
                raise AssertionError(f"batch {t} {name}: NMSE {err:.2e} against the grouped GEMM")
            us = time_us(fn, reps=10)
            row[name] = {"us": round(us, 1), "pct_ceiling": round(100 * routed * per_expert / us / 1e3 / ceiling, 1),
                         "nmse_vs_grouped": err}
        rows.append(row)
        print(f"batch {t:4d} ({t * topk} assignments, {routed} experts): "
              + ", ".join(f"{k} {v['us']:.0f} us ({v['pct_ceiling']:.0f}%)" for k, v in row.items()
                          if isinstance(v, dict)), flush=True)
    with open(args.out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "ceiling_gbps": ceiling, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
