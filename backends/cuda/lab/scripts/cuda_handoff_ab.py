"""A/B of the decode MoE's hand-off (``fp4_gemv_cuda.Handoff``, session 45): the down GEMV started in the gate/up
GEMV's last wave, each block waiting for its own assignment's producer warps, against the two launches one after the
other. In one process, same weights and routing:

* one full-size 816B MoE layer (NVFP4, E 256, top-8, h = I = 4096; ``--layer small``: muse-small's, E 64,
  h = I = 768) at decode batches 1-16, each mode replayed from its own CUDA graph in interleaved rounds
  (``bench.time_us_interleaved``), outputs checked bit-equal first, with the % of the memory ceiling over the routed
  experts' bytes (the targets' MoE decode row). Both modes are the decode GEMVs whatever the batch (the backend
  hands 4096-wide experts to the grouped Gluon GEMM from ``moe_prefill.DECODE_FROM_TOKENS`` tokens);
* muse-small's batch-1 decode (``MUSECORE_CUDA_MOE_HANDOFF`` set per mode, a fresh capture each), alternated rounds
  (``--rounds 0``: none).

    python backends/cuda/lab/scripts/cuda_handoff_ab.py [--batches 1,4,8,16] [--layer 816b|small] [--rounds 3]
        [--out cuda_handoff_ab.json]
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from cuda_decode_host_probe import decode_numbers  # this folder is sys.path[0] when run as a script
from cuda_moe_runs_probe import Layer816B, LayerSmall
from musecore.api import load_random
from musecore_cuda.bench import time_us_interleaved
from musecore_cuda.kernels.moe_decode import HANDOFF_ENV, moe_decode_gemv


def layer_rows(batches: list[int], small: bool = False) -> list[dict]:
    layer = LayerSmall() if small else Layer816B()
    name = "muse-small MoE layer" if small else "816B MoE layer"
    fp4, norm = layer.fp4, layer.norm
    rows = []
    for t in batches:
        z, weights, ids = layer.route(t)
        calls = {mode: (lambda on=on: moe_decode_gemv(z, weights, ids, fp4.gate, fp4.up, fp4.down, norm, 1e-8,
                                                      handoff=on)) for mode, on in (("handoff", True), ("plain", False))}
        if not torch.equal(calls["handoff"](), calls["plain"]()):
            raise AssertionError(f"batch {t}: the hand-off changed the output")
        us = time_us_interleaved(calls, rounds=6, reps=5, warm_s=0.2)
        row = {"batch": t, "routed_experts": int(ids.unique().numel()), "ceiling_gbps": layer.ceiling,
               **{mode: {"us": round(v, 1), "pct_ceiling": layer.pct_ceiling(ids, v)} for mode, v in us.items()}}
        rows.append(row)
        print(f"{name} batch {t}: hand-off {row['handoff']['us']} us ({row['handoff']['pct_ceiling']}%), "
              f"plain {row['plain']['us']} us ({row['plain']['pct_ceiling']}%)", flush=True)
    return rows


def decode_rows(preset: str, fmt: str, rounds: int) -> list[dict]:
    model = load_random(preset, "h200", checkpoint_format=fmt)
    prompt = torch.randint(0, model.config.vocab_size, (1, 32)).tolist()
    rows = []
    for r in range(rounds):
        for mode in ("handoff", "plain"):
            os.environ[HANDOFF_ENV] = "1" if mode == "handoff" else "0"  # read at capture: decode_numbers recaptures
            row = {"round": r, "mode": mode, **decode_numbers(model, prompt)}
            print(f"{preset} decode: {row}", flush=True)
            rows.append(row)
    os.environ.pop(HANDOFF_ENV, None)
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batches", default="1,4,8,16")
    p.add_argument("--layer", choices=("816b", "small"), default="816b")
    p.add_argument("--preset", default="muse-small")
    p.add_argument("--format", default="nvfp4")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="cuda_handoff_ab.json")
    args = p.parse_args()
    result = {"gpu": torch.cuda.get_device_name(), "layer_name": args.layer,
              "layer": layer_rows([int(b) for b in args.batches.split(",")], args.layer == "small")}
    torch.cuda.empty_cache()
    result["decode"] = decode_rows(args.preset, args.format, args.rounds)
    for mode in ("handoff", "plain") if args.rounds else ():
        mine = [r for r in result["decode"] if r["mode"] == mode]
        print(f"{args.preset} {mode}: replay median {sorted(r['replay_us'] for r in mine)[len(mine) // 2]} us, "
              f"generate median {sorted(r['generate_us_per_token'] for r in mine)[len(mine) // 2]} us/token")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
