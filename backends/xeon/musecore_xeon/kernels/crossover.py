"""Where the weight-streaming kernel stops paying off: the crossover M, measured, never guessed.

At small M a linear layer is bound by weight bytes, so PyTorch's INT4 kernel
(``_weight_int4pack_mm_for_cpu``) wins by reading a quarter of BF16's bytes. As M grows it turns
compute-bound (its inner loop dequantizes every weight for every block of rows), and a GEMM on
dequantized tiles can overtake it. Where that happens depends on the ISA, the thread count and K,
so it is measured on this machine for each *shape class* on a proxy weight (at most
``PROXY_MAX_ROWS`` output rows, ``int4.INT4_PROXY_MAX_ROWS`` for INT4: both paths are linear in N, but
cache effects are not, so the proxy cannot be too small) and cached per process.

``MUSECORE_XEON_INT4_CROSSOVER`` / ``MUSECORE_XEON_BF16_CROSSOVER`` override the measurement:
an integer M (rows >= M take the dense path) or ``none`` (never leave the small-M kernel).
``MUSECORE_XEON_BF16_GEMV_CROSSOVER`` does the same for the native BF16 GEMV against ``F.linear`` / the BF16
tiles: rows M below it take the GEMV (``1``: never; ``none``: every M).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable, Hashable, Optional

import torch

INT4_CROSSOVER_ENV = "MUSECORE_XEON_INT4_CROSSOVER"
BF16_CROSSOVER_ENV = "MUSECORE_XEON_BF16_CROSSOVER"
BF16_GEMV_CROSSOVER_ENV = "MUSECORE_XEON_BF16_GEMV_CROSSOVER"
CALIBRATION_MS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
PROXY_MAX_ROWS = 1024
RETIME_RATIO = 3.0  # a point where one path is within this factor of the other is timed twice
# ... and one within this factor gets CLOSE_CALL_ROUNDS more rounds, the two paths alternating: on a shared host a
# burst of another tenant's work can move one path's best-of-3 enough to pick the slower path (lab/NOTES.md). Each
# path keeps its best time over all rounds.
CLOSE_CALL_RATIO = 1.5
CLOSE_CALL_ROUNDS = 3
# A path measured slower at M than at the larger M measured before it by more than this fraction was stalled (fewer
# rows cannot cost more): that point gets CLOSE_CALL_ROUNDS more rounds too.
MONOTONE_SLACK = 0.10

_CACHE: dict[Hashable, "CrossoverCalibration"] = {}


@dataclass(frozen=True)
class CrossoverCalibration:
    """The measured (or overridden) crossover of one shape class, with the timings behind it."""

    kind: str
    in_features: int
    proxy_out_features: int
    threads: int
    crossover: Optional[int]  # rows >= crossover take the dense path; None: never
    source: str  # "measured" or "env NAME=VALUE"
    ms: tuple[int, ...] = ()
    small_m_us: tuple[float, ...] = ()
    dense_us: tuple[float, ...] = ()

    def table(self) -> str:
        lines = [f"{self.kind} K={self.in_features} proxy N={self.proxy_out_features} threads={self.threads}: "
                 f"crossover={self.crossover} ({self.source})"]
        for m, a, b in zip(self.ms, self.small_m_us, self.dense_us):
            lines.append(f"  M={m:4d}  kernel {a:10.1f} us  dense {b:10.1f} us  {'dense' if b < a else 'kernel'}")
        return "\n".join(lines)


def env_crossover(name: str) -> tuple[bool, Optional[int]]:
    """``(set, value)`` from environment variable ``name``: an integer M >= 1, or ``none``."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return False, None
    if raw.strip().lower() in ("none", "never", "off"):
        return True, None
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected an integer M (rows >= M use the dense path) or 'none'") from None
    if value < 1:
        raise ValueError(f"{name}={raw!r}: the crossover M must be >= 1 (or 'none')")
    return True, value


def dense_wins(small_us: float, dense_us: float, dense_margin: float = 0.0) -> bool:
    """The dense path is taken when it is faster, or slower by less than ``dense_margin`` (a fraction)."""
    return dense_us < small_us * (1.0 + dense_margin)


def pick_crossover(ms: tuple[int, ...], small_m_us: tuple[float, ...], dense_us: tuple[float, ...],
                   dense_margin: float = 0.0) -> Optional[int]:
    """The smallest measured M from which the dense path wins (:func:`dense_wins`) at every larger measured M too.

    Requiring a win at every larger M keeps one noisy point from flipping the decision, and makes
    the choice monotone: the kernel is used below, the dense path at and above.
    """
    crossover: Optional[int] = None
    for m, small, dense in sorted(zip(ms, small_m_us, dense_us), reverse=True):
        if dense_wins(small, dense, dense_margin):
            crossover = m
        else:
            break
    return crossover


def time_us(fn: Callable[[], object], repeats: int) -> float:
    """Best-of-``repeats`` wall time after one warm-up call; the minimum resists other load on the host."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e6


def measure_crossover(kind: str, in_features: int, proxy_out_features: int,
                      small_m_path: Callable[[torch.Tensor], torch.Tensor],
                      dense_path: Callable[[torch.Tensor], torch.Tensor], act_dtype: torch.dtype,
                      ms: tuple[int, ...] = CALIBRATION_MS, repeats: int = 3,
                      dense_margin: float = 0.0) -> CrossoverCalibration:
    """Time both paths on random activations ``[M, in_features]``, from the largest M down.

    The scan stops at the first M where the kernel wins, which is all :func:`pick_crossover` needs
    (a win at every larger M), so a shape whose kernel wins at M=256 costs one point, not nine.
    Every point that is not a clear win (the two within ``RETIME_RATIO`` of each other) is timed
    again, a close call (within ``CLOSE_CALL_RATIO``) ``CLOSE_CALL_ROUNDS`` more times, the paths alternating,
    and each path keeps its best time, whichever path won: one stall of either path (another
    process took the core) must not move the crossover, and a stalled dense path must not stop the
    scan early (the kernel would then run every M, far slower than BF16 at large M). So the point that ends
    the scan (the kernel wins there, by any ratio: a stalled dense path can look 10x slower) and any point where
    a path is slower than at the larger M before it (by more than ``MONOTONE_SLACK``: a stall, fewer rows cannot
    cost more) get the ``CLOSE_CALL_ROUNDS`` more rounds as well.
    """
    measured: list[tuple[int, float, float]] = []
    for m in sorted(ms, reverse=True):
        x = torch.randn(m, in_features, dtype=act_dtype)
        small, dense = time_us(lambda: small_m_path(x), repeats), time_us(lambda: dense_path(x), repeats)
        rounds = 1 if max(small, dense) < RETIME_RATIO * min(small, dense) else 0
        for _ in range(rounds):
            small = min(small, time_us(lambda: small_m_path(x), repeats))
            dense = min(dense, time_us(lambda: dense_path(x), repeats))
        stalled = bool(measured) and (small > measured[-1][1] * (1.0 + MONOTONE_SLACK)
                                      or dense > measured[-1][2] * (1.0 + MONOTONE_SLACK))
        if max(small, dense) < CLOSE_CALL_RATIO * min(small, dense) or stalled \
                or not dense_wins(small, dense, dense_margin):
            for _ in range(CLOSE_CALL_ROUNDS):
                small = min(small, time_us(lambda: small_m_path(x), repeats))
                dense = min(dense, time_us(lambda: dense_path(x), repeats))
        measured.append((m, small, dense))
        if not dense_wins(small, dense, dense_margin):
            break
    measured.reverse()
    m_seen, small_us, dense_us = (tuple(col) for col in zip(*measured))
    return CrossoverCalibration(kind, in_features, proxy_out_features, torch.get_num_threads(),
                                pick_crossover(m_seen, small_us, dense_us, dense_margin), "measured", m_seen, small_us,
                                dense_us)


def cached_crossover(key: Hashable, env_name: str, kind: str, in_features: int, proxy_out_features: int,
                     measure: Callable[[], CrossoverCalibration]) -> CrossoverCalibration:
    """The environment override if set, else the cached measurement of this shape class (measured once)."""
    is_set, value = env_crossover(env_name)
    if is_set:
        return CrossoverCalibration(kind, in_features, proxy_out_features, torch.get_num_threads(), value,
                                    f"env {env_name}={os.environ[env_name]}")
    full_key = (key, torch.get_num_threads())
    if full_key not in _CACHE:
        _CACHE[full_key] = measure()
    return _CACHE[full_key]


def calibrations() -> list[CrossoverCalibration]:
    """Every crossover measured so far in this process (for the benchmark report and debugging)."""
    return list(_CACHE.values())
