"""``musecore doctor``: every discovered backend, loaded or failed and why, its hardware and score."""

from __future__ import annotations

import json


def add_parser(sub) -> None:
    p = sub.add_parser("doctor", help="list discovered backends: loaded or failed (with the traceback), hardware, score")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(run=run)


def run(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from musecore.backends.registry import discover

    records = discover()
    if args.json:
        print(json.dumps([r.to_dict() for r in records.values()], indent=2))
        return 0
    table = Table(title="musecore backends")
    for col in ("backend", "status", "score", "devices", "details"):
        table.add_column(col)
    for r in records.values():
        d = r.to_dict()
        status = "[red]failed[/]" if not r.loaded else ("[green]ready[/]" if d["available"] else "[yellow]no hardware[/]")
        table.add_row(r.name, status, str(d["score"]), ", ".join(d["devices"]), r.error or d["probe"])
    console = Console()
    console.print(table)
    for r in records.values():
        if r.traceback:
            console.print(f"\n[bold]{r.name}[/] traceback:\n{r.traceback}", markup=False, highlight=False)
    return 0
