"""Progress on stderr: a bar on a terminal, one line per stage anywhere else.

tqdm redraws its bar with carriage returns; in a log file (``2>log``, a CI job) every redraw is
kept, hundreds of lines per stage. So a bar is drawn only when the stream is a terminal; anywhere
else each stage writes one line when it ends: what, how much, how long, and "stopped" when it did
not finish. Every long command of musecore-quant (inspect, convert, verify, diff) and of musecore
(bench, checkpoint loading) reports through this one helper; it lives here because musecore depends
on musecore_quant, not the reverse (``musecore.console`` re-exports it).

Example::

    with progress("verify", total=len(names), unit="weight") as bar:
        for name in names:
            ...
            bar.update(1)
"""

from __future__ import annotations

import sys
import threading
import time
from types import TracebackType
from typing import IO, Any, Optional

MODES = ("bar", "lines", "off")


def is_terminal(stream: Optional[IO]) -> bool:
    try:
        return bool(stream is not None and stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def _amount(n: float, unit: str, unit_scale: bool) -> str:
    if not unit_scale:
        return f"{n:g} {unit}"
    for prefix in ("", "k", "M", "G", "T"):
        if abs(n) < 1000 or prefix == "T":
            return f"{n:.1f} {prefix}{unit}" if prefix else f"{n:g} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


class Progress:
    """One stage: a tqdm bar (``mode='bar'``), one line when it ends (``'lines'``), or nothing (``'off'``)."""

    def __init__(self, desc: str, total: Optional[float] = None, unit: str = "it", *, mode: str = "lines",
                 stream: Optional[IO] = None, unit_scale: bool = False) -> None:
        if mode not in MODES:
            raise ValueError(f"progress mode {mode!r}; expected one of {MODES}")
        self.desc, self.total, self.unit, self.mode, self.unit_scale = desc, total, unit, mode, unit_scale
        self.stream = stream if stream is not None else sys.stderr
        self.count: float = 0
        self.postfix: dict[str, Any] = {}
        self.started = time.perf_counter()
        self._bar: Any = None
        self._ticking: Optional[threading.Event] = None
        if mode == "bar":
            from tqdm import tqdm
            self._bar = tqdm(total=total, desc=desc, unit=unit, unit_scale=unit_scale, file=self.stream,
                             dynamic_ncols=True)
            if total is None:  # a stage without steps (one benchmark case): keep its clock moving
                self._ticking = threading.Event()
                threading.Thread(target=self._tick, name="progress-clock", daemon=True).start()

    def _tick(self) -> None:
        while not self._ticking.wait(0.5):
            bar = self._bar
            if bar is not None:
                bar.refresh()

    def update(self, n: float = 1) -> None:
        self.count += n
        if self._bar is not None:
            self._bar.update(n)

    def set_postfix(self, **values: Any) -> None:
        """Shown beside the bar; the last values go at the end of the stage's line."""
        self.postfix = values
        if self._bar is not None:
            self._bar.set_postfix(**values)

    def line(self, finished: bool = True) -> str:
        """The one line a stage writes when not on a terminal."""
        seconds = time.perf_counter() - self.started
        if self.total is None and not self.count:  # a stage without a count: only its time
            what = f"{seconds:.1f} s"
        else:
            amount = _amount(self.count, self.unit, self.unit_scale)
            if self.total is not None and self.count != self.total:  # 4/10 weight; 1.2 MB of 3.0 MB
                amount = (f"{amount} of {_amount(self.total, self.unit, True)}" if self.unit_scale else
                          f"{self.count:g}/{self.total:g} {self.unit}")
            what = f"{amount} in {seconds:.1f} s"
        extra = "".join(f", {k} {v}" for k, v in self.postfix.items())
        return f"{self.desc}: {what}{extra}" if finished else f"{self.desc}: stopped after {what}{extra}"

    def close(self, finished: bool = True) -> None:
        if self._ticking is not None:
            self._ticking.set()
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self.mode == "lines":
            print(self.line(finished), file=self.stream, flush=True)
            self.mode = "off"  # once

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, kind: Optional[type], value: Optional[BaseException], tb: Optional[TracebackType]) -> None:
        self.close(finished=kind is None)


def progress(desc: str, total: Optional[float] = None, unit: str = "it", *, enabled: bool = True,
             stream: Optional[IO] = None, unit_scale: bool = False) -> Progress:
    """A stage's progress on ``stream`` (stderr): a bar on a terminal, one line at the end otherwise,
    nothing when ``enabled`` is False (``--no-progress``, ``--quiet``)."""
    stream = stream if stream is not None else sys.stderr
    mode = "off" if not enabled else "bar" if is_terminal(stream) else "lines"
    return Progress(desc, total, unit, mode=mode, stream=stream, unit_scale=unit_scale)
