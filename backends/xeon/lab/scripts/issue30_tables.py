"""Issue 30's tables: INT4 vs PyTorch BF16 over M for the 816B and muse-small linear shapes, and muse-small prefill
(512 tokens) INT4 vs BF16, through the backend's own benchmark cases (``musecore_xeon.bench``), written to JSON after
every shape (a run cut short by a time limit keeps what it measured), and rendered as the markdown ratio table.

    python backends/xeon/lab/scripts/issue30_tables.py linear --out DIR [--shapes 8192x2048 ...]
    python backends/xeon/lab/scripts/issue30_tables.py prefill --out DIR
    python backends/xeon/lab/scripts/issue30_tables.py table DIR/linear.json [DIR/prefill.json]

The committed AVX512_BF16 results come from ``musecore bench --backend xeon --case linear --case prefill``; this
driver is the same cases cut per shape for a time-limited device call (the AMX host).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def linear(out: Path, shapes: list[tuple[int, int]]) -> None:
    from musecore_xeon.bench import LINEAR_SHAPES, benchmarks
    from musecore_xeon.kernels import crossover, int4
    case = benchmarks()["linear"]
    rows: list[dict] = []
    for shape in shapes or LINEAR_SHAPES:
        started = time.time()
        rows += case(shapes=[shape])
        extra = {"calibrations": [c.table() for c in crossover.calibrations()],
                 "amx_vs_bf16dot": {str(k): v for k, v in int4.dense_picks().items()}}
        (out / "linear.json").write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows, **extra}, indent=1))
        print(f"{shape[0]}x{shape[1]}: {time.time() - started:.0f} s", flush=True)
        print(table(rows), flush=True)


def prefill(out: Path, layers: int | None) -> None:
    from musecore_xeon.bench import benchmarks
    rows = benchmarks()["prefill"](layers=layers)
    (out / "prefill.json").write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows}, indent=1))
    print(table(rows), flush=True)


def table(rows: list[dict]) -> str:
    """Markdown: INT4 speedup vs PyTorch BF16 per shape and M (path in brackets where not the small-M kernel)."""
    lines = []
    lin = [r for r in rows if r.get("case") == "linear" and r.get("impl") == "xeon-int4"]
    if lin:
        ms = sorted({r["M"] for r in lin})
        lines.append("| shape | " + " | ".join(f"M={m}" for m in ms) + " |")
        lines.append("|---" * (len(ms) + 1) + "|")
        for shape in dict.fromkeys(r["shape"] for r in lin):
            cells = []
            for m in ms:
                r = next((r for r in lin if r["shape"] == shape and r["M"] == m), None)
                if r is None:
                    cells.append("")
                    continue
                mark = "**" if r["speedup_vs_bf16"] < 1.0 else ""
                cells.append(f"{mark}{r['speedup_vs_bf16']:.2f}x{mark} {r['path']}")
            lines.append(f"| {shape} | " + " | ".join(cells) + " |")
    pre = [r for r in rows if r.get("case") == "prefill"]
    for r in pre:
        lines.append(f"prefill {r['shape']} {r['impl']}: {r['prefill_tokens_per_s']:.1f} tok/s, "
                     f"{r['speedup_vs_bf16']:.2f}x BF16 (threads {r.get('threads')}, load {r.get('load_avg_1m')})")
    if rows:
        r = rows[0]
        lines.append(f"host: {r.get('cpu')} isa={r.get('isa')} torch={r.get('torch_cpu_capability')} "
                     f"gemms={r.get('int4_gemms')} threads={r.get('threads')} load_avg_1m={r.get('load_avg_1m')}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("linear", "prefill", "table"))
    parser.add_argument("paths", nargs="*", help="table: JSON files to render")
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--shapes", nargs="*", default=[], help="NxK, default: bench.LINEAR_SHAPES")
    parser.add_argument("--layers", type=int, default=None, help="prefill: the first N decoder layers only")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.what == "linear":
        linear(args.out, [tuple(int(v) for v in s.split("x")) for s in args.shapes])
    elif args.what == "prefill":
        prefill(args.out, args.layers)
    else:
        rows = []
        for path in args.paths:
            data = json.loads(Path(path).read_text())
            rows += data["rows"] if isinstance(data, dict) else data
        print(table(rows))


if __name__ == "__main__":
    main()
