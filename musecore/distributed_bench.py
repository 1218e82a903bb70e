"""Distributed benchmark: decode and prefill of a (cut-down) preset across the ranks of one launch.

Run it under ``torchrun`` (every rank runs the same command; rank 0 writes the JSON)::

    torchrun --nproc-per-node 4 -m musecore.distributed_bench --preset muse-spark-open-816b-a42b \\
        --layers 1 --format nvfp4 --device h200 --tp 4 --ep 4 --out benchmarks/results/dist_ep4.json

and once with ``--nproc-per-node 1`` (no --tp/--ep) for the one-device baseline: scaling efficiency
and equality come from comparing the two files (``logits_checksum``: the same random weights and
input on every launch; ``launch`` reports the largest difference of the sampled logits). ``--layers 1`` keeps one decoder layer of the preset at full width (the
816B preset's MoE layer: 256 experts, top-8). Rows: decode time per step at each batch size and
tokens/s, one prefill, the bytes each collective moved per step (``Comm`` counts them) and the
all-to-all bus bandwidth measured in the same run, with the hardware recorded.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import time
from typing import Any, Callable

import torch


def parse(argv: Any = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m musecore.distributed_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="muse-small")
    p.add_argument("--layers", type=int, default=None, help="keep this many decoder layers (default: all)")
    p.add_argument("--format", default="bf16", help="checkpoint format of the random weights (bf16, nvfp4, ...)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--tp", type=int, default=None)
    p.add_argument("--ep", type=int, default=None)
    p.add_argument("--sp", action="store_true")
    p.add_argument("--batches", default="1,8,64", help="decode batch sizes (comma-separated)")
    p.add_argument("--prefill", type=int, default=512, help="prefill length in tokens (0: skip)")
    p.add_argument("--steps", type=int, default=8, help="timed decode steps per batch size")
    p.add_argument("--out", default=None, help="JSON file rank 0 writes (default: stdout)")
    return p.parse_args(argv)


def timed(fn: Callable[[], Any], sync: Callable[[], None], barrier: Callable[[], None], repeats: int) -> float:
    """Median seconds of ``fn`` over ``repeats`` runs, every rank starting together."""
    out = []
    for _ in range(repeats):
        barrier()
        start = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - start)
    return statistics.median(out)


def bus_bandwidth(comm: Any, device: torch.device, mib: int = 64) -> float:
    """GB/s of one ``all_to_all_single`` of ``mib`` MiB per rank, measured here (the ceiling the MoE
    dispatch is compared with), as the NCCL tests define bus bandwidth for all-to-all:
    ``bytes * (world - 1) / world / time``."""
    n = mib * 2**20 // 2
    x = torch.ones(n, dtype=torch.bfloat16, device=device)
    y = torch.empty_like(x)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    barrier = lambda: comm.dist.barrier(group=comm.group)  # noqa: E731
    comm.dist.all_to_all_single(y, x, group=comm.group)  # warm
    t = timed(lambda: comm.dist.all_to_all_single(y, x, group=comm.group), sync, barrier, 5)
    return x.numel() * 2 * (comm.world - 1) / comm.world / t / 1e9


def launch(device: str, nproc: int, *extra: str, timeout_s: float = 1800) -> list[dict]:
    """Run this benchmark under ``torch.distributed.run`` with ``nproc`` ranks (``tp = ep = nproc``) and
    once with one rank, and return ``musecore bench`` rows: per phase and batch, tokens/s at ``nproc``
    ranks, the one-rank figure and the scaling efficiency (``speedup / nproc``), all measured in this call.
    What ``musecore bench --backend cuda|xeon --case distributed`` runs."""
    import os
    import subprocess
    import tempfile

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for world in (1, nproc):
            out = os.path.join(tmp, f"world{world}.json")
            mesh = ["--tp", str(world), "--ep", str(world)] if world > 1 else []
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
                   "--master-port", str(_free_port()), "-m", "musecore.distributed_bench", "--device", device,
                   *mesh, *extra, "--out", out]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
            if done.returncode != 0:
                raise RuntimeError(f"distributed benchmark with {world} rank(s) failed: {rank_errors(done.stderr)}")
            with open(out) as f:
                results[world] = json.load(f)
    one, many = results[1], results[nproc]
    rows = []
    for base, row in zip(one["rows"], many["rows"]):
        speedup = row["tokens_per_s"] / base["tokens_per_s"]
        rows.append({"backend": device, "case": "distributed", "format": many["format"],
                     "shape": f"{many['preset']} x{many['layers']} layers, {row['phase']}",
                     "M": row.get("batch", row.get("tokens")), "ranks": nproc,
                     "tokens_per_s": row["tokens_per_s"], "tokens_per_s_one_rank": base["tokens_per_s"],
                     "speedup_vs_one_rank": speedup, "scaling_efficiency": speedup / nproc,
                     "all_to_all_bus_GBps": many["all_to_all_bus_GBps"],
                     "logits_max_abs_diff_vs_one_rank": max(abs(a - b) for a, b in zip(
                         one["logits_checksum"]["sample"], many["logits_checksum"]["sample"])),
                     "hardware": many["hardware"]})
    return rows


def rank_errors(stderr: str) -> str:
    """The ranks' own error lines from a failed launch's stderr (not torchrun's summary that only says a rank
    died, nor traceback source lines), the last three joined; the last line when none names an error."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    own = [line for line in lines if "Error" in line and "ChildFailedError" not in line
           and not line.startswith(("raise ", "File "))]
    return " | ".join(own[-3:]) or (lines[-1] if lines else "no output")


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: Any = None) -> int:
    from musecore.api import load_random
    from musecore.benchmarking import cpu_name
    from musecore.config import MuseConfig

    args = parse(argv)
    config = MuseConfig.from_name(args.preset)
    if args.layers is not None:
        L, per_layer = args.layers, config.num_hidden_layers
        cut = {f.name: getattr(config, f.name)[:L] for f in dataclasses.fields(config)  # every per-layer list
               if isinstance(getattr(config, f.name), list) and len(getattr(config, f.name)) == per_layer}
        config = dataclasses.replace(config, num_hidden_layers=L, **cut)
    model = load_random(config, device=args.device, checkpoint_format=args.format,
                        tp=args.tp, ep=args.ep, sp=args.sp)
    comm, device = model.comm, model.device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    barrier = (lambda: comm.dist.barrier(group=comm.group)) if comm is not None else (lambda: None)
    gen = torch.Generator().manual_seed(0)
    probe = torch.randint(0, config.vocab_size - 8, (2, 16), generator=gen)
    logits = model.forward(probe).float()
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        cache = model.new_cache(batch, 16 + 2 * args.steps + 2)
        model.forward(torch.randint(0, config.vocab_size - 8, (batch, 16), generator=gen), cache=cache)
        step = torch.randint(0, config.vocab_size - 8, (batch, 1), generator=gen)
        model.forward(step, cache=cache)  # warm
        if comm is not None:
            comm.reset_traffic()
        model.forward(step, cache=cache)
        traffic = dict(comm.traffic) if comm is not None else {}
        t = timed(lambda: model.forward(step, cache=cache), sync, barrier, args.steps)
        rows.append({"phase": "decode", "batch": batch, "step_ms": t * 1e3, "tokens_per_s": batch / t,
                     "bytes_sent_per_step": traffic})
    if args.prefill:
        ids = torch.randint(0, config.vocab_size - 8, (1, args.prefill), generator=gen)
        model.forward(ids[:, :64])  # warm
        if comm is not None:
            comm.reset_traffic()
        t = timed(lambda: model.forward(ids), sync, barrier, 2)
        traffic = {k: v // 2 for k, v in comm.traffic.items()} if comm is not None else {}
        rows.append({"phase": "prefill", "tokens": args.prefill, "seconds": t, "tokens_per_s": args.prefill / t,
                     "bytes_sent": traffic})
    result = {
        "command": "torchrun ... -m musecore.distributed_bench " + " ".join(sys.argv[1:] if argv is None else argv),
        "preset": args.preset, "layers": config.num_hidden_layers, "format": args.format, "device": args.device,
        "mesh": None if comm is None else dataclasses.asdict(comm.mesh) | {"world": comm.world},
        "hardware": {"torch": torch.__version__, "machine": platform.machine(), "cpu": cpu_name(),
                     "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None,
                     "threads": torch.get_num_threads()},
        "all_to_all_bus_GBps": None if comm is None else bus_bandwidth(comm, device),
        "logits_checksum": {"sum": logits.sum().item(), "abs_max": logits.abs().max().item(),
                            "sample": logits[:, -1, :256].flatten().tolist()},  # compared across launches
        "rows": rows,
    }
    if comm is None or comm.rank == 0:
        text = json.dumps(result, indent=1)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text + "\n")
        else:
            print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
