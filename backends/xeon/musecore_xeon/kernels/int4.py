"""INT4 weight-only linear layers: a native C GEMV for small M, SGEMM on dequantized tiles above the crossover.

Resident layout (one copy of the codes): nibble-planar int32 codes ``[N, K/8]`` (4-row blocks interleaved by
chunk) and the QTensor's fp16
scales and zeros blocked per 4 rows ``[N/4, K/g, 2, 4]`` (:mod:`musecore_xeon.kernels.native` explains the layout).
Small M runs the native GEMV (``int4_gemv``); from a crossover M measured on this machine, the dense path:
on CPUs with AMX the INT4 GEMM of :mod:`native_amx_source` (weight panels dequantized to bf16 in L2 and multiplied
by ``tdpbf16ps``), elsewhere the weight dequantized one tile at a time (``int4_dequant``, exact fp32) and
multiplied by SGEMM (or oneDNN's BF16 GEMM where the CPU has a BF16 dot product).
Numerics: the weights are exactly ``(q - z) * scale`` of the QTensor. The dense tiles differ from a
dequantize-then-matmul only in the fp32 summation order; the GEMV rounds the activations to int16 per group
(error <= max|x_group| * 2^-16 per element, NMSE ~5e-10 for Gaussian activations, see :mod:`native`).

PyTorch's ``_weight_int4pack_mm_for_cpu`` (its own packing, bf16 ``scales_and_zeros [K/g, N, 2]``,
``(q - 8) * scale + zero`` with ``zero = (8 - z) * scale``, FORMATS.md) remains the small-M kernel when
the native kernels cannot be built (no compiler, announced by a RuntimeWarning), when a caller asks for it
(``kernel="int4pack"``: the lab's comparisons), or when K is not a multiple of 64 (g = 32 only).
Then the planar codes are a second copy, kept only while the dense-tile path can be used.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Optional

import torch

from musecore_quant.qtensor import QTensor
from musecore_xeon.kernels.crossover import (CALIBRATION_MS, INT4_CROSSOVER_ENV, CrossoverCalibration,
                                             cached_crossover, measure_crossover)
from musecore_xeon.kernels import native
from musecore_xeon.kernels.dense import (NATIVE_BF16_TILE_ELEMENTS, restore_shape, tile_rows_for, tile_workspace,
                                          tiled_matmul)

KERNEL_GROUP_SIZES: tuple[int, ...] = (32, 64, 128, 256)
PACK_ROWS = 64  # the largest int4pack block (AVX-512); its rows are padded to it so every block is full
LOW_NIBBLES = 0x0F0F0F0F0F0F0F0F  # the low nibble of each byte of an int64 word
DENSE_COPY_MAX_M = max(CALIBRATION_MS)  # a crossover above this M never uses the dense copy in the measured range
SMALL_M_KERNELS = ("native", "int4pack")


def small_m_kernel(in_features: int, group_size: int) -> str:
    """``native`` (the C GEMV) unless K does not fit the planar layout or the native kernels are unavailable
    (announced by :mod:`native`)."""
    if in_features % planar_chunk(group_size) or not native.available():
        return "int4pack"
    return "native"


def planar_chunk(group_size: int) -> int:
    return max(group_size, 64)


# Nibble of each position p = 0..7 of a planar word: p/2 + 4*(p%2), so positions 2j, 2j+1 are nibbles j, j+4 (the two
# 16-bit halves: one int16 pair of the GEMV's madd). native_int4_source.py explains why.
POSITION_NIBBLES: tuple[int, ...] = (0, 4, 1, 5, 2, 6, 3, 7)


def interleave_row_blocks(words: torch.Tensor, group_size: int) -> torch.Tensor:
    """Row-major planar words ``[N, K/8]`` (N a multiple of ROWS) -> the resident order: per block of ROWS rows,
    chunk by chunk, the ROWS rows' words of that chunk one after another (``[N/ROWS, K/C, ROWS, W]``, viewed as
    ``[N, K/8]``). A block is then one sequential stream, which the hardware prefetcher follows better than ROWS
    rows read side by side (one stream per 4 KiB page, not four)."""
    n, kw = words.shape
    w = planar_chunk(group_size) // 8
    return words.view(n // native.ROWS, native.ROWS, kw // w, w).transpose(1, 2).reshape(n, kw).contiguous()


def deinterleave_row_blocks(words: torch.Tensor, group_size: int) -> torch.Tensor:
    """The inverse of :func:`interleave_row_blocks`."""
    n, kw = words.shape
    w = planar_chunk(group_size) // 8
    return words.view(n // native.ROWS, kw // w, native.ROWS, w).transpose(1, 2).reshape(n, kw)


def to_planar(codes: torch.Tensor, group_size: int) -> torch.Tensor:
    """int codes ``[N, K]`` (0..15, N a multiple of ROWS) -> resident nibble-planar int32 ``[N, K/8]``: per chunk
    of C = max(g, 64) columns, W = C/8 words; column ``p*W + q`` of the chunk is word q, nibble
    ``POSITION_NIBBLES[p]``; row blocks interleaved by chunk (:func:`interleave_row_blocks`)."""
    n, k = codes.shape
    c = planar_chunk(group_size)
    shifts = 4 * torch.tensor(POSITION_NIBBLES, dtype=torch.int64).view(8, 1)
    words = (codes.to(torch.int64).view(n, k // c, 8, c // 8) << shifts).sum(2)
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words)  # the int32 with the same bits
    return interleave_row_blocks(words.to(torch.int32).reshape(n, k // 8), group_size)


def from_planar(words: torch.Tensor, group_size: int) -> torch.Tensor:
    """Resident nibble-planar int32 ``[N, K/8]`` -> int32 codes ``[N, K]`` (the inverse of :func:`to_planar`)."""
    n, kw = words.shape
    c = planar_chunk(group_size)
    shifts = 4 * torch.tensor(POSITION_NIBBLES, dtype=torch.int32).view(1, 1, 8, 1)
    rows = deinterleave_row_blocks(words, group_size)
    return ((rows.reshape(n, kw * 8 // c, 1, c // 8) >> shifts) & 15).reshape(n, kw * 8)


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


def block_scale_zero(pairs: torch.Tensor) -> torch.Tensor:
    """fp16 ``(scale, z)`` pairs ``[N, K/g, 2]`` (N a multiple of ROWS) -> the resident ``[N/ROWS, K/g, 2, ROWS]``:
    per row block and group the ROWS scales, then the ROWS zeros (one 16-byte load in the GEMV)."""
    n, groups, _ = pairs.shape
    return pairs.view(n // native.ROWS, native.ROWS, groups, 2).permute(0, 2, 3, 1).contiguous()


def row_scale_zero(blocked: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`block_scale_zero`: ``[N/ROWS, K/g, 2, ROWS]`` -> ``(scale, z)`` pairs ``[N, K/g, 2]``."""
    blocks, groups, _, rows = blocked.shape
    return blocked.permute(0, 3, 1, 2).reshape(blocks * rows, groups, 2)


def kernel_scales_and_zeros(scale_zero: torch.Tensor) -> torch.Tensor:
    """fp16 ``(scale, z)`` ``[N, K/g, 2]`` -> bf16 ``[K/g, N, 2]`` for ``_weight_int4pack_mm_for_cpu``."""
    s, z = scale_zero[..., 0].float(), scale_zero[..., 1].float()
    return torch.stack((s, (8.0 - z) * s), dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)


@dataclass
class Int4Linear:
    """One INT4 weight ``[N, K]`` resident for this CPU, and the path taken for each M.

    ``codes`` (nibble-planar) and ``scale_zero`` serve the native GEMV and the dense tiles; with the
    ``int4pack`` small-M kernel, ``packed``/``scales_and_zeros`` hold PyTorch's packing and ``codes`` is
    kept only while the dense path can be used. ``crossover``: rows M >= crossover run the dense tiles
    (None: always the small-M kernel). Rows are padded with zero-scale rows; outputs are cut back.
    """

    codes: Optional[torch.Tensor]    # int32 [N_padded, K/8], see native.py
    scale_zero: torch.Tensor         # fp16 [N_padded/ROWS, K/g, 2, ROWS]: scales, zeros; w = (q - zero) * scale
    group_size: int
    out_features: int
    in_features: int
    dense_dtype: torch.dtype = torch.float32
    kernel: str = "native"           # the small-M kernel: "native" or "int4pack"
    packed: Optional[torch.Tensor] = None            # uint8, PyTorch's int4pack (kernel == "int4pack")
    scales_and_zeros: Optional[torch.Tensor] = None  # bf16 [K/g, N_pad64, 2]   (kernel == "int4pack")
    crossover: Optional[int] = None
    calibration: Optional[CrossoverCalibration] = None
    gemv: Optional[native.Int4Gemv] = field(default=None, repr=False)  # the native call bound to these codes
    amx: bool = False                # the dense path is the AMX GEMM (else dequantized tiles)
    bf16_dot: bool = False           # the dense path is the AVX512_BF16 GEMM (csrc/bf16dot.c; never with amx)

    @property
    def padded_out_features(self) -> int:
        return self.scale_zero.shape[0] * native.ROWS

    @property
    def tile_rows(self) -> int:
        elements = NATIVE_BF16_TILE_ELEMENTS if self.dense_dtype == torch.bfloat16 else None
        return tile_rows_for(self.in_features, self.padded_out_features, native.ROWS, elements)

    @property
    def nbytes(self) -> int:
        """Resident bytes the small-M kernel streams per call."""
        if self.kernel == "int4pack":
            return self.packed.numel() + self.scales_and_zeros.numel() * 2
        return self.codes.numel() * 4 + self.scale_zero.numel() * 2

    @property
    def dense_nbytes(self) -> int:
        """Extra resident bytes kept for the dense tiles (0 with the native kernel: one copy serves both)."""
        return self.codes.numel() * 4 if self.kernel == "int4pack" and self.codes is not None else 0

    def keep_dense_copy(self) -> None:
        """With int4pack: rebuild the planar codes from the packing (no-op when they exist)."""
        if self.codes is None:
            codes = self.int4pack_codes_t(0, self.packed.shape[0]).T[:self.padded_out_features]  # [N, K]
            self.codes = to_planar(codes, self.group_size)

    def set_crossover(self, crossover: Optional[int], calibration: Optional[CrossoverCalibration] = None) -> None:
        """Use the dense path from ``crossover`` on; with int4pack, keep the planar copy only when it can be used."""
        if self.in_features % planar_chunk(self.group_size):
            crossover = None  # no planar layout for this K (g = 32, K not a multiple of 64): int4pack at every M
        self.crossover, self.calibration = crossover, calibration
        if self.amx and crossover is not None:  # AMX host with AVX512_BF16 too: the faster GEMM (measured, cached)
            pick_amx_or_bf16_dot(self)
        if self.kernel == "int4pack" and (crossover is None or crossover > DENSE_COPY_MAX_M):
            self.codes = None
        else:
            self.keep_dense_copy()

    def uses_dense_tiles(self, m: int) -> bool:
        return self.crossover is not None and m >= self.crossover

    @property
    def dense_path(self) -> str:
        """The dense path's name: ``amx``, ``bf16dot`` or ``tiles``."""
        return "amx" if self.amx else "bf16dot" if self.bf16_dot else "tiles"

    def path(self, m: int) -> str:
        """The path M rows take: the small-M kernel's name, ``amx``, ``bf16dot`` or ``tiles``."""
        return self.dense_path if self.uses_dense_tiles(m) else self.kernel

    def run_dense(self, x2d: torch.Tensor) -> torch.Tensor:
        """The dense path: the AMX GEMM or the AVX512_BF16 GEMM where it runs, else :meth:`run_tiles`."""
        if self.amx or self.bf16_dot:
            if x2d.dtype is not torch.bfloat16 and x2d.dtype is not torch.float32 or not x2d.is_contiguous():
                x2d = x2d.to(torch.bfloat16).contiguous()
            gemm = native.int4_amx if self.amx else native.int4_bf16_gemm
            return gemm(self.bound_gemv(), x2d)
        return self.run_tiles(x2d)

    def run_small_m(self, x2d: torch.Tensor) -> torch.Tensor:
        """The small-M kernel; returns ``x2d``'s dtype for bf16/fp32 input (bf16 for the int4pack kernel)."""
        gemv = self.gemv
        if gemv is not None and gemv.codes is self.codes and x2d.is_contiguous() \
                and (x2d.dtype is torch.bfloat16 or x2d.dtype is torch.float32):
            return gemv.call(x2d)  # the bound native GEMV, checked first: each Python step costs ~0.2-0.5 us here
        if self.kernel == "int4pack":
            return self.run_int4pack(x2d)
        if x2d.dtype not in (torch.bfloat16, torch.float32) or not x2d.is_contiguous():
            x2d = x2d.to(torch.bfloat16 if x2d.dtype != torch.float32 else x2d.dtype).contiguous()
        return self.bound_gemv().call(x2d)

    def bound_gemv(self) -> native.Int4Gemv:
        """The native call bound to these codes, bound once (the codes of a native weight never change)."""
        gemv = self.gemv
        if gemv is None or gemv.codes is not self.codes:
            gemv = self.gemv = native.Int4Gemv(self.codes, self.scale_zero, self.group_size, self.out_features)
        return gemv

    def build_int4pack(self, codes: Optional[torch.Tensor] = None) -> None:
        """PyTorch's packing of the same codes (rows padded to :data:`PACK_ROWS`), bf16 scales/zeros."""
        if self.packed is not None:
            return
        codes = from_planar(self.codes, self.group_size) if codes is None else codes
        sz = row_scale_zero(self.scale_zero)
        pad = -codes.shape[0] % PACK_ROWS
        if pad:  # padded rows: code 8, scale 0, zero 8 -> weight 0, and every packing block is full
            codes = torch.cat((codes, torch.full((pad, codes.shape[1]), 8, dtype=torch.int32)))
            sz = torch.cat((sz, torch.zeros(pad, *sz.shape[1:], dtype=sz.dtype)))
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        self.scales_and_zeros = kernel_scales_and_zeros(sz)

    def run_int4pack(self, x2d: torch.Tensor) -> torch.Tensor:
        """PyTorch's INT4 kernel on BF16 activations (bf16 scales: the weights differ by that rounding)."""
        self.build_int4pack()
        if x2d.dtype != torch.bfloat16 or not x2d.is_contiguous():
            x2d = x2d.to(torch.bfloat16).contiguous()
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2d, self.packed, self.group_size, self.scales_and_zeros)
        return y if y.shape[1] == self.out_features else y[:, :self.out_features]

    # the name the benchmark and the calibration use for "the small-M path"
    run_kernel = run_small_m

    def int4pack_codes_t(self, n0: int, n1: int) -> torch.Tensor:
        """Codes ``[K, n1-n0]`` (uint8, view of a fresh buffer) unpacked from the int4pack packing.

        The nibbles are split and transposed as int64 words (8 codes at a time): byte-wise, the packing's
        16-row half-blocks make PyTorch copy 16-byte runs.
        """
        block_n, k = int4pack_block_n(), self.in_features
        rows, words = n1 - n0, block_n // 16  # int64 words per half-block of packed bytes
        packed = self.packed[n0:n1].reshape(-1).view(torch.int64).view(rows // block_n, k, words)
        codes = torch.empty(k, rows // block_n, 2 * words, dtype=torch.int64)  # bytes [K, nb, BLOCK_N]
        codes[:, :, :words].copy_((packed & LOW_NIBBLES).transpose(0, 1))         # rows d
        codes[:, :, words:].copy_(((packed >> 4) & LOW_NIBBLES).transpose(0, 1))  # rows d + BLOCK_N/2
        return codes.view(torch.uint8).view(k, rows)

    def torch_ops_tile(self, n0: int, n1: int, workspace: torch.Tensor) -> torch.Tensor:
        """``(q - z) * scale`` of rows ``n0:n1`` as ``[n1-n0, K]`` fp32 with PyTorch ops (no compiler)."""
        rows, k, g = n1 - n0, self.in_features, self.group_size
        tile = workspace[: rows * k].view(rows, k)
        tile.copy_(from_planar(self.codes[n0:n1], g))
        sz = row_scale_zero(self.scale_zero[n0 // native.ROWS:n1 // native.ROWS]).float()
        groups = tile.view(rows, k // g, g)
        return groups.sub_(sz[..., 1:]).mul_(sz[..., :1]).view(rows, k)

    def tile(self, n0: int, n1: int, workspace: torch.Tensor) -> torch.Tensor:
        """Rows ``n0:n1`` of the dequantized weight, fp32 ``[n1-n0, K]`` in ``workspace`` (exact)."""
        rows, k = n1 - n0, self.in_features
        if native.available():
            return native.int4_dequant(self.codes[n0:n1], self.scale_zero[n0 // native.ROWS:n1 // native.ROWS],
                                       workspace[: rows * k].view(rows, k), self.group_size)
        return self.torch_ops_tile(n0, n1, workspace)

    def run_tiles(self, x2d: torch.Tensor) -> torch.Tensor:
        """Dense GEMM on tiles dequantized one at a time into one reused buffer (the compute-bound path)."""
        self.keep_dense_copy()
        k, tile_rows = self.in_features, self.tile_rows
        workspace = tile_workspace(k * tile_rows, torch.float32)
        if self.dense_dtype == torch.float32:
            tile_t = lambda n0, n1: self.tile(n0, n1, workspace).T  # noqa: E731
        else:  # native BF16 GEMM (AMX / AVX-512 BF16): the exact fp32 tile rounded to bf16
            low = tile_workspace(k * tile_rows, self.dense_dtype, slot=1)
            tile_t = lambda n0, n1: low[: (n1 - n0) * k].view(n1 - n0, k).copy_(self.tile(n0, n1, workspace)).T  # noqa: E731
        y = tiled_matmul(x2d.to(self.dense_dtype), self.padded_out_features, tile_rows, tile_t)
        return y if self.padded_out_features == self.out_features else y[:, :self.out_features]

    def dequantize(self) -> torch.Tensor:
        """The whole weight ``[N, K]`` fp32 as the dense path sees it (tests, debugging)."""
        self.keep_dense_copy()
        n, k = self.padded_out_features, self.in_features
        return self.tile(0, n, torch.empty(n * k))[:self.out_features]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gemv = self.gemv
        if gemv is not None and (self.crossover is None or x.numel() < self.crossover * self.in_features) \
                and (x.dtype is torch.bfloat16 or x.dtype is torch.float32) and x.is_contiguous():
            return gemv.call(x)  # the decode path: any leading dims, no reshape
        x2d = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        y = self.run_dense(x2d) if self.uses_dense_tiles(x2d.shape[0]) else self.run_small_m(x2d)
        return restore_shape(y, x, self.out_features)


def check_int4_shape(in_features: int, group_size: int) -> None:
    """Raise with what to do when this backend cannot take this weight."""
    if group_size not in KERNEL_GROUP_SIZES:
        raise ValueError(f"INT4 group size {group_size} is not supported by the xeon INT4 kernels "
                         f"(supported: {KERNEL_GROUP_SIZES}); requantize with group_size=128")
    if in_features % group_size:
        raise ValueError(f"INT4 in_features {in_features} is not a multiple of group size {group_size}")


def fp16_scales(scale: torch.Tensor) -> torch.Tensor:
    """The QTensor's scales as fp16 (the canonical dtype); other dtypes must convert exactly."""
    if scale.dtype == torch.float16:
        return scale
    half = scale.to(torch.float16)
    if not torch.equal(half.to(scale.dtype), scale):
        raise ValueError(f"INT4 scales of dtype {scale.dtype} are not exactly representable in fp16 (the canonical "
                         "int4 scale dtype, musecore_quant.qtensor); convert them to fp16 when reading the checkpoint")
    return half


def pack_int4(data: torch.Tensor, scale: torch.Tensor, zero: Optional[torch.Tensor], group_size: int,
              dense_dtype: torch.dtype, kernel: Optional[str] = None) -> Int4Linear:
    """Canonical INT4 tensors of one weight (``data [N, K/2]``, ``scale``/``zero [N, K/g]``) -> resident.

    ``kernel``: the small-M kernel asked for (``native``, the default, or ``int4pack``; :func:`small_m_kernel`). With ``int4pack`` the planar copy is
    built too and dropped later by :meth:`Int4Linear.set_crossover` when the dense path is never used.
    """
    n, k = data.shape[0], data.shape[1] * 2
    check_int4_shape(k, group_size)
    if kernel is not None and kernel not in SMALL_M_KERNELS:
        raise ValueError(f"INT4 small-M kernel {kernel!r}: expected one of {SMALL_M_KERNELS}")
    kernel = kernel or small_m_kernel(k, group_size)
    if kernel == "native" and k % planar_chunk(group_size):
        raise ValueError(f"the native INT4 kernel needs K a multiple of {planar_chunk(group_size)}; got {k}")
    codes = unpack_codes(data)
    sz = torch.stack((fp16_scales(scale), (torch.full_like(scale, 8, dtype=torch.float16) if zero is None
                                           else zero.to(torch.float16))), dim=-1)
    pad = -n % native.ROWS
    if pad:  # padded rows: code 8, scale 0, zero 8 -> weight 0
        codes = torch.cat((codes, torch.full((pad, k), 8, dtype=torch.int32)))
        sz = torch.cat((sz, torch.zeros(pad, *sz.shape[1:], dtype=sz.dtype)))
    planar = to_planar(codes, group_size) if k % planar_chunk(group_size) == 0 else None
    lin = Int4Linear(planar, block_scale_zero(sz), group_size, n, k, dense_dtype, kernel)
    if kernel == "int4pack":
        lin.build_int4pack(codes)
    else:
        lin.gemv = native.Int4Gemv(lin.codes, lin.scale_zero, group_size, n)
        lin.amx = uses_amx(group_size, dense_dtype)
        lin.bf16_dot = not lin.amx and uses_bf16_dot(dense_dtype)
    return lin


def uses_bf16_dot(dense_dtype: torch.dtype) -> bool:
    """The AVX512_BF16 GEMM (``vdpbf16ps``, every group size) is the dense path of native INT4 weights where it runs
    (BF16 compute) and the AMX GEMM does not (AMX hosts: :func:`pick_amx_or_bf16_dot` measures both)."""
    return dense_dtype == torch.bfloat16 and native.bf16_dot_ready()


# On a host with both GEMMs (AMX + AVX512_BF16), which one a shape class's dense path takes, measured once per
# (K, proxy rows, group size, threads): the faster at M = 64 and 256 summed (lab/NOTES.md).
_DENSE_PICKS: dict[tuple, tuple[str, dict[str, float]]] = {}
DENSE_PICK_MS: tuple[int, ...] = (64, 256)


def pick_amx_or_bf16_dot(lin: Int4Linear) -> str:
    """``amx`` or ``bf16dot`` for ``lin`` (an AMX weight on a host that also has AVX512_BF16), measured on a proxy of
    its shape class (cached); sets ``lin.amx`` / ``lin.bf16_dot`` accordingly. ``MUSECORE_XEON_INT4_GEMM`` =
    ``amx`` or ``bf16dot`` skips the measurement."""
    import os
    forced = os.environ.get(INT4_GEMM_ENV, "").strip().lower()
    if forced and forced not in ("amx", "bf16dot"):
        raise ValueError(f"{INT4_GEMM_ENV}={forced!r}: expected 'amx' or 'bf16dot' (or unset it to measure at load)")
    if not (lin.amx and native.bf16_dot_ready()):
        return lin.dense_path
    if forced:
        pick = forced
    else:
        proxy_rows = min(lin.padded_out_features + -lin.padded_out_features % PACK_ROWS, INT4_PROXY_MAX_ROWS)
        key = (lin.in_features, proxy_rows, lin.group_size, torch.get_num_threads())
        if key not in _DENSE_PICKS:
            from musecore_xeon.kernels.crossover import time_us
            g = torch.Generator().manual_seed(0)
            data = torch.randint(0, 256, (proxy_rows, lin.in_features // 2), dtype=torch.uint8, generator=g)
            scale = (torch.rand(proxy_rows, lin.in_features // lin.group_size, generator=g) * 0.02).half()
            proxy = pack_int4(data, scale, None, lin.group_size, torch.bfloat16)
            gemv = proxy.bound_gemv()
            us = {"amx": 0.0, "bf16dot": 0.0}
            for m in DENSE_PICK_MS:
                x = torch.randn(m, lin.in_features, dtype=torch.bfloat16)
                for _ in range(2):  # alternating rounds, each path keeps its best
                    a = time_us(lambda: native.int4_amx(gemv, x), 3)
                    b = time_us(lambda: native.int4_bf16_gemm(gemv, x), 3)
                    us[f"amx@{m}"] = min(us.get(f"amx@{m}", a), a)
                    us[f"bf16dot@{m}"] = min(us.get(f"bf16dot@{m}", b), b)
                us["amx"] += us[f"amx@{m}"]
                us["bf16dot"] += us[f"bf16dot@{m}"]
            _DENSE_PICKS[key] = ("amx" if us["amx"] <= us["bf16dot"] else "bf16dot", us)
        pick = _DENSE_PICKS[key][0]
    lin.amx, lin.bf16_dot = pick == "amx", pick == "bf16dot"
    return pick


def dense_picks() -> dict[tuple, tuple[str, dict[str, float]]]:
    """Every AMX-vs-AVX512_BF16 measurement of this process: key (K, proxy rows, g, threads) -> (pick, timings us)."""
    return dict(_DENSE_PICKS)


INT4_GEMM_ENV = "MUSECORE_XEON_INT4_GEMM"


def uses_amx(group_size: int, dense_dtype: torch.dtype) -> bool:
    """The AMX GEMM is the dense path of native INT4 weights with g a multiple of 128 where it runs (BF16 compute)."""
    return dense_dtype == torch.bfloat16 and group_size % 128 == 0 and native.amx_ready()


# Near the crossover the two INT4 paths are within noise on the proxy, and at full size a wrong pick of the native
# GEMM cost up to 17%. The tiles are the BF16 path's own SGEMM on exact weights and stay within a few % of BF16, so a
# tie goes to them: the dense path is taken when it is at most this much slower on the proxy (lab/NOTES.md: why 20%).
INT4_DENSE_MARGIN = 0.20
# The INT4 proxy is larger than the BF16 one (PROXY_MAX_ROWS): a 1024-row proxy misjudged full-size weights by more
# than the margin (lab/NOTES.md). Up to this many rows the proxy is the full weight.
INT4_PROXY_MAX_ROWS = 4096


def int4_crossover(in_features: int, out_features: int, group_size: int, dense_dtype: torch.dtype,
                   kernel: str = "native") -> CrossoverCalibration:
    """Measured M from which the tiled dense path beats the small-M kernel (cached per shape class)."""
    proxy_rows = min(out_features + -out_features % PACK_ROWS, INT4_PROXY_MAX_ROWS)
    if in_features % planar_chunk(group_size):
        return CrossoverCalibration("int4-" + kernel, in_features, proxy_rows, torch.get_num_threads(), None,
                                    f"K={in_features} not a multiple of {planar_chunk(group_size)}: no dense tiles")

    def measure() -> CrossoverCalibration:
        g = torch.Generator().manual_seed(0)
        data = torch.randint(0, 256, (proxy_rows, in_features // 2), dtype=torch.uint8, generator=g)
        scale = (torch.rand(proxy_rows, in_features // group_size, generator=g) * 0.02).half()
        proxy = pack_int4(data, scale, None, group_size, dense_dtype, kernel)
        if proxy.amx:
            pick_amx_or_bf16_dot(proxy)
        # the GEMMs on the CPU's BF16 dot product are not the BF16 path's own SGEMM: no tie margin for them
        margin = 0.0 if proxy.bf16_dot else INT4_DENSE_MARGIN
        measured = measure_crossover("int4-" + kernel, in_features, proxy_rows, proxy.run_small_m, proxy.run_dense,
                                     torch.bfloat16, dense_margin=margin)
        if measured.crossover is None and proxy.bf16_dot:
            # The AVX512_BF16 GEMM runs 2x+ faster than the GEMV at M = 256 on every shape measured (lab/NOTES.md), so
            # "never" is most likely a burst of other work on the host during the first point: measured once more.
            measured = measure_crossover("int4-" + kernel, in_features, proxy_rows, proxy.run_small_m,
                                         proxy.run_dense, torch.bfloat16, dense_margin=margin)
        return measured

    key = ("int4", kernel, in_features, proxy_rows, group_size, dense_dtype, uses_amx(group_size, dense_dtype),
           uses_bf16_dot(dense_dtype))
    return cached_crossover(key, INT4_CROSSOVER_ENV, "int4-" + kernel, in_features, proxy_rows, measure)


def prepare_int4(qt: QTensor, dense_dtype: torch.dtype, *, calibrate: bool = True,
                 kernel: Optional[str] = None) -> Int4Linear:
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
    resident = pack_int4(qt.data, qt.scale, qt.zero, qt.group_size, dense_dtype, kernel)
    if calibrate:
        calibration = int4_crossover(resident.in_features, resident.out_features, qt.group_size, dense_dtype,
                                     resident.kernel)
        resident.set_crossover(calibration.crossover, calibration)
    return resident
