"""The ``musecore`` command line: one subcommand per module in ``musecore/commands/``.

Each command module defines ``add_parser(subparsers)`` and ``run(args) -> int``. Read commands
take ``--json``; errors a user can fix print one line (no traceback) and exit 2
(``--debug`` or ``MUSECORE_DEBUG=1`` shows the traceback instead). A mistyped option or command
gets the closest valid one suggested (Python 3.11's argparse suggests nothing). ``-v``/``-vv``
and ``--quiet`` set the level of the ``musecore`` loggers (default: warnings); they work before or
after the command name. ``python -m musecore`` runs the same. Commands that run a model set PyTorch's
CPU threads to the cores free now (``musecore.threads``; ``MUSECORE_NUM_THREADS`` overrides).
"""

from __future__ import annotations

import argparse
import difflib
import errno
import importlib
import logging
import os
import sys
from typing import Any, Optional, Sequence

COMMANDS = ("generate", "chat", "serve", "plan", "devices", "doctor", "matrix", "bench")
# CPU threads set from the free cores (musecore.threads); serve chooses its own (commands/serve.py says why)
RUNS_MODELS = ("generate", "chat", "matrix", "bench")


class UsageError(Exception):
    """A problem with the user's input: printed as one line, exit code 2."""


def version() -> str:
    from importlib.metadata import PackageNotFoundError, version as dist_version

    try:
        return dist_version("musecore")
    except PackageNotFoundError:  # a source tree that was never installed
        return "unknown (not installed)"


def add_common_options(parser: argparse.ArgumentParser, default: object = None) -> None:
    """``-v``, ``--quiet``, ``--debug``: on the top-level parser (defaults) and on every command
    (``SUPPRESS``ed defaults, so ``musecore -v generate`` and ``musecore generate -v`` both work)."""
    parser.add_argument("-v", "--verbose", action="count", default=0 if default is None else default,
                        help="more log output: -v info, -vv debug")
    parser.add_argument("-q", "--quiet", action="store_true", default=False if default is None else default,
                        help="only errors in the log output")
    parser.add_argument("--debug", action="store_true", default=False if default is None else default,
                        help="show the traceback of an error (as MUSECORE_DEBUG=1 does)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="musecore", description="Run Muse Spark Open on whatever hardware you have.")
    parser.add_argument("--version", action="version", version=f"musecore {version()}")
    add_common_options(parser)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        module = importlib.import_module(f"musecore.commands.{name}")
        module.add_parser(sub)
        add_common_options(sub.choices[name], default=argparse.SUPPRESS)
    return parser


def suggest(word: str, choices: Sequence[str]) -> str:
    """"; did you mean X?" for the closest choice, or "" when none is close."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else ""


def parse(parser: argparse.ArgumentParser, argv: Optional[Sequence[str]]) -> argparse.Namespace:
    """``parser.parse_args`` with a suggestion for a mistyped command or option (exit 2, one line)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    words = [a for a in argv if not a.startswith("-")]
    if words and words[0] not in commands and argv.index(words[0]) == _first_positional(argv):
        parser.exit(2, f"musecore: error: unknown command {words[0]!r}{suggest(words[0], commands)} "
                       f"(commands: {', '.join(commands)})\n")
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        command = commands[args.command]
        options = [o for action in command._actions for o in action.option_strings]
        first = unknown[0]
        hint = suggest(first.split("=", 1)[0], options) if first.startswith("-") else ""
        parser.exit(2, f"musecore {args.command}: error: unrecognized argument {first!r}{hint} "
                       f"(musecore {args.command} --help lists the options)\n")
    return args


def _first_positional(argv: list[str]) -> int:
    """Index of the command name: the first word not starting with '-' (top-level options take no value)."""
    return next(i for i, a in enumerate(argv) if not a.startswith("-"))


def configure_logging(args: argparse.Namespace) -> None:
    level = logging.ERROR if args.quiet else {0: logging.WARNING, 1: logging.INFO}.get(args.verbose, logging.DEBUG)
    logger = logging.getLogger("musecore")
    logger.setLevel(level)
    for old in [h for h in logger.handlers if getattr(h, "musecore_cli", False)]:
        logger.removeHandler(old)  # main() may run more than once in a process (tests): write to today's stderr
    handler = logging.StreamHandler(sys.stderr)
    handler.musecore_cli = True  # type: ignore[attr-defined]
    handler.setFormatter(logging.Formatter("%(name)s: %(levelname)s: %(message)s"))
    logger.addHandler(handler)


def user_errors() -> tuple[type, ...]:
    """Errors a user can act on, printed as one line: bad input, a plan with gaps, a backend that is
    missing or broken, a compile cache other users can write to."""
    from musecore.backends.registry import BackendError
    from musecore.compile_cache import CacheError
    from musecore.distributed import DistributedError
    from musecore.planning import PlanError

    return (UsageError, FileNotFoundError, ValueError, PlanError, BackendError, CacheError, DistributedError)


STORAGE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.EEXIST)


def debug_requested(args: Any = None) -> bool:
    """``--debug``, or ``MUSECORE_DEBUG`` set to anything but empty or 0: show tracebacks."""
    return bool(getattr(args, "debug", False)) or os.environ.get("MUSECORE_DEBUG", "") not in ("", "0")


def say_error(command: str, message: str) -> int:
    """One whole line on stderr (one write: under torchrun every rank reports, and print's two writes, the text and
    the newline, interleaved two ranks' errors on one line; each line names its rank there); exit status 2."""
    rank = f"[rank {os.environ.get('RANK', '?')}] " if os.environ.get("WORLD_SIZE", "1") not in ("", "1") else ""
    sys.stderr.write(f"{rank}musecore {command}: error: {message}\n")
    sys.stderr.flush()
    return 2


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        args = parse(build_parser(), argv)
    except SystemExit as e:  # --help, --version, usage errors: argparse's exit status
        return int(e.code or 0)
    configure_logging(args)
    try:
        if args.command in RUNS_MODELS:  # the reference path's threads too, not only the xeon backend's
            from musecore.threads import configure_threads
            configure_threads()
        return int(args.run(args) or 0)
    except user_errors() as e:
        if debug_requested(args):  # the full traceback, for bug reports
            raise
        return say_error(args.command, str(e))
    except BrokenPipeError:  # `musecore ... | head`: the reader left; not an error of ours (before OSError: a subclass)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # Python flushes stdout at exit: let that flush go nowhere
        return 0
    except OSError as e:  # a full disk, a read-only place, a file where a folder goes: the user's to fix, one line
        if e.errno not in STORAGE_ERRNOS or debug_requested(args):
            raise
        where = e.filename or "the output"
        fix = ("a file is in the way of a folder: remove it or write somewhere else"
               if e.errno in (errno.ENOTDIR, errno.EEXIST) else "free space or write somewhere else")
        return say_error(args.command, f"cannot write {where}: {e.strerror}; {fix}")
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
