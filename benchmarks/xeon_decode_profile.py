"""Where a muse-small decode token goes on the xeon backend: weight streaming against everything else (issue 30, item 3).

A benchmark, not a test. After a 32-token prefill, ``--steps`` decode steps through ``model.forward`` (batch 1),
measured three ways in one process:

1. the plain step as loaded (each attention and MoE block one C call where the backend fuses it,
   ``musecore_xeon.fused``): wall time and the main thread's CPU time (``time.thread_time``; with one thread every
   kernel runs on it, so on a shared host this is the work, not the waiting); then the same step with every block
   through its separate ops, which is the step that 2 and 3 take apart;
2. every op of the operator interface wrapped with a timer: the weight-streaming ops (``linear`` per shape and
   format, ``moe``) with their resident bytes and GB/s, the other ops (attention, router, norms, softcap,
   embedding), and what is left: the graph's own Python and tensor bookkeeping (``model.py``, the KV cache);
3. the "fixed cost" step: ``linear``, ``moe`` and ``attention`` replaced by a replay of the outputs they gave on
   a real step (nothing streams), so what remains is the per-token cost that does not depend on weight bytes:
   Python per op, aten dispatch and allocations, KV cache writes, the small C ops, the softcap; plus the aten ops
   it issues per step (``torch.profiler`` counts).

    python3 benchmarks/xeon_decode_profile.py [--threads 1 2] [--plans [int4] [bf16]] [--steps 64] [--layers N]
        [--moe-vs-gemv] [--json PATH]

``--moe-vs-gemv`` adds the fused decode MoE (T = 1, 8 of 64 experts) against one GEMV of the same bytes, cold: what
a MoE layer costs beyond its bytes.

``--layers`` cuts the preset's depth (development: loading all 16 layers takes minutes). Prints a markdown
report (what ``benchmarks/results/xeon_avx512bf16/decode_profile.md`` holds) and writes JSON with ``--json``.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch

from musecore.ops import TEXT_OPS

STREAMING = ("linear", "moe")
REPLAYED = ("linear", "moe", "attention")  # the fixed-cost step replays these ops' outputs


def resident_bytes(linear: Any) -> int:
    """Bytes one call of a prepared xeon linear streams (INT4 codes + scales/zeros, or the dense weight)."""
    if hasattr(linear, "codes") and linear.codes is not None:
        return linear.codes.numel() * 4 + linear.scale_zero.numel() * 2
    return linear.weight.numel() * linear.weight.element_size()


def muse_small(layers: int = 0) -> Any:
    """muse-small's config, cut to its first ``layers`` layers when given (development runs)."""
    from musecore.config import MuseConfig
    config = MuseConfig.from_name("muse-small")
    if layers:
        config.num_hidden_layers = layers
        for name in ("layer_types", "mlp_layer_types", "layer_rope_theta"):  # one entry per layer
            setattr(config, name, getattr(config, name)[:layers])
        config.validate()
    return config


def load(plan: str, layers: int) -> Any:
    from musecore.api import load_random
    from musecore_xeon.bench import all_experts_bf16, plan_keeps_bf16_experts
    config = muse_small(layers)
    if plan == "int4":  # the default xeon plan (INT4 experts, attention, pooler/unpooler, lm_head)
        return load_random(config, "xeon", checkpoint_format="int4")
    with plan_keeps_bf16_experts():
        return load_random(all_experts_bf16(config), "xeon", quantize_dense=False)


def run_steps(model: Any, steps: int, prompt: int = 32, after_prefill: Callable[[], None] = lambda: None
              ) -> tuple[float, float]:
    """Mean wall and main-thread CPU seconds per decode step after a ``prompt``-token prefill."""
    cache = model.new_cache(1, prompt + steps + 8)
    with torch.inference_mode():
        model.forward(torch.arange(1, prompt + 1)[None], cache=cache)
        after_prefill()
        wall, cpu = time.perf_counter(), time.thread_time()
        for s in range(steps):
            model.forward(torch.tensor([[5]]), positions=torch.tensor([[prompt + s]]), cache=cache)
        return (time.perf_counter() - wall) / steps, (time.thread_time() - cpu) / steps


class OpTimers:
    """Every text op of ``model.ops`` wrapped with a wall and CPU timer, keyed by op (and for ``linear`` by shape
    and format, for ``moe`` by format), with the bytes the streaming ops read per call."""

    def __init__(self, model: Any) -> None:
        self.model, self.table = model, {op: getattr(model.ops, op) for op in TEXT_OPS if op != "sample"}
        self.stats: dict[tuple, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0, 0])

    def key(self, op: str, args: tuple) -> tuple[tuple, int]:
        if op == "linear":
            w = args[1]
            return ("linear", f"{w.out_features}x{w.in_features}", w.format), resident_bytes(w.extra["linear"])
        if op == "moe":
            experts, ids = args[3], args[2]
            resident = experts.extra["xeon"]
            per_expert = resident_bytes(resident.gate_up[0]) + resident_bytes(resident.down[0])
            return ("moe", f"{ids.numel()} routed experts", experts.format), per_expert * ids.numel()
        return (op, "", ""), 0

    def __enter__(self) -> "OpTimers":
        for op, fn in self.table.items():
            def timed(*args: Any, _op: str = op, _fn: Callable = fn, **kwargs: Any) -> Any:
                wall, cpu = time.perf_counter(), time.thread_time()
                out = _fn(*args, **kwargs)
                entry = self.stats[self.key(_op, args)[0]]
                entry[0] += time.perf_counter() - wall
                entry[1] += time.thread_time() - cpu
                entry[2] += 1
                entry[3] = self.key(_op, args)[1]
                return out
            setattr(self.model.ops, op, timed)
        return self

    def __exit__(self, *exc: Any) -> None:
        for op, fn in self.table.items():
            setattr(self.model.ops, op, fn)


def fixed_cost_step(model: Any, steps: int) -> tuple[float, float, dict[str, int]]:
    """Mean wall / CPU seconds of a decode step whose linear, moe and attention calls return the outputs recorded
    on a real step (nothing streams), and the aten ops it issues per step."""
    table = {op: getattr(model.ops, op) for op in REPLAYED}
    recorded: dict[str, list[Any]] = {op: [] for op in REPLAYED}
    replay: dict[str, Any] = {}

    def make(op: str) -> Callable:
        def call(*args: Any, **kwargs: Any) -> Any:
            if op in replay:
                return next(replay[op])
            out = table[op](*args, **kwargs)
            recorded[op].append(out)
            return out
        return call

    for op in REPLAYED:
        setattr(model.ops, op, make(op))
    try:
        cache = model.new_cache(1, 32 + steps + 16)
        with torch.inference_mode():
            model.forward(torch.arange(1, 33)[None], cache=cache)
            for op in REPLAYED:
                recorded[op].clear()
            model.forward(torch.tensor([[5]]), positions=torch.tensor([[32]]), cache=cache)
            replay.update({op: itertools.cycle(outs) for op, outs in recorded.items()})
            for s in range(4):
                model.forward(torch.tensor([[5]]), positions=torch.tensor([[33 + s]]), cache=cache)
            wall, cpu = time.perf_counter(), time.thread_time()
            for s in range(steps):
                model.forward(torch.tensor([[5]]), positions=torch.tensor([[37 + s]]), cache=cache)
            wall, cpu = (time.perf_counter() - wall) / steps, (time.thread_time() - cpu) / steps
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for s in range(8):
                    model.forward(torch.tensor([[5]]), positions=torch.tensor([[37 + steps + s]]), cache=cache)
    finally:
        for op, fn in table.items():
            setattr(model.ops, op, fn)
    counts = {e.key: e.count // 8 for e in prof.key_averages() if e.key.startswith("aten::")}
    return wall, cpu, dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def profile_plan(model: Any, threads: int, steps: int) -> dict[str, Any]:
    torch.set_num_threads(threads)
    run_steps(model, 8)
    plain = [run_steps(model, steps) for _ in range(3)]  # as loaded: the fused blocks where the backend has them
    wall = statistics.median(p[0] for p in plain)
    cpu = statistics.median(p[1] for p in plain)
    from musecore.model import separate_ops  # every block through its ops: what 2 and 3 take apart
    with separate_ops(model):
        separate = statistics.median(run_steps(model, steps)[0] for _ in range(3))
        return {**breakdown(model, steps), "threads": threads, "step_ms": wall * 1e3, "step_cpu_ms": cpu * 1e3,
                "tokens_per_s": 1 / wall, "unfused_step_ms": separate * 1e3}


def breakdown(model: Any, steps: int) -> dict[str, Any]:
    """The timed step's ops (wall, CPU, bytes) and the fixed-cost step, every block through its ops."""
    with OpTimers(model) as timers:
        run_steps(model, 4)
        timed_wall, timed_cpu = run_steps(model, steps, after_prefill=timers.stats.clear)
    per_step = lambda v: v / steps  # noqa: E731
    ops = [{"op": k[0], "shape": k[1], "format": k[2], "calls_per_step": v[2] / steps,
            "wall_ms_per_step": per_step(v[0]) * 1e3, "cpu_ms_per_step": per_step(v[1]) * 1e3,
            "us_per_call": v[0] / v[2] * 1e6, "bytes_per_call": v[3],
            "gb_per_s": (v[3] * v[2] / v[0] / 1e9) if v[3] else None} for k, v in timers.stats.items()]
    ops.sort(key=lambda r: -r["wall_ms_per_step"])
    streaming = sum(r["wall_ms_per_step"] for r in ops if r["op"] in STREAMING)
    other_ops = sum(r["wall_ms_per_step"] for r in ops if r["op"] not in STREAMING)
    fixed_wall, fixed_cpu, aten = fixed_cost_step(model, steps)
    nbytes = sum(r["bytes_per_call"] * r["calls_per_step"] for r in ops if r["op"] in STREAMING)
    return {"timed_step_ms": timed_wall * 1e3, "streaming_ms": streaming, "other_ops_ms": other_ops,
            "outside_ops_ms": timed_wall * 1e3 - streaming - other_ops, "weight_bytes_per_step": nbytes,
            "streaming_gb_per_s": nbytes / streaming / 1e6 if streaming else None,
            "fixed_cost_step_ms": fixed_wall * 1e3, "fixed_cost_step_cpu_ms": fixed_cpu * 1e3,
            "aten_ops_per_step": sum(aten.values()), "aten_op_counts": aten, "ops": ops}


def moe_vs_gemv(threads: list[int], copies: int = 3, calls: int = 32, rounds: int = 5) -> list[dict[str, Any]]:
    """The fused decode MoE of muse-small (T = 1, 8 of 64 experts) against ONE GEMV streaming the same bytes
    (``[8 * 3 * I, h]``), INT4 and BF16, weights cold (``copies`` layers of 64 experts, and as many bytes of GEMV
    weights, cycled; 2 BF16 layers): what the MoE costs beyond its bytes. Wall and main-thread CPU time per call,
    medians of ``rounds`` rounds in which the two alternate (a shared host's drift hits both)."""
    import musecore_quant
    from musecore_xeon import XeonBackend
    from musecore_xeon.bench import host_fields
    backend = XeonBackend(num_threads=max(threads))
    E, h, inter, k = 64, 768, 768, 8
    gen = torch.Generator().manual_seed(0)
    ids = [torch.randperm(E, generator=gen)[:k][None] for _ in range(calls)]
    z, weights, post = torch.randn(1, h, dtype=torch.bfloat16), torch.full((1, k), 1 / k), torch.ones(h, dtype=torch.bfloat16)
    rows = []
    for fmt in ("int4", "bf16"):
        def weight(*shape: int) -> Any:
            w = torch.randn(*shape, generator=gen) * 0.02
            return musecore_quant.quantize(w, "int4", group_size=128) if fmt == "int4" else w.to(torch.bfloat16)
        n_layers = copies if fmt == "int4" else 2
        layers = [backend.prepare_experts(weight(E, inter, h), weight(E, inter, h), weight(E, h, inter))
                  for _ in range(n_layers)]
        gemvs = [backend.prepare_weight(weight(k * 3 * inter, h), "expert") for _ in range(n_layers * E // k)]
        nbytes = resident_bytes(gemvs[0].extra["linear"])

        def timed(call: Callable[[int], Any], n: int) -> tuple[float, float]:
            for i in range(4):
                call(i)
            wall, cpu = time.perf_counter(), time.thread_time()
            for i in range(n):
                call(i)
            return (time.perf_counter() - wall) / n, (time.thread_time() - cpu) / n

        for t in threads:
            torch.set_num_threads(t)
            runs: dict[str, list[tuple[float, float]]] = {"moe": [], "gemv": []}
            for _ in range(rounds):
                runs["moe"].append(timed(lambda i: backend.moe(z, weights, ids[i % calls], layers[i % len(layers)],
                                                               post, 1e-6), 2 * calls))
                runs["gemv"].append(timed(lambda i: backend.linear(z, gemvs[i % len(gemvs)]), 2 * calls))
            med = {key: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for key, v in runs.items()}
            for key, what in (("moe", "fused moe, 8 of 64 experts"), ("gemv", f"one GEMV {k * 3 * inter}x{h}")):
                wall, cpu = med[key]
                rows.append({"format": fmt, "threads": t, "what": what, "mb": nbytes / 1e6, "us_wall": wall * 1e6,
                             "us_cpu": cpu * 1e6, "gb_per_s_wall": nbytes / wall / 1e9, "gb_per_s_cpu": nbytes / cpu / 1e9,
                             "rounds_us_wall": [w * 1e6 for w, _ in runs[key]], "moe_over_gemv_wall": med["moe"][0] / med["gemv"][0],
                             **host_fields()})
    return rows


def moe_markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| format | threads | call | MB | us (wall, median) | GB/s (wall) | us (main-thread CPU) | moe / GEMV (wall) |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['format']} | {r['threads']} | {r['what']} | {r['mb']:.2f} | {r['us_wall']:.0f} | "
              f"{r['gb_per_s_wall']:.1f} | {r['us_cpu']:.0f} | {r['moe_over_gemv_wall']:.3f} |" for r in rows]
    return "\n".join(lines) + "\n"


def markdown(plan: str, r: dict[str, Any]) -> str:
    lines = [f"### {plan}, {r['threads']} thread(s): {r['step_ms']:.2f} ms/token ({r['tokens_per_s']:.1f} tokens/s), "
             f"main-thread CPU {r['step_cpu_ms']:.2f} ms",
             "",
             f"- every block through its separate ops: {r['unfused_step_ms']:.2f} ms/token (the rows below are that "
             "step's)",
             f"- weight streaming (linear + moe): {r['streaming_ms']:.2f} ms ({r['weight_bytes_per_step'] / 1e6:.1f} MB, "
             f"{r['streaming_gb_per_s']:.1f} GB/s) of a {r['timed_step_ms']:.2f} ms step with timers",
             f"- other ops (attention, router, norms, softcap, embedding): {r['other_ops_ms']:.2f} ms",
             f"- outside the ops (model.py, KV cache bookkeeping, timers): {r['outside_ops_ms']:.2f} ms",
             f"- fixed-cost step (linear/moe/attention replayed, nothing streams): {r['fixed_cost_step_ms']:.2f} ms wall, "
             f"{r['fixed_cost_step_cpu_ms']:.2f} ms CPU; {r['aten_ops_per_step']} aten ops per step "
             f"({', '.join(f'{k[6:]} {v}' for k, v in list(r['aten_op_counts'].items())[:8])})",
             "",
             "| op | shape | format | calls/token | ms/token | us/call | MB/call | GB/s |",
             "|---|---|---|---|---|---|---|---|"]
    for o in r["ops"]:
        gbs = f"{o['gb_per_s']:.1f}" if o["gb_per_s"] else ""
        mb = f"{o['bytes_per_call'] / 1e6:.2f}" if o["bytes_per_call"] else ""
        lines.append(f"| {o['op']} | {o['shape']} | {o['format']} | {o['calls_per_step']:.0f} | "
                     f"{o['wall_ms_per_step']:.3f} | {o['us_per_call']:.1f} | {mb} | {gbs} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--plans", nargs="*", default=["int4", "bf16"], choices=("int4", "bf16"),
                   help="the plans to profile (none: only --moe-vs-gemv)")
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--layers", type=int, default=0, help="cut muse-small to this many layers (development)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--moe-vs-gemv", action="store_true",
                   help="also time the fused decode MoE against one GEMV of the same bytes (INT4 and BF16, cold)")
    args = p.parse_args()
    results: dict[str, Any] = {"command": "python3 benchmarks/xeon_decode_profile.py " + " ".join(
        f"{k} {v}" for k, v in vars(args).items() if v), "load_average_before": os.getloadavg(), "profiles": {}}
    for plan in args.plans:
        model = load(plan, args.layers)
        for threads in args.threads:
            r = profile_plan(model, threads, args.steps)
            results["profiles"][f"{plan}/{threads}"] = r
            print(markdown(plan, r), flush=True)
        del model
    if args.moe_vs_gemv:
        results["moe_vs_gemv"] = moe_vs_gemv(args.threads)
        print(moe_markdown(results["moe_vs_gemv"]))
    results["load_average_after"] = os.getloadavg()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
