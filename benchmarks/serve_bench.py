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

PROMPTS = ["def fibonacci(n):", "import numpy as np\n", "class Stack:\n    def __init__(self):",
           "# Sort a list of numbers", "The quick brown fox", "for i in range(10):",
           "def parse_args():\n    parser = argparse.ArgumentParser(", "Hello, my name is"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


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
    ttfts = sorted(r["ttft_s"] for r in results)
    tokens = sum(r["tokens"] for r in results)
    q = statistics.quantiles(ttfts, n=10) if len(ttfts) > 1 else ttfts * 9
    return {"concurrency": concurrency, "requests": len(results), "completion_tokens": tokens,
            "wall_s": round(wall, 3), "throughput_tokens_per_s": round(tokens / wall, 2),
            "ttft_p50_s": round(statistics.median(ttfts), 4), "ttft_p90_s": round(q[8], 4),
            "mean_latency_s": round(statistics.mean(r["latency_s"] for r in results), 3),
            "decode_steps": int(metric(url, "musecore_decode_steps_total") - steps_before)}


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
    args = parser.parse_args()

    load_before = os.getloadavg()
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
    import torch

    result = {"benchmark": "musecore serve", "model": args.model, "device": args.device,
              "cpu": cpu_name(), "cores": os.cpu_count(), "torch": torch.__version__,
              "python": platform.python_version(),
              # other work on the machine shares its cores: the 1-minute load average before and after
              "load_average_1min": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
              "max_tokens": args.max_tokens, "requests_per_client": args.requests_per_client,
              "max_batch": args.max_batch, "prompt": "streamed /v1/completions, greedy, 8 fixed code/text prompts",
              "command": " ".join(["python", "benchmarks/serve_bench.py"] + sys.argv[1:]),
              "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "rounds": rounds}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
