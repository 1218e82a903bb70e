"""``musecore bench``: not built yet (see the open issues); registered so the CLI's verbs are stable."""

from __future__ import annotations

from musecore.cli import UsageError


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="(not available yet)")
    p.set_defaults(run=run)


def run(args) -> int:
    raise UsageError("'musecore bench' is not implemented yet")
