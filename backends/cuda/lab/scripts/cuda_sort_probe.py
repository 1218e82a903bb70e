"""``torch.sort`` against the one-program sort (``musecore_triton.kernels.sort``) of the decode MoE's
assignments, at the counts the runs path sorts (top-8 of 64 or 256 experts at batch 1-128: 8-1024 assignments), each
replayed from a CUDA graph (``bench.time_us``), outputs checked equal to a stable ``torch.sort`` first::

    python backends/cuda/lab/scripts/cuda_sort_probe.py [--counts 8,32,64,128,1024] [--out cuda_sort_probe.json]
"""

from __future__ import annotations

import argparse
import json

import torch

from musecore_cuda.bench import time_us
from musecore_triton.kernels.sort import sort_assignments


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--counts", default="8,32,64,128,1024")
    p.add_argument("--out", default="cuda_sort_probe.json")
    args = p.parse_args()
    rows = []
    for n in (int(c) for c in args.counts.split(",")):
        for experts in (64, 256):
            flat = torch.randint(0, experts, (n,), device="cuda")
            order, perm = sort_assignments(flat)
            want = torch.sort(flat, stable=True)
            if not (torch.equal(order, want[0]) and torch.equal(perm, want[1])):
                raise AssertionError(f"{n} assignments over {experts} experts: the sorts differ")
            row = {"assignments": n, "experts": experts, "torch_sort_us": round(time_us(lambda: torch.sort(flat)), 2),
                   "one_program_us": round(time_us(lambda: sort_assignments(flat)), 2)}
            rows.append(row)
            print(row, flush=True)
    with open(args.out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
