"""Session 82: where dequantize + cuBLAS overtakes the large-M Gluon launch past M = 2048, timed the way the targets
case times M = 4096 (``bench.bench_linear``: both NVFP4 paths beside BF16 cuBLAS on the same model-like weights, in
interleaved rounds from ``bench.INTERLEAVE_M`` on, so that power-limited clocks fall on every path alike).

Since session 82 ``choices.GLUON_LARGE_MAX_M`` (2048) ends the Gluon launch on every K: at M = 4096 the targets case
had dequantize + cuBLAS ahead on the K = 8192 shapes in 36 of 52 rows (runs 122-167); 2049-4095 were never timed in
interleaved rounds (run 168's sequential sweep is inside its own noise). Each (shape, M) prints both paths' times and
``gluon_vs_dequant`` (> 1: the Gluon launch is faster), each shape the largest M up to which the Gluon launch led,
and the summary the least of those over the shapes routed to it at the smallest M (the bound that data would
support; session 83 left k_proj out of it: too few output tiles for the Gluon launch past M = 256)::

    python backends/cuda/lab/scripts/cuda_large_m_crossover.py [--ms 2048,2560,3072,3584,4096]
        [--shapes q_proj,k_proj,o_proj,pooler] [--out cuda_large_m_crossover.json]
"""

from __future__ import annotations

import argparse
import json


def crossover(rows: list[dict]) -> dict:
    """The NVFP4 ``gluon`` and ``dequant`` rows of :func:`musecore_cuda.bench.bench_linear` paired by (shape, M):
    ``{"points": [{shape, M, gluon_us, dequant_us, gluon_vs_dequant, routed}], "leads_to": {shape: M or None},
    "gluon_leads_all_to": M or None}``. ``leads_to`` is, per shape, the largest M up to which the Gluon launch led at
    every M timed (None when it trailed at the smallest). ``gluon_leads_all_to`` is the least of those over the shapes
    routed to the Gluon launch at the smallest M timed (the shapes a larger ``GLUON_LARGE_MAX_M`` would move; a shape
    already on dequantize + cuBLAS there, k_proj's N = 1024 at M = 2048, has no say); None when no shape is."""
    times: dict[tuple[str, int], dict[str, float]] = {}
    routed: dict[tuple[str, int], str] = {}
    for r in rows:
        if r.get("format") != "nvfp4" or r.get("path") not in ("gluon", "dequant"):
            continue
        key = (r["shape"], r["M"])
        times.setdefault(key, {})[r["path"]] = r["time_us"]
        if r.get("default"):
            routed[key] = r["path"]
    points = [{"shape": shape, "M": m, "gluon_us": t["gluon"], "dequant_us": t["dequant"],
               "gluon_vs_dequant": round(t["dequant"] / t["gluon"], 3), "routed": routed.get((shape, m))}
              for (shape, m), t in sorted(times.items(), key=lambda kv: (kv[0][1], kv[0][0]))
              if "gluon" in t and "dequant" in t]
    leads_to: dict[str, int | None] = {}
    on_gluon = []
    for shape in sorted({p["shape"] for p in points}):
        mine = [p for p in points if p["shape"] == shape]  # ascending M
        if mine[0]["routed"] == "gluon":
            on_gluon.append(shape)
        leads_to[shape] = None
        for p in mine:
            if p["gluon_vs_dequant"] <= 1.0:
                break
            leads_to[shape] = p["M"]
    bounds = [leads_to[s] for s in on_gluon]
    bound = None if not bounds or None in bounds else min(bounds)
    return {"points": points, "leads_to": leads_to, "gluon_leads_all_to": bound}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ms", default="2048,2560,3072,3584,4096")
    parser.add_argument("--shapes", default="q_proj,k_proj,o_proj,pooler")
    parser.add_argument("--out", default="cuda_large_m_crossover.json")
    args = parser.parse_args()
    import torch

    from musecore_cuda.bench import bench_linear
    rows = bench_linear(shapes=args.shapes.split(","), ms=tuple(int(m) for m in args.ms.split(",")),
                        formats=("nvfp4",))
    result = crossover(rows)
    for p in result["points"]:
        print(f"{p['shape']:22s} M={p['M']:5d}: gluon {p['gluon_us']:8.2f} us, dequant {p['dequant_us']:8.2f} us, "
              f"gluon/dequant speed {p['gluon_vs_dequant']:.3f} (routed: {p['routed']})", flush=True)
    for shape, m in result["leads_to"].items():
        print(f"{shape:22s}: the Gluon launch led up to M = {m}")
    print(f"the Gluon launch led on every shape routed to it at the smallest M up to M = "
          f"{result['gluon_leads_all_to']}")
    with open(args.out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows, **result}, f, indent=1)


if __name__ == "__main__":
    main()
