"""Time a chain of dependent 16-bit GEMVs as one kernel per phase and as one persistent kernel with grid-wide barriers
(``backends/cuda/lab/persistent_probe.py`` says why; issue 26, session 53). For each width ``D`` (``P`` phases of a
``[D, D]`` bf16 weight, ``P * D * D * 2`` bytes in all, past L2 at the defaults), every mode is captured in a CUDA
graph and the graphs' replays are timed in alternating rounds (``P`` is raised where the weights would stay in L2):

* ``chain_pdl`` / ``chain``: ``P`` launches of ``dense_gemv`` with programmatic dependent launch / without;
* ``persistent`` / ``persistent_prefetch``: one launch, one program per ``dense_gemv`` row block (the chain's grid),
  when the device can hold them all at once; ``_prefetch`` fetches each program's next-phase rows into L2 before it
  waits at the barrier;
* ``persistent_sms`` / ``persistent_sms_prefetch`` (``dense_gemv``'s cut only): one program per SM, each taking every
  SM-count-th row block;
* ``hold_{rows}x{warps}w`` (beside ``dense_gemv``'s cut): ``persistent_probe.persistent_hold_kernel``, one program per
  row block holding its next phase's rows in registers while it waits (sums grouped otherwise: equal to rounding).

Each cut of ``--cuts`` runs all of them: ``dense_gemv``'s own (at K = 1536, 2 rows x 2048 columns: 213 registers in
the persistent kernel's SM90 SASS, so 4 programs per SM, fewer than its 768 row blocks) and narrower K chunks whose
one-program-per-row-block grid fits. Every mode's output is checked against the chain's (the same body and cut: the
same bits expected, except ``hold``). Per mode: us per replay and per phase, the weight bytes' GB/s and % of the
measured memory ceiling. The last row is :func:`verdict`, session 53's decision rule applied to the run. One JSON row
per line::

    python backends/cuda/lab/scripts/cuda_persistent_probe.py [--dims 768,1536,3072] [--cuts default,2x512,4x512]
        [--phases 32] [--rounds 5] [--out backends/cuda/lab/results/cuda_persistent_probe.json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

from musecore.benchmarking import write_rows
from musecore_cuda.bench import capture_graph, memory_ceiling_gbps, replay_us
from musecore_cuda.kernels import pdl
from musecore_triton.kernels.dense_gemv import dense_gemv, gemv_blocks

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # backends/cuda/lab
import persistent_probe as pp  # noqa: E402

MAX_BLOCKS_PER_SM, MAX_THREADS_PER_SM, REGISTERS_PER_SM = 32, 2048, 65536  # SM90
MIN_BYTES = 160 << 20  # the chain's weights: ~3x the H200's 50 MB L2
# persistent_hold's (rows per program, warps): at D = 1536 their SM90 SASS takes 151 / 225 / 141 / 254 registers,
# so 768 / 384 / 384 / 96 programs fit (792 / 528 / 396 / 132 resident); at D = 3072 none fits (255 registers, spills)
HOLD_CUTS = ((2, 2), (4, 2), (4, 4), (16, 8))


def resident_programs(compiled, sms: int) -> int:
    """How many programs of ``compiled`` (a launched Triton kernel) the GPU holds at once, by registers, threads,
    blocks and shared memory per SM."""
    threads = 32 * compiled.metadata.num_warps
    per_sm = min(MAX_BLOCKS_PER_SM, MAX_THREADS_PER_SM // threads,
                 REGISTERS_PER_SM // max(1, compiled.n_regs * threads))
    shared = compiled.metadata.shared
    if shared:
        per_sm = min(per_sm, torch.cuda.get_device_properties(0).shared_memory_per_multiprocessor // shared)
    return per_sm * sms


# Session 53's decision rule (lab NOTES): a per-layer persistent decode kernel is worth writing if the best one-launch
# form beats the PDL chain by more than this many us per phase at muse-small's width.
VERDICT_D, VERDICT_MARGIN_US = 1536, 1.0
ONE_LAUNCH_MODES = ("persistent_prefetch", "hold_")


def verdict(rows: list[dict], D: int = VERDICT_D, margin_us: float = VERDICT_MARGIN_US) -> dict:
    """The decision rule on one run's rows: the best valid one-launch row at width ``D`` (``persistent_prefetch`` of
    any cut, or a ``hold_*`` row; its barrier did not give up, its output is finite, and a persistent row's equals
    the chain's)
    against the PDL chain of ``dense_gemv``'s own cut, in us per phase. ``write`` is True when the one-launch form
    wins by more than ``margin_us``, False when it does not, None when a side is missing (the reason says which)."""
    timed = [r for r in rows if r.get("D") == D and "us_per_phase" in r and not r.get("barrier_gave_up")]
    chain = [r for r in timed if r["mode"] == "chain_pdl" and "unrolled" not in r["cut"]]
    default = gemv_blocks(D)
    chain = [r for r in chain if r["cut"] == f"{default[0]}x{default[1]}"] or chain
    one = [r for r in timed if r["mode"].startswith(ONE_LAUNCH_MODES) and math.isfinite(r["max_diff_vs_chain"])
           and (r["mode"].startswith("hold_") or r["max_diff_vs_chain"] == 0.0)]
    if not chain or not one:
        missing = "chain_pdl" if not chain else "valid one-launch"
        return {"verdict": None, "D": D, "reason": f"no {missing} row at D={D}"}
    base, best = chain[0], min(one, key=lambda r: r["us_per_phase"])
    gain = round(base["us_per_phase"] - best["us_per_phase"], 3)
    return {"verdict": gain > margin_us, "D": D, "chain_pdl_us_per_phase": base["us_per_phase"],
            "best_mode": best["mode"], "best_cut": best.get("cut"), "best_us_per_phase": best["us_per_phase"],
            "gain_us_per_phase": gain, "margin_us": margin_us,
            "reading": ("write the per-layer persistent kernel" if gain > margin_us else
                        "fewer launches alone will not reach the target: the grid barrier costs about what a "
                        "PDL kernel boundary does")}


def parse_cut(cut: str, D: int) -> tuple[int, int, int]:
    """``default`` (``dense_gemv``'s cut for K = D) or ``NxK``: ``N`` rows per program, ``K``-column chunks."""
    if cut == "default":
        return gemv_blocks(D)
    n, k = (int(v) for v in cut.split("x"))
    return n, k, 0


def probe(w: torch.Tensor, y: torch.Tensor, blocks: tuple[int, int, int], sms: int, ceiling: float, rounds: int,
          reps: int, with_sms: bool) -> list[dict]:
    """One cut's rows: the chain with and without PDL, and the persistent kernel where its grid can be resident."""
    P, D, _ = w.shape
    counters = torch.zeros(2, dtype=torch.int32, device=w.device)
    flag = torch.zeros(1, dtype=torch.int32, device=w.device)
    blocks_n = pp.row_blocks(D, blocks)
    cut = f"{blocks[0]}x{blocks[1]}" + (f" unrolled {blocks[2]}" if blocks[2] else "")
    rows = []

    def chain() -> torch.Tensor:
        x = y[0][None]
        for i in range(P):
            x = dense_gemv(x, w[i], blocks)
        return x[0]

    want = chain()  # eager, without PDL
    kernel = pp.launch(w, y, counters, flag, 1, blocks=blocks)  # compiles; one program is always resident
    torch.cuda.synchronize()
    fits = resident_programs(kernel, sms)
    plans = [("chain_pdl", chain, True, blocks_n), ("chain", chain, False, blocks_n)]
    persistent = [("persistent", blocks_n, False), ("persistent_prefetch", blocks_n, True)]
    if with_sms:
        persistent += [("persistent_sms", sms, False), ("persistent_sms_prefetch", sms, True)]
        for block_n, warps in HOLD_CUTS:  # (beside dense_gemv's cut: the baseline the step runs today)
            name = f"hold_{block_n}x{warps}w"
            hold = pp.persistent_hold(w, y, counters, flag, block_n, warps, programs=1)  # compiles: always resident
            torch.cuda.synchronize()
            programs, fits_hold = -(-D // block_n), resident_programs(hold, sms)
            if programs > fits_hold:
                rows.append({"D": D, "mode": name, "programs": programs, "skipped":
                             f"{programs} programs; the GPU holds {fits_hold} at once (n_regs {hold.n_regs})"})
                print(json.dumps(rows[-1]), flush=True)
                continue
            plans.append((name, lambda block_n=block_n, warps=warps: (pp.persistent_hold(
                w, y, counters, flag, block_n, warps), y[P])[1], False, programs))
    for name, programs, prefetch in persistent:
        if programs > fits:
            rows.append({"D": D, "cut": cut, "mode": name, "programs": programs, "skipped":
                         f"{programs} programs; the GPU holds {fits} at once (n_regs {kernel.n_regs})"})
            print(json.dumps(rows[-1]), flush=True)
            continue
        plans.append((name, lambda programs=programs, prefetch=prefetch: pp.persistent_chain(
            w, y, counters, flag, programs, prefetch=prefetch, blocks=blocks), False, programs))
    graphs, outputs, programs_of = {}, {}, {}
    for name, fn, on, programs in plans:
        def keep(fn=fn, name=name) -> None:  # the last call (the captured one) leaves the graph's output here
            outputs[name] = fn()
        with pdl.scope(on):
            graphs[name] = capture_graph(keep)
        programs_of[name] = programs
    times: dict[str, list[float]] = {name: [] for name in graphs}
    checks: dict[str, tuple[float, bool]] = {}  # mode: (max |output - chain's|, a barrier gave up)
    names = list(graphs)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            flag.zero_()
            graphs[name].replay()
            torch.cuda.synchronize()
            times[name] += [replay_us(graphs[name]) for _ in range(reps)]
            gave_up = bool(int(flag)) or checks.get(name, (0.0, False))[1]
            checks[name] = (float((outputs[name].float() - want.float()).abs().max()), gave_up)
    for name in names:
        ts = sorted(times[name])
        t = ts[len(ts) // 2]
        diff, gave_up = checks[name]
        nbytes = P * D * D * 2
        rows.append({"D": D, "phases": P, "cut": cut, "mode": name, "programs": programs_of[name],
                     "resident_max": fits, "n_regs": kernel.n_regs, "us": round(t, 2), "us_per_phase": round(t / P, 3),
                     "gbps": round(nbytes / t / 1e3, 1), "pct_ceiling": round(100 * nbytes / t / 1e3 / ceiling, 1),
                     "barrier_gave_up": gave_up, "max_diff_vs_chain": diff})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dims", default="768,1536,3072")
    p.add_argument("--phases", type=int, default=32)
    p.add_argument("--cuts", default="default,2x512,4x512",
                   help="comma list: default (dense_gemv's) or NxK (rows per program x K chunk); the chain and the "
                        "persistent kernel run each")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", default="backends/cuda/lab/results/cuda_persistent_probe.json")
    args = p.parse_args()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    ceiling = memory_ceiling_gbps()["ceiling_gbps"]
    rows = []
    for D in (int(d) for d in args.dims.split(",")):
        P = max(args.phases, -(-MIN_BYTES // (D * D * 2)))  # enough phases that the weights stream from HBM
        w, y = pp.chain_inputs(P, D, torch.bfloat16, dev)
        for cut in args.cuts.split(","):
            rows += probe(w, y, parse_cut(cut, D), sms, ceiling, args.rounds, args.reps, with_sms=cut == "default")
            torch.cuda.empty_cache()
    rows.append(verdict(rows))
    print(json.dumps(rows[-1]), flush=True)
    write_rows(args.out, rows)


if __name__ == "__main__":
    main()
