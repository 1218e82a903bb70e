"""A/B of programmatic dependent launch (``musecore_cuda/kernels/pdl.py``): the same benchmarks with PDL off
(``MUSECORE_CUDA_PDL=0``), as shipped (``default``), everywhere with waits only (``MUSECORE_CUDA_PDL_EARLY=0``:
every kernel signals the next when its blocks exit) and everywhere with the early signal of the plain decode
GEMVs, each in its own process, alternating for ``--rounds`` rounds::

    python backends/cuda/lab/scripts/cuda_pdl_ab.py --rounds 2 --out backends/cuda/lab/results/cuda_pdl_ab.json

Cases: ``e2e`` (muse-small decode, batch 1 and 32, CUDA graphs), ``moe`` (the full-size layer at
decode batches: gate+up, down and finalize are three dependent kernels in one graph replay) and
``linear`` (decode linears, ``--linear-shapes`` at ``--linear-ms``; the benchmark replays one graph of back-to-back
calls over rotated weight copies, so with PDL each call's start overlaps the previous call's tail, as in a decode
step where a linear follows another kernel). Every row is printed next to its counterparts with the
ratios (first setting / each other one); the best of the rounds is kept per setting. ``default`` is what
ships (no variable set: PDL only inside decode graphs of up to ``pdl.MAX_BATCH`` sequences).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

CASES = ("e2e", "moe", "linear")


def child(cases: list[str], path: Path, e2e_batches: tuple[int, ...], shapes: list[str], ms: tuple[int, ...]) -> None:
    import torch
    from musecore_cuda import bench
    from musecore_cuda.kernels import fp4_gemv_cuda

    if "MUSECORE_AB_EXPERTS_EARLY_BLOCKS_PER_SM" in os.environ:  # (a lab knob, not a product variable)
        fp4_gemv_cuda.EXPERTS_EARLY_BLOCKS_PER_SM = int(os.environ["MUSECORE_AB_EXPERTS_EARLY_BLOCKS_PER_SM"])
    rows = []
    for case in cases:
        if case == "e2e":
            rows += bench.bench_e2e(batches=e2e_batches)
        elif case == "moe":
            rows += bench.bench_moe(batches=(1, 4, 16), prefill=64)
        elif case == "linear":
            rows += bench.bench_linear(shapes=shapes, ms=ms, formats=("nvfp4",))
        torch.cuda.empty_cache()
    path.write_text(json.dumps(rows))


def key(row: dict) -> tuple:
    return (row["case"], row.get("format"), row.get("path"), row.get("shape"), row.get("M"), row.get("config"))


SETTINGS = {"off": {"MUSECORE_CUDA_PDL": "0"},
            "default": {},  # what ships: PDL inside decode graphs of <= pdl.MAX_BATCH sequences, early GEMVs
            "waits": {"MUSECORE_CUDA_PDL": "1", "MUSECORE_CUDA_PDL_EARLY": "0"},
            "early": {"MUSECORE_CUDA_PDL": "1", "MUSECORE_CUDA_PDL_EARLY": "1"},
            # (session 77) run 153: the session-76 early set and the FP4 expert GEMVs, on every grid
            # (EXPERTS_EARLY_BLOCKS_PER_SM did not exist yet; the default since is `early`, which limits them)
            "experts_early": {"MUSECORE_CUDA_PDL": "1", "MUSECORE_CUDA_PDL_EARLY": (
                "fp4_gemv_mma,fp4_gemv_fma,dense_gemv,router_pooler,attention,fp4_gemv_mma_experts"),
                              "MUSECORE_AB_EXPERTS_EARLY_BLOCKS_PER_SM": "1000"},
            # the early set without the expert GEMVs (session 76's)
            "experts_late": {"MUSECORE_CUDA_PDL": "1", "MUSECORE_CUDA_PDL_EARLY": (
                "fp4_gemv_mma,fp4_gemv_fma,dense_gemv,router_pooler,attention")},
            # (session 64) the Gluon linear alone (run 107's waits_top / no_gluon settings: commit 278f0df)
            "gluon_only": {"MUSECORE_CUDA_PDL": "fp4_gluon"}}
VARS = ("MUSECORE_CUDA_PDL", "MUSECORE_CUDA_PDL_EARLY", "MUSECORE_AB_EXPERTS_EARLY_BLOCKS_PER_SM")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--settings", default=",".join(SETTINGS), help="which of " + ", ".join(SETTINGS))
    parser.add_argument("--e2e-batches", default="1,32")
    parser.add_argument("--linear-shapes", default="q_proj,k_proj,expert_down")
    parser.add_argument("--linear-ms", default="1,8,16,64")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--child", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    cases = args.cases.split(",")
    if args.child:
        child(cases, args.child, tuple(int(b) for b in args.e2e_batches.split(",")), args.linear_shapes.split(","),
              tuple(int(m) for m in args.linear_ms.split(",")))
        return
    names = args.settings.split(",")
    best: dict[str, dict[tuple, dict]] = {name: {} for name in names}
    for r in range(args.rounds):
        for name in names:
            tmp = Path(f"/tmp/cuda_pdl_ab_{name}.json")
            env = {k: v for k, v in os.environ.items() if k not in VARS} | SETTINGS[name]
            subprocess.run([sys.executable, __file__, "--cases", args.cases, "--e2e-batches", args.e2e_batches,
                            "--linear-shapes", args.linear_shapes, "--linear-ms", args.linear_ms,
                            "--child", str(tmp)], env=env, check=True)
            for row in json.loads(tmp.read_text()):
                k = key(row)
                if k not in best[name] or row["time_us"] < best[name][k]["time_us"]:
                    best[name][k] = row
            print(f"round {r + 1} {name} done", flush=True)
    table = []
    others = names[1:]
    print(f"{'case':5s} {'format':7s} {'shape':24s} {'M':>4s} {'config':16s} "
          + " ".join(f"{n + ' us':>10s}" for n in names) + " " + " ".join(f"{names[0] + '/' + n:>13s}" for n in others))
    for k, base in best[names[0]].items():
        rows = [best[n].get(k) for n in names]
        if any(r is None for r in rows):
            continue
        ratios = {n: round(base["time_us"] / r["time_us"], 3) for n, r in zip(others, rows[1:])}
        table.append({"key": list(k), **dict(zip(names, rows)), "ratio_to_first": ratios})
        print(f"{k[0]:5s} {str(k[1]):7s} {str(k[3]):24s} {str(k[4]):>4s} {str(k[5] or ''):16s} "
              + " ".join(f"{r['time_us']:10.1f}" for r in rows) + " " + " ".join(f"{v:13.3f}" for v in ratios.values()))
    if args.out:
        args.out.write_text(json.dumps({"command": " ".join(sys.argv), "rounds": args.rounds,
                                        "settings": {n: SETTINGS[n] for n in names}, "rows": table}, indent=1))


if __name__ == "__main__":
    main()
