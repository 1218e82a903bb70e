"""How many threads PyTorch's CPU kernels get: the cores free now, not every core.

An OpenMP parallel region waits for its slowest thread, and a thread whose core another process
holds waits a whole scheduler slice, so on a shared CPU "one thread per core" can collapse. Measured
on a 2-core AMD EPYC shared with other jobs (1-minute load average 6-7), ``MUSECORE_NUM_THREADS=T
musecore generate --device D --prompt "def fibonacci(n):" --max-new-tokens 64 --json``, one process
per run, 1 and 2 threads interleaved, four runs each: xeon 195-320 tokens/s with 1 thread and 5-12
with 2; the reference path (``cpu``) 31-47 with 1 and 2-18 with 2. ``musecore serve`` measured the
other way round on the same machine and keeps every core (``musecore/commands/serve.py``).
What is known of the cause: the collapse is OpenMP's spin-waiting in the main thread. In one
process (load 7.5, 2 threads) generate ran 7-22 tokens/s from the main thread and 176-382 from a
worker thread (where the server's scheduler runs), and ``GOMP_SPINCOUNT=0`` (set before torch is
imported) lifted the main thread to 190-255; not yet made the default.

So the default is the cores this process may use (CPU affinity and the cgroup's CPU quota) minus
their share of the 1-minute load average, rounded, at least 1. ``MUSECORE_NUM_THREADS`` overrides
it: a number, or ``all`` for every usable core (what PyTorch does by itself). The load average lags
by up to a minute and counts this process's own earlier work too; pin the count when that matters.

Example::

    from musecore.threads import configure_threads
    configure_threads()        # the free cores; or configure_threads(4), or MUSECORE_NUM_THREADS=4
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import Optional

import torch

NUM_THREADS_ENV = "MUSECORE_NUM_THREADS"
log = logging.getLogger("musecore.threads")


def usable_cores() -> int:
    """Cores this process may run on: its CPU affinity, capped by a cgroup v2 CPU quota (``cpu.max``)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):  # no cgroup v2 quota to read
        pass
    return max(1, cores)


def free_cores(load: Optional[float] = None) -> int:
    """Usable cores minus their share of the 1-minute load average (the whole machine's), at least 1."""
    cores = usable_cores()
    if load is None:
        try:
            load = os.getloadavg()[0]
        except OSError:  # no load average on this platform
            return cores
    share = load * cores / max(os.cpu_count() or cores, cores)  # the load spread over all of the machine's CPUs
    return max(1, min(cores, math.floor(cores - share + 0.5)))


def thread_count(requested: Optional[int] = None) -> tuple[int, str]:
    """``(threads, why)``: ``requested``, else ``MUSECORE_NUM_THREADS`` (a number or ``all``), else the free cores."""
    if requested is not None:
        if not 1 <= requested <= max_threads():
            raise ValueError(f"thread count must be in 1..{max_threads()} (4x the {usable_cores()} usable cores); "
                             f"got {requested}")
        return requested, "asked for"
    raw = os.environ.get(NUM_THREADS_ENV, "").strip()
    if raw.lower() == "all":
        return usable_cores(), f"{NUM_THREADS_ENV}=all"
    if raw:
        try:
            count = int(raw)
        except ValueError:
            count = 0
        if count < 1:
            raise ValueError(f"{NUM_THREADS_ENV}={raw!r} is not a thread count; set it to a number >= 1 (e.g. 4), "
                             "to 'all' for every usable core, or unset it for the cores free now")
        if count > max_threads():  # thousands of OpenMP threads crash the process (libgomp, a segfault)
            raise ValueError(f"{NUM_THREADS_ENV}={raw} is over 4x this machine's {usable_cores()} usable cores "
                             f"({max_threads()}); set at most that, 'all' for every usable core, or unset it")
        return count, f"{NUM_THREADS_ENV}={raw}"
    ranks = local_ranks()  # torchrun's ranks on this host share its cores
    per_rank = f", shared by {ranks} ranks on this host" if ranks > 1 else ""
    try:
        load = os.getloadavg()[0]
    except OSError:
        return max(1, usable_cores() // ranks), f"every usable core (no load average on this platform){per_rank}"
    return (max(1, free_cores(load) // ranks),
            f"free cores: {usable_cores()} usable, 1-minute load average {load:.2f}{per_rank}")


def max_threads() -> int:
    """The most threads musecore sets: 4x the usable cores (more only oversubscribes; thousands crash OpenMP)."""
    return 4 * usable_cores()


def local_ranks() -> int:
    """How many ranks of a ``torchrun`` launch run on this host (``LOCAL_WORLD_SIZE``; 1 outside one)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def configure_threads(requested: Optional[int] = None) -> int:
    """Set PyTorch's intra-op threads (see the module doc) and return the count."""
    count, why = thread_count(requested)
    torch.set_num_threads(count)
    log.info("using %d CPU thread(s) (%s)", count, why)
    return count
