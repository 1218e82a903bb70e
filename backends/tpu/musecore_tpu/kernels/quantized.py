"""8-bit weights on the TPU's MXU: INT8 (v6e's int8 MXU, 2x its bf16 rate) and FP8 E4M3 (v7's FP8 MXU, 2x bf16).

``y = x @ W^T`` with ``W^T`` resident K-major as 8-bit codes ``q8 [K, N]`` and an f32 scale, ``W = q8 * wscale``:

- ``int8``: symmetric per output channel, ``wscale [1, N] = amax(|W_n|) / 127`` (musecore_quant's ``int8`` codec, a
  load-time target of the ``tpu-v6e-int8`` device: 1 byte + 4/K bytes per weight, half of BF16);
- ``fp8``: E4M3 with one per-tensor scale, ``wscale [1, 1]`` (musecore_quant's FP8 codec, ModelOpt's rule).

Activations, ``act``:

- ``None`` (W8A16): the 8-bit values are exact in bf16, so the kernel feeds bf16 x bf16 to the MXU in ONE pass
  (f32 accumulation) and applies the scale after the K sum: only the summation order differs from fp32 math;
- ``"int8-token"`` (W8A8 INT8, v6e): each row quantized to int8 with its own scale ``amax(|x_t|) / 127``;
  int8 x int8 dots accumulate exactly in int32, scaled by ``xscale_t * wscale_n`` at the end;
- ``"fp8-token"`` (W8A8 FP8, v7; musecore's ``fp8-token`` activation format, as on ``h200-fp8``): each row to E4M3
  with scale ``amax(|x_t|) / 448``; E4M3 x E4M3 dots accumulate in f32 (every product is exact in f32).

The activation quantization is a jnp pre-pass (one read of ``x``: its row amax needs all of K, a K tile does not
have it); XLA fuses it on a TPU. Its scales and quotients are correctly rounded, so its codes are exactly those of
musecore's reference rule (:func:`divide_correctly_rounded`). :func:`matmul_q8` is the Pallas kernel,
:func:`matmul_q8_reference` the same
contract in plain jnp (dequantize everything, one f32 matmul).
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from musecore_tpu.kernels import tiling
from musecore_tpu.kernels.matmul import HIGHEST, interpret_mode

WEIGHT_FORMATS = ("int8", "fp8")
ACT_FORMATS = (None, "int8-token", "fp8-token")
INT8_MAX = 127.0
E4M3_MAX = 448.0


def _split(a: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Veltkamp's split of f32 ``a`` into ``hi + lo``, each with at most 12 significant bits (so their products are
    exact in f32)."""
    t = a * 4097.0
    hi = t - (t - a)
    return hi, a - hi


def _product_error(a: jax.Array, b: jax.Array, p: jax.Array) -> jax.Array:
    """``a * b - p`` exactly, for ``p = fl(a * b)`` (Dekker's TwoProduct; no FMA needed)."""
    a_hi, a_lo = _split(a)
    b_hi, b_lo = _split(b)
    return ((a_hi * b_hi - p) + a_hi * b_lo + a_lo * b_hi) + a_lo * b_lo


def divide_correctly_rounded(x: jax.Array, s: jax.Array) -> jax.Array:
    """``x / s`` correctly rounded in f32 (``s > 0``), as musecore's reference divides; the hardware's quotient can be
    an ulp off, and bf16 activations often sit exactly on a code's rounding tie (``x = amax / 2`` is ``63.5`` steps
    before ``amax / 127`` is rounded), where one ulp decides the code. Of the hardware's quotient and its two
    neighbours, the one whose residual ``x - c*s`` is smallest: ``c*s = p + e`` exactly (:func:`_product_error`),
    ``x - p`` is exact (Sterbenz), so ``(x - p) - e`` is the residual to 2^-24 of itself, far finer than the gap
    ``ulp(c) * s`` between neighbours. Exact while the product's error terms stay normal f32 (``|x| > 2^-75``;
    below, XLA flushes them to zero): a code's rounding boundary there would need a row amax below 2^-58."""
    def residual(c: jax.Array) -> jax.Array:
        p = c * s
        return jnp.abs((x - p) - _product_error(c, s, p))
    best = x / s
    best_residual = residual(best)
    for candidate in (jnp.nextafter(best, jnp.inf), jnp.nextafter(best, -jnp.inf)):
        r = residual(candidate)
        best = jnp.where(r < best_residual, candidate, best)
        best_residual = jnp.minimum(r, best_residual)
    return best


def token_scale(amax: jax.Array, act: str) -> jax.Array:
    """The reference's per-token scale, correctly rounded: ``amax / 127`` (``int8-token``) or ``amax / 448``
    (``fp8-token``); 1.0 where it is 0. (XLA turns a division by a constant into a multiply by its reciprocal:
    measured, 4% of ``amax / 127`` scales an ulp off on this CPU.)"""
    top = INT8_MAX if act == "int8-token" else E4M3_MAX
    scale = divide_correctly_rounded(amax, jnp.full_like(amax, top))
    return jnp.where(scale == 0, 1.0, scale)


def quantize_tokens(x: jax.Array, act: str) -> tuple[jax.Array, jax.Array]:
    """Rows of ``x [M, K]`` -> (8-bit codes, f32 scale per row ``[M, 1]``); a zero row gets scale 1.0.

    ``fp8-token`` is musecore's reference rule (``musecore.ops.reference.fake_quantize_activation``): the f32
    quotient clamped to +-448, cast to E4M3 (round to nearest even). ``int8-token``: round to nearest even,
    clamped to +-127 (symmetric, no -128). The scales (:func:`token_scale`) and the quotients ``x / scale``
    (:func:`divide_correctly_rounded`) are correctly rounded, as the reference's, so the codes are the reference's
    codes: a one-pass elementwise prologue (a few dozen VPU flops per value; the amax needs the whole row anyway)."""
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=-1, keepdims=True)
    top = INT8_MAX if act == "int8-token" else E4M3_MAX
    scale = token_scale(amax, act)
    quotient = jnp.clip(divide_correctly_rounded(xf, scale), -top, top)
    if act == "int8-token":
        return jnp.round(quotient).astype(jnp.int8), scale
    return quotient.astype(jnp.float8_e4m3fn), scale


def _q8_kernel(act: Optional[str], bf16_pass: bool, x_ref, *refs):
    xs_ref = refs[0] if act else None
    w_ref, ws_ref, o_ref, acc_ref = refs[-4:]
    k = pl.program_id(2)

    @pl.when(k == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    if act == "int8-token":      # int8 x int8 -> int32: exact
        acc_ref[...] += jnp.dot(x_ref[...], w_ref[...], preferred_element_type=jnp.int32)
    elif act == "fp8-token":     # e4m3 x e4m3 -> f32: every product exact
        acc_ref[...] += jnp.dot(x_ref[...], w_ref[...], preferred_element_type=jnp.float32)
    elif bf16_pass:              # 8-bit values are exact in bf16: one MXU pass
        acc_ref[...] += jnp.dot(x_ref[...].astype(jnp.bfloat16), w_ref[...].astype(jnp.bfloat16),
                                preferred_element_type=jnp.float32)
    else:                        # f32 activations: the 6-pass f32 path
        acc_ref[...] += jnp.dot(x_ref[...].astype(jnp.float32), w_ref[...].astype(jnp.float32),
                                preferred_element_type=jnp.float32, precision=HIGHEST)

    @pl.when(k == pl.num_programs(2) - 1)
    def _():
        y = acc_ref[...].astype(jnp.float32) * ws_ref[...]
        if act:
            y = y * xs_ref[...]
        o_ref[...] = y.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("fmt", "act", "out_dtype", "interpret"))
def matmul_q8(x: jax.Array, w: dict, *, fmt: str, act: Optional[str] = None, out_dtype: Any = jnp.bfloat16,
              interpret: Any = False) -> jax.Array:
    """``x [M, K] @ W^T -> [M, N]``, ``w = {"q8": [K, N] int8 | float8_e4m3fn, "wscale": [1, N] | [1, 1] f32}``."""
    if fmt not in WEIGHT_FORMATS or act not in ACT_FORMATS:
        raise ValueError(f"matmul_q8 takes weights {WEIGHT_FORMATS} and activations {ACT_FORMATS}; got {fmt}, {act}")
    if act is not None and act[:-len("-token")] != fmt:
        raise ValueError(f"{act} activations need {act[:-len('-token')]} weights (one MXU operand type); got {fmt}")
    M, K = x.shape
    N = w["q8"].shape[1]
    cfg = tiling.q8_config(fmt, act, M, K, N)
    tm, tk, tn = cfg.tiles
    Mp = tiling.round_up(M, tm)
    operands, in_specs = [], []
    if act is None:
        xin = x
    else:
        xin, xscale = quantize_tokens(x, act)
    if Mp != M:
        xin = jnp.pad(xin, ((0, Mp - M), (0, 0)))
    operands.append(xin)
    in_specs.append(pl.BlockSpec((tm, tk), lambda i, j, k: (i, k)))
    if act is not None:
        operands.append(jnp.pad(xscale, ((0, Mp - M), (0, 0)), constant_values=1.0) if Mp != M else xscale)
        in_specs.append(pl.BlockSpec((tm, 1), lambda i, j, k: (i, 0)))
    wscale = w["wscale"].astype(jnp.float32).reshape(1, -1)
    operands += [w["q8"], wscale]
    in_specs += [pl.BlockSpec((tk, tn), lambda i, j, k: (k, j)),
                 pl.BlockSpec((1, tn), lambda i, j, k: (0, j)) if wscale.shape[1] == N else
                 pl.BlockSpec((1, 1), lambda i, j, k: (0, 0))]
    acc_dtype = jnp.int32 if act == "int8-token" else jnp.float32
    y = pl.pallas_call(
        functools.partial(_q8_kernel, act, x.dtype == jnp.bfloat16), grid=(Mp // tm, N // tn, K // tk),
        in_specs=in_specs, out_specs=pl.BlockSpec((tm, tn), lambda i, j, k: (i, j)),
        out_shape=jax.ShapeDtypeStruct((Mp, N), out_dtype), scratch_shapes=[pltpu.VMEM((tm, tn), acc_dtype)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret_mode(interpret))(*operands)
    return y[:M] if Mp != M else y


def matmul_q8_reference(x: jax.Array, w: dict, *, fmt: str, act: Optional[str] = None,
                        out_dtype: Any = jnp.bfloat16) -> jax.Array:
    """:func:`matmul_q8`'s contract in plain jnp: dequantized weights and activations, one f32 matmul."""
    wt = w["q8"].astype(jnp.float32) * w["wscale"].astype(jnp.float32).reshape(1, -1)
    if act is None:
        xf = x.astype(jnp.float32)
    else:
        codes, scale = quantize_tokens(x, act)
        xf = codes.astype(jnp.float32) * scale
    return jnp.dot(xf, wt, precision=HIGHEST).astype(out_dtype)
