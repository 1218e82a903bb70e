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


class Layer816B:
    """One full-size 816B MoE layer (NVFP4, E 256, top-8, h = I = 4096) with random weights, its router, the
    memory ceiling measured here and the bytes of one expert; :meth:`route` gives a batch's (z, weights, ids)."""

    experts, topk, width, inter, hidden = 256, 8, 4096, 4096, 8192

    def __init__(self) -> None:
        E, h, inter, H = self.experts, self.width, self.inter, self.hidden
        self.be = CudaBackend("cuda")
        self.ceiling = memory_ceiling_gbps()["ceiling_gbps"]
        self.fp4 = self.be.prepare_experts(random_fp4("nvfp4", (E, inter, h)), random_fp4("nvfp4", (E, inter, h)),
                                           random_fp4("nvfp4", (E, h, inter)))
        self.per_expert = sum(s.nbytes for s in (self.fp4.gate, self.fp4.up, self.fp4.down)) // E
        self.norm = torch.ones(h, device="cuda", dtype=torch.bfloat16)
        self.router = torch.randn(E, H, device="cuda") * H ** -0.5
        self.bias = torch.randn(E, device="cuda") * 0.01

    def route(self, t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        H = self.hidden
        weights, ids = self.be.router_topk(torch.randn(t, H, device="cuda", dtype=torch.bfloat16), self.router,
                                           self.bias, self.topk, (H / 256) ** -0.5, 1.0)
        return torch.randn(t, self.width, device="cuda", dtype=torch.bfloat16), weights, ids

    def pct_ceiling(self, ids: torch.Tensor, us: float) -> float:
        """The % of the memory ceiling at which ``us`` streams the routed experts' bytes once."""
        return round(100 * int(ids.unique().numel()) * self.per_expert / us / 1e3 / self.ceiling, 1)


class LayerSmall(Layer816B):
    """muse-small's MoE layer (E 64, top-8, h = I = 768 behind the pooler, hidden 1536), the same way."""

    experts, topk, width, inter, hidden = 64, 8, 768, 768, 1536


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batches", default="8,16,32,48,64,96,128")
    p.add_argument("--out", default="cuda_moe_runs_probe.json")
    args = p.parse_args()
    layer = Layer816B()
    fp4, norm, experts, topk, ceiling = layer.fp4, layer.norm, layer.experts, layer.topk, layer.ceiling
    rows = []
    for t in (int(b) for b in args.batches.split(",")):
        z, weights, ids = layer.route(t)
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
            row[name] = {"us": round(us, 1), "pct_ceiling": layer.pct_ceiling(ids, us), "nmse_vs_grouped": err}
        rows.append(row)
        print(f"batch {t:4d} ({t * topk} assignments, {routed} experts): "
              + ", ".join(f"{k} {v['us']:.0f} us ({v['pct_ceiling']:.0f}%)" for k, v in row.items()
                          if isinstance(v, dict)), flush=True)
    with open(args.out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "ceiling_gbps": ceiling, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
