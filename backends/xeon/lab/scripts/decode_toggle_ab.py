"""In-process A/B of session 38's decode-step changes on one loaded model (random-weight muse-small, the INT4 plan):
the plain decode step (``benchmarks/xeon_decode_profile.py``'s ``run_steps``, main-thread CPU per token) with
each change switched off in turn, configurations alternating within every round so the host's drift hits all:
``one-call moe`` off = each layer's ``XeonExperts.native_call`` None (the ctypes path of 4a8391e: the same kernel),
``rope table`` off = ``model.rope.tabled`` False (the per-step formula). Same bits in every configuration.

    python3 backends/xeon/lab/scripts/decode_toggle_ab.py [--threads 1 2] [--rounds 5] [--steps 64] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "benchmarks"))
import xeon_decode_profile as profile  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--layers", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    model = profile.load("int4", args.layers)
    experts = [layer.mlp.experts.extra["xeon"] for layer in model.layers if getattr(layer.mlp, "experts", None)]
    calls = [e.native_call for e in experts]

    def configure(moe_one_call: bool, rope_table: bool) -> None:
        for e, call in zip(experts, calls):
            e.native_call = call if moe_one_call else None
        model.rope.tabled = rope_table

    configs = {"all on": (True, True), "one-call moe off": (False, True), "rope table off": (True, False),
               "both off": (False, False)}
    out = {"load_before": os.getloadavg(), "results": {}}
    for t in args.threads:
        torch.set_num_threads(t)
        profile.run_steps(model, 8)
        runs = {name: [] for name in configs}
        for _ in range(args.rounds):
            for name, flags in configs.items():
                configure(*flags)
                runs[name].append(profile.run_steps(model, args.steps)[1] * 1e3)
        configure(True, True)
        out["results"][f"{t}t"] = {name: {"step_cpu_ms_median": statistics.median(v), "step_cpu_ms": v}
                                   for name, v in runs.items()}
        print(f"{t} thread(s): " + ", ".join(f"{name} {statistics.median(v):.2f} ms" for name, v in runs.items()),
              flush=True)
    out["load_after"] = os.getloadavg()
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
