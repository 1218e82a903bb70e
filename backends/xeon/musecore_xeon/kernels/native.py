"""A one-pass INT4 -> fp32 tile dequantizer in C, compiled at first use and called through ctypes.

Why: the dense-tile path costs one SGEMM plus one dequantization per tile, and the BF16 path it is
compared with costs the same SGEMM plus one BF16 -> fp32 copy (one write of the fp32 tile). With
PyTorch ops the INT4 tile takes four passes (``& 0xF``, ``>> 4``, two converting copies, ``mul_``),
measured 0.5-0.7 ms per 2 Mi-element tile against 0.25-0.3 ms for the BF16 upcast on the 2-core
EPYC, which left INT4 at 0.85-0.95x of BF16 above the crossover. This loop writes each fp32 weight
once (``fma(q, scale, offset)``, auto-vectorised by the compiler) and measured 0.27 ms: parity.

It needs a C compiler (``cc``/``gcc``, no PyTorch headers, <1 s) the first time; the shared
object is cached under ``$MUSECORE_XEON_CACHE`` (default ``~/.cache/musecore_xeon``) by a hash
of the source and flags. Without a compiler, or with ``MUSECORE_XEON_NATIVE_DEQUANT=0``, the
backend uses the PyTorch-op dequantization (same values, slower). Single-threaded: the GEMM that
follows is PyTorch's and uses every intra-op thread.

Exactness: ``q * scale`` is exact in fp32 (a 4-bit code times a bf16 scale), so the fused
multiply-add rounds the same real number once, exactly as ``mul_`` then ``add_`` do.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path
from typing import Optional

import torch

NATIVE_ENV = "MUSECORE_XEON_NATIVE_DEQUANT"
CACHE_ENV = "MUSECORE_XEON_CACHE"

SOURCE = r"""
#include <stdint.h>

/* out[j] = ((codes[j - c0] >> shift) & 15) * scale[j / g] + offset[j / g] for columns c0 <= j < c1 */
static void columns(const uint8_t *codes, int shift, const float *scale, const float *offset, float *out,
                    int64_t c0, int64_t c1, int64_t g) {
    for (int64_t a = c0; a < c1;) {
        int64_t b = (a / g + 1) * g;
        if (b > c1) b = c1;
        const float s = scale[a / g], o = offset[a / g];
        const uint8_t *c = codes - c0;
        for (int64_t j = a; j < b; ++j) out[j] = (float)((c[j] >> shift) & 15) * s + o;
        a = b;
    }
}

/* out[r, c] = q * scale[r, c / g] + offset[r, c / g] for r < rows, c < k, where the codes are
   uint8 [rows, k/2] in split-K halves: low nibble = column c, high nibble = column c + k/2. */
void musecore_dequant_split_k(const uint8_t *codes, const float *scale, const float *offset, float *out,
                              int64_t rows, int64_t k, int64_t g) {
    const int64_t half = k / 2, groups = k / g;
    for (int64_t r = 0; r < rows; ++r) {
        const uint8_t *c = codes + r * half;
        const float *s = scale + r * groups, *o = offset + r * groups;
        float *row = out + r * k;
        columns(c, 0, s, o, row, 0, half, g);
        columns(c, 4, s, o, row, half, k, g);
    }
}
"""


def compile_flags() -> list[str]:
    from musecore_xeon.cpu import read_cpu_info
    info = read_cpu_info()
    isa = ["-mavx2", "-mfma"] if info.has("avx2") and info.has("fma") else []
    return ["-O3", "-fPIC", "-shared", *isa]


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "musecore_xeon")


UNAVAILABLE: list[str] = []  # why the native dequantizer is not used, once known (shown by probe details)


def _unavailable(reason: str) -> None:
    """Not a silent fallback: the slower PyTorch-op dequantization is announced once, with the reason."""
    UNAVAILABLE.append(reason)
    warnings.warn(f"musecore-xeon: {reason}; INT4 dense tiles use the slower PyTorch-op dequantization "
                  f"(same values). Set {NATIVE_ENV}=0 to choose that explicitly.", RuntimeWarning, stacklevel=3)


@functools.cache
def load() -> Optional[ctypes.CDLL]:
    """The compiled dequantizer, or None (disabled, no compiler, or the build failed)."""
    if os.environ.get(NATIVE_ENV, "").strip().lower() in ("0", "off", "no", "false"):
        UNAVAILABLE.append(f"disabled by {NATIVE_ENV}")
        return None
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    try:
        flags = compile_flags()
        digest = hashlib.sha256((SOURCE + " ".join(flags)).encode()).hexdigest()[:16]
        target = cache_dir() / f"dequant-{digest}.so"
        if not target.exists():
            if compiler is None:
                _unavailable("no C compiler (cc/gcc) to build the native INT4 dequantizer")
                return None
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                src, obj = Path(tmp) / "dequant.c", Path(tmp) / "dequant.so"
                src.write_text(SOURCE)
                subprocess.run([compiler, *flags, "-o", str(obj), str(src)], check=True, capture_output=True,
                               timeout=120)
                os.replace(obj, target)  # atomic: concurrent processes never load a half-written file
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as err:
        _unavailable(f"building/loading the native INT4 dequantizer failed ({type(err).__name__}: {err})")
        return None
    fn = lib.musecore_dequant_split_k
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3
    fn.restype = None
    return lib


def available() -> bool:
    return load() is not None


def dequant_split_k(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, out: torch.Tensor,
                    group_size: int) -> torch.Tensor:
    """``out [rows, K] = q * scale + offset`` (fp32) from split-K codes ``[rows, K/2]`` and fp32
    ``scale``/``offset`` ``[rows, K/g]`` (each contiguous, e.g. a row slice); returns ``out``."""
    lib = load()
    if lib is None:
        raise RuntimeError("the native INT4 dequantizer is not available (see musecore_xeon.kernels.native)")
    rows, k = out.shape
    for t, dtype in ((codes, torch.uint8), (scale, torch.float32), (offset, torch.float32), (out, torch.float32)):
        if t.dtype != dtype or not t.is_contiguous():
            raise ValueError(f"dequant_split_k: expected contiguous {dtype}, got {t.dtype} "
                             f"(contiguous={t.is_contiguous()})")
    if k % group_size or k % 2 or codes.shape != (rows, k // 2) \
            or not scale.numel() == offset.numel() == rows * (k // group_size):
        raise ValueError(f"dequant_split_k: shapes codes {tuple(codes.shape)}, scale {tuple(scale.shape)}, "
                         f"out {tuple(out.shape)}, group size {group_size} do not match")
    lib.musecore_dequant_split_k(codes.data_ptr(), scale.data_ptr(), offset.data_ptr(), out.data_ptr(),
                                 rows, k, group_size)
    return out
