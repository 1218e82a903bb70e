"""One side of a before/after A/B of the decode step's fixed cost (issue 30 item 3): muse-small (random weights, the
INT4 plan, optionally cut to ``--layers``), the fixed-cost step of ``benchmarks/xeon_decode_profile.py`` (linear, moe
and attention replayed: nothing streams) and the plain decode step, ``--rounds`` times each per thread count, printed
as one JSON line. Run it alternately on two trees (``PYTHONPATH`` = the other tree's packages, as the NOTES say) so
that the host's drift hits both sides; on this VM runs minutes apart differ by up to 1.5x.

    python3 backends/xeon/lab/scripts/fixed_cost_ab.py --tag after [--layers 16] [--threads 1 2] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "benchmarks"))
import xeon_decode_profile as profile  # noqa: E402  (the tree's own copy of the profile's step functions)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tag", required=True)
    p.add_argument("--layers", type=int, default=0)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=64)
    args = p.parse_args()
    load = os.getloadavg()
    model = profile.load("int4", args.layers)
    out = {"tag": args.tag, "musecore": __import__("musecore").__file__, "layers": args.layers or 16,
           "load_before": load, "utc": time.strftime("%H:%M:%S", time.gmtime())}
    for t in args.threads:
        torch.set_num_threads(t)
        profile.run_steps(model, 8)
        fixed, plain = [], []
        for _ in range(args.rounds):
            wall, cpu, aten = profile.fixed_cost_step(model, args.steps)
            fixed.append(cpu * 1e3)
            plain.append(profile.run_steps(model, args.steps)[1] * 1e3)
        out[f"{t}t"] = {"fixed_cpu_ms_median": statistics.median(fixed), "fixed_cpu_ms": fixed,
                        "step_cpu_ms_median": statistics.median(plain), "step_cpu_ms": plain,
                        "aten_ops_per_step": sum(aten.values())}
    out["load_after"] = os.getloadavg()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
