"""INT4 weight-only linear layers on PyTorch's CPU kernel ``_weight_int4pack_mm_for_cpu``.

The kernel reads 4-bit codes in its own ISA-specific packing (``_convert_weight_to_int4pack_for_cpu``)
with per-group ``scales_and_zeros [K/g, N, 2]`` and computes ``(q - 8) * scale + zero`` with a float
zero. From the canonical QTensor (``w = (q - z) * scale``, z = 8 when symmetric) the codes are kept
as they are and ``zero = (8 - z) * scale`` (FORMATS.md). Scales keep their sign: AutoRound writes
negative ones. Only BF16 activations take the kernel's vectorised path, so activations are cast to
BF16 and scales/zeros stored in BF16 (the kernel requires the activation dtype there).

Above a measured crossover M the kernel is compute-bound; there the weight is dequantized a tile at a
time and multiplied by a dense GEMM. PyTorch's packing interleaves rows K-major and costs ~6x a BF16
tile upcast to unpack, so weights that take the dense path at some M keep a second, unpack-friendly
copy of the codes (+0.5 byte/weight, see :func:`split_k_halves`) and fp32 per-group scales/offsets;
weights whose crossover is None (the kernel wins at every M <= 256) drop it. The tile is written in
one pass by a small C loop (:mod:`musecore_xeon.kernels.native`), or by PyTorch ops without a compiler.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch

from musecore_quant.qtensor import QTensor
from musecore_xeon.kernels.crossover import (CALIBRATION_MS, INT4_CROSSOVER_ENV, PROXY_MAX_ROWS, CrossoverCalibration,
                                             cached_crossover, measure_crossover)
from musecore_xeon.kernels import native
from musecore_xeon.kernels.dense import restore_shape, tile_rows_for, tile_workspace, tiled_matmul

KERNEL_GROUP_SIZES: tuple[int, ...] = (32, 64, 128, 256)
PACK_ROWS = 64  # the largest packing block (AVX-512); rows are padded to it so every block is full
LOW_NIBBLES = 0x0F0F0F0F0F0F0F0F  # the low nibble of each byte of an int64 word
DENSE_COPY_MAX_M = max(CALIBRATION_MS)  # a crossover above this M never uses the dense copy in the measured range


@functools.cache
def int4pack_block_n() -> int:
    """Rows per block of this build's int4 packing, found by packing a known matrix.

    PyTorch packs full blocks of ``BLOCK_N`` output rows (64 with AVX-512, 32 with AVX2) as
    ``[N/BLOCK_N, K, BLOCK_N/2]`` bytes whose low nibble is row ``d`` and high nibble row
    ``d + BLOCK_N/2``. The dense fallback unpacks that layout, so it is checked here, not assumed.
    """
    n, k = 128, 64
    codes = (torch.arange(n * k, dtype=torch.int32).view(n, k) * 7 + torch.arange(n, dtype=torch.int32)[:, None]) % 16
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    for block_n in (64, 32, 16):
        blocks = codes.view(n // block_n, block_n, k).permute(0, 2, 1)  # [nb, K, BLOCK_N]
        half = block_n // 2
        expect = (blocks[..., :half] | (blocks[..., half:] << 4)).to(torch.uint8)
        if torch.equal(expect.flatten(), packed.flatten()):
            return block_n
    raise RuntimeError(f"torch {torch.__version__}: _convert_weight_to_int4pack_for_cpu uses a packing this "
                       "backend does not know (not [N/B, K, B/2] with B in 64/32/16); the INT4 dense fallback "
                       "cannot unpack it. Report this with the torch version.")


def unpack_codes(data: torch.Tensor) -> torch.Tensor:
    """Canonical uint8 ``[..., N, K/2]`` (low nibble = even k) -> int32 codes ``[..., N, K]``."""
    return torch.stack((data & 0xF, data >> 4), dim=-1).flatten(-2).to(torch.int32)


def split_k_halves(codes: torch.Tensor) -> torch.Tensor:
    """int codes ``[N, K]`` -> uint8 ``[N, K/2]``: low nibble = column k, high nibble = column k + K/2.

    The dense-tile path's copy of the codes. Unpacking it is two contiguous half-row writes per
    nibble (``& 0xF`` and ``>> 4`` into the two halves of each row, converted to the GEMM dtype on
    the way), where the canonical layout (even/odd k in one byte) or the kernel's packing would need
    strided or transposed writes.
    """
    half = codes.shape[1] // 2
    return (codes[:, :half] | (codes[:, half:] << 4)).to(torch.uint8)


def dense_scales_and_offsets(scales_and_zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 ``[K/g, N, 2]`` kernel scales/zeros -> fp32 ``scale [N, K/g, 1]`` and ``offset [N, K/g]``.

    ``w = q * scale + offset`` with ``offset = zero - 8 * scale`` equals the kernel's
    ``(q - 8) * scale + zero``: ``q * scale`` is exact in fp32 (4-bit times 8-bit mantissas) and
    ``offset`` is an exact difference of two bf16 values, so both round the same real number once.
    """
    sz = scales_and_zeros.float()
    scale, zero = sz[..., 0], sz[..., 1]
    return scale.T.contiguous().unsqueeze(-1), (zero - 8.0 * scale).T.contiguous()


def kernel_scales_and_zeros(scale: torch.Tensor, zero: Optional[torch.Tensor]) -> torch.Tensor:
    """fp16 ``scale [N, K/g]`` and true ``zero [N, K/g]`` (None = 8) -> bf16 ``[K/g, N, 2]`` for the kernel."""
    s = scale.float()
    offset = torch.zeros_like(s) if zero is None else (8.0 - zero.float()) * s  # (q-z)s = (q-8)s + (8-z)s
    return torch.stack((s, offset), dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)


@dataclass
class Int4Linear:
    """One INT4 weight ``[N, K]`` in the kernel's resident layout, and the path taken for each M.

    ``crossover``: rows M >= crossover run the tiled dense path (None: always the INT4 kernel).
    Rows are padded to a multiple of ``PACK_ROWS`` (zero scales) so every packing block is full;
    outputs are cut back to ``out_features``.
    """

    packed: torch.Tensor             # uint8 [N_padded, K/2] in the kernel's packing
    scales_and_zeros: torch.Tensor   # bf16 [K/g, N_padded, 2]
    group_size: int
    out_features: int
    in_features: int
    dense_dtype: torch.dtype = torch.float32
    crossover: Optional[int] = None
    calibration: Optional[CrossoverCalibration] = None
    # The dense-tile path's own copy (None until needed, dropped when the crossover is None):
    dense_codes: Optional[torch.Tensor] = None    # uint8 [N_padded, K/2], see split_k_halves
    dense_scale: Optional[torch.Tensor] = None    # fp32 [N_padded, K/g, 1]
    dense_offset: Optional[torch.Tensor] = None   # fp32 [N_padded, K/g]: w = q * scale + offset

    @property
    def padded_out_features(self) -> int:
        return self.packed.shape[0]

    @property
    def tile_rows(self) -> int:
        return tile_rows_for(self.in_features, self.padded_out_features, int4pack_block_n())

    @property
    def nbytes(self) -> int:
        """Resident bytes of the kernel's copy (what a decode step streams)."""
        return self.packed.numel() + self.scales_and_zeros.numel() * 2

    @property
    def dense_nbytes(self) -> int:
        """Extra resident bytes of the dense-tile copy (0 when it is not kept)."""
        return sum(t.numel() * t.element_size() for t in (self.dense_codes, self.dense_scale, self.dense_offset)
                   if t is not None)

    def keep_dense_copy(self) -> None:
        """Build the dense-tile copy from the kernel's packing (no-op when it exists)."""
        if self.dense_codes is None:
            codes = self.int4pack_codes_t(0, self.padded_out_features).T  # [N, K] uint8
            self.dense_codes = split_k_halves(codes)
        if self.dense_scale is None:
            self.dense_scale, self.dense_offset = dense_scales_and_offsets(self.scales_and_zeros)

    def drop_dense_copy(self) -> None:
        self.dense_codes = self.dense_scale = self.dense_offset = None

    def set_crossover(self, crossover: Optional[int], calibration: Optional[CrossoverCalibration] = None) -> None:
        """Use the dense path from ``crossover`` on; keep its copy only when it can be used."""
        self.crossover, self.calibration = crossover, calibration
        if crossover is None or crossover > DENSE_COPY_MAX_M:
            self.drop_dense_copy()
        else:
            self.keep_dense_copy()

    def uses_dense_tiles(self, m: int) -> bool:
        return self.crossover is not None and m >= self.crossover

    def run_kernel(self, x2d: torch.Tensor) -> torch.Tensor:
        """PyTorch's INT4 kernel on BF16 activations (the small-M path); returns bf16."""
        if x2d.dtype != torch.bfloat16 or not x2d.is_contiguous():
            x2d = x2d.to(torch.bfloat16).contiguous()
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2d, self.packed,
                                                       self.group_size, self.scales_and_zeros)
        return y if self.padded_out_features == self.out_features else y[:, :self.out_features]

    def int4pack_codes_t(self, n0: int, n1: int) -> torch.Tensor:
        """Codes ``[K, n1-n0]`` (uint8, view of a fresh buffer) unpacked from the kernel's packing.

        Only used to build the dense copy and as the reference it is tested against. The nibbles are
        split and transposed as int64 words (8 codes at a time): byte-wise, the packing's 16-row
        half-blocks make PyTorch copy 16-byte runs.
        """
        block_n, k = int4pack_block_n(), self.in_features
        rows, words = n1 - n0, block_n // 16  # int64 words per half-block of packed bytes
        packed = self.packed[n0:n1].reshape(-1).view(torch.int64).view(rows // block_n, k, words)
        codes = torch.empty(k, rows // block_n, 2 * words, dtype=torch.int64)  # bytes [K, nb, BLOCK_N]
        codes[:, :, :words].copy_((packed & LOW_NIBBLES).transpose(0, 1))         # rows d
        codes[:, :, words:].copy_(((packed >> 4) & LOW_NIBBLES).transpose(0, 1))  # rows d + BLOCK_N/2
        return codes.view(torch.uint8).view(k, rows)

    def use_native(self) -> bool:
        """The one-pass C dequantizer (fp32 tiles only; :mod:`musecore_xeon.kernels.native`)."""
        return self.dense_dtype == torch.float32 and native.available()

    def native_tile(self, n0: int, n1: int, workspace: torch.Tensor) -> torch.Tensor:
        """``q * scale + offset`` of rows ``n0:n1`` as fp32 ``[n1-n0, K]`` in ``workspace``, in one pass."""
        rows, k = n1 - n0, self.in_features
        return native.dequant_split_k(self.dense_codes[n0:n1], self.dense_scale[n0:n1], self.dense_offset[n0:n1],
                                      workspace[: rows * k].view(rows, k), self.group_size)

    def scaled_codes_tile(self, n0: int, n1: int, workspace: torch.Tensor, scratch: torch.Tensor,
                          with_offset: bool) -> torch.Tensor:
        """``q * scale`` (+ ``offset`` if ``with_offset``) of rows ``n0:n1`` as ``[n1-n0, K]`` in
        ``workspace``'s dtype, from the dense copy: four vectorised passes, the fp32 write done once.

        ``workspace`` (>= ``(n1-n0) * K`` elements) and ``scratch`` (uint8, >= ``(n1-n0) * K/2``)
        are reused across tiles: a fresh multi-MiB buffer per tile costs page faults on every call.
        """
        k, g = self.in_features, self.group_size
        rows, half = n1 - n0, k // 2
        codes = self.dense_codes[n0:n1]
        nibbles = scratch[: rows * half].view(rows, half)
        tile = workspace[: rows * k].view(rows, k)
        torch.bitwise_and(codes, 0xF, out=nibbles)
        tile[:, :half].copy_(nibbles)
        torch.bitwise_right_shift(codes, 4, out=nibbles)
        tile[:, half:].copy_(nibbles)
        groups = tile.view(rows, k // g, g)
        groups.mul_(self.dense_scale[n0:n1].to(tile.dtype))
        if with_offset:
            groups.add_(self.dense_offset[n0:n1, :, None].to(tile.dtype))
        return tile

    def run_tiles(self, x2d: torch.Tensor) -> torch.Tensor:
        """Dense GEMM on tiles dequantized one at a time into one reused buffer (the compute-bound path).

        In fp32 the per-group offsets are not added to the tiles (a full pass over each tile) but once
        to the output: ``x @ (q*s + o).T = x @ (q*s).T + xsum_g @ o.T`` with ``xsum_g`` the activation
        sums over each group (a ``[M, K/g] x [K/g, N]`` GEMM).
        """
        self.keep_dense_copy()
        k, g, tile_rows = self.in_features, self.group_size, self.tile_rows
        workspace = tile_workspace(k * tile_rows, self.dense_dtype)
        if self.use_native():
            # the C loop called directly on row offsets: per-tile Python overhead was ~10 us of a 50 us tile
            fn, groups = native.load().musecore_dequant_split_k, k // g
            codes, scale, offset = (t.data_ptr() for t in (self.dense_codes, self.dense_scale, self.dense_offset))
            full = workspace[: tile_rows * k].view(tile_rows, k)

            def tile_t(n0: int, n1: int) -> torch.Tensor:
                rows = n1 - n0
                fn(codes + n0 * (k // 2), scale + 4 * n0 * groups, offset + 4 * n0 * groups, full.data_ptr(), rows, k, g)
                return (full if rows == tile_rows else workspace[: rows * k].view(rows, k)).T

            y = tiled_matmul(x2d.to(torch.float32), self.padded_out_features, tile_rows, tile_t)
            return y if self.padded_out_features == self.out_features else y[:, :self.out_features]
        fold_offset = self.dense_dtype == torch.float32
        scratch = tile_workspace(k // 2 * tile_rows, torch.uint8, slot=1)
        x = x2d.to(self.dense_dtype)
        y = tiled_matmul(x, self.padded_out_features, tile_rows,
                         lambda n0, n1: self.scaled_codes_tile(n0, n1, workspace, scratch, not fold_offset).T)
        if fold_offset:
            y.addmm_(x.view(x.shape[0], k // g, g).sum(-1), self.dense_offset.T)
        return y if self.padded_out_features == self.out_features else y[:, :self.out_features]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The whole weight ``[N, K]`` from the dense copy, as the dense path sees it (tests, debugging)."""
        self.keep_dense_copy()
        n, k = self.padded_out_features, self.in_features
        if dtype == torch.float32 and self.use_native():
            return self.native_tile(0, n, torch.empty(n * k))[:self.out_features]
        w = self.scaled_codes_tile(0, n, torch.empty(n * k, dtype=dtype), torch.empty(n * k // 2, dtype=torch.uint8),
                                   with_offset=True)
        return w[:self.out_features]

    def dequantize_int4pack(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The whole weight ``[N, K]`` from the kernel's packing and scales (the reference for the copy)."""
        n, k, g = self.padded_out_features, self.in_features, self.group_size
        q = self.int4pack_codes_t(0, n).T.to(dtype)  # [N, K]
        sz = self.scales_and_zeros.to(dtype)  # [K/g, N, 2]
        scale = sz[..., 0].T.contiguous()
        offset = (sz[..., 1] - 8.0 * sz[..., 0]).T.contiguous()
        w = q.view(n, k // g, g).mul_(scale[..., None]).add_(offset[..., None]).view(n, k)
        return w[:self.out_features]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x2d = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        y = self.run_tiles(x2d) if self.uses_dense_tiles(x2d.shape[0]) else self.run_kernel(x2d)
        return restore_shape(y, x, self.out_features)


def check_int4_shape(in_features: int, group_size: int) -> None:
    """Raise with what to do when PyTorch's INT4 CPU kernel cannot take this weight."""
    if group_size not in KERNEL_GROUP_SIZES:
        raise ValueError(f"INT4 group size {group_size} is not supported by _weight_int4pack_mm_for_cpu "
                         f"(supported: {KERNEL_GROUP_SIZES}); requantize with group_size=128")
    if in_features % group_size:
        raise ValueError(f"INT4 in_features {in_features} is not a multiple of group size {group_size}")


def pack_int4(data: torch.Tensor, scale: torch.Tensor, zero: Optional[torch.Tensor], group_size: int,
              dense_dtype: torch.dtype, keep_dense_copy: bool = True) -> Int4Linear:
    """Canonical INT4 tensors of one weight (``data [N, K/2]``, ``scale``/``zero [N, K/g]``) -> resident.

    ``keep_dense_copy``: also build the dense-tile copy (dropped later by
    :meth:`Int4Linear.set_crossover` when the measured crossover is None).
    """
    n, k = data.shape[0], data.shape[1] * 2
    check_int4_shape(k, group_size)
    codes, sz = unpack_codes(data), kernel_scales_and_zeros(scale, zero)
    pad = -n % PACK_ROWS
    if pad:  # padded rows: code 8, scale 0, zero 0 -> weight 0, and every packing block is full
        codes = torch.cat((codes, torch.full((pad, k), 8, dtype=torch.int32)))
        sz = torch.cat((sz, torch.zeros(sz.shape[0], pad, 2, dtype=sz.dtype)), dim=1)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    lin = Int4Linear(packed, sz, group_size, n, k, dense_dtype)
    if keep_dense_copy:
        lin.dense_codes = split_k_halves(codes)
        lin.dense_scale, lin.dense_offset = dense_scales_and_offsets(sz)
    return lin


def int4_crossover(in_features: int, out_features: int, group_size: int,
                   dense_dtype: torch.dtype) -> CrossoverCalibration:
    """Measured M from which the tiled dense path beats the INT4 kernel (cached per shape class)."""
    proxy_rows = min(out_features + -out_features % PACK_ROWS, PROXY_MAX_ROWS)

    def measure() -> CrossoverCalibration:
        g = torch.Generator().manual_seed(0)
        data = torch.randint(0, 256, (proxy_rows, in_features // 2), dtype=torch.uint8, generator=g)
        scale = (torch.rand(proxy_rows, in_features // group_size, generator=g) * 0.02).half()
        proxy = pack_int4(data, scale, None, group_size, dense_dtype)
        return measure_crossover("int4", in_features, proxy_rows, proxy.run_kernel, proxy.run_tiles, torch.bfloat16)

    key = ("int4", in_features, proxy_rows, group_size, dense_dtype)
    return cached_crossover(key, INT4_CROSSOVER_ENV, "int4", in_features, proxy_rows, measure)


def prepare_int4(qt: QTensor, dense_dtype: torch.dtype, *, calibrate: bool = True) -> Int4Linear:
    """A 2-D canonical INT4 QTensor -> :class:`Int4Linear` with its measured crossover.

    Example::

        lin = prepare_int4(musecore_quant.quantize(w, "int4", group_size=128), torch.float32)
        y = lin(x_bf16)                     # [M, N]
    """
    if qt.format != "int4":
        raise ValueError(f"prepare_int4 takes an int4 QTensor; got format {qt.format!r}")
    if len(qt.shape) != 2:
        raise ValueError(f"prepare_int4 takes one [out, in] weight; got logical shape {qt.shape} "
                         "(stacked experts go through prepare_experts)")
    resident = pack_int4(qt.data, qt.scale, qt.zero, qt.group_size, dense_dtype)
    if calibrate:
        calibration = int4_crossover(resident.in_features, resident.out_features, qt.group_size, dense_dtype)
        resident.set_crossover(calibration.crossover, calibration)
    return resident
