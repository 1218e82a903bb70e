"""``musecore matrix``: not built yet (see the open issues); registered so the CLI's verbs are stable."""

from __future__ import annotations

from musecore.cli import UsageError


def add_parser(sub) -> None:
    p = sub.add_parser("matrix", help="(not available yet)")
    p.set_defaults(run=run)


def run(args) -> int:
    raise UsageError("'musecore matrix' is not implemented yet")
