"""The ``musecore`` command line: one subcommand per module in ``musecore/commands/``.

Each command module defines ``add_parser(subparsers)`` and ``run(args) -> int``. Read commands
take ``--json``; errors a user can fix print one line (no traceback) and exit 2
(``MUSECORE_DEBUG=1`` shows the traceback instead).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Optional, Sequence

COMMANDS = ("generate", "chat", "serve", "plan", "devices", "doctor", "matrix", "bench")


class UsageError(Exception):
    """A problem with the user's input: printed as one line, exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="musecore", description="Run Muse Spark Open on whatever hardware you have.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        module = importlib.import_module(f"musecore.commands.{name}")
        module.add_parser(sub)
    return parser


def user_errors() -> tuple[type, ...]:
    """Errors a user can act on, printed as one line: bad input, a plan with gaps, a backend that is
    missing or broken, a compile cache other users can write to."""
    from musecore.backends.registry import BackendError
    from musecore.compile_cache import CacheError
    from musecore.planning import PlanError

    return (UsageError, FileNotFoundError, ValueError, PlanError, BackendError, CacheError)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except user_errors() as e:
        if os.environ.get("MUSECORE_DEBUG"):  # the full traceback, for bug reports
            raise
        print(f"musecore {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
