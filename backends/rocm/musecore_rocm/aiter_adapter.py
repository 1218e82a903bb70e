"""AMD's aiter (ROCm/aiter; PyPI ``amd-aiter``) as an optional plan candidate: never required.

On a ROCm host with aiter installed, ``aiter.fused_moe(..., quant_type=QuantType.per_1x32)`` (MXFP4
MoE, weights pre-shuffled with ``shuffle_weight`` / ``e8m0_shuffle``) and ``gemm_a4w4`` are the
vendor's tuned kernels beside this backend's Triton ones. This module answers whether they are
usable here and why not, and holds aiter's preshuffled weight/scale layouts as tested permutations
(below); the calls into aiter's kernels are not written (no ROCm host was reachable to check their
arguments), so aiter is never selected yet. Its absence is a plan reason, not an error. Note that the PyPI name ``aiter`` is an unrelated asyncio package: the
import alone does not prove AMD's library is present, so the check looks for ``fused_moe``.
"""

from __future__ import annotations

import importlib.util

AITER_SYMBOLS = ("fused_moe", "gemm_a4w4")


def aiter_status() -> tuple[bool, str]:
    """``(usable, reason)`` for AMD's aiter in this process; never raises, imports nothing when absent."""
    if importlib.util.find_spec("aiter") is None:
        return False, "aiter is not installed (AMD's ROCm/aiter, PyPI amd-aiter; optional)"
    try:
        import aiter
    except Exception as exc:  # aiter imports HIP extensions: on a host without ROCm the import fails
        return False, f"import aiter failed ({type(exc).__name__}: {exc})"
    missing = [s for s in AITER_SYMBOLS if not hasattr(aiter, s)]
    if missing:
        return False, (f"the installed 'aiter' lacks {missing}: it is not AMD's aiter (PyPI 'aiter' is an unrelated "
                       "asyncio package)")
    return False, ("AMD aiter is importable, but the calls into its kernels are not written (only its MXFP4 "
                   "weight/scale shuffles are, as tested permutations); the Triton kernels run")


# -- aiter's preshuffled MXFP4 layouts (what gemm_a4w4 / fused_moe read), as permutations --------------
# Written from aiter's definitions (aiter/ops/shuffle.py: ``shuffle_weight`` with layout (16, 16) on
# uint8, ``shuffle_scale`` for E8M0) so that the adapter can prepare weights once at load; each has
# its inverse, and the tests check both are bijections that undo each other (and equal aiter's own
# functions where aiter is importable).

WEIGHT_TILE_N, WEIGHT_TILE_K_BYTES, WEIGHT_LANE_BYTES = 16, 32, 16


def _weight_view(shape: tuple[int, ...]) -> tuple[int, ...]:
    *lead, n, kb = shape
    if n % WEIGHT_TILE_N or kb % WEIGHT_TILE_K_BYTES:
        raise ValueError(f"aiter's weight shuffle needs rows % {WEIGHT_TILE_N} == 0 and packed bytes % "
                         f"{WEIGHT_TILE_K_BYTES} == 0; got {list(shape)}")
    return (-1, n // WEIGHT_TILE_N, WEIGHT_TILE_N, kb // WEIGHT_TILE_K_BYTES,
            WEIGHT_TILE_K_BYTES // WEIGHT_LANE_BYTES, WEIGHT_LANE_BYTES)


def shuffle_weight(packed):
    """Canonical MXFP4 bytes ``[..., N, K/2]`` -> aiter's (16, 16) preshuffled order (same shape)."""
    return packed.reshape(_weight_view(tuple(packed.shape))).permute(0, 1, 3, 4, 2, 5).contiguous().reshape(packed.shape)


def unshuffle_weight(shuffled):
    """Inverse of :func:`shuffle_weight`."""
    *lead, n, kb = shuffled.shape
    v = _weight_view(tuple(shuffled.shape))
    tiled = shuffled.reshape(v[0], v[1], v[3], v[4], v[2], v[5])
    return tiled.permute(0, 1, 4, 2, 3, 5).contiguous().reshape(shuffled.shape)


def shuffle_scale(scale):
    """E8M0 scales ``[M, K/32]`` -> aiter's shuffled order, padded to ``[ceil(M/256)*256, ceil(K/32 / 8)*8]``."""
    import torch
    m, n = scale.shape
    sm, sn = (m + 255) // 256 * 256, (n + 7) // 8 * 8
    padded = torch.zeros(sm, sn, dtype=scale.dtype, device=scale.device)
    padded[:m, :n] = scale
    return padded.view(sm // 32, 2, 16, sn // 8, 2, 4).permute(0, 3, 5, 2, 4, 1).contiguous().view(sm, sn)


def unshuffle_scale(shuffled, rows: int, cols: int):
    """Inverse of :func:`shuffle_scale`: the ``[rows, cols]`` scales back in row-major order."""
    sm, sn = shuffled.shape
    tiled = shuffled.view(sm // 32, sn // 8, 4, 16, 2, 2)  # the permuted axes (0, 3, 5, 2, 4, 1)
    return tiled.permute(0, 5, 3, 1, 4, 2).contiguous().view(sm, sn)[:rows, :cols]
