"""``musecore matrix`` with its rows split over a few one-thread processes, merged into one report.

Each row of the accuracy matrix is measured on its own (the same BF16 baseline, recomputed
identically in every shard, the same cached checkpoints), so splitting the rows over processes
changes no number: it only lets a run use more than one core while each process keeps
``OMP_NUM_THREADS=1``. The merged report is rendered by ``musecore matrix``'s own Markdown, PNG and
JSON writers, rows in the catalogue order; the first shard also runs the per-op conformance suite.

    OMP_NUM_THREADS=1 python benchmarks/accuracy_matrix_shards.py --shards 3 --op-sizes tiny,small \\
        --markdown docs/accuracy-matrix.md --png docs/accuracy-matrix.png --json docs/accuracy-matrix.json
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Optional


def run_shard(rows: list[str], op_sizes: tuple[str, ...], tokens: Optional[int], out: Path) -> None:
    from musecore.matrix import run_matrix
    report = run_matrix("muse-tiny", rows=rows, tokens=tokens, native=True, op_sizes=op_sizes,
                        log=lambda msg: print(f"shard {out.stem}: {msg}", file=sys.stderr, flush=True))
    out.write_bytes(pickle.dumps(report))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shards", type=int, default=3)
    p.add_argument("--op-sizes", default="tiny")
    p.add_argument("--rows", nargs="+", help="row ids (default: all)")
    p.add_argument("--tokens", type=int, default=None, help="evaluation tokens (default: all; fewer for a smoke test)")
    p.add_argument("--markdown", type=Path)
    p.add_argument("--png", type=Path)
    p.add_argument("--json", type=Path)
    p.add_argument("--shard-rows", nargs="*", help=argparse.SUPPRESS)  # internal: run one shard
    p.add_argument("--shard-out", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    sizes = tuple(s.strip() for s in args.op_sizes.split(",") if s.strip())
    if args.shard_out is not None:
        run_shard(args.shard_rows, sizes, args.tokens, args.shard_out)
        return 0

    from musecore.commands.matrix import render_markdown, render_png
    from musecore.matrix import ROWS, select_rows
    from musecore.matrix import run_matrix
    started = time.perf_counter()
    specs = select_rows(args.rows)
    ids = [r.id for r in specs]
    # build (or find) every checkpoint once, here, so that no two shards convert the same one at once
    first_of = {}
    for spec in specs:
        first_of.setdefault(spec.checkpoint, spec.id)
    run_matrix("muse-tiny", rows=list(first_of.values()), tokens=64, native=False, op_sizes=(),
               log=lambda msg: print(f"warm: {msg}", file=sys.stderr, flush=True))
    # cheap rows first in every shard; the AutoRound/GPTQ rows spread over the shards
    shards = [ids[k::args.shards] for k in range(args.shards)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        shards = [rows for rows in shards if rows]
        outs = [Path(tmp) / f"shard{k}.pkl" for k in range(len(shards))]
        extra = [] if args.tokens is None else ["--tokens", str(args.tokens)]
        procs = [subprocess.Popen([sys.executable, __file__, "--op-sizes", args.op_sizes if k == 0 else "", *extra,
                                   "--shard-out", str(out), "--shard-rows", *rows], env=env)
                 for k, (rows, out) in enumerate(zip(shards, outs)) if rows]
        codes = [proc.wait() for proc in procs]
        if any(codes):
            print(f"a shard failed: exit codes {codes}", file=sys.stderr)
            return 1
        reports = [pickle.loads(out.read_bytes()) for out in outs]
    by_id = {row.row_id: row for report in reports for row in report.rows}
    checkpoints: dict = {}
    native_skipped: dict = {}
    for report in reports:
        checkpoints.update(report.checkpoints)
        native_skipped.update(report.native_skipped)
    order = {name: k for k, name in enumerate(["bf16", "nvfp4-weights", "nvfp4", "mxfp4", "mxfp4-least-error", "int4-rtn"])}
    checkpoints = dict(sorted(checkpoints.items(), key=lambda kv: (order.get(kv[0], len(order)), kv[0])))
    first = reports[0]
    merged = replace(first, rows=[by_id[i] for i in ids if i in by_id], checkpoints=checkpoints,
                     native_skipped=native_skipped, seconds=time.perf_counter() - started)
    command = " ".join(["OMP_NUM_THREADS=1 python benchmarks/accuracy_matrix_shards.py", *sys.argv[1:]])
    if args.markdown:
        png = os.path.relpath(args.png.resolve(), args.markdown.resolve().parent) if args.png else None
        args.markdown.write_text(render_markdown(merged, command, png))
    if args.png:
        render_png(merged, args.png)
    if args.json:
        args.json.write_text(json.dumps(merged.to_json(), indent=2) + "\n")
    print(f"{len(merged.rows)} rows in {merged.seconds:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
