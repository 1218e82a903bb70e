"""In-process A/B of the one-call blocks (``musecore_xeon.fused``) on one loaded model (random-weight muse-small, the
INT4 plan): the plain decode step (``benchmarks/xeon_decode_profile.py``'s ``run_steps``: wall and main-thread CPU
per token) with every fused attention and MoE block on and off, alternating within each round so that the host's
drift hits both; first a check that both give the same logits bit for bit over ``--check`` greedy steps.

    python3 backends/xeon/lab/scripts/fused_blocks_ab.py [--threads 1 2] [--rounds 5] [--steps 64] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "benchmarks"))
import xeon_decode_profile as profile  # noqa: E402
from musecore.model import separate_ops  # noqa: E402


def greedy_logits(model, steps: int) -> list[torch.Tensor]:
    cache = model.new_cache(1, 32 + steps + 8)
    out, token = [], None
    with torch.inference_mode():
        logits = model.forward(torch.arange(1, 33)[None], cache=cache)[:, -1]
        for s in range(steps):
            token = int(logits.argmax())
            logits = model.forward(torch.tensor([[token]]), positions=torch.tensor([[32 + s]]), cache=cache)[:, -1]
            out.append(logits.clone())
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--check", type=int, default=16, help="greedy steps compared bit for bit (0: none)")
    p.add_argument("--layers", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    model = profile.load("int4", args.layers)
    blocks = [b for layer in model.layers for b in (layer.self_attn, layer.mlp) if hasattr(b, "fused")]
    fused = [b.fused for b in blocks]
    kinds = {kind: sum(f is not None for b, f in zip(blocks, fused) if type(b).__name__ == kind)
             for kind in ("Attention", "MoE")}
    print(f"{sum(f is not None for f in fused)} of {len(blocks)} blocks fused ({kinds})", flush=True)

    def configure(on: bool):
        return contextlib.nullcontext() if on else separate_ops(model)

    out = {"utc": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime()), "load_before": os.getloadavg(),
           "fused_blocks": kinds, "blocks": len(blocks)}
    if args.check:
        a = greedy_logits(model, args.check)
        with separate_ops(model):
            b = greedy_logits(model, args.check)
        same = all(torch.equal(x, y) for x, y in zip(a, b))
        worst = max((x - y).abs().max().item() for x, y in zip(a, b))
        out["bit_equal_logits"] = same
        print(f"logits over {args.check} greedy steps: bit-equal {same} (max |diff| {worst:.3g})", flush=True)
    for t in args.threads:
        torch.set_num_threads(t)
        for on in (True, False):
            with configure(on):
                profile.run_steps(model, 8)
        rows = {"on": [], "off": []}
        for r in range(args.rounds):
            for on in ((True, False) if r % 2 == 0 else (False, True)):
                with configure(on):
                    wall, cpu = profile.run_steps(model, args.steps)
                rows["on" if on else "off"].append((wall * 1e3, cpu * 1e3))
        med = {k: statistics.median(w for w, _ in v) for k, v in rows.items()}
        out[f"{t}t"] = {"wall_ms_on": [w for w, _ in rows["on"]], "wall_ms_off": [w for w, _ in rows["off"]],
                        "cpu_ms_on": [c for _, c in rows["on"]], "cpu_ms_off": [c for _, c in rows["off"]],
                        "median_wall_ms_on": med["on"], "median_wall_ms_off": med["off"]}
        print(f"{t} thread(s): fused {med['on']:.2f} ms/token, separate ops {med['off']:.2f} ms/token "
              f"({med['off'] / med['on']:.3f}x; rounds on {[round(w, 2) for w, _ in rows['on']]}, "
              f"off {[round(w, 2) for w, _ in rows['off']]})", flush=True)
    out["load_after"] = os.getloadavg()
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
