"""Why muse-small's batch-1 decode runs slower later in a process (issue 26, session 51).

A fresh process decodes muse-small NVFP4 at ~707 us per token (``cuda_decode_host_probe.py``, run 49), ``bench_e2e``
(the BF16 model first, then NVFP4) at ~742, and session 49 saw +45 us after one ``torch.profiler`` session. This
probe times the NVFP4 model's ``generate`` (a new capture, then the median of 3 runs of 64 tokens) in one process
after each event of ``--sequence`` in turn: nothing (``fresh``, ``again``), a plain step graph captured and kept
(``step``, with its replay time), those graphs dropped, the model reloaded, a BF16 model loaded, run and deleted,
a profiler session, buffers of random sizes held (``pad``: does the place the next capture's buffers land in decide
its speed?). Run 50's first version (fixed sequence) found ~707 us only for the first generate of a process.

    python backends/cuda/lab/scripts/cuda_history_probe.py [--sequence fresh,again,step,again] [--out history.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from unittest import mock

import torch
import triton
from torch.profiler import ProfilerActivity, profile

import graph_edges
from cuda_capture_probe import DebugGraph, kernels
from cuda_decode_host_probe import _prefilled_step, gpu_us, placement_pad, replay_timeline
from musecore.api import load_random


def triton_variants() -> dict:
    """Compiled variants per musecore Triton kernel (``JITFunction.device_caches``, Triton 3.6): a later generate that
    compiles new ones ran with other specializations (alignment, divisibility) than the first."""
    out = {}
    for name, mod in list(sys.modules.items()):
        if not name.startswith("musecore_triton.kernels"):
            continue
        for attr, fn in vars(mod).items():
            caches = getattr(fn, "device_caches", None)
            if isinstance(fn, triton.runtime.JITFunction) and caches:
                n = sum(len(c[0]) for c in caches.values())
                if n:
                    out[f"{name.rsplit('.', 1)[1]}.{attr}"] = n
    return out


def generate_us(model, prompt: list[list[int]]) -> dict:
    """``generate`` per token: a new capture (8 tokens), then the median of 3 runs of 64 tokens; and a fourth run's
    timeline (``cuda_decode_host_probe.replay_timeline``: each replay's GPU time, the GPU's idle time between
    replays, the host's loop): is a slower capture's token slower on the GPU or between replays?"""
    model.release_generation_cache()
    model.generate(prompt, max_new_tokens=8)
    gen = []
    for _ in range(3):
        model.generate(prompt, max_new_tokens=64)
        gen.append(1e6 / model.last_generation_stats.decode_tokens_per_s)
    return {"generate_us_per_token": round(sorted(gen)[1], 1), **replay_timeline(model, prompt, 64)}


def sum_gaps(kernels: dict) -> float:
    return sum(v for k, v in kernels.items() if k.startswith("gap before "))


@torch.inference_mode()  # (generate's cache is made of inference tensors)
def greedy_kernels(model, prompt: list[list[int]], n: int = 20) -> dict:
    """GPU microseconds per replay of each kernel of the greedy graph ``generate`` kept (the last capture), over ``n``
    replays from the prompt's end on its cache (reset and prefilled again), under the profiler."""
    _, cache, steps = model._generation_cache
    step = steps["greedy"]
    cache.reset()
    model.forward(torch.tensor(prompt, device="cuda"), cache=cache)
    step.start(torch.zeros(1, dtype=torch.long, device="cuda"),
               torch.full((1,), len(prompt[0]), dtype=torch.long, device="cuda"),
               torch.ones(1, dtype=torch.bool, device="cuda"))
    torch.cuda.synchronize()
    return {k: round(v / n, 2) for k, v in kernels(lambda: [step() for _ in range(n)], gaps=True).items()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="cuda_history_probe.json")
    p.add_argument("--sequence", default=SEQUENCE,
                   help="comma-separated events, each followed by a timed generate: " + ", ".join(EVENTS))
    p.add_argument("--kernels", action="store_true",
                   help="after each event's generate, its greedy graph's kernels and the gaps between them under the "
                        "profiler (20 replays from the prompt's end), and those differing most from the first event's")
    p.add_argument("--edges", action="store_true",
                   help="keep every graph after capture (cuda_capture_probe.DebugGraph) and print each event's greedy "
                        "graph's edge types and node attributes (graph_edges.py), and where they differ from the "
                        "first event's")
    args = p.parse_args()
    if args.edges:
        mock.patch.object(torch.cuda, "CUDAGraph", DebugGraph).start()
    prompt = torch.randint(0, 65536, (1, 32), generator=torch.Generator().manual_seed(1)).tolist()
    state = {"model": load_random("muse-small", "h200", checkpoint_format="nvfp4"), "prompt": prompt}
    rows, seen = [], {}
    for event in args.sequence.split(","):
        extra = EVENTS[event](state)
        row = {"after": event, **generate_us(state["model"], prompt), **(extra or {})}
        if args.kernels:
            row["kernels"] = greedy_kernels(state["model"], prompt)
            first = rows[0]["kernels"] if rows else row["kernels"]
            print(f"kernels and the gaps before them: us per replay here minus after "
                  f"{rows[0]['after'] if rows else event!r}; all gaps {sum_gaps(first):+.2f} -> "
                  f"{sum_gaps(row['kernels']):+.2f}")
            for d, k in sorted((row["kernels"].get(k, 0.0) - first.get(k, 0.0), k) for k in {*first, *row["kernels"]}
                               )[-8:]:
                print(f"{d:+8.2f}  {first.get(k, 0):8.2f} -> {row['kernels'].get(k, 0):8.2f}  {k}")
        if args.edges:
            edge_rows, node_rows, row["attribute_differences"] = graph_edges.compare(
                state["model"]._generation_cache[2]["greedy"].graph, f"after {event!r}", state.get("first_graph"))
            row["edges"] = graph_edges.summary(edge_rows)
            state.setdefault("first_graph", (edge_rows, node_rows))
        variants = triton_variants()
        row["new_triton_variants"] = {k: n - seen.get(k, 0) for k, n in variants.items() if n != seen.get(k, 0)}
        seen = variants
        print(json.dumps(row), flush=True)
        rows.append(row)
    with open(args.out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "sequence": args.sequence, "rows": rows}, f, indent=1)


def _step(state: dict) -> dict:  # a plain step graph captured and replayed (it stays alive in ``state``)
    step, tok, pos = _prefilled_step(state["model"], state["prompt"], 64)
    state.setdefault("steps", []).append(step)
    return {"replay_us": round(gpu_us(lambda: step(tok, pos), warmup=3), 1)}


def _bf16(state: dict) -> None:  # a BF16 model loaded, run and deleted
    other = load_random("muse-small", "h200", checkpoint_format="bf16")
    other.generate(state["prompt"], max_new_tokens=64)
    del other
    gc.collect()
    torch.cuda.empty_cache()


def _reload(state: dict) -> None:
    state.pop("model")
    state.pop("steps", None)
    gc.collect()
    torch.cuda.empty_cache()
    state["model"] = load_random("muse-small", "h200", checkpoint_format="nvfp4")


def _profiler(state: dict) -> None:
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]):
        state["model"].generate(state["prompt"], max_new_tokens=4)
        torch.cuda.synchronize()


def _release_empty(state: dict) -> None:  # the kept graph and cache freed, and the allocator's cache emptied
    state["model"].release_generation_cache()
    gc.collect()
    torch.cuda.empty_cache()


def _pad(state: dict) -> dict:  # buffers of random sizes held from here on: later allocations land elsewhere
    state["model"].release_generation_cache()  # (else the next cache reuses the freed one's blocks, pad or not)
    pads = state.setdefault("pads", [])
    pads.append(placement_pad(16, len(pads) + 1))
    return {"pad_bytes": sum(t.numel() for t in pads[-1])}


def _retriton(state: dict) -> dict:  # every musecore Triton kernel loaded again (from Triton's disk cache) at its next
    # launch: is only a graph captured right after its kernels were loaded fully overlapped by PDL? (session 52)
    cleared = 0
    for name, mod in list(sys.modules.items()):
        if name.startswith("musecore_triton.kernels"):
            for fn in vars(mod).values():
                if isinstance(fn, triton.runtime.JITFunction) and getattr(fn, "device_caches", None):
                    fn.device_caches.clear()
                    cleared += 1
    return {"kernels_cleared": cleared}


def _drop_steps(state: dict) -> None:
    state.pop("steps", None)
    gc.collect()
    torch.cuda.empty_cache()


EVENTS = {"fresh": lambda state: None, "again": lambda state: None, "step": _step, "drop_steps": _drop_steps,
          "bf16": _bf16, "reload": _reload, "profiler": _profiler,
          "release_empty": _release_empty, "pad": _pad, "retriton": _retriton}
SEQUENCE = "fresh,again,again,step,again,drop_steps,reload,bf16,profiler"


if __name__ == "__main__":
    main()
