"""Helpers the backends' benchmarks share (``musecore bench``): timing weights cold.

A weight called back to back stays in the last-level cache (a GPU's L2, a CPU's L3), so a
bandwidth-bound kernel would look faster than it runs in a model, where every layer's weights evict
the others'. The benchmarks therefore cycle through independent copies of each weight whose bytes
together exceed the cache, and take one call's time as the cycle's time over the number of copies.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable, Sequence, Union


def copies_needed(nbytes_per_copy: int, total_bytes: int, min_copies: int = 1) -> int:
    """How many copies of ``nbytes_per_copy`` bytes reach ``total_bytes``; at least ``min_copies``."""
    return max(min_copies, math.ceil(total_bytes / max(nbytes_per_copy, 1)))


def rotating(make: Callable[[], Any], nbytes_per_copy: int, total_bytes: int, min_copies: int = 1) -> list[Any]:
    """Independent objects from ``make()`` (each must own its memory), :func:`copies_needed` of them."""
    return [make() for _ in range(copies_needed(nbytes_per_copy, total_bytes, min_copies))]


def cycle(objs: Sequence[Any], call: Callable[[Any], object]) -> Callable[[], None]:
    """One ``call`` on each object in turn: time it and divide by ``len(objs)`` for one cold call."""
    def run() -> None:
        for obj in objs:
            call(obj)
    return run


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), for the hardware record of a benchmark's JSON."""
    import platform
    from pathlib import Path
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def write_rows(path: Union[str, Path], rows: Sequence[dict]) -> Path:
    """``rows`` as a JSON list at ``path``, one row per line (diffs of result files stay row by row); its folder is
    made first."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("[\n" + ",\n".join(json.dumps(r) for r in rows) + "\n]\n")
    return path
