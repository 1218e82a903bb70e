"""``y = x @ W^T`` on the TPU: BF16 weights, and 4-bit weights (INT4 g128, MXFP4, NVFP4) kept packed in HBM.

W4A16: the 4-bit codes and block scales stream from HBM (a quarter of BF16's bytes, which is what decode speed
is made of), are decoded in VMEM (:mod:`musecore_tpu.kernels.decode`) and meet 16-bit activations in the MXU.

MXU passes. ``Precision.HIGHEST`` on f32 operands is 6 bf16 passes on a TPU (bf16x6). Where both operands are
exactly bf16 values, one bf16 pass with f32 accumulation gives the same products (a bf16 x bf16 product is exact
in f32), so the kernel uses ONE pass (:func:`dot_bf16`) there: bf16 activations times bf16 weights, MXFP4 (E2M1
times a power of two) and NVFP4 (E2M1 times E4M3: at most 6 significant bits; the per-tensor global scale, which
is not a bf16 value, multiplies the f32 sum at the end). INT4 (``(q - z) * s`` with fp16 scales, up to 15
significant bits) and f32 activations keep HIGHEST: one bf16 pass would round those weights (measured in
``tests/test_kernels.py::test_single_pass_bf16_dots``: NMSE 2.7e-6 for INT4 g128, 1e-15..7e-14, summation
order only, where exact).

:func:`matmul` is the Pallas kernel, :func:`matmul_reference` the same contract in plain ``jnp``.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from musecore_tpu.kernels import tiling
from musecore_tpu.kernels.decode import FP4_FORMATS, decode_halves

HIGHEST = jax.lax.Precision.HIGHEST


BF16_EXACT = ("bf16", "mxfp4", "nvfp4")  # weight formats whose decoded values (before any f32 global scale) are bf16


def _dot(a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.dot(a, b, preferred_element_type=jnp.float32, precision=HIGHEST)


def dot_bf16(a: jax.Array, b: jax.Array) -> jax.Array:
    """ONE bf16 MXU pass, f32 accumulation: exact products when both operands hold bf16 values."""
    return jnp.dot(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), preferred_element_type=jnp.float32)


def single_pass(fmt: str, x_dtype: Any) -> bool:
    """Whether ``x (x_dtype) @ W (fmt)`` is exact in one bf16 pass (see the module docstring)."""
    return x_dtype == jnp.bfloat16 and fmt in BF16_EXACT


def _dense_kernel(x_ref, w_ref, o_ref, acc_ref):
    @pl.when(pl.program_id(2) == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    if x_ref.dtype == jnp.bfloat16 and w_ref.dtype == jnp.bfloat16:
        acc_ref[...] += dot_bf16(x_ref[...], w_ref[...])
    else:
        acc_ref[...] += _dot(x_ref[...].astype(jnp.float32), w_ref[...].astype(jnp.float32))

    @pl.when(pl.program_id(2) == pl.num_programs(2) - 1)
    def _():
        o_ref[...] = acc_ref[...].astype(o_ref.dtype)


def _packed_kernel(fmt: str, group: int, has_zeros: bool, x_ref, codes_ref, scales_ref, *rest):
    zeros_ref = rest[0] if has_zeros else None
    gs_ref = rest[1 if has_zeros else 0] if fmt == "nvfp4" else None
    o_ref, acc_ref = rest[-2], rest[-1]

    @pl.when(pl.program_id(2) == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    one_pass = single_pass(fmt, x_ref.dtype)
    gs = None if gs_ref is None else gs_ref[0, 0]
    lo, hi = decode_halves(fmt, group, codes_ref[...], scales_ref[...], None if zeros_ref is None else zeros_ref[...],
                           None if gs is None else (jnp.float32(1.0) if one_pass else gs))
    x = x_ref[...]
    half = lo.shape[0]
    if one_pass:  # the global scale multiplies the f32 sum below instead of every weight
        acc_ref[...] += dot_bf16(x[:, :half], lo) + dot_bf16(x[:, half:], hi)
    else:
        x = x.astype(jnp.float32)
        acc_ref[...] += _dot(x[:, :half], lo) + _dot(x[:, half:], hi)

    @pl.when(pl.program_id(2) == pl.num_programs(2) - 1)
    def _():
        acc = acc_ref[...]
        o_ref[...] = (acc * gs if one_pass and gs is not None else acc).astype(o_ref.dtype)


def interpret_mode(interpret: Any) -> Any:
    """``interpret=`` for ``pallas_call``: False (compile for the TPU), True or ``"tpu"`` (JAX's TPU interpreter:
    TPU memory spaces, DMAs and semaphores simulated on the CPU), ``"jax"`` (Pallas' generic interpreter: the
    kernel body as plain jax ops, ~10x faster per call, no TPU memory model; for the long model-level tests)."""
    if interpret == "jax":
        return True
    return pltpu.InterpretParams() if interpret else False


@functools.partial(jax.jit, static_argnames=("fmt", "group", "out_dtype", "interpret"))
def matmul(x: jax.Array, w: dict, *, fmt: str, group: int = 0, out_dtype: Any = jnp.bfloat16,
           interpret: bool = False) -> jax.Array:
    """``x [M,K] @ W^T -> [M,N]`` with W resident (:mod:`musecore_tpu.layouts`): ``{"wt": [K,N]}`` for 16-bit
    weights, ``{"codes", "scales", "zeros"?, "global_scale"?}`` for 4-bit ones."""
    M, K = x.shape
    if fmt in FP4_FORMATS or fmt == "int4":
        N = w["codes"].shape[1]
    else:
        N = w["wt"].shape[1]
    cfg_tm, tk, tn = tiling.m_tile(M), tiling.k_tile(fmt, K, group or None), tiling.n_tile(N)
    Mp = tiling.round_up(M, cfg_tm)
    xp = jnp.pad(x, ((0, Mp - M), (0, 0))) if Mp != M else x
    grid = (Mp // cfg_tm, N // tn, K // tk)
    x_spec = pl.BlockSpec((cfg_tm, tk), lambda i, j, k: (i, k))
    out_spec = pl.BlockSpec((cfg_tm, tn), lambda i, j, k: (i, j))
    params = pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"))
    if fmt in ("bf16", "fp16", "fp32"):
        kernel, operands = _dense_kernel, [xp, w["wt"]]
        in_specs = [x_spec, pl.BlockSpec((tk, tn), lambda i, j, k: (k, j))]
    else:
        g = group
        operands = [xp, w["codes"], w["scales"]]
        in_specs = [x_spec, pl.BlockSpec((tk // 2, tn), lambda i, j, k: (k, j)),
                    pl.BlockSpec((tk // g, tn), lambda i, j, k: (k, j))]
        if w.get("zeros") is not None:
            operands.append(w["zeros"])
            in_specs.append(pl.BlockSpec((tk // g, tn), lambda i, j, k: (k, j)))
        if fmt == "nvfp4":
            operands.append(w["global_scale"].reshape(1, 1).astype(jnp.float32))
            in_specs.append(pl.BlockSpec((1, 1), lambda i, j, k: (0, 0)))
        kernel = functools.partial(_packed_kernel, fmt, g, w.get("zeros") is not None)
    y = pl.pallas_call(kernel, grid=grid, in_specs=in_specs, out_specs=out_spec,
                       out_shape=jax.ShapeDtypeStruct((Mp, N), out_dtype),
                       scratch_shapes=[pltpu.VMEM((cfg_tm, tn), jnp.float32)], compiler_params=params,
                       interpret=interpret_mode(interpret))(*operands)
    return y[:M] if Mp != M else y


# -- the plain-jnp reference ---------------------------------------------------------------------------------------

E2M1_TABLE = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_resident(w: dict, fmt: str, group: int, K: int) -> jax.Array:
    """f32 ``W^T [K, N]`` of a resident weight, by table lookup and reshapes (no code shared with the kernel)."""
    if fmt in ("bf16", "fp16", "fp32"):
        return w["wt"].astype(jnp.float32)
    if fmt in ("fp8", "int8"):  # per-tensor [1, 1] or per-channel [1, N] scale
        return w["q8"].astype(jnp.float32) * w["wscale"].astype(jnp.float32).reshape(1, -1)
    codes = w["codes"].astype(jnp.int32)  # [K/2, N] half-split per K tile
    N = codes.shape[1]
    tk = tiling.k_tile(fmt, K, group)
    tiles = codes.reshape(K // tk, tk // 2, N)
    q = jnp.concatenate([tiles & 15, tiles >> 4], axis=1).reshape(K, N)  # rows back in K order
    scales = w["scales"]
    if fmt == "nvfp4":
        s = scales.astype(jnp.uint8).view(jnp.float8_e4m3fn).astype(jnp.float32) * w["global_scale"].astype(jnp.float32)
    elif fmt == "mxfp4":
        s = jnp.exp2(scales.astype(jnp.float32) - 127.0)
    else:
        s = scales.astype(jnp.float32)
    s = jnp.broadcast_to(s[:, None, :], (K // group, group, N)).reshape(K, N)
    if fmt in FP4_FORMATS:
        values = jnp.asarray(E2M1_TABLE, jnp.float32)[q]
    else:
        z = 8.0 if w.get("zeros") is None else jnp.broadcast_to(
            w["zeros"].astype(jnp.float32)[:, None, :], (K // group, group, N)).reshape(K, N)
        values = q.astype(jnp.float32) - z
    return values * s


def matmul_reference(x: jax.Array, w: dict, *, fmt: str, group: int = 0, out_dtype: Any = jnp.bfloat16) -> jax.Array:
    """:func:`matmul`'s contract in plain jnp: dequantize all of W, one f32 matmul."""
    wt = dequantize_resident(w, fmt, group, x.shape[1])
    return jnp.dot(x.astype(jnp.float32), wt, precision=HIGHEST).astype(out_dtype)


def check_group(fmt: str, group: Optional[int]) -> int:
    """The block size the kernels take for ``fmt`` (from ``musecore_quant``'s format facts for FP4)."""
    return group or tiling.GROUP.get(fmt, 0)
