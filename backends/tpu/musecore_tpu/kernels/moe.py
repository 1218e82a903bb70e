"""Routed SwiGLU experts over only the routed rows (megablox-style grouped matmul) with the MoE finalize.

``musecore.ops`` ``moe`` contract: for each (token, slot) the chosen expert computes
``e = down(silu(gate(z)) * up(z))`` in f32, rounded to z's dtype; then the post-expert norm shared by all experts,
scale first (``rms(round(e * w))``, rounded); then ``y[t] += weight[t, j] * that`` summed in f32.

1. Routing (jnp): the ``T*k`` (token, slot) rows are sorted by expert and each expert's rows padded to a whole
   tile of ``tr`` rows, so every row tile belongs to one expert; experts nobody chose get no tile. The tile ->
   expert table is scalar-prefetched (SMEM) and picks each tile's weight blocks in the BlockSpec index maps.
2. Kernel A: gate and up of the tile's expert, f32 accumulators, ``silu(g) * u`` at the last K step -> ``[R, I]`` f32.
3. Kernel B: down, then the finalize on the full ``h``-wide row: round to z's dtype, the shared post-expert
   norm (scale first), times the routing weight -> ``[R, h]`` f32 rows.
4. The f32 sum of each token's k rows: an XLA scatter-add (rows in expert order, the reference's order).

``act="fp8-token"`` (FP8 experts only; W8A8 on v7's FP8 MXU, musecore's ``fp8-token`` MoE rule,
``musecore.ops.reference.expert_forward``): z is quantized to E4M3 per token (``amax / 448``, a jnp pre-pass, once per
token for all its experts); kernel A multiplies E4M3 x E4M3 with f32 accumulation and applies ``xscale_t * wscale_e``
after the K sum; ``h = silu(g) * u`` (f32) is re-quantized per row to E4M3 by a jnp pass between the kernels (the
row amax needs all of ``I``, which one kernel-A tile does not have); kernel B does the same for down. Rows tiles are
rounded to 32 rows (8-bit operands tile (32, 128)).

``act="int8-token"`` (INT8 experts only; W8A8 on v6e's int8 MXU, musecore's ``int8-token`` rule): the same steps with
per-token / per-row INT8 codes (``amax / 127``, round half to even, +-127) and the experts' INT8 codes with one f32
scale per output channel (musecore_quant's ``int8`` codec); int8 x int8 products accumulate exactly in int32, and
``xscale_t * wscale_n`` (``wscale`` a ``[1, tn]`` block of the expert's channel scales) multiplies the sum at the
end (an int32 sum holds K * 127^2 for K up to 133,000). INT8 experts with ``act=None`` (W8A16) decode ``q * wscale`` in f32, like FP8's W8A16.

Tiles beyond the routed rows (the grid is sized for the worst case, ``cdiv(T*k, tr) + min(E, T*k)`` tiles) are
skipped with ``pl.when`` and write zeros.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from musecore_tpu.kernels import tiling
from musecore_tpu.kernels.decode import decode_halves
from musecore_tpu.kernels.matmul import HIGHEST, dequantize_resident, interpret_mode
from musecore_tpu.kernels.quantized import quantize_tokens

PACKED = ("int4", "mxfp4", "nvfp4")
Q8 = ("fp8", "int8")  # 8-bit resident weights: {"q8": codes [E, K, N], "wscale": [E, 1, 1] (fp8) | [E, 1, N] (int8)}
ACT_FORMATS = (None, "fp8-token", "int8-token")


def check_act(fmt: str, act: Optional[str]) -> None:
    """``fp8-token`` experts need FP8 weights, ``int8-token`` INT8 ones (the MXU takes one 8-bit operand type)."""
    if act not in ACT_FORMATS:
        raise ValueError(f"moe activations: {act!r}; the TPU grouped kernel takes {ACT_FORMATS}")
    if act is not None and act.removesuffix("-token") != fmt:
        raise ValueError(f"{act} expert activations need {act.removesuffix('-token')} expert weights; got {fmt}")


def _int_acc(act: Optional[str]) -> bool:
    """int8 x int8 accumulates exactly in int32; every other path in f32."""
    return act == "int8-token"


def _dot(a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.dot(a, b, preferred_element_type=jnp.float32, precision=HIGHEST)


def _stack(w: dict, fmt: str) -> jax.Array:
    """The stacked ``[E, K', N]`` array of a resident expert weight (its shape gives E and N)."""
    return w["codes"] if fmt in PACKED else w["q8"] if fmt in Q8 else w["wt"]


def route(ids: jax.Array, num_experts: int, tr: int) -> dict[str, jax.Array]:
    """Sorted, tile-padded row plan for ``ids [T, k]``: per routed row its padded position, and per tile its
    expert and whether it holds rows."""
    T, k = ids.shape
    P = T * k
    tiles = tiling.cdiv(P, tr) + min(num_experts, P)
    flat = ids.reshape(P).astype(jnp.int32)
    order = jnp.argsort(flat, stable=True)                        # rows in expert order
    sorted_e = flat[order]
    counts = jnp.bincount(flat, length=num_experts)
    padded = (counts + tr - 1) // tr * tr                         # 0 for experts nobody chose
    start = jnp.cumsum(counts) - counts
    start_padded = jnp.cumsum(padded) - padded
    position = start_padded[sorted_e] + jnp.arange(P) - start[sorted_e]  # padded row of each sorted row
    ends = jnp.cumsum(padded)
    first_row = jnp.arange(tiles) * tr
    tile_expert = jnp.minimum(jnp.searchsorted(ends, first_row, side="right"), num_experts - 1).astype(jnp.int32)
    tile_valid = (first_row < ends[-1]).astype(jnp.int32)
    return {"order": order, "position": position, "tile_expert": tile_expert, "tile_valid": tile_valid,
            "tiles": tiles}


def _weight_specs(w: dict, fmt: str, group: int, tk: int, tn: int, k_axis: int, n_axis):
    """BlockSpecs and operands of one stacked expert weight; the expert comes from the prefetched tile table.
    ``n_axis`` is the grid axis of N tiles, or None when the block spans all of N."""
    def index(*grid_and_refs):
        grid, (te, _tv) = grid_and_refs[:-2], grid_and_refs[-2:]
        return te[grid[0]], grid[k_axis], (0 if n_axis is None else grid[n_axis])
    if fmt == "fp8":  # E4M3 codes and the expert's per-tensor scale
        return [w["q8"], w["wscale"].astype(jnp.float32)], [
            pl.BlockSpec((None, tk, tn), index), pl.BlockSpec((None, 1, 1), lambda *a: (a[-2][a[0]], 0, 0))]
    if fmt == "int8":  # INT8 codes and the expert's f32 scales of the tile's output channels
        def channel_index(*grid_and_refs):
            expert, _k, n = index(*grid_and_refs)
            return expert, 0, n
        return [w["q8"], w["wscale"].astype(jnp.float32)], [
            pl.BlockSpec((None, tk, tn), index), pl.BlockSpec((None, 1, tn), channel_index)]
    if fmt not in PACKED:
        return [w["wt"]], [pl.BlockSpec((None, tk, tn), index)]
    operands = [w["codes"], w["scales"]]
    specs = [pl.BlockSpec((None, tk // 2, tn), index), pl.BlockSpec((None, tk // group, tn), index)]
    if w.get("zeros") is not None:
        operands.append(w["zeros"])
        specs.append(pl.BlockSpec((None, tk // group, tn), index))
    if fmt == "nvfp4":
        operands.append(w["global_scale"].reshape(-1, 1, 1).astype(jnp.float32))
        specs.append(pl.BlockSpec((None, 1, 1), lambda *a: (a[-2][a[0]], 0, 0)))
    return operands, specs


def _take_weight(fmt: str, group: int, has_zeros: bool, refs: list, act: Optional[str] = None
                 ) -> tuple[Any, list]:
    """Pop one weight's refs; return a function giving its f32 tile halves (or the dense tile) and the rest.
    With ``act``: the function gives (the 8-bit codes tile, the f32 scale: FP8's per expert, INT8's ``[1, tn]``)."""
    if fmt in Q8:
        q8, ws = refs.pop(0), refs.pop(0)
        scale = (lambda: ws[0, 0]) if fmt == "fp8" else (lambda: ws[...])
        if act:
            return (lambda: (q8[...], scale())), refs
        # W8A16: the reference's dequantization, fp32(code) * scale, rounded once in f32
        return (lambda: q8[...].astype(jnp.float32) * scale()), refs
    if fmt not in PACKED:
        wt = refs.pop(0)
        return (lambda: wt[...].astype(jnp.float32)), refs
    codes, scales = refs.pop(0), refs.pop(0)
    zeros = refs.pop(0) if has_zeros else None
    gs = refs.pop(0) if fmt == "nvfp4" else None
    return (lambda: decode_halves(fmt, group, codes[...], scales[...], None if zeros is None else zeros[...],
                                  None if gs is None else gs[0, 0])), refs


def _matmul_step(x: jax.Array, weight: Any, fmt: str, act: Optional[str] = None) -> jax.Array:
    if act == "fp8-token":  # E4M3 x E4M3 -> f32: every product exact; scales after the K sum
        return jnp.dot(x, weight()[0], preferred_element_type=jnp.float32)
    if act == "int8-token":  # int8 x int8 -> int32: exact; scales after the K sum
        return jnp.dot(x, weight()[0], preferred_element_type=jnp.int32)
    if fmt not in PACKED:
        return _dot(x, weight())
    lo, hi = weight()
    half = lo.shape[0]
    return _dot(x[:, :half], lo) + _dot(x[:, half:], hi)


def _gate_up_kernel(fmt: str, group: int, has_zeros: bool, act: Optional[str], te_ref, tv_ref, x_ref, *refs):
    refs = list(refs)
    xs_ref = refs.pop(0) if act else None
    gate, refs = _take_weight(fmt, group, has_zeros, refs, act)
    up, refs = _take_weight(fmt, group, has_zeros, refs, act)
    h_ref, acc_g, acc_u = refs
    i, k = pl.program_id(0), pl.program_id(2)

    @pl.when(k == 0)
    def _():
        acc_g[...] = jnp.zeros_like(acc_g)
        acc_u[...] = jnp.zeros_like(acc_u)

    @pl.when(tv_ref[i] == 1)
    def _():
        x = x_ref[...] if act else x_ref[...].astype(jnp.float32)
        acc_g[...] += _matmul_step(x, gate, fmt, act)
        acc_u[...] += _matmul_step(x, up, fmt, act)

    @pl.when(k == pl.num_programs(2) - 1)
    def _():
        g, u = acc_g[...].astype(jnp.float32), acc_u[...].astype(jnp.float32)
        if act:  # x-hat @ W-hat = (codes @ codes) * xscale_t * wscale (per expert, or per output channel)
            g = g * xs_ref[...] * gate()[1]
            u = u * xs_ref[...] * up()[1]
        h_ref[...] = g * jax.nn.sigmoid(g) * u


def _down_kernel(fmt: str, group: int, has_zeros: bool, act: Optional[str], act_dtype: Any, eps: float, te_ref,
                 tv_ref, h_ref, *refs):
    refs = list(refs)
    hs_ref = refs.pop(0) if act else None
    down, refs = _take_weight(fmt, group, has_zeros, refs, act)
    norm_ref, wrow_ref, out_ref, acc = refs
    i, k = pl.program_id(0), pl.program_id(1)

    @pl.when(k == 0)
    def _():
        acc[...] = jnp.zeros_like(acc)

    @pl.when(tv_ref[i] == 1)
    def _():
        acc[...] += _matmul_step(h_ref[...], down, fmt, act)

    @pl.when(k == pl.num_programs(1) - 1)
    def _():
        y = acc[...].astype(jnp.float32) * hs_ref[...] * down()[1] if act else acc[...]
        e = y.astype(act_dtype)                                            # the expert's output, rounded
        scaled = (e.astype(jnp.float32) * norm_ref[...].astype(jnp.float32)).astype(act_dtype)  # scale first
        s = scaled.astype(jnp.float32)
        normed = (s * jax.lax.rsqrt(jnp.mean(s * s, axis=-1, keepdims=True) + eps)).astype(act_dtype)
        out_ref[...] = wrow_ref[...] * normed.astype(jnp.float32)                  # routing weight, f32


@functools.partial(jax.jit, static_argnames=("fmt", "group", "eps", "act", "interpret"))
def moe(z: jax.Array, weights: jax.Array, ids: jax.Array, gate: dict, up: dict, down: dict, post_norm: jax.Array,
        *, fmt: str, group: int = 0, eps: float, act: Optional[str] = None, interpret: bool = False) -> jax.Array:
    """``y [T, h]`` f32 of the routed experts (resident weights from :mod:`musecore_tpu.layouts`, stacked [E, ...]);
    ``act="fp8-token"`` / ``"int8-token"``: W8A8 FP8 / INT8 experts with per-token activation scales (module
    docstring)."""
    check_act(fmt, act)
    T, hidden = z.shape
    k = ids.shape[1]
    E, inter = _stack(gate, fmt).shape[0], _stack(gate, fmt).shape[2]
    tr = tiling.rows_tile(T * k, E, act)
    plan = route(ids, E, tr)
    tiles, R = plan["tiles"], plan["tiles"] * tr
    token = plan["order"] // k
    row_scale = [pl.BlockSpec((tr, 1), lambda i, *rest: (i, 0))] if act else []  # W8A8: f32 scale per row
    acc_dtype = jnp.int32 if _int_acc(act) else jnp.float32
    if act:  # each token quantized once (its row amax), then gathered into its k routed rows; padding: code 0
        zq, zs = quantize_tokens(z, act)
        x_rows = jnp.zeros((R, hidden), zq.dtype).at[plan["position"]].set(zq[token])
        x_scale = [jnp.ones((R, 1), jnp.float32).at[plan["position"]].set(zs[token])]
    else:
        x_rows = jnp.zeros((R, hidden), z.dtype).at[plan["position"]].set(z[token])
        x_scale = []
    w_rows = jnp.zeros((R, 1), jnp.float32).at[plan["position"], 0].set(weights.reshape(-1)[plan["order"]])
    row_token = jnp.zeros((R,), jnp.int32).at[plan["position"]].set(token.astype(jnp.int32))
    has_zeros = gate.get("zeros") is not None
    semantics = pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"))

    tk, tn = tiling.k_tile(fmt, hidden, group or None), tiling.n_tile(inter)
    g_ops, g_specs = _weight_specs(gate, fmt, group, tk, tn, 2, 1)
    u_ops, u_specs = _weight_specs(up, fmt, group, tk, tn, 2, 1)
    h = pl.pallas_call(
        functools.partial(_gate_up_kernel, fmt, group, has_zeros, act),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=(tiles, inter // tn, hidden // tk),
            in_specs=[pl.BlockSpec((tr, tk), lambda i, j, kk, te, tv: (i, kk))] + row_scale + g_specs + u_specs,
            out_specs=pl.BlockSpec((tr, tn), lambda i, j, kk, te, tv: (i, j)),
            scratch_shapes=[pltpu.VMEM((tr, tn), acc_dtype), pltpu.VMEM((tr, tn), acc_dtype)]),
        out_shape=jax.ShapeDtypeStruct((R, inter), jnp.float32), compiler_params=semantics,
        interpret=interpret_mode(interpret),
    )(plan["tile_expert"], plan["tile_valid"], x_rows, *x_scale, *g_ops, *u_ops)
    if act:  # the hidden activations re-quantized per row (padding rows: zeros, scale 1)
        h, h_scale = quantize_tokens(h, act)
        h_scale = [h_scale]
    else:
        h_scale = []

    tk2 = tiling.k_tile(fmt, inter, group or None)
    d_ops, d_specs = _weight_specs(down, fmt, group, tk2, hidden, 1, None)
    rows = pl.pallas_call(
        functools.partial(_down_kernel, fmt, group, has_zeros, act, z.dtype, eps),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=(tiles, inter // tk2),
            in_specs=[pl.BlockSpec((tr, tk2), lambda i, kk, te, tv: (i, kk))] + row_scale + d_specs
                     + [pl.BlockSpec((1, hidden), lambda i, kk, te, tv: (0, 0)),
                        pl.BlockSpec((tr, 1), lambda i, kk, te, tv: (i, 0))],
            out_specs=pl.BlockSpec((tr, hidden), lambda i, kk, te, tv: (i, 0)),
            scratch_shapes=[pltpu.VMEM((tr, hidden), acc_dtype)]),
        out_shape=jax.ShapeDtypeStruct((R, hidden), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret_mode(interpret),
    )(plan["tile_expert"], plan["tile_valid"], h, *h_scale, *d_ops, post_norm.reshape(1, hidden), w_rows)
    return jnp.zeros((T, hidden), jnp.float32).at[row_token].add(rows)  # padding rows add 0.0


def moe_reference(z: jax.Array, weights: jax.Array, ids: jax.Array, gate: dict, up: dict, down: dict,
                  post_norm: jax.Array, *, fmt: str, group: int = 0, eps: float, act: Optional[str] = None) -> jax.Array:
    """The same contract in plain jnp, expert by expert over all tokens (masked), dense weights; ``fp8-token`` /
    ``int8-token``: dequantized per-token 8-bit activations (z, then h) times the dequantized weights, f32 math."""
    check_act(fmt, act)

    def fq(x: jax.Array) -> jax.Array:
        if act is None:
            return x
        codes, scale = quantize_tokens(x, act)
        return codes.astype(jnp.float32) * scale
    T, hidden = z.shape
    E, inter = _stack(gate, fmt).shape[0], _stack(gate, fmt).shape[2]
    y = jnp.zeros((T, hidden), jnp.float32)
    zf = fq(z.astype(jnp.float32))
    pick = lambda w, e: {n: (None if v is None else v[e]) for n, v in w.items()}  # noqa: E731
    for e in range(E):
        g = dequantize_resident(pick(gate, e), fmt, group, hidden)
        u = dequantize_resident(pick(up, e), fmt, group, hidden)
        d = dequantize_resident(pick(down, e), fmt, group, inter)
        a = jnp.dot(zf, g, precision=HIGHEST)
        out = jnp.dot(fq(jax.nn.silu(a) * jnp.dot(zf, u, precision=HIGHEST)), d, precision=HIGHEST).astype(z.dtype)
        s = (out.astype(jnp.float32) * post_norm.astype(jnp.float32)).astype(z.dtype).astype(jnp.float32)
        normed = (s * jax.lax.rsqrt(jnp.mean(s * s, -1, keepdims=True) + eps)).astype(z.dtype).astype(jnp.float32)
        w = jnp.sum(jnp.where(ids == e, weights, 0.0), axis=1, keepdims=True)  # 0 where e was not chosen
        y = y + w * normed
    return y
