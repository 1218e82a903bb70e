"""The rich console every command prints its tables with.

Data is printed literally: markup is off, so text in square brackets (CPU flags, error messages,
paths) is never taken for a style tag and eaten. On a terminal tables fit the window; otherwise
(a pipe, a file, a CI log) nothing is cut or wrapped to 80 columns: the width is unbounded and
there is no colour, so ``musecore devices | cat`` and ``musecore bench ... > file`` keep every column.

Progress goes to stderr through :func:`progress` (musecore_quant's helper, shared so that both
command lines behave alike): a bar on a terminal, one line per stage otherwise (no carriage-return
floods in logs), nothing with ``--quiet``.
"""

from __future__ import annotations

import sys
from typing import IO, Optional

from musecore_quant.progress import Progress, progress  # noqa: F401  (re-exported: musecore's one entry)
from rich.console import Console

UNBOUNDED = 10_000  # "as wide as the content": rich needs a number


def is_terminal(stream: Optional[IO] = None) -> bool:
    stream = stream if stream is not None else sys.stdout
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


class DataConsole(Console):
    """rich's Console, except that a reader who left (``musecore devices | head``) is not an error: rich exits
    with status 1 there; this raises BrokenPipeError, which the command line ends with status 0."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        raise BrokenPipeError


def data_console(file: Optional[IO] = None) -> Console:
    """A console for data: no markup, no highlighting; full width and no colour when not a terminal."""
    out = file if file is not None else sys.stdout
    if is_terminal(out):
        return DataConsole(file=out, markup=False, highlight=False)
    return DataConsole(file=out, markup=False, highlight=False, width=UNBOUNDED, color_system=None, soft_wrap=True)
