"""Is a decode graph captured later in a process slower than the first one captured? (issue 26, session 51)

``cuda_history_probe.py`` (runs 50-52) found muse-small's greedy ``generate`` at ~707 us per token only for the first
capture in a process and ~740 for every later one, while the plain step graph's replay stayed at ~686. Here three
greedy graphs are captured one after another on caches of their own (nothing else in between) and replayed back to
back in alternated rounds (GPU time per replay); then one replay of each runs under the profiler, and the kernels
whose summed time differs most between the first graph and the last are printed.

    python backends/cuda/lab/scripts/cuda_capture_probe.py [--room 64] [--each [--release]] [--dump DIR]
        [--reinstantiate] [--out capture.json]

``--each`` times each graph right after its capture (so it is replayed before the next capture; run 64 captured all
first: 690-693 us each), ``--release`` then frees it as ``generate`` frees its old graph: does a process's first
graph keep its PDL overlap (run 68: 85 us per token against 50 later) only until another graph is replayed, or freed?

``--dump DIR`` keeps every graph after capture and writes each one's DOT (``graph{i}.dot``: every node's kernel,
grid, block and shared memory) with ``graph{i}.diff``, the lines of graph i's DOT that differ from graph 0's once the
device addresses are masked (empty when the graphs differ only in where their buffers lie), and its edges' types and
ports (``graph{i}.edges.json``, ``graph_edges.py``: programmatic or default, which the DOT does not show), and
each node's launch and function attributes (``graph{i}.nodes.json``, session 53; session 52's masking missed the
DOT's upper-case addresses, so its diff counts, 2200 lines, were addresses too).

``--reinstantiate`` (session 53) keeps every graph and, after the rounds above, instantiates each one again through
the driver (``graph_edges.Exec``) and times that executable in the same way: if graph 0's new executable runs like
the later graphs, the loss comes with when a graph is instantiated (or first launched); if it stays fast and the
later graphs' new executables stay slow, it is in what was captured.

Run 51 used room 200 (a 232-key cache; attention 142.8 vs 119.1 us per replay between graph 0 and 2); ``--room 64``
(the default since) gives the 96-key cache of ``generate(prompt of 32, max_new_tokens=64)``, as the A/B scripts run.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import gc
import json
import os
import re
from collections import defaultdict
from unittest import mock

import torch
from torch.profiler import ProfilerActivity, profile

import graph_edges
from cuda_decode_host_probe import gpu_us
from musecore.api import load_random
from musecore.benchmarking import write_rows


def greedy_step(model, prompt: list[list[int]], room: int):
    length = len(prompt[0])
    cache = model.new_cache(1, length + room, static=True)
    model.forward(torch.tensor(prompt, device="cuda"), cache=cache)
    step = model.backend.make_greedy_decode_step(model, cache)
    one = torch.ones(1, dtype=torch.bool, device="cuda")

    def restart() -> None:
        step.start(torch.zeros(1, dtype=torch.long, device="cuda"),
                   torch.full((1,), length, dtype=torch.long, device="cuda"), one)
    return step, restart


def replay_us(step, restart, room: int) -> float:
    """GPU microseconds per replay of ``step``, from the prompt's end (``restart`` first) over up to 50 replays of the
    cache's ``room`` positions."""
    restart()
    return gpu_us(step, n=min(50, room - 2))


class DebugGraph(torch.cuda.CUDAGraph):
    """A ``torch.cuda.CUDAGraph`` that keeps its ``cudaGraph_t`` for :meth:`debug_dump` (``keep_graph=True``, given
    to ``__init__`` too: pybind11 constructs there; debug mode alone dumps nothing, run 62; instantiated at the first
    replay)."""

    def __new__(cls, keep_graph: bool = True):
        return super().__new__(cls, keep_graph=True)

    def __init__(self, keep_graph: bool = True) -> None:
        super().__init__(keep_graph=True)


def dump_graphs(steps: list, folder: str) -> list[int]:
    """Each graph's DOT into ``folder``, and how many lines of each differ from graph 0's with addresses masked."""
    os.makedirs(folder, exist_ok=True)
    masked = []
    for i, (step, _) in enumerate(steps):
        path = os.path.join(folder, f"graph{i}.dot")
        step.graph.debug_dump(path)
        with open(path) as f:
            masked.append([re.sub(r"0x[0-9a-fA-F]{6,}", "ADDR", line) for line in f])  # (the DOT prints upper case)
    first = None
    for i, (step, _) in enumerate(steps):
        edge_rows, node_rows, _ = graph_edges.compare(step.graph, f"graph {i}", first)
        first = first or (edge_rows, node_rows)
        with open(os.path.join(folder, f"graph{i}.edges.json"), "w") as f:
            json.dump(edge_rows, f, indent=0)
        write_rows(os.path.join(folder, f"graph{i}.nodes.json"), node_rows)
    changed = []
    for i, lines in enumerate(masked):
        diff = [d for d in difflib.unified_diff(masked[0], lines, n=0) if d[:1] in "+-" and d[:3] not in ("+++", "---")]
        with open(os.path.join(folder, f"graph{i}.diff"), "w") as f:
            f.writelines(diff)
        changed.append(len(diff))
    return changed


def kernels(fn, gaps: bool = False) -> dict:
    """GPU microseconds of each kernel (name cut to 70 characters) summed over ``fn``'s run under the profiler; with
    ``gaps``, also ``gap before <name>``: the summed time from the end of the kernel before to this one's start
    (negative where they overlapped: programmatic dependent launch starts a kernel under its predecessor's tail,
    if the profiler lets it)."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    out: dict = defaultdict(float)
    device = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
    for i, e in enumerate(device):
        out[e.name[:70]] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
        if gaps and i:
            out["gap before " + e.name[:59]] += e.time_range.start - device[i - 1].time_range.end
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="cuda_capture_probe.json")
    p.add_argument("--graphs", type=int, default=3)
    p.add_argument("--room", type=int, default=64, help="cache positions after the 32-token prompt")
    p.add_argument("--each", action="store_true",
                   help="time each graph right after its capture, before the next one is captured")
    p.add_argument("--release", action="store_true", help="with --each: free each graph but the last after timing it")
    p.add_argument("--dump", default=None, help="folder for each graph's DOT (debug mode) and its diff to graph 0's")
    p.add_argument("--reinstantiate", action="store_true",
                   help="keep every graph; after the rounds, time a new executable of each (graph_edges.Exec)")
    args = p.parse_args()
    keep = bool(args.dump) or args.reinstantiate
    model = load_random("muse-small", "h200", checkpoint_format="nvfp4")
    prompt = torch.randint(0, 65536, (1, 32), generator=torch.Generator().manual_seed(1)).tolist()
    steps, at_capture = [], []
    for i in range(args.graphs):
        with mock.patch.object(torch.cuda, "CUDAGraph", DebugGraph) if keep else contextlib.nullcontext():
            step, restart = greedy_step(model, prompt, args.room)
        if args.each:  # timed (so replayed) before the next capture
            t = [replay_us(step, restart, args.room) for _ in range(3)]
            at_capture.append(round(sorted(t)[1], 1))
            print(json.dumps({"graph": i, "replay_us_at_capture": at_capture[-1]}), flush=True)
        if not args.release or i == args.graphs - 1:
            steps.append((step, restart))
        del step, restart
        gc.collect()
    if args.dump and not args.release:
        print("DOT lines differing from graph 0's (addresses masked):", dump_graphs(steps, args.dump), flush=True)
    times: dict = defaultdict(list)
    for _ in range(3):
        for i, (step, restart) in enumerate(steps):
            times[i].append(replay_us(step, restart, args.room))
    rows = [{"graph": i, "replay_us": sorted(t)[1], "rounds": [round(x, 1) for x in t]} for i, t in times.items()]
    if args.reinstantiate:
        again: dict = defaultdict(list)
        execs = [graph_edges.Exec(step.graph) for step, _ in steps]  # all instantiated now, after every replay above
        for _ in range(3):
            for i, (step, restart) in enumerate(steps):
                own, step.graph = step.graph, execs[i]
                try:
                    again[i].append(replay_us(step, restart, args.room))
                finally:
                    step.graph = own
        for i, ex in enumerate(execs):
            ex.close()
            rows[i]["reinstantiated_us"] = sorted(again[i])[1]
            rows[i]["reinstantiated_rounds"] = [round(x, 1) for x in again[i]]
    for r in rows:
        print(json.dumps(r), flush=True)
    profiles = []
    for step, restart in steps:
        restart()
        step()
        profiles.append(kernels(lambda: [step() for _ in range(5)]))
    first, last = profiles[0], profiles[-1]
    diff = sorted(((last.get(k, 0.0) - first.get(k, 0.0)) / 5, k) for k in set(first) | set(last))
    print("kernel: us per replay in the last graph minus the first")
    for d, k in diff[:5] + diff[-8:]:
        print(f"{d:+8.2f}  {first.get(k, 0) / 5:8.2f} -> {last.get(k, 0) / 5:8.2f}  {k}")
    with open(args.out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows, "at_capture_us": at_capture,
                   "kernels_first": first, "kernels_last": last}, f, indent=1)


if __name__ == "__main__":
    main()
