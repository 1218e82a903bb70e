"""Causal GQA attention over a KV cache (full or sliding window; prefill and decode), flash style.

``musecore.ops`` ``attention`` contract: key j is visible to query i iff ``0 <= k_pos[j] <= q_pos[i]`` and, with a
window W, ``q_pos[i] - k_pos[j] < W``; ``k_pos = -1`` marks an empty slot (a ring buffer's unwritten entry, or
padding); fp8 K/V are dequantized with their per-tensor scales; fp32 softmax; a query that sees no key returns zeros.

Visibility comes from positions, not from slot order, so the same kernel reads a linear cache (full layers) and a
ring buffer of W slots (sliding layers) in whatever order the slots hold positions. One grid step takes one KV head
and all ``nq/nkv`` query heads that read it (GQA: K/V are loaded once per group), ``tq`` queries and ``tkv`` keys;
the online softmax keeps f32 running max, sum and accumulator in VMEM.
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


def _kernel(scale: float, window: Optional[int], k_scale: float, v_scale: float,
            q_ref, qpos_ref, k_ref, v_ref, kpos_ref, o_ref, m_ref, l_ref, acc_ref):
    kv_step = pl.program_id(3)
    tq, group, d = q_ref.shape

    @pl.when(kv_step == 0)
    def _():
        m_ref[...] = jnp.full_like(m_ref, NEG_INIT)
        l_ref[...] = jnp.zeros_like(l_ref)
        acc_ref[...] = jnp.zeros_like(acc_ref)

    q = q_ref[...].astype(jnp.float32).reshape(tq * group, d)        # rows: query-major, then the group's heads
    k = k_ref[...].astype(jnp.float32) * k_scale                     # [tkv, d]
    v = v_ref[...].astype(jnp.float32) * v_scale
    s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
                            precision=HIGHEST) * scale                # [rows, tkv]
    qp, kp = qpos_ref[...], kpos_ref[...]                            # [rows, 1], [1, tkv]
    visible = (kp >= 0) & (kp <= qp)
    if window is not None:
        visible &= (qp - kp) < window
    s = jnp.where(visible, s, -jnp.inf)
    m_prev = m_ref[...]
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=-1, keepdims=True))
    p = jnp.exp(s - m_new)
    alpha = jnp.exp(m_prev - m_new)
    l_ref[...] = alpha * l_ref[...] + jnp.sum(p, axis=-1, keepdims=True)
    acc_ref[...] = alpha * acc_ref[...] + jnp.dot(p, v, preferred_element_type=jnp.float32, precision=HIGHEST)
    m_ref[...] = m_new

    @pl.when(kv_step == pl.num_programs(3) - 1)
    def _():
        l = l_ref[...]
        out = jnp.where(l > 0, acc_ref[...] / jnp.where(l > 0, l, 1.0), 0.0)  # sees nothing -> zeros
        o_ref[...] = out.reshape(tq, group, d).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("window", "scale", "k_scale", "v_scale", "interpret"))
def attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, k_pos: jax.Array, *,
              window: Optional[int], scale: float, k_scale: float = 1.0, v_scale: float = 1.0,
              interpret: bool = False) -> jax.Array:
    """``q [B,T,nq,d]``, ``k, v [B,S,nkv,d]`` (bf16/f32, or float8_e4m3fn with scales), positions ``[B,T]``,
    ``[B,S]`` -> ``[B,T,nq,d]`` in q's dtype."""
    B, T, nq, d = q.shape
    S, nkv = k.shape[1], k.shape[2]
    group = nq // nkv
    tq = min(tiling.TILE_Q, T)
    tkv = min(tiling.TILE_KV, S)
    Tp, Sp = tiling.round_up(T, tq), tiling.round_up(S, tkv)
    q_pos = q_pos.astype(jnp.int32)
    k_pos = k_pos.astype(jnp.int32)
    if Tp != T:  # padded queries see nothing
        q = jnp.pad(q, ((0, 0), (0, Tp - T), (0, 0), (0, 0)))
        q_pos = jnp.pad(q_pos, ((0, 0), (0, Tp - T)), constant_values=-1)
    if Sp != S:  # padded keys are empty slots
        k = jnp.pad(k, ((0, 0), (0, Sp - S), (0, 0), (0, 0)))
        v = jnp.pad(v, ((0, 0), (0, Sp - S), (0, 0), (0, 0)))
        k_pos = jnp.pad(k_pos, ((0, 0), (0, Sp - S)), constant_values=-1)
    qg = q.reshape(B, Tp, nkv, group, d).transpose(0, 2, 1, 3, 4)      # [B, nkv, T, group, d]
    qpos_rows = jnp.repeat(q_pos, group, axis=1)[..., None]            # [B, T*group, 1]
    kt, vt = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)          # [B, nkv, S, d]
    kpos = k_pos[:, None, :]                                           # [B, 1, S]
    rows = tq * group
    out = pl.pallas_call(
        functools.partial(_kernel, scale, window, k_scale, v_scale),
        grid=(B, nkv, Tp // tq, Sp // tkv),
        in_specs=[pl.BlockSpec((None, None, tq, group, d), lambda b, h, i, j: (b, h, i, 0, 0)),
                  pl.BlockSpec((None, rows, 1), lambda b, h, i, j: (b, i, 0)),
                  pl.BlockSpec((None, None, tkv, d), lambda b, h, i, j: (b, h, j, 0)),
                  pl.BlockSpec((None, None, tkv, d), lambda b, h, i, j: (b, h, j, 0)),
                  pl.BlockSpec((None, 1, tkv), lambda b, h, i, j: (b, 0, j))],
        out_specs=pl.BlockSpec((None, None, tq, group, d), lambda b, h, i, j: (b, h, i, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((B, nkv, Tp, group, d), q.dtype),
        scratch_shapes=[pltpu.VMEM((rows, 1), jnp.float32), pltpu.VMEM((rows, 1), jnp.float32),
                        pltpu.VMEM((rows, d), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret_mode(interpret),
    )(qg, qpos_rows, kt, vt, kpos)
    return out.transpose(0, 2, 1, 3, 4).reshape(B, Tp, nq, d)[:, :T]


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
