"""A/B of programmatic dependent launch (``musecore_cuda/kernels/pdl.py``): the same benchmarks with PDL off
(``MUSECORE_CUDA_PDL=0``), with waits only (``MUSECORE_CUDA_PDL_EARLY=0``: every kernel signals the next when
its blocks exit) and with the default early signal of the decode GEMVs, each in its own process, alternating
for ``--rounds`` rounds::

    python benchmarks/cuda_pdl_ab.py --rounds 2 --out benchmarks/results/cuda_pdl_ab.json

Cases: ``e2e`` (muse-small decode, batch 1 and 32, CUDA graphs), ``moe`` (the full-size layer at
decode batches: gate+up, down and finalize are three dependent kernels in one graph replay) and
``linear`` (decode linears; the benchmark replays one graph of back-to-back calls over rotated
weight copies, so with PDL each call's start overlaps the previous call's tail, as in a decode
step where a linear follows another kernel). Every row is printed next to its counterparts with the
ratios off/on; the best of the rounds is kept per setting.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

CASES = ("e2e", "moe", "linear")


def child(cases: list[str], path: Path) -> None:
    import torch
    from musecore_cuda import bench

    rows = []
    for case in cases:
        if case == "e2e":
            rows += bench.bench_e2e(batches=(1, 32))
        elif case == "moe":
            rows += bench.bench_moe(batches=(1, 4, 16), prefill=64)
        elif case == "linear":
            rows += bench.bench_linear(shapes=["q_proj", "k_proj", "expert_down"], ms=(1, 8, 16, 64),
                                       formats=("nvfp4",))
        torch.cuda.empty_cache()
    path.write_text(json.dumps(rows))


def key(row: dict) -> tuple:
    return (row["case"], row.get("format"), row.get("path"), row.get("shape"), row.get("M"), row.get("config"))


SETTINGS = {"off": {"MUSECORE_CUDA_PDL": "0"},
            "waits": {"MUSECORE_CUDA_PDL": "1", "MUSECORE_CUDA_PDL_EARLY": "0"},
            "early": {"MUSECORE_CUDA_PDL": "1", "MUSECORE_CUDA_PDL_EARLY": "1"}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--child", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    cases = args.cases.split(",")
    if args.child:
        child(cases, args.child)
        return
    best: dict[str, dict[tuple, dict]] = {name: {} for name in SETTINGS}
    for r in range(args.rounds):
        for name, env in SETTINGS.items():
            tmp = Path(f"/tmp/cuda_pdl_ab_{name}.json")
            subprocess.run([sys.executable, __file__, "--cases", args.cases, "--child", str(tmp)],
                           env={**os.environ, **env}, check=True)
            for row in json.loads(tmp.read_text()):
                k = key(row)
                if k not in best[name] or row["time_us"] < best[name][k]["time_us"]:
                    best[name][k] = row
            print(f"round {r + 1} {name} done", flush=True)
    table = []
    print(f"{'case':7s} {'path':10s} {'shape':28s} {'M':>5s} {'off us':>9s} {'waits us':>9s} {'early us':>9s} "
          f"{'off/waits':>9s} {'off/early':>9s}")
    for k, off in best["off"].items():
        waits, early = best["waits"].get(k), best["early"].get(k)
        if waits is None or early is None:
            continue
        row = {"key": list(k), "off": off, "waits": waits, "early": early,
               "off_over_waits": round(off["time_us"] / waits["time_us"], 3),
               "off_over_early": round(off["time_us"] / early["time_us"], 3)}
        table.append(row)
        print(f"{k[0]:7s} {str(k[2]):10s} {str(k[3]):28s} {str(k[4]):>5s} {off['time_us']:9.1f} "
              f"{waits['time_us']:9.1f} {early['time_us']:9.1f} {row['off_over_waits']:9.3f} "
              f"{row['off_over_early']:9.3f}")
    if args.out:
        args.out.write_text(json.dumps({"command": " ".join(sys.argv), "rounds": args.rounds, "settings": SETTINGS,
                                        "rows": table}, indent=1))


if __name__ == "__main__":
    main()
