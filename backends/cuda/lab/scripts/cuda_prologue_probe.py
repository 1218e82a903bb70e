"""Time the residual norm in the producer GEMV's last program (today) against the same row op in every program of the
consumer GEMV (``backends/cuda/lab/prologue_probe.py`` says why; issue 26, session 70).

For each width ``D``: a chain of ``P`` pairs of ``[D, D]`` bf16 GEMVs with one ``residual_norm`` between the two GEMVs
of each pair (``P`` raised until the weights are past L2), captured in a CUDA graph per mode and replayed in
alternating rounds:

* ``tail``: ``dense_gemv(residual_norm=...)`` then ``dense_gemv`` (today's o_proj / unpooler and the GEMV after);
* ``prologue_{rows}x{warps}w``: a plain ``dense_gemv`` then ``prologue_gemv`` at that cut (``dense_gemv``'s is 2 rows
  on 2 warps; wider cuts read the row fewer times).

Each with programmatic dependent launch (``_pdl``, as the decode step at batch 1) and without. Every mode's chain output
is checked against ``tail``'s (NMSE). Per mode: us per replay and per pair, and the gain per pair against the tail of
the same PDL setting. The last row is the verdict: the best prologue cut with PDL at least ``--margin-us`` per pair
faster than the tail with PDL (then moving the product's row ops into their consumers is worth writing). One JSON row
per line::

    python backends/cuda/lab/scripts/cuda_prologue_probe.py [--dims 1536] [--cuts 2x2,4x4,8x8,16x16] [--rounds 5]
        [--chains residual,finalize] [--finalize-dims 768] [--topk 8]
        [--out backends/cuda/lab/results/cuda_prologue_probe.json]

Session 72 adds the ``finalize`` chain (``finalize_gemv``, in the product since session 75 as
``musecore_triton.kernels.moe.finalize_gemv``): per pair ``--topk`` down GEMVs (one per assignment, fp32 rows), then
``separate`` (``moe.finalize``'s own launch and the unpooler GEMV, the product's before session 75) against the
finalize in every program of the unpooler GEMV at each cut; square ``[h, h]`` unpoolers (muse-small's is 1536 x 768:
the launch structure is what is timed). A verdict row per chain; a yes there would take one launch per MoE layer out
of the decode step.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from musecore.testing import nmse
from musecore.benchmarking import write_rows
from musecore_cuda.bench import capture_graph, replay_us
from musecore_cuda.kernels import pdl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # backends/cuda/lab
import prologue_probe as pr  # noqa: E402

MIN_BYTES = 160 << 20  # the chain's weights: ~3x the H200's 50 MB L2
TOLERANCE = 1e-4  # NMSE of a chain's output against the tail chain's (bf16 roundings in another order, P pairs deep)


def verdict(rows: list[dict], margin_us: float, chain: str = "residual") -> dict:
    """Whether the best valid prologue cut with PDL of ``chain`` beats its baseline (``BASELINES``) with PDL of its
    own width ``D`` by ``margin_us`` per pair or more (over several ``--dims``, the largest such gain)."""
    base = BASELINES[chain]
    timed = [r for r in rows if "us_per_pair" in r and r["pdl"] and r.get("chain", "residual") == chain]
    tails = {r["D"]: r["us_per_pair"] for r in timed if r["mode"] == base}
    gains = [(tails[r["D"]] - r["us_per_pair"], r) for r in timed
             if r["mode"] != base and r["D"] in tails and r["nmse_vs_tail"] <= TOLERANCE]
    if not gains:
        return {"chain": chain, "verdict": None, "why": f"no timed {base} with a valid prologue row of its width, "
                "with PDL"}
    gain, best = max(gains, key=lambda g: g[0])
    return {"chain": chain, "verdict": gain >= margin_us, "best": best["mode"], "gain_us_per_pair": round(gain, 3),
            "margin_us": margin_us, "D": best["D"],
            "why": f"{best['mode']} {best['us_per_pair']} against {base} {tails[best['D']]} us per pair "
                   f"(D {best['D']})"}


BASELINES = {"residual": "tail", "finalize": "separate"}  # each chain's mode of today's kernels


def probe(d: int, cuts: list[tuple[int, int]], rounds: int, reps: int) -> list[dict]:
    """The residual-norm chain (session 70): ``tail`` against ``prologue_{rows}x{warps}w``."""
    pairs = max(16, -(-MIN_BYTES // (2 * d * d * 2)))
    inputs = pr.pair_inputs(pairs, d, torch.bfloat16, torch.device("cuda"))
    plans = {"tail": pr.tail_pair(inputs)}
    for rows, warps in cuts:
        plans[f"prologue_{rows}x{warps}w"] = pr.prologue_pair(inputs, block_n=rows, num_warps=warps)
    runs = {name: (lambda pair=pair: pr.run_chain(inputs, *pair)[0]) for name, pair in plans.items()}
    return time_chains(runs, "residual", d, pairs, rounds, reps)


def probe_finalize(d: int, topk: int, cuts: list[tuple[int, int]], rounds: int, reps: int) -> list[dict]:
    """The finalize chain (session 72): per pair ``topk`` down GEMVs, then ``separate`` (``moe.finalize``'s launch
    and the unpooler GEMV) against ``prologue_{rows}x{warps}w`` (``finalize_gemv``); square ``[d, d]`` unpoolers."""
    pairs = max(16, -(-MIN_BYTES // ((topk + 1) * d * d * 2)))
    inputs = pr.moe_chain_inputs(pairs, d, topk, torch.bfloat16, torch.device("cuda"))
    separate = pr.finalize_tails(inputs)["separate"]
    runs = {"separate": lambda: pr.run_moe_chain(inputs, separate)}
    for rows, warps in cuts:
        tail = pr.finalize_tails(inputs, block_n=rows, num_warps=warps)["prologue"]
        runs[f"prologue_{rows}x{warps}w"] = lambda tail=tail: pr.run_moe_chain(inputs, tail)
    return time_chains(runs, "finalize", d, pairs, rounds, reps)


def time_chains(runs: dict, chain: str, d: int, pairs: int, rounds: int, reps: int) -> list[dict]:
    """Each run (a callable giving the chain's output) captured in a CUDA graph with PDL and without, replayed in
    alternating rounds; one row per (run, PDL) with its time, gain against the chain's baseline and NMSE to it."""
    base = BASELINES[chain]
    graphs, outputs = {}, {}
    for name, run in runs.items():
        for on in (True, False):
            key = (name, on)

            def keep(run=run, key=key) -> None:  # the captured call leaves the chain's output here
                outputs[key] = run()
            with pdl.scope(on):
                graphs[key] = capture_graph(keep)
    times: dict = {key: [] for key in graphs}
    keys = list(graphs)
    for r in range(rounds):
        for key in keys[r % len(keys):] + keys[:r % len(keys)]:
            graphs[key].replay()
            torch.cuda.synchronize()
            times[key] += [replay_us(graphs[key]) for _ in range(reps)]
    median = {key: sorted(ts)[len(ts) // 2] for key, ts in times.items()}
    rows = []
    for key in keys:
        name, on = key
        t, tail = median[key], median[(base, on)]
        rows.append({"chain": chain, "D": d, "pairs": pairs, "mode": name, "pdl": on, "us": round(t, 2),
                     "us_per_pair": round(t / pairs, 3), "gain_us_per_pair_vs_tail": round((tail - t) / pairs, 3),
                     "nmse_vs_tail": float(nmse(outputs[(base, on)].float(), outputs[key].float())),
                     "gpu": torch.cuda.get_device_name()})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dims", default="1536")
    p.add_argument("--cuts", default="2x2,4x4,8x8,16x16", help="the prologue consumer's rows per program x warps")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--margin-us", type=float, default=0.5)
    p.add_argument("--chains", default="residual,finalize", type=lambda v: v.split(","),
                   help="residual: the norm after o_proj / the unpooler; finalize: the MoE finalize before the "
                   "unpooler (at --finalize-dims, top --topk)")
    p.add_argument("--finalize-dims", default="768", help="the experts' width h (muse-small: 768)")
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--out", default="backends/cuda/lab/results/cuda_prologue_probe.json")
    args = p.parse_args()
    cuts = [tuple(int(v) for v in c.split("x")) for c in args.cuts.split(",")]
    chains = {"residual": (args.dims, lambda d: probe(d, cuts, args.rounds, args.reps)),
              "finalize": (args.finalize_dims, lambda d: probe_finalize(d, args.topk, cuts, args.rounds, args.reps))}
    unknown = sorted(set(args.chains) - set(chains))
    if unknown:
        p.error(f"--chains: unknown {', '.join(unknown)}; the chains are {', '.join(chains)}")
    rows = []
    for chain in args.chains:
        dims, run = chains[chain]
        for d in (int(v) for v in dims.split(",")):
            rows += run(d)
            torch.cuda.empty_cache()
    for chain in args.chains:
        rows.append(verdict(rows, args.margin_us, chain))
        print(json.dumps(rows[-1]), flush=True)
    write_rows(args.out, rows)


if __name__ == "__main__":
    main()
