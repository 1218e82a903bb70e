"""Where a generated token's time goes beyond the captured decode step (issue 26 item 3, session 43).

``cuda_profile_decode.py`` found muse-small batch-1 ``generate`` at ~860 us per token against a ~710 us graph
replay. This probe splits that gap on the H200: the graph replay back to back; the host time of one ``step()``
call (graph launch included); the GPU and host time of the work ``generate`` queues around each replay (the
position update, the input copies, greedy sampling, the token's copy to the host); and a profiler timeline of
``generate`` itself, from which the GPU's idle time between kernels per token is summed.

    python backends/cuda/lab/scripts/cuda_decode_host_probe.py [--preset muse-small] [--out probe.json] [--trace t.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch.profiler import ProfilerActivity, profile

from musecore.api import load_random
from musecore.testing import nmse


def gpu_us(fn, n: int = 50, warmup: int = 1) -> float:
    """GPU microseconds per call of ``fn`` (not captured: it may replay a graph itself), ``n`` calls back to back
    between two events after ``warmup`` calls."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(warmup):
        fn()
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n * 1e3


def host_us(fn, n: int = 30) -> float:
    """Host time of one call issued on an idle GPU (what the call itself costs the CPU)."""
    total = 0.0
    for _ in range(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        total += time.perf_counter() - t
    torch.cuda.synchronize()
    return total / n * 1e6


def decode_numbers(model, prompt: list[list[int]], new_tokens: int = 64, kernels: bool = True,
                   outputs: dict | None = None) -> dict:
    """One mode of the lab's A/B scripts (``cuda_fused_ab.py``, ``cuda_merge_ab.py``): ``generate`` per token after a
    fresh capture, the graph replay of one step on a static cache filled by ``prompt``, and (``kernels``) its kernels,
    counted under the profiler: later replays in the process may run slower after it (session 48, run 31), so an A/B
    can count them after all its timed rounds instead (:func:`step_kernels`). ``outputs`` (a dict): filled with the
    greedy tokens ``generate`` made and the replayed step's logits (fp32, on the host), for :func:`output_check`."""
    model.release_generation_cache()  # a new capture for this mode
    model.generate(prompt, max_new_tokens=8)
    tokens = model.generate(prompt, max_new_tokens=new_tokens)
    gen_us = 1e6 / model.last_generation_stats.decode_tokens_per_s
    step, tok, pos = _prefilled_step(model, prompt, new_tokens)
    rep = gpu_us(lambda: step(tok, pos), warmup=3)
    if outputs is not None:
        outputs["tokens"] = tokens
        outputs["logits"] = step(tok, pos).float().cpu()
    row = {"replay_us": round(rep, 1), "generate_us_per_token": round(gen_us, 1)}
    if kernels:
        row["kernels_per_step"] = _count_kernels(lambda: step(tok, pos))
    return row


def output_check(outputs: dict, first: dict) -> dict:
    """A mode's outputs (:func:`decode_numbers`' ``outputs``) against the first mode's of its round: whether the greedy
    tokens are the same and the replayed step's logits' NMSE (a launch detail that races shows as a large or NaN
    NMSE; one that only groups an fp32 sum differently, as ~1e-6 and perhaps a different token after a near tie)."""
    a, b = outputs["logits"], first["logits"]
    # the logits' size and where their argmax falls, so that an NMSE of 0 from all-zero or unwritten logits (sessions
    # 80-81: 0 in every mode, also where the generated tokens differ) shows as such
    return {"tokens_equal_first": outputs["tokens"] == first["tokens"], "logits_nmse_vs_first": nmse(b, a),
            "logits_rms": float(a.square().mean().sqrt()), "logits_argmax": int(a.flatten().argmax()),
            "first_token_diff": next((i for i, (x, y) in enumerate(zip(_flat(outputs["tokens"]),
                                                                        _flat(first["tokens"]))) if x != y), None)}


def _flat(tokens) -> list[int]:
    """``generate``'s tokens (nested lists or a tensor) as one list."""
    return torch.as_tensor(tokens).flatten().tolist()


def step_kernels(model, prompt: list[list[int]]) -> int:
    """Kernels in one captured decode step of ``model`` on a static cache filled by ``prompt`` (under the profiler)."""
    step, tok, pos = _prefilled_step(model, prompt, 8)
    step(tok, pos)
    return _count_kernels(lambda: step(tok, pos))


def _prefilled_step(model, prompt: list[list[int]], room: int):
    """``(step, ids, positions)``: the decode step captured on a static cache that ``prompt`` filled, with ``room``
    positions after it, and one token's inputs at the next position."""
    length = len(prompt[0])
    cache = model.new_cache(1, length + room, static=True)
    model.forward(torch.tensor(prompt, device="cuda"), cache=cache)
    tok = torch.zeros(1, 1, dtype=torch.long, device="cuda")
    pos = torch.full((1, 1), length, dtype=torch.long, device="cuda")
    return model.decode_step(cache), tok, pos


def _count_kernels(fn) -> int:
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type.name == "CUDA")


def replay_timeline(model, prompt: list[list[int]], new_tokens: int) -> dict:
    """Events (no profiler) around every graph replay of one greedy ``generate``: each replay's GPU time, the GPU's
    idle time from one replay's end to the next one's start, and the host's time between the launch calls. If the
    gaps are ~0 the token's time is the graph's; if a gap is as long as the host's loop minus the replay, the host
    is late."""
    from musecore_triton.graphs import GreedyGraphStep
    marks: list = []
    call = GreedyGraphStep.__call__

    def timed_call(self):
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        host = time.perf_counter()
        before.record()
        out = call(self)
        after.record()
        marks.append((host, before, after))
        return out

    GreedyGraphStep.__call__ = timed_call
    try:
        model.generate(prompt, max_new_tokens=new_tokens)
    finally:
        GreedyGraphStep.__call__ = call
    torch.cuda.synchronize()
    if len(marks) < 3:
        return {"timeline": f"{len(marks)} greedy replays (the backend has no greedy step?)"}
    marks = marks[2:]  # the first replays follow the prefill and the first step's host sync
    graph = [b.elapsed_time(a) * 1e3 for _, b, a in marks]
    idle = [marks[i - 1][2].elapsed_time(marks[i][1]) * 1e3 for i in range(1, len(marks))]
    host = [(marks[i][0] - marks[i - 1][0]) * 1e6 for i in range(1, len(marks))]
    med = lambda xs: round(sorted(xs)[len(xs) // 2], 1)  # noqa: E731
    return {"timeline_replays": len(marks), "timeline_graph_us": med(graph), "timeline_idle_us": med(idle),
            "timeline_idle_max_us": round(max(idle), 1), "timeline_host_loop_us": med(host),
            "timeline_generate_us_per_token": round(1e6 / model.last_generation_stats.decode_tokens_per_s, 1)}


def greedy_pair(model, prompt: list[list[int]], n: int = 50) -> dict:
    """The greedy graph replayed back to back (positions advancing, as in ``generate``), alone and with the token's
    copy to pinned host memory and an event between replays (what ``generate`` queues per token): the GPU cost of
    that copy between two graphs, without any host wait. (Runs 36 and 41 also timed the copy captured as the graph's
    last node, through a copy of ``GreedyGraphStep``'s body: the same ~9 us; that variant is at commit cb6f3a4.)"""
    length = len(prompt[0])
    cache = model.new_cache(1, length + 3 * n + 8, static=True)
    model.forward(torch.tensor(prompt, device="cuda"), cache=cache)
    greedy = model.backend.make_greedy_decode_step(model, cache)
    first = torch.zeros(1, dtype=torch.long, device="cuda")
    nxt = torch.full((1,), length, dtype=torch.long, device="cuda")
    live = torch.ones(1, dtype=torch.bool, device="cuda")
    pinned, event = torch.empty(1, dtype=torch.long, pin_memory=True), torch.cuda.Event()

    def with_copy() -> None:
        pinned.copy_(greedy.tokens, non_blocking=True)
        event.record()
        greedy()
    greedy.start(first, nxt, live)
    alone = gpu_us(greedy, n=n)
    greedy.start(first, nxt, live)
    copied = gpu_us(with_copy, n=n)
    return {"greedy_replay_gpu_us": round(alone, 1), "greedy_with_copy_gpu_us": round(copied, 1)}


def ab_arguments(out: str) -> argparse.Namespace:
    """The lab A/B scripts' command line: ``--preset``, ``--format``, ``--rounds`` (alternations), ``--out``,
    ``--modes`` (a comma-separated subset of the script's modes; all by default), ``--pad-mb`` (see
    :func:`placement_pad`)."""
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="muse-small")
    p.add_argument("--format", default="nvfp4")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=out)
    p.add_argument("--modes", default="")
    p.add_argument("--pad-mb", type=float, default=0.0,
                   help="before each mode's capture, hold a device buffer of a random size up to this many MB")
    return p.parse_args()


def placement_pad(max_mb: float, seed: int) -> list:
    """Device buffers of random sizes (``seed``'s draws; none when ``max_mb`` is 0) to hold while a mode captures its
    graph, so that the static cache and the graph's buffers land at other addresses: one of 0 .. ``max_mb`` MB in
    2 MB steps (the allocator's large pool) and 0-255 blocks of 512 B - 8 KB (its small pool, where a muse-small
    layer's KV cache and the step's activations live). Session 51 saw one graph's attention take 119 or 143 us per
    step by capture (run 51) and every capture after a process's first run ~33 us per token slower; with a pad per
    (round, mode), an A/B's rounds sample placements instead of repeating one, so a mode is not judged on where its
    buffers happened to land."""
    if max_mb <= 0:
        return []
    g = torch.Generator().manual_seed(seed)
    draw = lambda hi: int(torch.randint(0, hi + 1, (1,), generator=g))  # noqa: E731
    sizes = [draw(int(max_mb // 2)) * (2 << 20)] + [512 * (1 + draw(15)) for _ in range(draw(255))]
    return [torch.empty(n, dtype=torch.uint8, device="cuda") for n in sizes if n]


def print_medians(rows: list[dict], modes) -> None:
    """Per mode of an A/B: the median (and range) of its rounds' replay and ``generate`` times, and its kernels if
    counted."""
    for mode in modes:
        mine = [r for r in rows if r["mode"] == mode]
        kernels = f", {mine[0]['kernels_per_step']} kernels" if "kernels_per_step" in mine[0] else ""
        rep, gen = (sorted(r[key] for r in mine) for key in ("replay_us", "generate_us_per_token"))
        print(f"{mode}: replay median {rep[len(rep) // 2]} us ({rep[0]} .. {rep[-1]}), generate median "
              f"{gen[len(gen) // 2]} us/token ({gen[0]} .. {gen[-1]}){kernels}")


def save_rows(path: str, args, rows: list[dict]) -> None:
    """An A/B script's rows as JSON, with the preset, format and GPU they ran on."""
    with open(path, "w") as f:
        json.dump({"preset": args.preset, "format": args.format, "gpu": torch.cuda.get_device_name(), "rows": rows},
                  f, indent=1)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="muse-small")
    p.add_argument("--format", default="nvfp4")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--out", default="cuda_decode_host_probe.json")
    p.add_argument("--trace", default="")
    args = p.parse_args()
    model = load_random(args.preset, "h200", checkpoint_format=args.format)
    prompt = torch.randint(0, model.config.vocab_size, (1, 32)).tolist()
    model.generate(prompt, max_new_tokens=8)
    row: dict = {"preset": args.preset, "format": args.format, "gpu": torch.cuda.get_device_name()}
    per_token = []
    for _ in range(3):
        model.generate(prompt, max_new_tokens=args.tokens)
        per_token.append(1e6 / model.last_generation_stats.decode_tokens_per_s)
    row["generate_us_per_token"] = [round(t, 1) for t in per_token]

    cache = model.new_cache(1, 128, static=True)
    model.forward(torch.randint(0, model.config.vocab_size, (1, 32), device="cuda"), cache=cache)
    step = model.decode_step(cache)
    tok = torch.zeros(1, 1, dtype=torch.long, device="cuda")
    pos = torch.full((1, 1), 32, dtype=torch.long, device="cuda")
    row["replay_gpu_us"] = round(gpu_us(lambda: step(tok, pos)), 1)
    row["step_call_host_us"] = round(host_us(lambda: step(tok, pos)), 1)
    logits = step(tok, pos)[:, -1]
    sample = lambda: model.ops.sample(logits, 0.0, 0, 1.0, None)  # noqa: E731
    row["sample_gpu_us"], row["sample_host_us"] = round(gpu_us(sample), 1), round(host_us(sample), 1)
    live = torch.ones(1, dtype=torch.bool, device="cuda")
    nxt = torch.full((1,), 40, dtype=torch.long, device="cuda")
    pinned = torch.empty(1, dtype=torch.long, pin_memory=True)
    event = torch.cuda.Event()

    def around() -> None:  # what generate's loop queues besides the replay (generate.py, _decode_loop)
        pinned.copy_(tok[:, 0], non_blocking=True)
        event.record()
        torch.where(live, nxt, torch.full_like(nxt, -1))[:, None]
        nxt.add_(live.long())
        nxt.sub_(live.long())  # (keeps the probe's position fixed)
    row["around_gpu_us"], row["around_host_us"] = round(gpu_us(around), 1), round(host_us(around), 1)

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        model.generate(prompt, max_new_tokens=16)
        torch.cuda.synchronize()
    if args.trace:
        prof.export_chrome_trace(args.trace)
    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                     if e.device_type.name == "CUDA" and e.time_range.end > e.time_range.start)
    lm = [k for k in kernels if k[2].startswith("nvjet") or "gemm" in k[2].lower()]
    # decode steps: from the second lm_head kernel to the last one (the prefill's lm_head comes first)
    if len(lm) >= 4:
        t0, t1 = lm[1][1], lm[-1][1]
        inside = [k for k in kernels if t0 <= k[0] < t1]
        busy, last_end, idle, gaps = 0.0, t0, 0.0, []
        for s, e, name in inside:
            if s > last_end:
                idle += s - last_end
                gaps.append((s - last_end, name))
            busy += e - s
            last_end = max(last_end, e)
        steps = len(lm) - 2
        row["trace_steps"] = steps
        row["trace_us_per_step"] = round((t1 - t0) / steps, 1)
        row["trace_idle_us_per_step"] = round(idle / steps, 1)
        row["trace_kernels_per_step"] = round(len(inside) / steps, 1)
        row["trace_largest_gaps"] = [(round(g, 1), n[:60]) for g, n in sorted(gaps, reverse=True)[:12]]
    row.update(replay_timeline(model, prompt, args.tokens))
    row.update(greedy_pair(model, prompt))
    print(json.dumps(row, indent=1))
    with open(args.out, "w") as f:
        json.dump(row, f, indent=1)


if __name__ == "__main__":
    main()
