"""RMSNorm and the fused post-sublayer norm + gated residual + next pre-norm, one row tile per grid step.

``musecore.ops`` contracts: ``rms(x) = x * (mean(x^2) + eps)^-1/2`` in f32; ``scale_first`` rounds ``x * w`` to x's
dtype before the norm (transformers' InputScaledRMSNorm); ``residual_norm`` computes
``h = rms(round(out * post_w))`` (weightless ``rms(out)`` without post_w) rounded to out's dtype,
``residual' = alpha * residual + beta * h`` in f32 rounded to the residual's dtype, and ``rms(residual') * next_w``.
The row is the full hidden width (the reduction needs all of it), so a block is ``[tr, H]``.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from musecore_tpu.kernels import tiling
from musecore_tpu.kernels.matmul import interpret_mode


def _rms(x: jax.Array, eps: float) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


def _norm(x: jax.Array, w: Optional[jax.Array], eps: float, scale_first: bool, dtype: Any) -> jax.Array:
    """One RMSNorm of f32-castable rows, output rounded to ``dtype``."""
    if scale_first:
        return _rms((x.astype(jnp.float32) * w).astype(dtype).astype(jnp.float32), eps).astype(dtype)
    y = _rms(x.astype(jnp.float32), eps)
    return (y if w is None else y * w).astype(dtype)


def _rms_kernel(eps: float, scale_first: bool, has_weight: bool, x_ref, *refs):
    w = refs[0][...].astype(jnp.float32) if has_weight else None
    o_ref = refs[-1]
    o_ref[...] = _norm(x_ref[...], w, eps, scale_first, o_ref.dtype)


def _rows(x: jax.Array) -> tuple[jax.Array, int, int, int]:
    n = x.shape[-1]
    flat = x.reshape(-1, n)
    R = flat.shape[0]
    tr = tiling.norm_rows_tile(R)
    Rp = tiling.round_up(R, tr)
    return (jnp.pad(flat, ((0, Rp - R), (0, 0))) if Rp != R else flat), R, tr, Rp


@functools.partial(jax.jit, static_argnames=("eps", "scale_first", "interpret"))
def rms_norm(x: jax.Array, weight: Optional[jax.Array], *, eps: float, scale_first: bool = False,
             interpret: bool = False) -> jax.Array:
    """``[..., n] -> [..., n]`` in x's dtype."""
    flat, R, tr, Rp = _rows(x)
    n = x.shape[-1]
    operands, specs = [flat], [pl.BlockSpec((tr, n), lambda i: (i, 0))]
    if weight is not None:
        operands.append(weight.reshape(1, n))
        specs.append(pl.BlockSpec((1, n), lambda i: (0, 0)))
    y = pl.pallas_call(functools.partial(_rms_kernel, eps, scale_first, weight is not None), grid=(Rp // tr,),
                       in_specs=specs, out_specs=pl.BlockSpec((tr, n), lambda i: (i, 0)),
                       out_shape=jax.ShapeDtypeStruct((Rp, n), x.dtype),
                       compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
                       interpret=interpret_mode(interpret))(*operands)
    return y[:R].reshape(x.shape)


def _residual_kernel(post_eps: float, eps: float, has_post: bool, res_ref, out_ref, coef_ref, *refs):
    post = refs[0][...].astype(jnp.float32) if has_post else None
    next_w = refs[-3][...].astype(jnp.float32)
    new_res_ref, normed_ref = refs[-2], refs[-1]
    h = _norm(out_ref[...], post, post_eps, has_post, out_ref.dtype).astype(jnp.float32)
    alpha, beta = coef_ref[0:1, :], coef_ref[1:2, :]
    new_res = (alpha * res_ref[...].astype(jnp.float32) + beta * h).astype(new_res_ref.dtype)
    new_res_ref[...] = new_res
    normed_ref[...] = _norm(new_res, next_w, eps, False, normed_ref.dtype)


@functools.partial(jax.jit, static_argnames=("post_eps", "eps", "interpret"))
def residual_norm(residual: jax.Array, out: jax.Array, post_weight: Optional[jax.Array], alpha: jax.Array,
                  beta: jax.Array, next_weight: jax.Array, *, post_eps: float, eps: float,
                  interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """``(residual', normed)``, both ``[..., H]`` in the residual's dtype."""
    res, R, tr, Rp = _rows(residual)
    o, *_ = _rows(out)
    n = residual.shape[-1]
    row = pl.BlockSpec((tr, n), lambda i: (i, 0))
    vec = pl.BlockSpec((1, n), lambda i: (0, 0))
    coef = jnp.stack([alpha.astype(jnp.float32), beta.astype(jnp.float32)])  # [2, H]
    operands = [res, o, coef] + ([post_weight.reshape(1, n)] if post_weight is not None else []) + \
        [next_weight.reshape(1, n)]
    specs = [row, row, pl.BlockSpec((2, n), lambda i: (0, 0))] + ([vec] if post_weight is not None else []) + [vec]
    new_res, normed = pl.pallas_call(
        functools.partial(_residual_kernel, post_eps, eps, post_weight is not None), grid=(Rp // tr,),
        in_specs=specs, out_specs=[row, row],
        out_shape=[jax.ShapeDtypeStruct((Rp, n), residual.dtype), jax.ShapeDtypeStruct((Rp, n), residual.dtype)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=interpret_mode(interpret))(*operands)
    return new_res[:R].reshape(residual.shape), normed[:R].reshape(residual.shape)


def rms_norm_reference(x: jax.Array, weight: Optional[jax.Array], *, eps: float, scale_first: bool = False) -> Any:
    xf = x.astype(jnp.float32)
    if scale_first:
        s = (xf * weight.astype(jnp.float32)).astype(x.dtype).astype(jnp.float32)
        return (s / jnp.sqrt(jnp.mean(s ** 2, -1, keepdims=True) + eps)).astype(x.dtype)
    y = xf / jnp.sqrt(jnp.mean(xf ** 2, -1, keepdims=True) + eps)
    return (y if weight is None else y * weight.astype(jnp.float32)).astype(x.dtype)


def residual_norm_reference(residual: jax.Array, out: jax.Array, post_weight: Optional[jax.Array], alpha: jax.Array,
                            beta: jax.Array, next_weight: jax.Array, *, post_eps: float, eps: float) -> Any:
    h = rms_norm_reference(out, post_weight, eps=post_eps, scale_first=post_weight is not None)
    new = (alpha.astype(jnp.float32) * residual.astype(jnp.float32) + beta.astype(jnp.float32) * h.astype(jnp.float32))
    new = new.astype(residual.dtype)
    return new, rms_norm_reference(new, next_weight, eps=eps)
