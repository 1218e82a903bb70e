"""The INT4 kernels in C: a GEMV / skinny GEMM for small M and the dense-tile dequantizer, compiled at first use
from ``musecore_xeon/csrc/kernels.c`` and called through ctypes, except the bound GEMVs (:class:`Int4Gemv`,
:class:`Bf16Gemv`), called through the CPython extension of :mod:`musecore_xeon.kernels.binding`.

Why: PyTorch's ``_weight_int4pack_mm_for_cpu`` is compute-bound on AVX2 (it converts every weight to float), far
below the memory bandwidth at M = 1. This GEMV works in integers on a layout made for ``_mm256_madd_epi16``:

**Nibble-planar layout.** A row of K codes is cut into chunks of C = max(g, 64) columns, each stored as
W = C/8 int32 words; column ``p*W + q`` of the chunk is word q, nibble ``p/2 + 4*(p%2)``: nibbles j and j+4
(the two 16-bit halves of a word) hold columns ``2j*W + q`` and ``(2j+1)*W + q``, so
``(w >> 4j) & 0x000F000F`` is a vector of int16 code pairs (nibble 3/7: one 16-bit shift). For g = 32 the
first 4 positions are one group and the last 4 the next: no pair straddles a group. The rows of a 4-row block
are interleaved chunk by chunk (chunk c of rows 0, 1, 2, 3, then chunk c + 1: ``[N/4, K/C, 4, W]``, viewed as
``[N, K/8]``), so the GEMV reads each block as one sequential stream, which the hardware prefetcher follows
better than four rows side by side. Scales and zeros are the QTensor's fp16 scale and the integer zero, blocked
per 4-row block ``[N/4, K/g, 2, 4]`` (4 scales then 4 zeros: one 16-byte load per group and block). 4 bytes per
group, the same as PyTorch's bf16 (scale, zero).

**int16 activations.** Each call quantizes every activation group to int16, ``sx = max|x_group| / 32767``,
``xq = round(x / sx)`` (an all-zero group: sx = 0, xq = 0), stored in the order of the code pairs. The
rounding error is at most ``sx/2 = max|x_group| * 2^-16``: no more than the bf16 rounding (2^-9 relative) of
every element within 2^7 of the group's largest, the elements that carry the dot product. The inner loop is
per 8 words (64 weights) and row 4 x (shift/AND, ``madd_epi16``, ``add_epi32``) into an int32 accumulator per
group (|sum| <= 2 g 15 32767 < 2^31 for g <= 256), one named variable per row (arrays stayed on the stack);
groups are flushed in pairs: the 4 rows' sums transposed by unpack/add (no hadd), two groups in one vector, the
zero term ``z * sum(xq)`` subtracted in int32 (exact; with the quantized sum, the result is exactly the dot product
of the rounded activation with the exact weight ``(q - z) * s``, whose error ``sum e (q - z)`` has a smaller
variance than the ``sum e q`` an exact float sum of x would leave), then one conversion and one FMA with
``s * sx`` into an fp32 total kept as even and odd groups (added at the end). M = 2 decodes each word once for
both activation rows. The portable C path does the same integer sums and float operations (the same bits).

The same codes feed the dense-tile path above the crossover M (``musecore_int4_dequant``: exact fp32 tiles
for SGEMM), so there is one resident copy of the codes (0.53 byte/weight at g = 128).

**Threads.** Row blocks are split with OpenMP over PyTorch's thread count, linked against PyTorch's own
``libgomp`` (``torch/lib``): one thread pool for PyTorch and these kernels (a second OpenMP runtime spins and
fights PyTorch's on a small host); the bound call reads ``omp_get_max_threads()`` of that runtime, which is
what ``torch.get_num_threads()`` returns. Without that library the code is built without OpenMP (one
thread), and :data:`UNAVAILABLE` says so.

Build: the system C compiler (``$CC``, ``cc`` or ``gcc``; no PyTorch headers, ~1 s) the first time; the
shared object is kept in the per-user compile cache (:mod:`musecore.compile_cache`, ``$MUSECORE_CACHE``),
keyed by the sources, the compiler and the flags. ``-mavx2 -mfma -mf16c`` where the CPU has them (more for
AVX-512 VNNI and AMX, capped by ``MUSECORE_XEON_ISA``); elsewhere the portable C path (``#ifndef __AVX2__``).
Without a compiler, or with ``MUSECORE_XEON_NATIVE_DEQUANT=0``, the backend runs PyTorch's int4pack kernel and
PyTorch-op dequantization, announced by a RuntimeWarning.
"""

from __future__ import annotations

import ctypes
import functools
import os
import shutil
import subprocess
import warnings
from pathlib import Path
from types import ModuleType
from typing import Optional

import torch

from musecore_xeon.kernels import binding
from musecore_xeon.kernels.compile import compile_cached

NATIVE_ENV = "MUSECORE_XEON_NATIVE_DEQUANT"
ROWS = 4  # rows per GEMV block (ROWS in int4.c): the nibble-planar codes are padded to a multiple

# csrc/kernels.c includes the others: one translation unit, one shared object
MAIN_SOURCE = "kernels.c"
SOURCES = (MAIN_SOURCE, "int4.c", "amx.c", "bf16dot.c", "ops.c", "bf16.c", "moe.c")


def torch_libgomp() -> Optional[Path]:
    """PyTorch's bundled OpenMP runtime, if it has one (pip wheels on Linux ship ``torch/lib/libgomp.so.1``)."""
    lib = Path(torch.__file__).parent / "lib"
    candidates = sorted(lib.glob("libgomp*.so*"))
    return candidates[0] if candidates else None


ISA_ENV = "MUSECORE_XEON_ISA"
ISA_LEVELS = ("amx", "avx512_vnni", "avx2", "portable")  # best first; the env var caps the level (A/B runs, tests)
AVX512_VNNI_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")
AMX_FLAGS = ("amx_tile", "amx_bf16", "avx512_bf16")


def isa_cap() -> str:
    """The highest ISA level the build may use: ``MUSECORE_XEON_ISA`` (one of :data:`ISA_LEVELS`), else the best."""
    raw = os.environ.get(ISA_ENV, "").strip().lower()
    if raw and raw not in ISA_LEVELS:
        raise ValueError(f"{ISA_ENV}={raw!r}: choose one of {list(ISA_LEVELS)} (or unset it to use what the CPU has)")
    return raw or ISA_LEVELS[0]


def compile_flags(cap: Optional[str] = None, info=None) -> list[str]:
    """The compiler flags for this CPU (or ``info``'s), up to ``cap`` (default :func:`isa_cap`): ``-mavx2 -mfma
    -mf16c`` where the CPU has AVX2, plus the AVX-512 VNNI flags where it has those (the GEMVs then read 512 bits per
    load), plus AMX-BF16 and AVX-512 BF16 where it has those (the INT4 GEMM of ``csrc/amx.c``)."""
    from musecore_xeon.cpu import read_cpu_info
    info = info or read_cpu_info()
    level = ISA_LEVELS.index(cap or isa_cap())
    isa = ["-mavx2", "-mfma"] if info.has("avx2") and info.has("fma") and level <= ISA_LEVELS.index("avx2") else []
    if isa and info.has("f16c"):
        isa.append("-mf16c")
    if isa and level <= ISA_LEVELS.index("avx512_vnni") and all(info.has(f) for f in AVX512_VNNI_FLAGS):
        isa += ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"]
        if level == ISA_LEVELS.index("amx") and all(info.has(f) for f in AMX_FLAGS):
            isa += ["-mamx-tile", "-mamx-bf16", "-mavx512bf16"]
    gomp = torch_libgomp()
    # -fopenmp links "libgomp.so.1"; -L/-rpath make that PyTorch's copy, already loaded by `import torch`
    omp = ["-fopenmp", f"-L{gomp.parent}", f"-Wl,-rpath,{gomp.parent}"] if gomp is not None else []
    return ["-O3", "-fPIC", "-shared", *isa, *omp]


UNAVAILABLE: list[str] = []  # why the native kernels are not used (or run single-threaded), once known


def _unavailable(reason: str) -> None:
    """Not a silent fallback: the slower PyTorch paths are announced once, with the reason."""
    UNAVAILABLE.append(reason)
    warnings.warn(f"musecore-xeon: {reason}; INT4 runs PyTorch's _weight_int4pack_mm_for_cpu at small M and "
                  f"PyTorch-op dequantization for dense tiles, BF16 weights PyTorch's F.linear at every small M (same "
                  f"values, slower). Set {NATIVE_ENV}=0 to choose that explicitly.", RuntimeWarning, stacklevel=3)


def disabled() -> bool:
    return os.environ.get(NATIVE_ENV, "").strip().lower() in ("0", "off", "no", "false")


def compiler() -> Optional[str]:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def build(flags: list[str]) -> Optional[Path]:
    """The shared object of ``csrc/kernels.c`` compiled with ``flags`` (in the per-user compile cache, keyed by the
    sources, the compiler and the flags), or None without a compiler. Raises ``CacheError`` for a cache directory
    that is not private, ``OSError`` / ``SubprocessError`` when the build fails."""
    cc = compiler()
    if cc is None:
        return None
    return compile_cached("kernels", SOURCES, MAIN_SOURCE, cc, [*flags, "-lm"],
                          lambda src, obj: [cc, *flags, "-o", str(obj), str(src), "-lm"], timeout=120)


def declare_signatures(lib: ctypes.CDLL) -> ctypes.CDLL:
    """ctypes argument and result types of every exported function (set once: each call then converts its
    Python ints and pointers without inspecting them)."""
    vp, i, i64, f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
    lib.musecore_int4_gemv.argtypes = [vp] * 3 + [i, vp, i] + [i64] * 5 + [i]
    lib.musecore_int4_moe.argtypes = [vp] * 5 + [i] + [vp] * 3 + [i, f32, vp] + [i64] * 9 + [i]
    lib.musecore_int4_moe.restype = ctypes.c_int
    lib.musecore_bf16_moe.argtypes = [vp] * 3 + [i] + [vp] * 3 + [i, f32, vp] + [i64] * 5 + [i]
    lib.musecore_bf16_moe.restype = ctypes.c_int
    lib.musecore_rms_norm.argtypes = [vp, i, vp, i, vp, i, i64, i64, f32, i]
    lib.musecore_residual_norm.argtypes = [vp, vp, i, vp, i, vp, vp, vp, i, vp, vp, i, i64, i64, f32, f32]
    lib.musecore_norm_rope.argtypes = [vp, i, i64, f32, vp, vp, vp, i64, i64, i64, f32]
    lib.musecore_head_norm_gate.argtypes = [vp, i, vp, i, i64, vp, i64, i64, i64, f32]
    lib.musecore_router_topk.argtypes = [vp, vp, i64, i64, i64, f32, f32, vp, vp]
    lib.musecore_router_topk.restype = ctypes.c_int
    lib.musecore_attention.argtypes = [vp, i, vp, vp, i, vp, vp, i64, f32, vp] + [i64] * 6 + [i]
    lib.musecore_int4_linear.argtypes = [vp, vp, vp, i64, i]
    lib.musecore_int4_dequant.argtypes = [vp] * 3 + [i64] * 3 + [i]
    lib.musecore_bf16_gemv.argtypes = [vp, vp, i, vp, i] + [i64] * 3 + [i]
    lib.musecore_bf16_linear.argtypes = [vp, vp, vp, i64, i]
    lib.musecore_max_threads.restype = ctypes.c_int
    for name in ("int4_gemv", "int4_linear", "int4_dequant", "bf16_gemv", "bf16_linear", "rms_norm", "residual_norm",
                 "norm_rope", "head_norm_gate", "attention"):
        getattr(lib, f"musecore_{name}").restype = None
    lib.musecore_int4_openmp.restype = ctypes.c_int
    lib.musecore_amx_ready.restype = ctypes.c_int
    lib.musecore_int4_amx_linear.argtypes = [vp, vp, i, vp, i, i64]
    lib.musecore_int4_amx_linear.restype = ctypes.c_int
    lib.musecore_int4_amx_panel.argtypes = [vp, i64, i64, i64, vp]
    lib.musecore_int4_amx_panel.restype = ctypes.c_int
    lib.musecore_int4_amx_tune.argtypes = [i64, i64, i64, i, i]
    lib.musecore_int4_amx_tune.restype = ctypes.c_int
    lib.musecore_int4_bf16_ready.restype = ctypes.c_int
    lib.musecore_int4_bf16_gemm.argtypes = [vp, vp, i, vp, i, i64]
    lib.musecore_int4_bf16_gemm.restype = ctypes.c_int
    return lib


def load_variant(cap: str) -> Optional[ctypes.CDLL]:
    """The same source built up to ISA level ``cap`` (``"portable"``: the ``#ifndef __AVX2__`` paths), for tests
    that compare builds; None without a compiler."""
    path = build(compile_flags(cap))
    return None if path is None else declare_signatures(ctypes.CDLL(str(path)))


def load_portable() -> Optional[ctypes.CDLL]:
    """The same source built without ISA flags (the ``#ifndef __AVX2__`` paths), for tests that compare both."""
    return load_variant("portable")


@functools.cache
def load() -> Optional[ctypes.CDLL]:
    """The compiled kernels, or None (disabled, no compiler, or the build failed)."""
    if disabled():
        UNAVAILABLE.append(f"disabled by {NATIVE_ENV}")
        return None
    try:
        target = build(compile_flags())
        if target is None:
            _unavailable("no C compiler (cc/gcc) to build the native INT4 kernels")
            return None
        lib = declare_signatures(ctypes.CDLL(str(target)))
    except (OSError, subprocess.SubprocessError) as err:
        detail = getattr(err, "stderr", b"") or b""
        _unavailable(f"building/loading the native INT4 kernels failed ({type(err).__name__}: {err} "
                     f"{detail.decode(errors='replace')[-500:]})")
        return None
    if not lib.musecore_int4_openmp():
        UNAVAILABLE.append("built without OpenMP (PyTorch bundles no libgomp here): the INT4 kernels run on one thread")
    return lib


def available() -> bool:
    return load() is not None


def _check(name: str, t: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> None:
    if t.dtype not in dtypes or not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor of {dtypes}, got {t.dtype} "
                         f"(contiguous={t.is_contiguous()})")


def _check_layout(codes: torch.Tensor, scale_zero: torch.Tensor, k: int, group_size: int) -> None:
    _check("codes", codes, (torch.int32,))
    _check("scale_zero", scale_zero, (torch.float16,))
    rows = codes.shape[0]
    if k % max(group_size, 64) or group_size not in (32, 64, 128, 256) or codes.shape != (rows, k // 8) \
            or rows % ROWS or scale_zero.shape != (rows // ROWS, k // group_size, 2, ROWS):
        raise ValueError(f"nibble-planar INT4: codes {tuple(codes.shape)}, scale_zero {tuple(scale_zero.shape)}, "
                         f"K={k}, group size {group_size} do not match (expected codes [N, K/8], "
                         f"scale_zero [N/{ROWS}, K/g, 2, {ROWS}], N a multiple of {ROWS}, g in 32/64/128/256, K a "
                         "multiple of max(g, 64))")


def int4_gemv(codes: torch.Tensor, scale_zero: torch.Tensor, x: torch.Tensor, group_size: int,
              out_features: int) -> torch.Tensor:
    """``x [M, K] @ W.T -> [M, out_features]`` in ``x``'s dtype (bf16 or fp32; fp32 accumulation) from
    nibble-planar ``codes`` int32 ``[N, K/8]`` (N a multiple of :data:`ROWS`) and fp16 ``scale_zero``
    ``[N/ROWS, K/g, 2, ROWS]`` (:func:`musecore_xeon.kernels.int4.block_scale_zero`).

    Example::

        y = int4_gemv(lin.codes, lin.scale_zero, x_bf16, 128, lin.out_features)
    """
    lib = load()
    if lib is None:
        raise RuntimeError("the native INT4 kernels are not available (see musecore_xeon.kernels.native.UNAVAILABLE)")
    m, k = x.shape
    _check_layout(codes, scale_zero, k, group_size)
    _check("x", x, (torch.bfloat16, torch.float32))
    if codes.shape[0] % ROWS or not 0 < out_features <= codes.shape[0]:
        raise ValueError(f"int4_gemv: {codes.shape[0]} code rows (a multiple of {ROWS}) for {out_features} outputs")
    y = torch.empty(m, out_features, dtype=x.dtype)
    bf16 = int(x.dtype == torch.bfloat16)
    lib.musecore_int4_gemv(codes.data_ptr(), scale_zero.data_ptr(), x.data_ptr(), bf16, y.data_ptr(), bf16,
                           m, k, group_size, codes.shape[0], out_features, torch.get_num_threads())
    return y


class Int4WeightArgs(ctypes.Structure):
    """``int4_weight_t`` in the C source: one weight's pointers and shape, passed as one pointer."""
    _fields_ = [("codes", ctypes.c_void_p), ("sz", ctypes.c_void_p), ("k", ctypes.c_int64), ("g", ctypes.c_int64),
                ("n_rows", ctypes.c_int64), ("n_valid", ctypes.c_int64)]


def linear_binding() -> Optional[ModuleType]:
    """The CPython extension that calls the bound GEMVs (:mod:`musecore_xeon.kernels.binding`), or None: then
    :class:`Int4Gemv` and :class:`Bf16Gemv` call them through ctypes."""
    lib = load()
    if lib is None:
        return None
    address = lambda fn: ctypes.cast(fn, ctypes.c_void_p).value  # noqa: E731
    return binding.load(address(lib.musecore_int4_linear), address(lib.musecore_bf16_linear))


class BoundGemv:
    """A native GEMV bound to one weight: its pointers and shape packed once into a C struct (``self.args``), called
    through the CPython extension of :mod:`~musecore_xeon.kernels.binding` (tensor checks, ``at::empty``, the
    kernel) or, where that cannot be built, through ctypes (a dtype/contiguity check, one ``torch.empty`` and a
    5-argument ctypes call: several times the cost around the kernel).
    ``x`` (bf16 or fp32, contiguous) may have any leading dims (no reshape: the output is allocated in ``x``'s shape,
    in ``x``'s dtype). The thread count is PyTorch's, read in C (``omp_get_max_threads`` of the shared libgomp).
    The weight tensors must stay alive and unmoved (the subclass keeps them)."""

    name = "gemv"  # prefixes the errors; the extension's function of the same kind is ``<kind>_linear``
    kind = ""

    def bind(self, lib: ctypes.CDLL, args: ctypes.Structure, in_features: int, out_features: int) -> None:
        self.in_features, self.out_features = in_features, out_features
        self.args = args
        self.args_ptr = ctypes.addressof(self.args)
        self.fn = getattr(lib, f"musecore_{self.kind}_linear")
        fast = linear_binding()
        # the hot call: the extension's METH_FASTCALL function with this weight's address bound (a C-level partial)
        self.call = functools.partial(getattr(fast, f"{self.kind}_linear"), self.args_ptr) if fast is not None \
            else self.call_ctypes
        self.binding = "extension" if fast is not None else "ctypes"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.call(x)

    def call_ctypes(self, x: torch.Tensor) -> torch.Tensor:
        """The same call through ctypes (without the extension; tests compare both)."""
        dtype, shape, k, n = x.dtype, x.shape, self.in_features, self.out_features
        if (dtype is not torch.bfloat16 and dtype is not torch.float32) or shape[-1] != k or not x.is_contiguous():
            raise ValueError(f"{self.name}: x must be a contiguous bf16/fp32 [..., {k}] tensor; got "
                             f"{dtype} {tuple(shape)} (contiguous={x.is_contiguous()})")
        # each torch call from Python costs 0.1-0.4 us here: the output shape is built without slicing x.shape
        if len(shape) == 2:
            m, y = shape[0], torch.empty(shape[0], n, dtype=dtype)
        elif len(shape) == 3:
            m, y = shape[0] * shape[1], torch.empty(shape[0], shape[1], n, dtype=dtype)
        else:
            m, y = x.numel() // k, torch.empty(*shape[:-1], n, dtype=dtype)
        self.fn(self.args_ptr, x.data_ptr(), y.data_ptr(), m, dtype is torch.bfloat16)
        return y


def _require_native(what: str) -> ctypes.CDLL:
    lib = load()
    if lib is None:
        raise RuntimeError(f"the native {what} kernels are not available (see musecore_xeon.kernels.native.UNAVAILABLE)")
    return lib


class Int4Gemv(BoundGemv):
    """:func:`int4_gemv` bound to one weight (:class:`BoundGemv`): the layout is checked once.

    Example::

        gemv = Int4Gemv(lin.codes, lin.scale_zero, 128, lin.out_features)
        y = gemv(x_bf16)                      # [..., M, N]; gemv.call(x_bf16) skips one Python frame
    """

    name, kind = "int4_gemv", "int4"

    def __init__(self, codes: torch.Tensor, scale_zero: torch.Tensor, group_size: int, out_features: int) -> None:
        lib = _require_native("INT4")
        in_features = codes.shape[1] * 8
        _check_layout(codes, scale_zero, in_features, group_size)
        if codes.shape[0] % ROWS or not 0 < out_features <= codes.shape[0]:
            raise ValueError(f"int4_gemv: {codes.shape[0]} code rows (a multiple of {ROWS}) for {out_features} outputs")
        self.codes, self.scale_zero = codes, scale_zero  # kept alive with the pointers
        self.bind(lib, Int4WeightArgs(codes.data_ptr(), scale_zero.data_ptr(), in_features, group_size,
                                      codes.shape[0], out_features), in_features, out_features)


class Bf16WeightArgs(ctypes.Structure):
    """``bf16_weight_t`` in the C source: one BF16 weight's pointer and shape."""
    _fields_ = [("w", ctypes.c_void_p), ("k", ctypes.c_int64), ("n", ctypes.c_int64)]


class Bf16Gemv(BoundGemv):
    """The native BF16 weight GEMV (``csrc/bf16.c``) bound to one contiguous bf16 weight ``[N, K]``
    (:class:`BoundGemv`): ``x [..., K]`` bf16 or fp32 -> ``[..., N]`` in ``x``'s dtype, fp32 accumulation.

    Example::

        gemv = Bf16Gemv(w_bf16)               # w [N, K], kept alive by the Bf16Gemv
        y = gemv(x_bf16)                      # [..., N]
    """

    name, kind = "bf16_gemv", "bf16"

    def __init__(self, weight: torch.Tensor) -> None:
        lib = _require_native("BF16")
        if weight.dtype != torch.bfloat16 or weight.dim() != 2 or not weight.is_contiguous() or weight.numel() == 0:
            raise ValueError(f"bf16_gemv: the weight must be a non-empty contiguous bf16 [N, K] tensor; got "
                             f"{weight.dtype} {tuple(weight.shape)} (contiguous={weight.is_contiguous()})")
        self.weight = weight  # kept alive with the pointer
        n, k = weight.shape
        self.bind(lib, Bf16WeightArgs(weight.data_ptr(), k, n), k, n)


def bf16_gemv(weight: torch.Tensor, x: torch.Tensor, threads: Optional[int] = None) -> torch.Tensor:
    """``x [M, K] @ weight.T`` (weight bf16 ``[N, K]``, x bf16/fp32) -> ``[M, N]`` in ``x``'s dtype, through ctypes with
    an explicit thread count (default PyTorch's): tests and measurements; decode calls use :class:`Bf16Gemv`.
    """
    return bf16_gemv_with(_require_native("BF16"), weight, x, threads)


def bf16_gemv_with(lib: ctypes.CDLL, weight: torch.Tensor, x: torch.Tensor, threads: Optional[int] = None) -> torch.Tensor:
    """:func:`bf16_gemv` on a given build of the kernels (e.g. :func:`load_portable`)."""
    _check("weight", weight, (torch.bfloat16,))
    _check("x", x, (torch.bfloat16, torch.float32))
    (m, k), (n, kw) = x.shape, weight.shape
    if k != kw:
        raise ValueError(f"bf16_gemv: x [{m}, {k}] does not match the weight [{n}, {kw}]")
    y = torch.empty(m, n, dtype=x.dtype)
    bf16 = int(x.dtype == torch.bfloat16)
    lib.musecore_bf16_gemv(weight.data_ptr(), x.data_ptr(), bf16, y.data_ptr(), bf16, m, n, k,
                           torch.get_num_threads() if threads is None else threads)
    return y


def amx_planned(info=None) -> bool:
    """Whether the build will include the INT4 AMX GEMM (the CPU, ``info`` or this one, has :data:`AMX_FLAGS` and
    ``MUSECORE_XEON_ISA`` does not cap it): the plan's and the probe's answer, known without compiling
    (:func:`amx_ready` also needs the build and Linux's permission)."""
    return "-mamx-bf16" in compile_flags(info=info)


@functools.cache
def amx_ready() -> bool:
    """Whether the INT4 AMX GEMM (``csrc/amx.c``) can run here: built (ISA level ``amx``: the CPU has AMX-BF16
    and AVX-512 BF16, and ``MUSECORE_XEON_ISA`` does not cap it) and the tile state granted by Linux."""
    lib = load()
    return lib is not None and bool(lib.musecore_amx_ready())


def int4_amx(gemv: Int4Gemv, x: torch.Tensor) -> torch.Tensor:
    """``x [M, K] @ W.T -> [M, N]`` in ``x``'s dtype (bf16 or fp32) on AMX for the weight bound in ``gemv`` (group
    size a multiple of 128): the weight dequantized to bf16 tile by tile in L2, products and sums in fp32."""
    if not amx_ready():
        raise RuntimeError("int4_amx: no AMX here (see musecore_xeon.kernels.native.amx_ready)")
    _check("x", x, (torch.bfloat16, torch.float32))
    if x.dim() != 2 or x.shape[1] != gemv.in_features:
        raise ValueError(f"int4_amx: x must be [M, {gemv.in_features}]; got {tuple(x.shape)}")
    y = torch.empty(x.shape[0], gemv.out_features, dtype=x.dtype)
    bf16 = int(x.dtype == torch.bfloat16)
    status = load().musecore_int4_amx_linear(gemv.args_ptr, x.data_ptr(), bf16, y.data_ptr(), bf16, x.shape[0])
    if status == -1:
        raise ValueError(f"int4_amx: group size {gemv.args.g} is not a multiple of 128 (the AMX kernel's chunk)")
    if status:
        raise MemoryError(f"int4_amx: no memory for the AMX buffers of a [{x.shape[0]}, {gemv.in_features}] input")
    return y


AMX_TUNE_MODES = {"full": 0, "no_dequant": 1, "no_products": 2, "no_pack": 3}


def int4_amx_tune(k_block: int = 0, m_block: int = 0, max_panel: int = 0, mode: str = "full",
                  stream: bool = False) -> None:
    """Lab only (``backends/xeon/lab/scripts/amx_blocking_sweep.py``): the AMX GEMM's blocking for this process
    (0 = the default), a leave-one-out ``mode`` that skips one phase for profiling (anything but ``full`` makes
    :func:`int4_amx` return garbage) and ``stream``: the packed activations written with non-temporal stores. The
    blocking and ``stream`` do not change the result's bits (tested)."""
    if not amx_ready():
        raise RuntimeError("int4_amx_tune: no AMX here (see musecore_xeon.kernels.native.amx_ready)")
    if mode not in AMX_TUNE_MODES:
        raise ValueError(f"int4_amx_tune: mode {mode!r} is not one of {sorted(AMX_TUNE_MODES)}")
    if load().musecore_int4_amx_tune(k_block, m_block, max_panel, AMX_TUNE_MODES[mode], int(stream)):
        raise ValueError(f"int4_amx_tune: k_block={k_block} (a multiple of 256 up to 8192), m_block={m_block} (of 16 "
                         f"up to 1024) or max_panel={max_panel} (of 32 up to 1024) is out of range")


def bf16_dot_planned(info=None) -> bool:
    """Whether the build will include the INT4 x BF16 GEMM on AVX512_BF16 (the CPU, ``info`` or this one, has
    AVX512_BF16 and the AVX-512 VNNI flags, and ``MUSECORE_XEON_ISA`` does not cap them away): known without
    compiling (:func:`bf16_dot_ready` asks the build)."""
    from musecore_xeon.cpu import read_cpu_info
    info = info or read_cpu_info()
    return info.has("avx512_bf16") and "-mavx512vnni" in compile_flags(info=info)


@functools.cache
def bf16_dot_ready() -> bool:
    """Whether the INT4 x BF16 GEMM on AVX512_BF16 (``csrc/bf16dot.c``, ``vdpbf16ps``) can run here: built with the
    AVX-512 flags (ISA level ``avx512_vnni`` or ``amx``, not capped below by ``MUSECORE_XEON_ISA``) and the CPU has
    AVX512_BF16 (checked in C with ``__builtin_cpu_supports``)."""
    lib = load()
    return lib is not None and bool(lib.musecore_int4_bf16_ready())


def int4_bf16_gemm(gemv: Int4Gemv, x: torch.Tensor) -> torch.Tensor:
    """``x [M, K] @ W.T -> [M, N]`` in ``x``'s dtype (bf16 or fp32) for the weight bound in ``gemv`` (every supported
    group size) with ``vdpbf16ps``: activations rounded to bf16 once, the codes decoded into L1 panels of bf16
    ``16 + q`` pairs, scales and zeros applied in fp32 per group (the weight stays exact), fp32 sums."""
    if not bf16_dot_ready():
        raise RuntimeError("int4_bf16_gemm: no AVX512_BF16 build here (see musecore_xeon.kernels.native.bf16_dot_ready)")
    _check("x", x, (torch.bfloat16, torch.float32))
    if x.dim() != 2 or x.shape[1] != gemv.in_features:
        raise ValueError(f"int4_bf16_gemm: x must be [M, {gemv.in_features}]; got {tuple(x.shape)}")
    y = torch.empty(x.shape[0], gemv.out_features, dtype=x.dtype)
    bf16 = int(x.dtype == torch.bfloat16)
    status = load().musecore_int4_bf16_gemm(gemv.args_ptr, x.data_ptr(), bf16, y.data_ptr(), bf16, x.shape[0])
    if status:
        raise MemoryError(f"int4_bf16_gemm: no memory for the buffers of a [{x.shape[0]}, {gemv.in_features}] input")
    return y


def amx_column_order(k: int, group_size: int) -> torch.Tensor:
    """The column of each k-slot of the AMX kernel's tiles (int64 ``[K]``; slot ``32 * tile + 2q + h``): within a
    chunk of g columns (W = g/8 planar words), chunk tile ``tau = j * W/16 + u`` holds column ``(2j + h) * W + 16u + q``
    (nibble pair j of planar words ``16u .. 16u+15``), so one shift, AND and table lookup make a tile row."""
    w = group_size // 8
    slot = torch.arange(group_size)
    tau, q, h = slot // 32, slot % 32 // 2, slot % 2
    j, u = tau // (w // 16), tau % (w // 16)
    return (torch.arange(0, k, group_size)[:, None] + (2 * j + h) * w + 16 * u + q).reshape(-1)


def int4_amx_panel(gemv: Int4Gemv, n0: int, k0: int, kb: int) -> torch.Tensor:
    """The AMX kernel's A tiles of weight rows ``n0 .. n0+31`` and k-slots ``k0 .. k0+kb-1`` as bf16
    ``[2, kb/32, 16, 32]`` (``[t, s, i, slot]`` holds ``W[n0 + 16t + i, order[k0 + 32s + slot]]`` with
    ``order = amx_column_order(K, g)``): the layout test's view."""
    lib = _require_native("INT4 AMX")
    out = torch.empty(2 * kb * 16 + 32, dtype=torch.int16)
    offset = (-out.data_ptr() % 64) // 2  # 64-byte aligned, as the kernel's stores need
    tiles = out[offset:offset + 2 * kb * 16]
    status = lib.musecore_int4_amx_panel(gemv.args_ptr, n0, k0, kb, tiles.data_ptr())
    if status:
        raise ValueError(f"int4_amx_panel: n0={n0}, k0={k0}, kb={kb} rejected (status {status}; -2: not an AMX build)")
    return tiles.view(torch.bfloat16).view(2, kb // 32, 16, 32).clone()


def int4_dequant(codes: torch.Tensor, scale_zero: torch.Tensor, out: torch.Tensor, group_size: int) -> torch.Tensor:
    """``out [rows, K] = (q - z) * scale`` (fp32, exact) from nibble-planar codes; returns ``out``."""
    lib = load()
    if lib is None:
        raise RuntimeError("the native INT4 kernels are not available (see musecore_xeon.kernels.native.UNAVAILABLE)")
    rows, k = out.shape
    _check_layout(codes, scale_zero, k, group_size)
    _check("out", out, (torch.float32,))
    if codes.shape[0] != rows:
        raise ValueError(f"int4_dequant: {codes.shape[0]} code rows for an output of {rows} rows")
    lib.musecore_int4_dequant(codes.data_ptr(), scale_zero.data_ptr(), out.data_ptr(), rows, k, group_size,
                              torch.get_num_threads())
    return out


def int4_moe(pointers: torch.Tensor, z: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
             post_norm: torch.Tensor, post_eps: float, intermediate: int, group_sizes: tuple[int, int],
             padded_rows: tuple[int, int], rows: Optional[list[int]] = None) -> torch.Tensor:
    """The routed INT4 experts of one MoE call in one native call -> fp32 ``[T, h]`` (``musecore_int4_moe``: gate/up
    GEMV, SwiGLU, down GEMV, the expert's output rounded to ``z``'s dtype, the shared post-expert norm scale first,
    the routing weight, the fp32 sum: the ``moe`` contract of :mod:`musecore.ops`).

    ``pointers`` int64 ``[4, E]``: per expert the data pointers of the fused gate/up codes, its scale/zero
    pairs, the down codes and its pairs (the tensors must stay alive: :class:`XeonExperts` holds them).
    ``z`` bf16/fp32 ``[T, h]``, ``ids`` int64 ``[T, k]``, ``weights`` fp32 ``[T, k]``, ``post_norm``
    bf16/fp32 ``[h]`` (one weight shared by all experts), all contiguous. Meant for decode sizes: every expert's rows
    go through the GEMV / skinny-GEMM row blocks (no dense tiles). ``rows``: :func:`row_addresses` of ``pointers``,
    when the caller keeps them (decode: ~2 us per call).
    """
    lib, post_norm = _moe_inputs(z, post_norm)
    (t, h), (_, k_top), e = z.shape, ids.shape, pointers.shape[1]
    y = torch.empty(t, h, dtype=torch.float32)
    status = lib.musecore_int4_moe(*(rows or row_addresses(pointers)), z.data_ptr(), int(z.dtype == torch.bfloat16),
                                   ids.data_ptr(), weights.data_ptr(), post_norm.data_ptr(),
                                   int(post_norm.dtype == torch.bfloat16), post_eps, y.data_ptr(), t, k_top, e, h,
                                   intermediate, group_sizes[0], group_sizes[1], padded_rows[0], padded_rows[1],
                                   torch.get_num_threads())
    return _moe_result("int4_moe", status, y, ids, e)


def bf16_moe(pointers: torch.Tensor, z: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
             post_norm: torch.Tensor, post_eps: float, intermediate: int,
             rows: Optional[list[int]] = None) -> torch.Tensor:
    """The routed BF16 experts of one MoE call in one native call -> fp32 ``[T, h]`` (``musecore_bf16_moe``: the
    same driver as :func:`int4_moe`, with the BF16 GEMV's row kernel). ``pointers`` int64 ``[2, E]``: per expert
    the data pointers of its contiguous bf16 fused gate/up ``[2I, h]`` and down ``[h, I]`` weights (kept alive by
    :class:`XeonExperts`); the other arguments as for :func:`int4_moe`.
    """
    lib, post_norm = _moe_inputs(z, post_norm)
    (t, h), (_, k_top), e = z.shape, ids.shape, pointers.shape[1]
    y = torch.empty(t, h, dtype=torch.float32)
    status = lib.musecore_bf16_moe(*(rows or row_addresses(pointers)), z.data_ptr(),
                                   int(z.dtype == torch.bfloat16), ids.data_ptr(), weights.data_ptr(),
                                   post_norm.data_ptr(), int(post_norm.dtype == torch.bfloat16), post_eps, y.data_ptr(),
                                   t, k_top, e, h, intermediate, torch.get_num_threads())
    return _moe_result("bf16_moe", status, y, ids, e)


def row_addresses(pointers: torch.Tensor) -> list[int]:
    """The address of each row of the contiguous int64 pointer table ``[R, E]`` as plain ints (no aten ``select`` per
    row: these calls are on the decode path, 4 selects were ~3-4 us of a ~10 us MoE call)."""
    base, row_bytes = pointers.data_ptr(), pointers.stride(0) * pointers.element_size()
    return [base + i * row_bytes for i in range(pointers.shape[0])]


def _moe_inputs(z: torch.Tensor, post_norm: torch.Tensor) -> tuple[ctypes.CDLL, torch.Tensor]:
    lib = load()
    if lib is None:
        raise RuntimeError("the native kernels are not available (see musecore_xeon.kernels.native.UNAVAILABLE)")
    _check("z", z, (torch.bfloat16, torch.float32))  # the roundings to z's dtype are done in C for these two only
    if post_norm.shape != (z.shape[1],):
        raise ValueError(f"moe: the post-expert norm weight must be [{z.shape[1]}] (one, shared by all experts); "
                         f"got {tuple(post_norm.shape)}")
    if post_norm.dtype not in (torch.bfloat16, torch.float32):
        post_norm = post_norm.float()
    return lib, post_norm.contiguous()


def _moe_result(name: str, status: int, y: torch.Tensor, ids: torch.Tensor, experts: int) -> torch.Tensor:
    if status == -1:
        raise ValueError(f"{name}: expert ids must lie in [0, {experts}); got {ids.min().item()}..{ids.max().item()}")
    if status:
        raise MemoryError(f"{name}: no memory for the scratch buffers of {tuple(ids.shape)} routed rows")
    return y


@functools.cache
def ops_binding(max_elements: int, max_queries: int) -> Optional[ModuleType]:
    """The CPython extension with its norm, router, softcap and decode-attention functions bound to this library's
    kernels, taking inputs of at most ``max_elements`` elements (K/V caches, router weights and softcapped logits
    excepted) and attention and router calls of at most ``max_queries`` queries (:mod:`musecore_xeon.ops` calls them,
    taking its PyTorch path when one returns None), or None without the extension or without the library: the ops
    then run their PyTorch path (the same math)."""
    fast = linear_binding()
    if fast is None:
        return None
    lib = load()
    address = lambda fn: ctypes.cast(fn, ctypes.c_void_p).value  # noqa: E731
    fast.set_ops(address(lib.musecore_rms_norm), address(lib.musecore_residual_norm), address(lib.musecore_norm_rope),
                 address(lib.musecore_head_norm_gate), address(lib.musecore_router_topk), address(lib.musecore_attention),
                 address(lib.musecore_router), address(lib.musecore_logit_softcap), max_elements, max_queries)
    from musecore_xeon.kernels.binding import torch_tanh_kernel
    fast.set_tanh(*torch_tanh_kernel())  # (0, 0): no kernel with torch.tanh's bits, the softcap runs PyTorch's ops
    return fast
