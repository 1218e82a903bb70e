"""Serving benchmark: throughput and time to first token of ``musecore serve`` at several concurrencies.

Starts ``musecore serve`` (a subprocess on a free 127.0.0.1 port), then for each concurrency C runs
C clients that each send ``--requests-per-client`` streamed completions back to back (greedy,
a fixed ``max_tokens``, prompts from a small fixed list) and records:

- throughput: completion tokens of all requests / wall time of the round,
- TTFT: from sending the request to the first streamed text chunk (p50, p90),
- the server's own decode-step count and peak batch (from ``/metrics``), which show the batching.

Usage::

    python benchmarks/serve_bench.py --device cpu --out benchmarks/results/serve_cpu.json

Every request has a timeout; the server is killed at the end whatever happens.

``--in-process`` measures the same rounds on the continuous-batching engine itself
(``musecore/serve/engine.py``), without HTTP, uvicorn or a tokenizer: for machines without the
``serve`` extra, and for presets without a checkpoint (``--random-weights``, e.g. muse-small made by
``musecore.api.load_random``). Prompts are then fixed token ids, every request runs to
``--max-tokens`` (the engine's ``ignore_eos``, as vLLM's ``--ignore-eos``), and TTFT is from
``Engine.submit`` to the first token handed to the request's sink::

    python benchmarks/serve_bench.py --in-process --random-weights --model muse-small --device h200 \
        --checkpoint-format nvfp4 --out benchmarks/results/serve_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from musecore.benchmarking import cpu_name

PROMPTS = ["def fibonacci(n):", "import numpy as np\n", "class Stack:\n    def __init__(self):",
           "# Sort a list of numbers", "The quick brown fox", "for i in range(10):",
           "def parse_args():\n    parser = argparse.ArgumentParser(", "Hello, my name is"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]




def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") and "quantile" not in line:
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def one_request(url: str, model: str, prompt: str, max_tokens: int, timeout: float) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first, tokens = None, 0
    with httpx.Client(timeout=timeout) as http, http.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk.get("choices") and chunk["choices"][0].get("text"):
                first = time.perf_counter() - start
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return {"ttft_s": first if first is not None else time.perf_counter() - start, "tokens": tokens,
            "latency_s": time.perf_counter() - start}


def run_round(url: str, model: str, concurrency: int, per_client: int, max_tokens: int, timeout: float) -> dict:
    results: list[dict] = []
    lock = threading.Lock()

    def client(k: int) -> None:
        for j in range(per_client):
            out = one_request(url, model, PROMPTS[(k + j) % len(PROMPTS)], max_tokens, timeout)
            with lock:
                results.append(out)

    steps_before = metric(url, "musecore_decode_steps_total")
    start = time.perf_counter()
    threads = [threading.Thread(target=client, args=(k,)) for k in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout * per_client + 10)
    wall = time.perf_counter() - start
    return summarize_round(concurrency, results, wall, int(metric(url, "musecore_decode_steps_total") - steps_before))


def summarize_round(concurrency: int, results: list[dict], wall: float, steps: int) -> dict:
    ttfts = sorted(r["ttft_s"] for r in results)
    tokens = sum(r["tokens"] for r in results)
    q = statistics.quantiles(ttfts, n=10) if len(ttfts) > 1 else ttfts * 9
    return {"concurrency": concurrency, "requests": len(results), "completion_tokens": tokens,
            "wall_s": round(wall, 3), "throughput_tokens_per_s": round(tokens / wall, 2),
            "ttft_p50_s": round(statistics.median(ttfts), 4), "ttft_p90_s": round(q[8], 4),
            "mean_latency_s": round(statistics.mean(r["latency_s"] for r in results), 3), "decode_steps": steps}


def in_process_rounds(args: argparse.Namespace) -> tuple[list[dict], dict]:
    """The rounds of :func:`run_round`, on ``musecore.serve.engine.Engine`` in this process (no HTTP)."""
    import torch

    import musecore
    import musecore.api
    from musecore.serve.engine import Engine, Request, Sampling

    started = time.perf_counter()
    if args.random_weights:
        model = musecore.api.load_random(args.model, device=args.device, checkpoint_format=args.checkpoint_format)
    else:
        model = musecore.load(args.model, device=args.device)
    load_s = time.perf_counter() - started
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompts = ([model.tokenizer.encode(p) for p in PROMPTS] if model.tokenizer is not None else
               [torch.randint(16, vocab, (int(n),), generator=gen).tolist() for n in (5, 9, 14, 7, 6, 8, 19, 6)])
    engine = Engine(model, max_batch=args.max_batch, max_model_len=args.max_model_len, max_waiting=1024,
                    ignore_eos=True, lookahead=not args.no_lookahead)
    started = time.perf_counter()
    engine.start()  # captures the decode steps of every batch bucket where the backend replays graphs
    start_s = time.perf_counter() - started

    def one(prompt: list[int], max_tokens: int) -> dict:
        done, state = threading.Event(), {"first": None, "usage": None, "error": None}
        start = time.perf_counter()

        def sink(event: dict) -> None:
            if event["type"] == "text" and state["first"] is None:
                state["first"] = time.perf_counter() - start
            elif event["type"] == "done":
                state["usage"], state["error"] = event.get("usage"), event.get("error")
                done.set()

        engine.submit(Request(prompt, Sampling(max_tokens=max_tokens), sink, model.tokenizer))
        if not done.wait(args.timeout):
            raise SystemExit(f"a request did not finish within --timeout {args.timeout} s")
        if state["error"]:
            raise SystemExit(f"the engine failed: {state['error']}")
        return {"ttft_s": state["first"], "tokens": state["usage"]["completion_tokens"],
                "latency_s": time.perf_counter() - start}

    passes: list[list[dict]] = []
    try:
        one(prompts[0], 8)  # warm-up: kernel compilation and autotuning happen here
        for _ in range(args.passes):
            passes.append(rounds := [])
            for c in (int(x) for x in args.concurrency.split(",")):
                results: list[dict] = []
                lock = threading.Lock()

                def client(k: int) -> None:
                    for j in range(args.requests_per_client):
                        out = one(prompts[(k + j) % len(prompts)], args.max_tokens)
                        with lock:
                            results.append(out)

                steps = engine.metrics.decode_steps
                start = time.perf_counter()
                threads = [threading.Thread(target=client, args=(k,)) for k in range(c)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                wall = time.perf_counter() - start
                rounds.append(summarize_round(c, results, wall, engine.metrics.decode_steps - steps))
                print(json.dumps(rounds[-1]), flush=True)
    finally:
        engine.stop()
    extra = {"load_s": round(load_s, 1), "plan_backend": model.plan.backend, "plan_device": model.plan.device,
             "decode_graphs": engine.graphs, "engine_start_s": round(start_s, 2),
             "graphs_captured": [list(key) for key in engine.captured_steps],
             "lookahead_steps": {"taken": engine.metrics.lookahead_taken, "not_used": engine.metrics.lookahead_dropped}}
    if len(passes) > 1:  # the earlier passes compiled kernels for new batch sizes and prompt lengths
        extra["earlier_passes"] = passes[:-1]
    if torch.cuda.is_available():
        extra["gpu"] = torch.cuda.get_device_name()
        extra["gpu_peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    return passes[-1], extra


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="muse-tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--concurrency", default="1,4,16", help="comma-separated (default: 1,4,16)")
    parser.add_argument("--requests-per-client", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    parser.add_argument("--out", default=None, help="write the JSON result here")
    parser.add_argument("--in-process", action="store_true",
                        help="measure the engine in this process, without HTTP (see the module doc)")
    parser.add_argument("--random-weights", action="store_true",
                        help="with --in-process: random weights for a preset (musecore.api.load_random)")
    parser.add_argument("--checkpoint-format", default="bf16",
                        help="with --random-weights: the routed experts' format (bf16, nvfp4, ...)")
    parser.add_argument("--passes", type=int, default=1,
                        help="with --in-process: run all rounds this many times and report the last (the first "
                             "compiles kernels for every batch size and prompt length; kept as earlier_passes)")
    parser.add_argument("--max-model-len", type=int, default=1024,
                        help="with --in-process: positions per cache row (default: 1024)")
    parser.add_argument("--no-lookahead", action="store_true",
                        help="with --in-process: Engine(lookahead=False), each greedy step launched after the host "
                             "has read the previous one's tokens (for A/B runs)")
    args = parser.parse_args()

    load_before = os.getloadavg()
    extra: dict = {}
    if args.in_process:
        rounds, extra = in_process_rounds(args)
    else:
        rounds = http_rounds(args)
    import torch

    result = {"benchmark": "musecore serve engine, in process (no HTTP)" if args.in_process else "musecore serve",
              "model": args.model, "device": args.device,
              **({"weights": f"random (musecore.api.load_random), experts {args.checkpoint_format}",
                  "ignore_eos": True, "max_model_len": args.max_model_len,
                  "passes": args.passes, "lookahead": not args.no_lookahead} if args.in_process else {}),
              **extra,
              "cpu": cpu_name(), "cores": os.cpu_count(), "torch": torch.__version__,
              "python": platform.python_version(),
              # other work on the machine shares its cores: the 1-minute load average before and after
              "load_average_1min": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
              "max_tokens": args.max_tokens, "requests_per_client": args.requests_per_client,
              "max_batch": args.max_batch,
              "prompt": ("8 fixed prompts of 5-19 token ids, greedy" if args.in_process else
                         "streamed /v1/completions, greedy, 8 fixed code/text prompts"),
              "command": " ".join(["python", "benchmarks/serve_bench.py"] + sys.argv[1:]),
              "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "rounds": rounds}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


def http_rounds(args: argparse.Namespace) -> list[dict]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "musecore", "serve", "--model", args.model, "--device", args.device,
           "--port", str(port), "--max-batch", str(args.max_batch), "--log-level", "warning"]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the server did not start: {server.stderr.read() if server.stderr else ''}")
            time.sleep(0.2)
        one_request(url, args.model, PROMPTS[0], 8, args.timeout)  # warm-up
        rounds = []
        for c in (int(x) for x in args.concurrency.split(",")):
            rounds.append(run_round(url, args.model, c, args.requests_per_client, args.max_tokens, args.timeout))
            print(json.dumps(rounds[-1]), flush=True)
    finally:
        server.terminate()
        try:
            server.wait(15)
        except subprocess.TimeoutExpired:
            server.kill()
    return rounds


if __name__ == "__main__":
    sys.exit(main())
