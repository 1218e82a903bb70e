"""Dense linear layers on the CPU, and the tiled GEMM that large-M INT4 falls back to.

PyTorch's BF16 matmul is only fast where oneDNN has a hardware BF16 dot product (AVX-512 BF16 or
AMX). Elsewhere (AVX2, e.g. AMD EPYC Milan) it runs about one GEMV per row: fine for decode, where
the weight read dominates, but ~5x slower than fp32 SGEMM at M=256. So a BF16 weight keeps its
BF16 bytes (half the memory and bandwidth of fp32) and, from a measured crossover M on, is
upcast tile by tile (a few MiB at a time, never the whole weight) into fp32 for SGEMM. INT4 weights
reuse the same tiled GEMM with a dequantizing tile producer.

At decode sizes a BF16 weight runs the native BF16 GEMV (:class:`musecore_xeon.kernels.native.Bf16Gemv`) wherever it
was measured faster than the path it replaces: PyTorch's BF16 ``F.linear`` streams the weight well below the
memory bandwidth at M = 1 on AVX2 (lab/NOTES.md: numbers). Order of the paths by M: the
native GEMV below ``gemv_crossover``, ``F.linear`` below ``crossover``, fp32 tiles from there on; both crossovers
are measured on this machine (:mod:`crossover`), never guessed.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from musecore_xeon.kernels import native
from musecore_xeon.kernels.crossover import (BF16_CROSSOVER_ENV, BF16_GEMV_CROSSOVER_ENV, PROXY_MAX_ROWS,
                                             CrossoverCalibration, cached_crossover, measure_crossover)

# M at which the native BF16 GEMV is timed against the other paths (M above the largest never takes it: not
# measured). Its time grows with M (every pair of activation rows re-reads the weight, from L1 after the first
# pair), so the tiles' SGEMM overtakes it somewhere in this range or above it.
BF16_GEMV_CALIBRATION_MS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
# A near-tie on the proxy goes to the path the GEMV would replace (as INT4_DENSE_MARGIN does for the INT4 tiles): the
# GEMV must be more than this much faster: a near-tie on the proxy was a loss at full size (lab/NOTES.md).
BF16_GEMV_DENSE_MARGIN = 0.10

# Elements per dense tile: 2 Mi (8 MiB in fp32): thinner tiles make the GEMM too thin, larger ones fall out of
# cache (lab/NOTES.md).
DENSE_TILE_ELEMENTS = 2 * 1024 * 1024
# Where the tiles feed a native BF16 GEMM (AMX / AVX-512 BF16: oneDNN), its per-call cost favours larger ones; 8 Mi
# takes most of the gain of larger tiles with a quarter of 32 Mi's workspace (lab/NOTES.md).
NATIVE_BF16_TILE_ELEMENTS = 8 * 1024 * 1024


def dense_compute_dtype(native_bf16_dot: bool) -> torch.dtype:
    """BF16 where the hardware multiplies it natively, else fp32 (SGEMM beats emulated BF16 GEMM)."""
    return torch.bfloat16 if native_bf16_dot else torch.float32


def tile_rows_for(in_features: int, out_features: int, multiple: int, elements: Optional[int] = None) -> int:
    """Output rows per tile: ``elements / K`` (default :data:`DENSE_TILE_ELEMENTS`), a multiple of ``multiple``,
    at most N."""
    elements = DENSE_TILE_ELEMENTS if elements is None else elements
    rows = max(multiple, (elements // max(in_features, 1)) // multiple * multiple)
    return min(rows, out_features)


_WORKSPACES = threading.local()


def tile_workspace(numel: int, dtype: torch.dtype, slot: int = 0) -> torch.Tensor:
    """A reused 1-D buffer of at least ``numel`` elements, one per (thread, dtype, slot).

    A fresh multi-MiB ``torch.empty`` per call is a fresh mmap, and writing it page-faults every
    page (measured 170 us for an 8 MiB tile at K=2048, ~40% of the tile's dequantization), so the
    tiled paths keep their largest tile buffer per thread (at most one 8 MiB tile per dtype).
    Valid until the next call with the same key on this thread: callers use it within one call.
    Always a normal tensor, even when first asked for under ``torch.inference_mode`` (generation):
    an inference tensor could not be written by a later call outside it (loading a model calibrates).
    """
    buffers = _WORKSPACES.__dict__.setdefault("buffers", {})
    buf = buffers.get((dtype, slot))
    if buf is None or buf.numel() < numel:
        with torch.inference_mode(False):
            buf = buffers[(dtype, slot)] = torch.empty(numel, dtype=dtype)
    return buf


def tiled_matmul(x: torch.Tensor, out_features: int, tile_rows: int,
                 tile_t: Callable[[int, int], torch.Tensor]) -> torch.Tensor:
    """``x [M,K] @ W.T`` where ``tile_t(n0, n1)`` yields ``W[n0:n1].T`` as a ``[K, n1-n0]`` tensor.

    Only one tile of the dense weight exists at a time; the GEMM writes straight into the output.
    """
    out = torch.empty(x.shape[0], out_features, dtype=x.dtype)
    for n0 in range(0, out_features, tile_rows):
        n1 = min(n0 + tile_rows, out_features)
        torch.mm(x, tile_t(n0, n1), out=out[:, n0:n1])
    return out


def restore_shape(y: torch.Tensor, x: torch.Tensor, out_features: int) -> torch.Tensor:
    """``y [M, N]`` back to ``x``'s leading dims and dtype (each step skipped when already so: decode
    makes thousands of these calls per token, and every no-op dispatch costs microseconds)."""
    if y.dtype != x.dtype:
        y = y.to(x.dtype)
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], out_features)


@dataclass
class DenseLinear:
    """A resident dense weight ``[N, K]`` (BF16 or fp32) and how ``x @ W.T`` runs for each M.

    ``crossover`` is None for fp32 weights and on CPUs with native BF16 (one path is best there);
    for BF16 weights on other CPUs it is the measured M from which tiles are upcast to fp32.
    ``gemv`` (BF16 weights, native kernels built) runs rows M < ``gemv_crossover`` (None: every M), set by
    :meth:`set_gemv_crossover` from a measurement; without it the native GEMV is never used.
    """

    weight: torch.Tensor
    crossover: Optional[int] = None
    calibration: Optional[CrossoverCalibration] = None
    gemv: Optional[native.Bf16Gemv] = field(default=None, repr=False)
    gemv_crossover: Optional[int] = None
    gemv_calibration: Optional[CrossoverCalibration] = None
    tile_rows: int = field(init=False)
    gemv_below_numel: int = field(init=False, default=0)  # x.numel() below which the native GEMV runs (0: never)

    def __post_init__(self) -> None:
        self.tile_rows = tile_rows_for(self.in_features, self.out_features, 64)

    def set_gemv_crossover(self, crossover: Optional[int], calibration: Optional[CrossoverCalibration] = None) -> None:
        """Run the native BF16 GEMV for M < ``crossover`` (None: every M; 1: never) and bind it to the weight."""
        self.gemv_crossover, self.gemv_calibration = crossover, calibration
        if crossover is not None and crossover <= 1:
            self.gemv, self.gemv_below_numel = None, 0
            return
        if self.gemv is None:
            self.gemv = native.Bf16Gemv(self.weight)
        self.gemv_below_numel = (1 << 62) if crossover is None else crossover * self.in_features

    def uses_gemv(self, m: int) -> bool:
        return m * self.in_features < self.gemv_below_numel

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    def uses_dense_tiles(self, m: int) -> bool:
        return self.crossover is not None and m >= self.crossover

    def run_gemv(self, x2d: torch.Tensor) -> torch.Tensor:
        """The native BF16 GEMV (bound on first use; bf16/fp32 x, output in x's dtype)."""
        if self.gemv is None:
            self.gemv = native.Bf16Gemv(self.weight)
        x2d = x2d if x2d.dtype in (torch.bfloat16, torch.float32) else x2d.to(torch.bfloat16)
        return self.gemv.call(x2d.contiguous())

    def run_large_m(self, x2d: torch.Tensor) -> torch.Tensor:
        """The path without the native GEMV: ``F.linear`` below ``crossover``, the fp32 tiles from it on."""
        return self.run_tiles(x2d) if self.uses_dense_tiles(x2d.shape[0]) else self.run_direct(x2d)

    def run_direct(self, x2d: torch.Tensor) -> torch.Tensor:
        """PyTorch's own matmul in the weight's dtype (the bandwidth-bound path)."""
        return F.linear(x2d if x2d.dtype == self.weight.dtype else x2d.to(self.weight.dtype), self.weight)

    def run_tiles(self, x2d: torch.Tensor) -> torch.Tensor:
        """fp32 SGEMM on weight tiles upcast one at a time into one reused buffer (the compute-bound path)."""
        workspace = tile_workspace(self.tile_rows * self.in_features, torch.float32)

        def upcast_tile_t(n0: int, n1: int) -> torch.Tensor:
            tile = workspace[: (n1 - n0) * self.in_features].view(n1 - n0, self.in_features)
            return tile.copy_(self.weight[n0:n1]).T

        return tiled_matmul(x2d.float(), self.out_features, self.tile_rows, upcast_tile_t)

    def path(self, m: int) -> str:
        """The path rows ``m`` take (benchmark tables, tests)."""
        return "native" if self.uses_gemv(m) else "tiles" if self.uses_dense_tiles(m) else "F.linear"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() < self.gemv_below_numel and (x.dtype is torch.bfloat16 or x.dtype is torch.float32) \
                and x.is_contiguous():
            return self.gemv.call(x)  # the decode path: any leading dims, no reshape, output in x's dtype
        x2d = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        m = x2d.shape[0]
        y = self.run_gemv(x2d) if self.uses_gemv(m) else self.run_large_m(x2d)
        return restore_shape(y, x, self.out_features)


def bf16_crossover(in_features: int, out_features: int) -> CrossoverCalibration:
    """Measured M from which upcasting BF16 tiles to fp32 beats PyTorch's BF16 matmul (cached per K, N class)."""
    proxy_rows = min(out_features, PROXY_MAX_ROWS)

    def measure() -> CrossoverCalibration:
        proxy = DenseLinear(torch.randn(proxy_rows, in_features, dtype=torch.bfloat16))
        return measure_crossover("bf16", in_features, proxy_rows, proxy.run_direct, proxy.run_tiles, torch.bfloat16)

    return cached_crossover(("bf16", in_features, proxy_rows), BF16_CROSSOVER_ENV, "bf16", in_features,
                            proxy_rows, measure)


def bf16_gemv_crossover(in_features: int, out_features: int, tiles_crossover: Optional[int]) -> CrossoverCalibration:
    """Measured M from which the native BF16 GEMV stops beating the path it replaces (``F.linear``, or the fp32
    tiles from ``tiles_crossover`` on), on a proxy of at most ``PROXY_MAX_ROWS`` rows; cached per (K, N class,
    tiles crossover). Where the GEMV wins at every measured M, the crossover is one past the largest (never
    extrapolated); where it loses at M = 1, it is 1 (never used)."""
    proxy_rows = min(out_features, PROXY_MAX_ROWS)

    def measure() -> CrossoverCalibration:
        proxy = DenseLinear(torch.randn(proxy_rows, in_features, dtype=torch.bfloat16), crossover=tiles_crossover)
        calibration = measure_crossover("bf16-gemv", in_features, proxy_rows, proxy.run_gemv, proxy.run_large_m,
                                        torch.bfloat16, ms=BF16_GEMV_CALIBRATION_MS,
                                        dense_margin=BF16_GEMV_DENSE_MARGIN)
        if calibration.crossover is None:  # won at every measured M: used up to the largest, not beyond
            calibration = dataclasses.replace(calibration, crossover=max(BF16_GEMV_CALIBRATION_MS) + 1)
        return calibration

    return cached_crossover(("bf16-gemv", in_features, proxy_rows, tiles_crossover), BF16_GEMV_CROSSOVER_ENV,
                            "bf16-gemv", in_features, proxy_rows, measure)


def prepare_dense(weight: torch.Tensor, dtype: torch.dtype, native_bf16_dot: bool, *,
                  calibrate: bool = True) -> DenseLinear:
    """Keep ``weight`` as ``dtype`` (bf16 or fp32) and decide its paths by M (measured).

    ``calibrate=False`` skips the measurements (tables that are only gathered, e.g. embeddings): such a weight
    never takes the native GEMV or the tiles.
    """
    if dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"xeon dense weights are kept in bfloat16 or float32; got {dtype}. "
                         "Pass dtype=torch.bfloat16 (fp16 weights are converted to it).")
    if weight.dim() != 2:
        raise ValueError(f"a linear weight must be 2-D [out, in]; got shape {tuple(weight.shape)}")
    resident = DenseLinear(weight.to(dtype).contiguous())
    if calibrate and dtype == torch.bfloat16 and not native_bf16_dot:
        resident.calibration = bf16_crossover(resident.in_features, resident.out_features)
        resident.crossover = resident.calibration.crossover
    if calibrate and dtype == torch.bfloat16 and native.available():
        calibration = bf16_gemv_crossover(resident.in_features, resident.out_features, resident.crossover)
        resident.set_gemv_crossover(calibration.crossover, calibration)
    return resident
