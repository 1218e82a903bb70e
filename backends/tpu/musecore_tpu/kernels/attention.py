"""Causal GQA attention over a KV cache (full or sliding window; prefill and decode), flash style.

``musecore.ops`` ``attention`` contract: key j is visible to query i iff ``0 <= k_pos[j] <= q_pos[i]`` and, with a
window W, ``q_pos[i] - k_pos[j] < W``; ``k_pos = -1`` marks an empty slot (a ring buffer's unwritten entry, or
padding); fp8 K/V are dequantized with their per-tensor scales; fp32 softmax; a query that sees no key returns zeros.

Visibility comes from positions, not from slot order, so the same kernel reads a linear cache (full layers) and a
ring buffer of W slots (sliding layers) in whatever order the slots hold positions. One grid step takes ``tq``
queries of every head and ``tkv`` keys of every KV head (the cache's own ``[S, nkv*d]`` rows, no transposed copy);
inside it each KV head serves its ``nq/nkv`` query heads (GQA), and the online softmax keeps f32 running max, sum
and accumulator per KV head in VMEM.
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

NEG_INIT = -1e30  # finite: a tile where every key is masked leaves m finite and contributes exp(-inf) = 0


def _kernel(scale: float, window: Optional[int], k_scale: float, v_scale: float, kv_heads: int, head_dim: int,
            q_ref, qpos_ref, k_ref, v_ref, kpos_ref, o_ref, m_ref, l_ref, acc_ref):
    kv_step = pl.program_id(2)
    d = head_dim

    @pl.when(kv_step == 0)
    def _():
        m_ref[...] = jnp.full_like(m_ref, NEG_INIT)
        l_ref[...] = jnp.zeros_like(l_ref)
        acc_ref[...] = jnp.zeros_like(acc_ref)

    qp, kp = qpos_ref[...], kpos_ref[...]                            # [rows, 1], [1, tkv]
    visible = (kp >= 0) & (kp <= qp)
    if window is not None:
        visible &= (qp - kp) < window
    # q.k: bf16 queries times bf16 or E4M3 keys are exact products in ONE bf16 MXU pass (the FP8 scale joins the
    # softmax scale); f32 inputs keep HIGHEST. p.v keeps HIGHEST: probabilities are f32, and one bf16 pass would
    # round them (measured NMSE 2.7e-6 for p.v, test_single_pass_bf16_dots).
    one_pass = q_ref.dtype == jnp.bfloat16 and k_ref.dtype in (jnp.bfloat16, jnp.float8_e4m3fn)
    for h in range(kv_heads):  # static: each KV head's lanes of the [tkv, nkv*d] block, read once for all heads
        v = v_ref[:, h * d:(h + 1) * d].astype(jnp.float32) * v_scale
        if one_pass:
            q, k = q_ref[h].astype(jnp.bfloat16), k_ref[:, h * d:(h + 1) * d].astype(jnp.bfloat16)
            s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * (
                k_scale * scale)
        else:
            q = q_ref[h].astype(jnp.float32)                             # [rows, d]: query-major, then the heads
            k = k_ref[:, h * d:(h + 1) * d].astype(jnp.float32) * k_scale  # [tkv, d]
            s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
                                    precision=HIGHEST) * scale            # [rows, tkv]
        s = jnp.where(visible, s, -jnp.inf)
        m_prev = m_ref[h]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=-1, keepdims=True))
        p = jnp.exp(s - m_new)
        alpha = jnp.exp(m_prev - m_new)
        l_ref[h] = alpha * l_ref[h] + jnp.sum(p, axis=-1, keepdims=True)
        acc_ref[h] = alpha * acc_ref[h] + jnp.dot(p, v, preferred_element_type=jnp.float32, precision=HIGHEST)
        m_ref[h] = m_new

    @pl.when(kv_step == pl.num_programs(2) - 1)
    def _():
        l = l_ref[...]
        out = jnp.where(l > 0, acc_ref[...] / jnp.where(l > 0, l, 1.0), 0.0)  # sees nothing -> zeros
        o_ref[...] = out.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("window", "scale", "k_scale", "v_scale", "interpret"))
def attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, k_pos: jax.Array, *,
              window: Optional[int], scale: float, k_scale: float = 1.0, v_scale: float = 1.0,
              interpret: Any = False) -> jax.Array:
    """``q [B,T,nq,d]``, ``k, v [B,S,nkv,d]`` (bf16/f32, or float8_e4m3fn with scales), positions ``[B,T]``,
    ``[B,S]`` -> ``[B,T,nq,d]`` in q's dtype.

    K and V are read in the cache's own layout, viewed as ``[B, S, nkv*d]`` (no copy): one block holds every KV
    head of ``tkv`` keys, so the cache is read once per query tile whatever the head count. Queries are regrouped
    per KV head (``[B, nkv, T*group, d]``, a copy of q only)."""
    B, T, nq, d = q.shape
    S, nkv = k.shape[1], k.shape[2]
    group = nq // nkv
    tq = tiling.q_tile(T, group)
    tkv = min(tiling.TILE_KV, S)
    Tp, Sp = tiling.round_up(T, tq), tiling.round_up(S, tkv)
    q_pos = q_pos.astype(jnp.int32)
    k_pos = k_pos.astype(jnp.int32)
    if Tp != T:  # padded queries see nothing
        q = jnp.pad(q, ((0, 0), (0, Tp - T), (0, 0), (0, 0)))
        q_pos = jnp.pad(q_pos, ((0, 0), (0, Tp - T)), constant_values=-1)
    if Sp != S:  # padded keys are empty slots (a copy of the cache: callers keep S a multiple of the tile)
        k = jnp.pad(k, ((0, 0), (0, Sp - S), (0, 0), (0, 0)))
        v = jnp.pad(v, ((0, 0), (0, Sp - S), (0, 0), (0, 0)))
        k_pos = jnp.pad(k_pos, ((0, 0), (0, Sp - S)), constant_values=-1)
    qg = q.reshape(B, Tp, nkv, group, d).transpose(0, 2, 1, 3, 4).reshape(B, nkv, Tp * group, d)
    qpos_rows = jnp.repeat(q_pos, group, axis=1)[..., None]            # [B, T*group, 1]
    kf, vf = k.reshape(B, Sp, nkv * d), v.reshape(B, Sp, nkv * d)      # views of the cache
    kpos = k_pos[:, None, :]                                           # [B, 1, S]
    rows = tq * group
    out = pl.pallas_call(
        functools.partial(_kernel, scale, window, k_scale, v_scale, nkv, d),
        grid=(B, Tp // tq, Sp // tkv),
        in_specs=[pl.BlockSpec((None, nkv, rows, d), lambda b, i, j: (b, 0, i, 0)),
                  pl.BlockSpec((None, rows, 1), lambda b, i, j: (b, i, 0)),
                  pl.BlockSpec((None, tkv, nkv * d), lambda b, i, j: (b, j, 0)),
                  pl.BlockSpec((None, tkv, nkv * d), lambda b, i, j: (b, j, 0)),
                  pl.BlockSpec((None, 1, tkv), lambda b, i, j: (b, 0, j))],
        out_specs=pl.BlockSpec((None, nkv, rows, d), lambda b, i, j: (b, 0, i, 0)),
        out_shape=jax.ShapeDtypeStruct((B, nkv, Tp * group, d), q.dtype),
        scratch_shapes=[pltpu.VMEM((nkv, rows, 1), jnp.float32), pltpu.VMEM((nkv, rows, 1), jnp.float32),
                        pltpu.VMEM((nkv, rows, d), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret_mode(interpret),
    )(qg, qpos_rows, kf, vf, kpos)
    out = out.reshape(B, nkv, Tp, group, d).transpose(0, 2, 1, 3, 4).reshape(B, Tp, nq, d)
    return out[:, :T]


def attention_reference(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, k_pos: jax.Array, *,
                        window: Optional[int], scale: float, k_scale: float = 1.0, v_scale: float = 1.0) -> Any:
    """The same contract in plain jnp: repeat K/V per query head, full masked softmax."""
    group = q.shape[2] // k.shape[2]
    kf = jnp.repeat(k.astype(jnp.float32) * k_scale, group, axis=2)
    vf = jnp.repeat(v.astype(jnp.float32) * v_scale, group, axis=2)
    s = jnp.einsum("bthd,bshd->bhts", q.astype(jnp.float32), kf, precision=HIGHEST) * scale
    qp, kp = q_pos[:, None, :, None], k_pos[:, None, None, :]
    visible = (kp >= 0) & (kp <= qp)
    if window is not None:
        visible &= (qp - kp) < window
    s = jnp.where(visible, s, -jnp.inf)
    p = jnp.nan_to_num(jax.nn.softmax(s, axis=-1), nan=0.0)
    p = jnp.where(visible.any(-1, keepdims=True), p, 0.0)
    return jnp.einsum("bhts,bshd->bthd", p, vf, precision=HIGHEST).astype(q.dtype)
