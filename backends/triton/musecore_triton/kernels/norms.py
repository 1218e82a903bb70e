"""Fused row-wise kernels: RMSNorm (weighted, weightless or scale-first), the post-sublayer norm +
gated residual + next norm, weightless q/k norms + q scale + RoPE (optionally writing k and v straight into a
static KV cache: :func:`qk_norm_rope_kv_write`), and the head norm times its gate. The residual norm's row
(:func:`residual_norm_row`) is also the last program's step of ``dense_gemv(residual_norm=)``.

Each is one pass over its rows in fp32 (one program per row), which is what makes them worth a
kernel: the unfused PyTorch versions read and write the hidden state several times. Rounding
follows the reference exactly where it rounds: a scale-first norm rounds ``x * w`` to the
activation dtype before normalising (transformers' InputScaledRMSNorm), the post norm's output is
rounded to its input's dtype before the residual gate reads it, and the new residual is rounded to
its dtype before the next norm reads it.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from musecore_triton import hooks
from musecore_triton.kernels.kv_cache import static_slot


@triton.jit
def _rms(x, mask, n, eps):
    x = tl.where(mask, x, 0.0)
    return 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n + eps)


@triton.jit
def _norm(x, w, mask, n, eps, HAS_WEIGHT: tl.constexpr, SCALE_FIRST: tl.constexpr, ACT: tl.constexpr):
    """fp32 ``rms(x) * w`` (scale after), ``rms(round(x * w))`` (scale first, rounded to ``ACT``) or
    ``rms(x)`` (no weight) of one row."""
    if HAS_WEIGHT:
        if SCALE_FIRST:
            s = (x * w).to(ACT).to(tl.float32)
            y = s * _rms(s, mask, n, eps)
        else:
            y = x * _rms(x, mask, n, eps) * w
    else:
        y = x * _rms(x, mask, n, eps)
    return y


@triton.jit
def rms_norm_kernel(x_ptr, w_ptr, y_ptr, n, eps, HAS_WEIGHT: tl.constexpr, SCALE_FIRST: tl.constexpr,
                    BLOCK: tl.constexpr, PDL: tl.constexpr):
    hooks.pdl_wait(PDL)  # the kernel before has finished (musecore_triton.hooks)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + row * n + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = _norm(x, w, mask, n, eps, HAS_WEIGHT, SCALE_FIRST, y_ptr.dtype.element_ty)
    tl.store(y_ptr + row * n + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def residual_norm_row(res_ptr, out_ptr, post_w_ptr, alpha_ptr, beta_ptr, next_w_ptr, new_res_ptr, normed_ptr, row,
                      n, post_eps, eps, HAS_POST: tl.constexpr, HAS_NEXT: tl.constexpr, BLOCK: tl.constexpr,
                      OUT_L2: tl.constexpr = False):
    """The ``residual_norm`` op on one row (``OUT_L2``: ``out`` is read from L2, past this SM's L1, as a kernel must
    when other blocks of it wrote ``out``). Every operand is loaded before the first reduction: in a GEMV's last
    program (``dense_gemv``'s epilogue) this row op is the launch's serial tail, and loads written after a reduction
    were issued after its barrier, one memory round trip each (session 49: three in the SASS, now one)."""
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    post, alpha, beta, nxt = residual_norm_weights(post_w_ptr, alpha_ptr, beta_ptr, next_w_ptr, offs, mask)
    o, res = residual_norm_inputs(res_ptr + row * n, out_ptr + row * n, offs, mask, OUT_L2)
    new_res, normed = residual_norm_values(o, post, alpha, beta, res, nxt, mask, n, post_eps, eps, HAS_POST,
                                           HAS_NEXT, out_ptr.dtype.element_ty, new_res_ptr.dtype.element_ty)
    tl.store(new_res_ptr + row * n + offs, new_res, mask=mask)
    tl.store(normed_ptr + row * n + offs, normed.to(normed_ptr.dtype.element_ty), mask=mask)


@triton.jit
def residual_norm_weights(post_w_ptr, alpha_ptr, beta_ptr, next_w_ptr, offs, mask):
    """The ``residual_norm`` op's weights at ``offs`` in fp32: ``(post, alpha, beta, next)`` (a program that defers
    the op loads them before its PDL wait: no kernel writes them)."""
    post = tl.load(post_w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    alpha = tl.load(alpha_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    beta = tl.load(beta_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    nxt = tl.load(next_w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return post, alpha, beta, nxt


@triton.jit
def residual_norm_inputs(res_ptr, out_ptr, offs, mask, OUT_L2: tl.constexpr = True):
    """The ``residual_norm`` op's activations at ``offs`` in fp32: ``(out, residual)`` (``OUT_L2``: ``out`` past this
    SM's L1, as :func:`residual_norm_row` reads it)."""
    if OUT_L2:
        o = tl.load(out_ptr + offs, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    else:
        o = tl.load(out_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    res = tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return o, res


@triton.jit
def _post_input(o, post, HAS_POST: tl.constexpr, ACT: tl.constexpr):
    """What the post norm takes the rms of: ``round(o * post)`` (scale first, rounded to ``ACT``) or ``o``."""
    if HAS_POST:
        o = (o * post).to(ACT).to(tl.float32)
    return o


@triton.jit
def _gated(o, post, alpha, beta, res, r_post, HAS_POST: tl.constexpr, ACT: tl.constexpr, RES: tl.constexpr):
    """The new residual ``round(alpha * res + beta * h)`` for the post norm's rms factor ``r_post``: ``h`` the post
    norm's output rounded to ``ACT`` as the reference's rms_norm returns it (``_norm``'s steps)."""
    h = (_post_input(o, post, HAS_POST, ACT) * r_post).to(ACT).to(tl.float32)
    return (alpha * res + beta * h).to(RES)


@triton.jit
def residual_norm_factors(o, post, alpha, beta, res, mask, n, post_eps, eps, HAS_POST: tl.constexpr,
                          ACT: tl.constexpr, RES: tl.constexpr):
    """The ``residual_norm`` op's two rms factors over a whole row held in registers (fp32 vectors, ``mask`` its
    ``n`` elements): ``(r_post, r_next)``. With them :func:`residual_norm_at` computes any slice of the row,
    with the bits the whole row's op gives it."""
    r_post = _rms(_post_input(o, post, HAS_POST, ACT), mask, n, post_eps)
    new_res = _gated(o, post, alpha, beta, res, r_post, HAS_POST, ACT, RES).to(tl.float32)
    return r_post, _rms(new_res, mask, n, eps)


@triton.jit
def residual_norm_at(o, post, alpha, beta, res, nxt, r_post, r_next, HAS_POST: tl.constexpr,
                     HAS_NEXT: tl.constexpr, ACT: tl.constexpr, RES: tl.constexpr):
    """``(new_res, normed fp32)`` of the ``residual_norm`` op on some elements of a row (the operands there) from the
    whole row's :func:`residual_norm_factors`."""
    new_res = _gated(o, post, alpha, beta, res, r_post, HAS_POST, ACT, RES)
    normed = new_res.to(tl.float32) * r_next
    if HAS_NEXT:
        normed = normed * nxt
    return new_res, normed


@triton.jit
def residual_norm_values(o, post, alpha, beta, res, nxt, mask, n, post_eps, eps, HAS_POST: tl.constexpr,
                         HAS_NEXT: tl.constexpr, ACT: tl.constexpr, RES: tl.constexpr):
    """``(new_res, normed fp32)``: the ``residual_norm`` op on a whole row held in registers (``o`` the sublayer's
    output, ``res`` the residual, both fp32; ``ACT`` ``o``'s dtype, ``RES`` the residual's), its roundings:
    the post norm (weightless, or scale-first) rounded to ``ACT``, the gated sum to ``RES``; ``normed`` is rounded
    by whoever stores or uses it."""
    r_post, r_next = residual_norm_factors(o, post, alpha, beta, res, mask, n, post_eps, eps, HAS_POST, ACT, RES)
    return residual_norm_at(o, post, alpha, beta, res, nxt, r_post, r_next, HAS_POST, HAS_NEXT, ACT, RES)


@triton.jit
def deferred_input(offs, mask, out_ptr, res_ptr, post_w_ptr, alpha_ptr, beta_ptr, next_w_ptr, H, post_eps, eps,
                   HAS_POST: tl.constexpr, HAS_NEXT: tl.constexpr, BLOCK_ROW: tl.constexpr, WHOLE: tl.constexpr,
                   PDL: tl.constexpr):
    """``(new_res, normed)`` at ``offs`` of ``residual_norm(res, out, post_w, alpha, beta, next_w, post_eps, eps)`` on
    the row ``[H]`` that the kernel before wrote (``out``): the op's weights loaded before the PDL wait, the whole
    row's two rms factors after it (``BLOCK_ROW >= H``), then the elements at ``offs`` (``WHOLE``: ``offs`` is the
    whole row, already in registers) with the op's roundings; ``normed`` fp32, rounded to the residual's dtype as the
    op stores it and a GEMV loads it."""
    row = tl.arange(0, BLOCK_ROW)
    rmask = row < H
    act = out_ptr.dtype.element_ty
    res_dt = res_ptr.dtype.element_ty
    post, alpha, beta, nxt = residual_norm_weights(post_w_ptr, alpha_ptr, beta_ptr, next_w_ptr, row, rmask)
    hooks.pdl_wait(PDL)  # out (and the residual, earlier) written by the kernels before (musecore_triton.hooks)
    o, res = residual_norm_inputs(res_ptr, out_ptr, row, rmask)
    r_post, r_next = residual_norm_factors(o, post, alpha, beta, res, rmask, H, post_eps, eps, HAS_POST, act, res_dt)
    if WHOLE:
        new_res, normed = residual_norm_at(o, post, alpha, beta, res, nxt, r_post, r_next, HAS_POST, HAS_NEXT, act,
                                           res_dt)
    else:  # this program's elements, read again (from this SM's L1 or L2)
        post_s, alpha_s, beta_s, nxt_s = residual_norm_weights(post_w_ptr, alpha_ptr, beta_ptr, next_w_ptr, offs, mask)
        o_s, res_s = residual_norm_inputs(res_ptr, out_ptr, offs, mask)
        new_res, normed = residual_norm_at(o_s, post_s, alpha_s, beta_s, res_s, nxt_s, r_post, r_next, HAS_POST,
                                           HAS_NEXT, act, res_dt)
    return new_res, normed.to(res_dt).to(tl.float32)


@triton.jit
def residual_norm_kernel(res_ptr, out_ptr, post_w_ptr, alpha_ptr, beta_ptr, next_w_ptr, new_res_ptr, normed_ptr,
                         n, post_eps, eps, HAS_POST: tl.constexpr, HAS_NEXT: tl.constexpr, BLOCK: tl.constexpr,
                         PDL: tl.constexpr):
    hooks.pdl_wait(PDL)  # the kernel before has finished (musecore_triton.hooks)
    residual_norm_row(res_ptr, out_ptr, post_w_ptr, alpha_ptr, beta_ptr, next_w_ptr, new_res_ptr, normed_ptr,
                      tl.program_id(0).to(tl.int64), n, post_eps, eps, HAS_POST, HAS_NEXT, BLOCK)


@triton.jit
def _norm_rope_inputs(x_ptr, cos_ptr, sin_ptr, src, bt, D: tl.constexpr, ROPE: tl.constexpr):
    """One head row's loads for :func:`_norm_rope_out`: ``(x, x_rot, cos, sin)`` fp32, rotate_half's source order in
    ``x_rot`` (with ``ROPE``; otherwise ``x`` stands in for the three)."""
    offs = tl.arange(0, D)
    x = tl.load(x_ptr + src + offs).to(tl.float32)
    if ROPE:
        rot = (offs + D // 2) % D  # rotate_half reads the other half (its sign: _norm_rope_out)
        x_rot = tl.load(x_ptr + src + rot).to(tl.float32)
        cos = tl.load(cos_ptr + bt * D + offs).to(tl.float32)
        sin = tl.load(sin_ptr + bt * D + offs).to(tl.float32)
    else:
        x_rot, cos, sin = x, x, x
    return x, x_rot, cos, sin


@triton.jit
def _norm_rope_out(x, x_rot, cos, sin, y_ptr, dst, eps, scale, D: tl.constexpr, ROPE: tl.constexpr):
    """One head row: weightless RMSNorm over d times ``scale``, then (``ROPE``) x*cos + rotate_half(x)*sin."""
    offs = tl.arange(0, D)
    r = scale / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
    y = x * r
    if ROPE:
        sign = tl.where(offs < D // 2, -1.0, 1.0)  # rotate_half negates the second half moved to the front
        y = y * cos + x_rot * r * sign * sin
    tl.store(y_ptr + dst + offs, y.to(y_ptr.dtype.element_ty))


@triton.jit
def qk_norm_rope_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, qy_ptr, ky_ptr, q_rows, nq, nkv, q_stride, k_stride, eps,
                        q_scale, v_ptr, cv_ptr, cpos_ptr, pos_ptr, T, v_stride, slots, capacity, D: tl.constexpr,
                        ROPE: tl.constexpr, PDL: tl.constexpr, WRITE_KV: tl.constexpr = False,
                        RING: tl.constexpr = False):
    """q's head rows then k's, one launch, one row per program (:func:`qk_norm_rope_row`)."""
    hooks.pdl_wait(PDL)  # the kernel before has finished (musecore_triton.hooks)
    qk_norm_rope_row(tl.program_id(0).to(tl.int64), q_ptr, k_ptr, cos_ptr, sin_ptr, qy_ptr, ky_ptr, q_rows, nq, nkv,
                     q_stride, k_stride, eps, q_scale, v_ptr, cv_ptr, cpos_ptr, pos_ptr, T, v_stride, slots, capacity,
                     D, ROPE, WRITE_KV, RING)


@triton.jit
def qk_norm_rope_row(row, q_ptr, k_ptr, cos_ptr, sin_ptr, qy_ptr, ky_ptr, q_rows, nq, nkv, q_stride, k_stride, eps,
                     q_scale, v_ptr, cv_ptr, cpos_ptr, pos_ptr, T, v_stride, slots, capacity, D: tl.constexpr,
                     ROPE: tl.constexpr, WRITE_KV: tl.constexpr, RING: tl.constexpr):
    """Head row ``row``: q rows first (``(b*T + t) * nq + h`` below ``q_rows``), then k's. Inputs may be slices of a
    fused projection: token ``bt``'s heads start at ``bt * stride`` (heads contiguous within it); outputs are
    contiguous.

    ``WRITE_KV``: the k rows go straight into a static cache ``ky [B, slots, nkv, D]`` at their position's slot
    (``kv_cache.static_slot``), with the new v rows (``cv``) and positions (``cpos``) beside them, as the KV write
    kernel places them."""
    if row < q_rows:
        bt = row // nq
        x, x_rot, cos, sin = _norm_rope_inputs(q_ptr, cos_ptr, sin_ptr, bt * q_stride + (row % nq) * D, bt, D, ROPE)
        _norm_rope_out(x, x_rot, cos, sin, qy_ptr, row * D, eps, q_scale, D, ROPE)
    else:
        row -= q_rows
        bt, h = row // nkv, row % nkv
        # Every load before any store (the compiler cannot move a load past a store that may alias it): a k row's
        # program waits for one memory round trip, not one for the position, one for v and one for k.
        x, x_rot, cos, sin = _norm_rope_inputs(k_ptr, cos_ptr, sin_ptr, bt * k_stride + h * D, bt, D, ROPE)
        if WRITE_KV:
            offs = tl.arange(0, D)
            p = tl.load(pos_ptr + bt)
            v = tl.load(v_ptr + bt * v_stride + h * D + offs)
            cache_row = (bt // T) * slots + static_slot(p, capacity, RING)
            dst = cache_row * nkv * D + h * D
            tl.store(cv_ptr + dst + offs, v)
            if h == 0:
                tl.store(cpos_ptr + cache_row, p)
        else:
            dst = row * D
        _norm_rope_out(x, x_rot, cos, sin, ky_ptr, dst, eps, 1.0, D, ROPE)


@triton.jit
def head_norm_gate_kernel(o_ptr, g_ptr, y_ptr, nq, g_stride, eps, D: tl.constexpr, PDL: tl.constexpr):
    """``rms(o) * sigmoid(g)`` element-wise on one head row; the gates may be a fused projection's slice
    (token ``bt``'s ``nq * D`` gates contiguous from ``bt * g_stride``)."""
    hooks.pdl_wait(PDL)  # the kernel before has finished (musecore_triton.hooks)
    row = tl.program_id(0).to(tl.int64)  # (b*T + t) * nq + h
    offs = tl.arange(0, D)
    o = tl.load(o_ptr + row * D + offs).to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(o * o, axis=0) / D + eps)
    g = tl.load(g_ptr + (row // nq) * g_stride + (row % nq) * D + offs).to(tl.float32)
    tl.store(y_ptr + row * D + offs, (o * r * (1.0 / (1.0 + tl.exp(-g)))).to(y_ptr.dtype.element_ty))


# Warps per program of each row kernel; None keeps Triton's default (4). The head kernels (one head per
# program) take one warp, whose reductions are shuffles only (measured; backends/cuda/lab/NOTES.md).
WARPS: dict[str, int | None] = {"rms_norm": None, "residual_norm": None, "qk_norm_rope": 1, "head_norm_gate": 1}


def _warps(kernel: str) -> dict:
    return {} if WARPS[kernel] is None else {"num_warps": WARPS[kernel]}


def _rows(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1] if x.numel() else 0


def _check_head_dim(d: int) -> None:
    if d & (d - 1):
        raise ValueError(f"the fused head kernels need a power-of-two head dim; got {d}")


def _vector(w: Optional[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """A per-channel vector for a kernel; without one, ``x`` stands in (at least one row long: the kernel
    loads it unconditionally, simpler than a constexpr branch, and ignores it)."""
    return x if w is None else w.contiguous()


def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float, scale_first: bool = False) -> torch.Tensor:
    """The ``rms_norm`` op: ``rms(x) * w``, ``rms(round(x * w))`` (``scale_first``) or ``rms(x)`` (no weight)."""
    x = x.contiguous()
    y = torch.empty_like(x)
    if x.numel():
        n = x.shape[-1]
        rms_norm_kernel[(_rows(x),)](x, _vector(weight, x), y, n, eps, HAS_WEIGHT=weight is not None,
                                     SCALE_FIRST=scale_first, BLOCK=triton.next_power_of_2(n),
                                     **_warps("rms_norm"), **hooks.launch_options(x.device, "rms_norm"))
    return y


def residual_norm(residual: torch.Tensor, out: torch.Tensor, post_weight: Optional[torch.Tensor],
                  alpha: torch.Tensor, beta: torch.Tensor, next_weight: Optional[torch.Tensor], post_eps: float,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``residual_norm`` op: ``h = rms(out)`` or ``rms(round(out * post_weight))``; ``residual' =
    alpha * residual + beta * h`` (fp32, rounded); ``normed = rms(residual') * next_weight``."""
    residual, out = residual.contiguous(), out.contiguous()
    new_residual = torch.empty_like(residual)
    normed = torch.empty_like(residual)
    if residual.numel():
        n = residual.shape[-1]
        residual_norm_kernel[(_rows(residual),)](residual, out, _vector(post_weight, out), alpha.contiguous(),
                                                 beta.contiguous(), _vector(next_weight, out), new_residual, normed,
                                                 n, post_eps, eps, HAS_POST=post_weight is not None,
                                                 HAS_NEXT=next_weight is not None,
                                                 BLOCK=triton.next_power_of_2(n), **_warps("residual_norm"),
                                                 **hooks.launch_options(out.device, "residual_norm"))
    return new_residual, normed


def _token_rows(x: torch.Tensor, inner: int) -> tuple[torch.Tensor, int]:
    """``x [B,T,...]`` and the distance between consecutive tokens' rows, where each token's trailing
    ``inner`` elements are contiguous and tokens are evenly spaced (a fused projection's slice is);
    otherwise a contiguous copy."""
    B, T = x.shape[:2]
    if x.numel() and x[0, 0].is_contiguous() and x[0, 0].numel() == inner:
        if T == 1:
            return x, x.stride(0)
        if B == 1 or x.stride(0) == T * x.stride(1):
            return x, x.stride(1)
    x = x.contiguous()
    return x, inner


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, cos: Optional[torch.Tensor], sin: Optional[torch.Tensor],
                 eps: float, q_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``qk_norm_rope`` op: weightless per-head norms, q times ``q_scale``, RoPE unless cos/sin are None."""
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    return _qk_norm_rope("qk_norm_rope", q, k, cos, sin, eps, q_scale, k_out), k_out


def qk_norm_rope_kv_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: Optional[torch.Tensor],
                          sin: Optional[torch.Tensor], eps: float, q_scale: float, cache_k: torch.Tensor,
                          cache_v: torch.Tensor, cache_pos: torch.Tensor, pos_new: torch.Tensor, capacity: int,
                          ring: bool) -> torch.Tensor:
    """:func:`qk_norm_rope` then :func:`musecore.kv_cache.write_static` of the normed k and of v, in one launch: the
    same bits in the cache (k/v rows in the cache's dtype, a static cache's ``[B, capacity + 1, nkv, d]`` buffers and
    long positions); returns the normed q. ``q``/``k``/``v`` may be slices of a fused projection."""
    check_kv_write("qk_norm_rope_kv_write", q, k, v, cache_k, cache_v, cache_pos, pos_new, capacity)
    v, v_stride = _token_rows(v, k.shape[2] * k.shape[3])
    return _qk_norm_rope("qk_norm_rope_kv_write", q, k, cos, sin, eps, q_scale, cache_k,
                         (v, cache_v, cache_pos, pos_new.contiguous(), v_stride, capacity + 1, capacity, ring))


def check_kv_write(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache_k: torch.Tensor,
                   cache_v: torch.Tensor, cache_pos: torch.Tensor, pos_new: torch.Tensor, capacity: int) -> None:
    """The KV write's operands: k/v ``[B,T,nkv,d]`` in the cache's dtype, a static cache's contiguous ``[B, capacity
    + 1, nkv, d]`` buffers and long positions ``[B, capacity + 1]``, the new positions ``[B,T]``."""
    B, T, nkv, d = k.shape
    if v.shape != k.shape or cache_k.shape != (B, capacity + 1, nkv, d) \
            or cache_v.shape != cache_k.shape or k.dtype != cache_k.dtype or v.dtype != cache_v.dtype \
            or cache_pos.shape != (B, capacity + 1) or cache_pos.dtype != torch.long or pos_new.shape != (B, T) \
            or not (cache_k.is_contiguous() and cache_v.is_contiguous() and cache_pos.is_contiguous()):
        raise ValueError(f"{name} needs k/v [B,T,nkv,d] in the cache's dtype and a static cache's "
                         f"contiguous buffers; got q {list(q.shape)}, k {k.dtype} {list(k.shape)}, v {list(v.shape)}, "
                         f"cache {cache_k.dtype} {list(cache_k.shape)}, capacity {capacity}")


def rope_rows(name: str, cos: Optional[torch.Tensor], sin: Optional[torch.Tensor], B: int, T: int, d: int
              ) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """``(cos, sin)`` as contiguous ``[B,T,d]`` (a table may broadcast to it: one row set for the whole batch), or
    None for a NoPE layer (neither given)."""
    if (cos is None) != (sin is None):
        raise ValueError(f"{name}: give both cos and sin (a RoPE layer) or neither (a NoPE layer)")
    if cos is None:
        return None
    try:
        return cos.expand(B, T, d).contiguous(), sin.expand(B, T, d).contiguous()
    except RuntimeError as exc:
        raise ValueError(f"{name}: cos/sin must broadcast to [B,T,d] = {[B, T, d]}; got "
                         f"{list(cos.shape)}, {list(sin.shape)}") from exc


def _qk_norm_rope(name: str, q: torch.Tensor, k: torch.Tensor, cos: Optional[torch.Tensor],
                  sin: Optional[torch.Tensor], eps: float, q_scale: float, k_out: torch.Tensor,
                  cache: Optional[tuple] = None) -> torch.Tensor:
    """One ``qk_norm_rope_kernel`` launch; returns the normed q. The normed k goes to ``k_out`` (``[B,T,nkv,d]``),
    or with ``cache = (v, cache_v, cache_pos, pos_new, v_stride, slots, capacity, ring)`` into the static cache
    ``k_out`` with v and the positions beside it."""
    _check_head_dim(q.shape[-1])
    B, T, nq, d = q.shape
    nkv = k.shape[2]
    if k.shape[:2] != (B, T) or k.shape[3] != d:
        raise ValueError(f"{name}: q {list(q.shape)} and k {list(k.shape)} need the same B, T and head dim")
    rows = rope_rows(name, cos, sin, B, T, d)
    (q, q_stride), (k, k_stride) = _token_rows(q, nq * d), _token_rows(k, nkv * d)
    q_out = torch.empty(B, T, nq, d, dtype=q.dtype, device=q.device)
    if B * T:
        cos, sin = rows or (q_out, q_out)  # placeholders when NoPE
        if cache is None:
            kv_args, kv_flags = (*(q_out,) * 4, T, 0, 0, 0), {}
        else:
            v, cache_v, cache_pos, pos_new, v_stride, slots, capacity, ring = cache
            kv_args, kv_flags = (v, cache_v, cache_pos, pos_new, T, v_stride, slots, capacity), dict(WRITE_KV=True,
                                                                                                      RING=ring)
        qk_norm_rope_kernel[(B * T * (nq + nkv),)](q, k, cos, sin, q_out, k_out, B * T * nq, nq, nkv, q_stride,
                                                   k_stride, eps, q_scale, *kv_args, D=d, ROPE=rows is not None,
                                                   **kv_flags, **_warps("qk_norm_rope"),
                                                   **hooks.launch_options(q.device, "qk_norm_rope"))
    return q_out


def head_norm_gate(o: torch.Tensor, gate_logits: torch.Tensor, eps: float) -> torch.Tensor:
    """The ``head_norm_gate`` op: weightless per-head norm times an element-wise sigmoid gate."""
    _check_head_dim(o.shape[-1])
    o = o.contiguous()
    y = torch.empty_like(o)
    B, T, nq, d = o.shape
    if gate_logits.shape != o.shape:
        raise ValueError(f"head_norm_gate: gate logits {list(gate_logits.shape)} must be [B,T,nq,d] = {[B, T, nq, d]}")
    g, g_stride = _token_rows(gate_logits, nq * d)
    if o.numel():
        head_norm_gate_kernel[(_rows(o),)](o, g, y, nq, g_stride, eps, D=d, **_warps("head_norm_gate"),
                                           **hooks.launch_options(o.device, "head_norm_gate"))
    return y
