"""Turning resident 4-bit tiles into f32 weights inside a kernel: nibbles, codes, block scales.

The resident layout (:mod:`musecore_tpu.layouts`) keeps every 4-bit format K-major, ``codes [K/2, N]`` u8, with
the two nibbles of a byte holding rows ``k`` (low) and ``k + tk/2`` (high) of the same K tile ("half-split"):
unpacking a tile is two shifts and no lane shuffle, and each half multiplies a contiguous half of the
activation tile. Scales are ``[K/g, N]``: E4M3 (NVFP4) and E8M0 (MXFP4) as their bytes, INT4 as f32.

Every decoded value equals the reference's (``musecore_quant.dequantize``): E2M1 codes, E4M3 and E8M0 scales are
decoded exactly and multiplied in the reference's order, so the kernel's error is only its summation order.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

FP4_FORMATS = ("nvfp4", "mxfp4")


def pow2(exponent: jax.Array) -> jax.Array:
    """``2.0 ** exponent`` (int32, -126..127) in f32, exactly: the exponent placed in the f32 bits."""
    return jax.lax.bitcast_convert_type(jnp.left_shift(exponent + 127, 23), jnp.float32)


def e2m1(codes: jax.Array) -> jax.Array:
    """f32 values of E2M1 codes (int32, 0..15): 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives."""
    e, mant = (codes >> 1) & 3, (codes & 1).astype(jnp.float32)
    magnitude = jnp.where(e == 0, 0.5 * mant, (2.0 + mant) * pow2(e - 2))
    return jnp.where(codes >= 8, -magnitude, magnitude)


def e4m3(bits: jax.Array) -> jax.Array:
    """f32 values of float8_e4m3fn bytes (int32); block scales are positive and finite."""
    e, mant = (bits >> 3) & 15, (bits & 7).astype(jnp.float32)
    value = jnp.where(e == 0, mant * (2.0 ** -9), (8.0 + mant) * pow2(jnp.maximum(e, 1) - 10))
    return jnp.where(bits >= 128, -value, value)


def e8m0(bits: jax.Array) -> jax.Array:
    """f32 ``2^(byte-127)`` of E8M0 bytes (int32); byte 0 is 2^-127 (an f32 subnormal)."""
    normal = jax.lax.bitcast_convert_type(jnp.left_shift(bits, 23), jnp.float32)
    return jnp.where(bits == 0, jnp.float32(2.0 ** -127), normal)


def block_scales(fmt: str, scales: jax.Array, global_scale: jax.Array | None) -> jax.Array:
    """f32 scales ``[K/g, N]`` of a tile, as the reference computes them (NVFP4: ``fp32(e4m3) * weight_scale_2``)."""
    if fmt == "nvfp4":
        return e4m3(scales.astype(jnp.int32)) * global_scale
    if fmt == "mxfp4":
        return e8m0(scales.astype(jnp.int32))
    return scales.astype(jnp.float32)


def decode_halves(fmt: str, group: int, codes: jax.Array, scales: jax.Array, zeros: jax.Array | None,
                  global_scale: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """A half-split tile ``codes [tk/2, tn]`` -> the f32 weights of its rows ``[0, tk/2)`` and ``[tk/2, tk)``."""
    half = codes.shape[0]
    packed = codes.astype(jnp.int32)
    s = jnp.repeat(block_scales(fmt, scales, global_scale), group, axis=0)  # [tk, tn]: sublane broadcast
    out = []
    for i, nibbles in enumerate((packed & 15, packed >> 4)):
        rows = slice(i * half, (i + 1) * half)
        if fmt in FP4_FORMATS:
            values = e2m1(nibbles)
        else:  # INT4: (q - z) * s, z = 8 when symmetric
            z = 8.0 if zeros is None else jnp.repeat(zeros.astype(jnp.float32), group, axis=0)[rows]
            values = nibbles.astype(jnp.float32) - z
        out.append(values * s[rows])
    return out[0], out[1]
