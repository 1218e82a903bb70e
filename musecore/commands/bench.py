"""``musecore bench --backend B [--case C] [--json]``: one command shape for every backend.

A backend package offers benchmarks through the ``musecore.benchmarks`` entry-point group: an entry
named after the backend whose object, called with no argument, returns ``{case: callable -> list of
rows}`` (the benchmark module is loaded only by this command, so the backend never imports it). Rows carry ``backend, case, shape, M, time_us,
speedup_vs_bf16, pct_memory_ceiling`` (ratios measured in the same process, never absolute claims).
While a case runs, stderr shows a running clock on a terminal, and one line per case elsewhere.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from musecore.cli import UsageError

COLUMNS = ("backend", "case", "format", "path", "shape", "M", "time_us", "speedup_vs_bf16", "pct_memory_ceiling")


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="run a backend's kernel and end-to-end benchmarks")
    p.add_argument("--backend", required=True, help="backend name (musecore doctor lists them)")
    p.add_argument("--case", action="append", help="case to run (repeatable; default: all but 'sweep')")
    p.add_argument("--out-dir", default="benchmarks/results", help="where <backend>_<case>.json is saved")
    p.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    p.set_defaults(run=run)


def run(args) -> int:
    from musecore.console import progress

    table = benchmark_cases(args.backend)
    cases = args.case or [c for c in table if c != "sweep"]
    unknown = [c for c in cases if c not in table]
    if unknown:
        raise UsageError(f"unknown case(s) {unknown} for backend {args.backend!r}; choose from {sorted(table)}")
    require_hardware(args.backend)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    all_rows = []
    for case in cases:  # progress on stderr: a running clock on a terminal, a line per case otherwise
        started = time.time()
        with progress(f"bench {args.backend} {case}", unit="row", enabled=not getattr(args, "quiet", False)) as stage:
            rows = table[case]()
            stage.update(len(rows))
        all_rows += rows
        (out_dir / f"{args.backend}_{case}.json").write_text(json.dumps(
            {"command": f"musecore bench --backend {args.backend} --case {case}",
             "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "rows": rows}, indent=1))
        if not args.json:
            print_table(f"{args.backend} {case} ({time.time() - started:.0f} s)", rows)
    if args.json:
        print(json.dumps(all_rows, indent=1))
    return 0


GROUP = "musecore.benchmarks"


def benchmark_cases(backend: str) -> dict:
    """``{case: callable}`` from the ``musecore.benchmarks`` entry point named ``backend``."""
    from stevedore import ExtensionManager

    from musecore.backends.registry import get_backend_class

    get_backend_class(backend)  # not installed / failed to load: that error, with its cause, first
    errors: list[str] = []
    ExtensionManager.ENTRY_POINT_CACHE.pop(GROUP, None)
    manager = ExtensionManager(GROUP, invoke_on_load=False,
                               on_load_failure_callback=lambda _m, ep, err: errors.append(
                                   f"{ep.name} = {ep.value}: {type(err).__name__}: {err}"))
    offered = [ext for ext in manager.extensions if ext.name == backend]
    if not offered:
        failed = [e for e in errors if e.startswith(f"{backend} = ")]
        if failed:
            raise UsageError(f"the benchmarks of backend {backend!r} failed to load ({failed[0]}); reinstall its package")
        raise UsageError(f"backend {backend!r} offers no benchmarks (no {GROUP!r} entry point named {backend!r})")
    table = offered[0].plugin()
    if not isinstance(table, dict) or not all(callable(f) for f in table.values()):
        raise UsageError(f"the {GROUP!r} entry point {backend!r} did not return a dict of case -> callable")
    return table


def require_hardware(backend: str) -> None:
    """A UsageError naming the probe's reason when ``backend``'s hardware is not here: its cases time that hardware
    (listing them, :func:`benchmark_cases`, needs none)."""
    from musecore.backends.registry import discover

    record = discover(probe=False)[backend]
    if record.probe is None or not record.probe.available:
        why = record.error or (record.probe.reason if record.probe else "its probe returned nothing")
        raise UsageError(f"musecore bench --backend {backend} needs that backend's hardware, and it is not here: {why}")


def print_table(title: str, rows: list[dict]) -> None:
    from rich.table import Table

    from musecore.console import data_console

    table = Table(title=title)
    for col in COLUMNS:
        table.add_column(col)
    for row in rows:  # a row that could not be measured says why where its shape goes
        row = {**row, "shape": f"{row.get('shape', '')} error: {row['error']}".strip()} if "error" in row else row
        table.add_row(*[f"{row[c]:.3g}" if isinstance(row.get(c), float) else str(row.get(c, "")) for c in COLUMNS])
    data_console().print(table)
