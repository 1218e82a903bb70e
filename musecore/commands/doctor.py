"""``musecore doctor``: every discovered backend, loaded or broken and why (an import or probe that
raised, exited, hung past ``$MUSECORE_PLUGIN_TIMEOUT`` or returned a malformed Probe), its hardware
and score, the real chips each backend's kernels have run on (and those they never have: said on any host, not only
on that chip's), and the environment variables each backend reads that are set now (they change kernel choices)."""

from __future__ import annotations

import json


def add_parser(sub) -> None:
    p = sub.add_parser("doctor", help="list discovered backends: loaded or failed (with the traceback), hardware, score")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(run=run)


def run(args) -> int:
    from rich.table import Table
    from rich.text import Text

    from musecore.backends.registry import discover, resolve_all
    from musecore.console import data_console

    records = resolve_all(discover())
    env = {name: settings(r) for name, r in records.items()}
    rows = {name: r.to_dict() for name, r in records.items()}
    if args.json:
        print(json.dumps([{**rows[name], "env": [vars(e) for e in env[name]]} for name in records], indent=2))
        return 0
    table = Table(title="musecore backends")
    for col in ("backend", "status", "score", "devices", "details"):
        table.add_column(col)
    for r in records.values():
        d = rows[r.name]
        status = (Text("failed", style="red") if not r.loaded else
                  Text("ready", style="green") if d["available"] else Text("no hardware", style="yellow"))
        table.add_row(r.name, status, str(d["score"]), ", ".join(d["devices"]), r.error or d["probe"])
    ran = Table(title="real hardware each backend's kernels have run on")
    for col in ("backend", "verified on"):
        ran.add_column(col)
    for r in records.values():
        if r.loaded:
            ran.add_row(r.name, rows[r.name]["verified_on"] or "not stated by the plugin (Backend.verified_on)")
    console = data_console()
    console.print(table)
    console.print(ran)
    overrides = [(name, e) for name, found in env.items() for e in found if e.value is not None]
    if overrides:
        shown = Table(title="environment overrides in force")
        for col in ("backend", "variable", "value", "default", "effect"):
            shown.add_column(col)
        for name, e in overrides:
            shown.add_row(name, e.name, e.value, e.default, e.effect)
        console.print(shown)
    for r in records.values():
        if r.traceback:
            console.print(f"\n{r.name} traceback:\n{r.traceback}")
    return 0


def settings(record) -> list:
    """The backend's ``env_settings()``, called in isolation as its probe is (a timeout, every exception
    caught): a plugin whose method raises or hangs is reported, not fatal."""
    if not record.loaded:
        return []
    from musecore.backends.base import EnvSetting
    from musecore.backends.registry import call_isolated

    cls = record.backend_class
    done = call_isolated(lambda: list(cls().env_settings()), f"backend {record.name!r}: env_settings()",
                         (record.name, record.target + " env_settings"))
    if done.error is not None:  # the plugin's bug, shown as such
        return [EnvSetting("?", done.error, "", "plugin error")]
    return done.value
