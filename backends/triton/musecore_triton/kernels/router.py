"""The MoE router's choice: sigmoid scores, top-k on scores + correction bias, renormalised weights.

The router's fp32 product ``x @ W^T`` ([T,H] x [H,E]) runs one of two ways, chosen by shape
(:func:`uses_split_k`):

* at decode (``T <= SPLIT_K_MAX_TOKENS``), :func:`router_gemv_kernel`: a split-K GEMV. The fp32
  weight (``E x H``, 8 MiB per layer on the 816B model) is the only real traffic, and one GEMM tile
  per 64 experts would stream it through a handful of compute units; the split over K spreads it
  over every CU. Each program multiplies its K range in fp32 (``tl.dot`` at ``ieee`` precision:
  fp32 products, fp32 sums, no TF32/xf32) and writes an fp32 partial ``[S, T, E]``; the top-k
  kernel adds the S partials in a fixed order (deterministic, no atomics) as it reads its row;
* beyond, the vendor BLAS (``F.linear`` on fp32 operands; an fp32 GEMM, never TF32 unless the
  caller switched PyTorch's fp32 matmul precision);
* for one token, :func:`router_topk_one_launch` (the CUDA backend's fused MoE block): the split-K partials and the
  choice in one launch, made by the program that finishes last (a ticket on a counter its caller owns); it sums the
  partials in a fixed tree instead of in order; :func:`router_pooler_one_launch` runs those programs beside the
  pooler GEMV's (both read only the block's input), one launch for both.

Both compute the reference's ``x.float() @ W.float().T`` in fp32; they differ from it (and each
other) only in the order of the fp32 sums, i.e. by about 1e-7 relative, which moves a choice only
where two ``score + bias`` values tie to that precision. Everything after the product is one
kernel per token row: sigmoid of the scaled logits, k rounds of max over ``scores + bias`` (the
bias only chooses), the chosen *scores* gathered, renormalised and scaled. It replaces sigmoid,
add, topk (a sort), gather, sum and two divisions: about seven PyTorch kernels at decode.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from musecore.ops import reference as ref
from musecore_triton import hooks
from musecore_triton.kernels import dense_gemv, norms

MAX_TOP_K = 64  # the kernel keeps k rounds unrolled; larger k runs the reference's torch ops (same numerics)
SPLIT_K_MAX_TOKENS = 16  # up to this many rows the product is the split-K GEMV (one 16-row dot tile)
GEMV_BLOCK_T = 16        # rows of the GEMV's tile: T <= 16 padded to 16, the smallest tl.dot M on every GPU
GEMV_BLOCK_E = 64        # experts per program
GEMV_BLOCK_K = 64        # K per step of a program


@triton.jit
def router_gemv_kernel(x_ptr, w_ptr, part_ptr, T, E, H, stride_x, k_split, BLOCK_T: tl.constexpr,
                       BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """Program (e, s): ``part[s, :T, e-block] = x[:T, K_s] @ W[e-block, K_s]^T`` in fp32, where ``K_s`` is the
    s-th range of ``k_split`` columns. Rows past T and experts past E are masked (read as 0, not stored)."""
    pid_e = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_t = tl.arange(0, BLOCK_T)
    offs_e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    offs_k = tl.arange(0, BLOCK_K)
    k0 = pid_s * k_split
    hooks.pdl_wait(PDL)  # x was written by the kernel before (musecore_triton.hooks)
    acc = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
    for kk in range(k0, tl.minimum(k0 + k_split, H), BLOCK_K):
        k = kk + offs_k
        km = k < H
        x = tl.load(x_ptr + offs_t[:, None].to(tl.int64) * stride_x + k[None, :],
                    mask=(offs_t < T)[:, None] & km[None, :], other=0.0).to(tl.float32)
        w = tl.load(w_ptr + offs_e[None, :].to(tl.int64) * H + k[:, None],
                    mask=km[:, None] & (offs_e < E)[None, :], other=0.0)  # [BLOCK_K, BLOCK_E] fp32
        acc = tl.dot(x, w, acc, input_precision="ieee")
    out = part_ptr + pid_s.to(tl.int64) * T * E + offs_t[:, None] * E + offs_e[None, :]
    tl.store(out, acc, mask=(offs_t < T)[:, None] & (offs_e < E)[None, :])


@triton.jit
def _choose(x, offs, mask, bias, w_ptr, ids_ptr, row, k, multiplier, scaling, K: tl.constexpr, BLOCK: tl.constexpr):
    """One row's choice from its fp32 logits ``x [BLOCK]``: ``s = sigmoid(x * multiplier)``; the k largest
    ``s + bias`` by k rounds of max (lowest index first on ties); weights ``s[ids] / (sum + 1e-15) * scaling``."""
    s = 1.0 / (1.0 + tl.exp(-(x * multiplier)))
    left = tl.where(mask, s + bias, -float("inf"))
    kk = tl.arange(0, K)
    weights = tl.zeros((K,), dtype=tl.float32)
    ids = tl.zeros((K,), dtype=tl.int64)
    for j in tl.static_range(K):  # K = k rounded up to a power of two; rounds past k are not stored
        best = tl.max(left, axis=0)
        idx = tl.min(tl.where(left == best, offs, BLOCK), axis=0)
        chosen = tl.sum(tl.where(offs == idx, s, 0.0), axis=0)  # the score, not score + bias
        weights = tl.where(kk == j, chosen, weights)
        ids = tl.where(kk == j, idx.to(tl.int64), ids)
        left = tl.where(offs == idx, -float("inf"), left)
    weights = tl.where(kk < k, weights, 0.0)
    weights = weights / (tl.sum(weights, axis=0) + 1e-15) * scaling
    tl.store(w_ptr + row * k + kk, weights, mask=kk < k)
    tl.store(ids_ptr + row * k + kk, ids, mask=kk < k)


@triton.jit
def router_topk_kernel(logits_ptr, bias_ptr, w_ptr, ids_ptr, E, stride, splits, split_stride, k, multiplier,
                       scaling, K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """One row: ``logits`` = the sum of its ``splits`` partials (in order s = 0, 1, ...; 1 = the logits
    themselves), then :func:`_choose`."""
    offs = tl.arange(0, BLOCK)
    mask = offs < E
    bias = tl.load(bias_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # a weight: read before the wait
    hooks.pdl_wait(PDL)  # the kernel before has finished (musecore_triton.hooks)
    row = tl.program_id(0).to(tl.int64)
    x = tl.load(logits_ptr + row * stride + offs, mask=mask, other=0.0).to(tl.float32)
    for s in range(1, splits):
        x += tl.load(logits_ptr + s * split_stride + row * stride + offs, mask=mask, other=0.0).to(tl.float32)
    _choose(x, offs, mask, bias, w_ptr, ids_ptr, row, k, multiplier, scaling, K, BLOCK)


@triton.jit
def router_one_launch_kernel(x_ptr, w_ptr, part_ptr, count_ptr, bias_ptr, wout_ptr, ids_ptr, E, H, k, multiplier,
                             scaling, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr,
                             K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr, WARM: tl.constexpr = False):
    """One token's router in one launch. Program (e, s) writes the fp32 partial ``part[s, e-block] = W[e-block,
    K_s] . x[K_s]``; the program that finishes last (a ticket on ``count``, which it resets to 0 for the next
    launch) adds the partials of each expert (a fixed tree over s: deterministic) and makes the choice
    (:func:`_choose`). The ticket (``dense_gemv.last_ticket``) orders every program's partial before the last one
    reads it."""
    router_program(tl.program_id(0), tl.program_id(1), tl.num_programs(0), tl.num_programs(1), x_ptr, w_ptr, part_ptr,
                   count_ptr, bias_ptr, wout_ptr, ids_ptr, E, H, k, multiplier, scaling, BLOCK_E, BLOCK_K, BLOCK_S, K,
                   BLOCK, PDL, WARM)


@triton.jit
def router_program(pid_e, pid_s, n_e, n_s, x_ptr, w_ptr, part_ptr, count_ptr, bias_ptr, wout_ptr, ids_ptr, E, H, k,
                   multiplier, scaling, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr,
                   K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr, WARM: tl.constexpr):
    """Program (``pid_e``, ``pid_s``) of the ``n_e x n_s`` that make up :func:`router_one_launch_kernel`: its
    weights (:func:`router_weights`), its slice of ``x`` once the kernel before has written it, then
    :func:`router_partial`."""
    offs_e, offs_k, em, km, w = router_weights(pid_e, pid_s, w_ptr, bias_ptr, E, H, BLOCK_E, BLOCK_K, WARM)
    hooks.pdl_wait(PDL)  # x was written by the kernel before (musecore_triton.hooks)
    x = tl.load(x_ptr + offs_k, mask=km, other=0.0).to(tl.float32)
    router_partial(pid_s, n_e, n_s, w, x, offs_e, em, part_ptr, count_ptr, bias_ptr, wout_ptr, ids_ptr, E, k,
                   multiplier, scaling, BLOCK_S, K, BLOCK)


@triton.jit
def router_weights(pid_e, pid_s, w_ptr, bias_ptr, E, H, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                   WARM: tl.constexpr):
    """A router program's expert block ``pid_e`` and K range ``pid_s`` and its fp32 weights ``[BLOCK_E, BLOCK_K]``
    (no kernel writes them: loaded before the PDL wait): ``(offs_e, offs_k, emask, kmask, w)``. ``WARM``: the first
    K range's programs prefetch the bias into L2 for the last program, as ``dense_gemv.gemv_program`` does its row
    op's weights."""
    offs_e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    offs_k = pid_s * BLOCK_K + tl.arange(0, BLOCK_K)
    em, km = offs_e < E, offs_k < H
    if WARM:
        hooks.prefetch_l2(bias_ptr + offs_e, em & (pid_s == 0))
    w = tl.load(w_ptr + offs_e[:, None].to(tl.int64) * H + offs_k[None, :], mask=em[:, None] & km[None, :],
                other=0.0)
    return offs_e, offs_k, em, km, w


@triton.jit
def router_partial(pid_s, n_e, n_s, w, x, offs_e, em, part_ptr, count_ptr, bias_ptr, wout_ptr, ids_ptr, E, k,
                   multiplier, scaling, BLOCK_S: tl.constexpr, K: tl.constexpr, BLOCK: tl.constexpr):
    """A router program's fp32 partial ``W[e-block, K_s] . x[K_s]`` stored; the program that draws the last ticket
    on ``count`` adds every expert's partials (a fixed tree over s: deterministic) and makes the choice
    (:func:`_choose`)."""
    tl.store(part_ptr + pid_s * E + offs_e, tl.sum(w * x[None, :], axis=1), mask=em)
    tl.debug_barrier()  # every thread's partial is stored before the ticket is taken
    if dense_gemv.last_ticket(count_ptr, n_e * n_s):
        offs = tl.arange(0, BLOCK)
        mask = offs < E
        bias = tl.load(bias_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # issued with the partials' loads
        logits = tl.zeros((BLOCK,), dtype=tl.float32)
        for s0 in range(0, n_s, BLOCK_S):
            ss = s0 + tl.arange(0, BLOCK_S)
            logits += tl.sum(tl.load(part_ptr + ss[:, None] * E + offs[None, :],
                                     mask=(ss < n_s)[:, None] & mask[None, :], other=0.0, cache_modifier=".cg"), axis=0)
        _choose(logits, offs, mask, bias, wout_ptr, ids_ptr, 0, k, multiplier, scaling, K, BLOCK)


def uses_split_k(tokens: int) -> bool:
    """The product at ``tokens`` rows runs as the split-K GEMV (decode), else as the vendor BLAS GEMM."""
    return 0 < tokens <= SPLIT_K_MAX_TOKENS


def split_count(experts: int, hidden: int, tokens: int, device: torch.device) -> int:
    """How many K ranges the GEMV splits ``hidden`` into: enough programs to give every compute unit one
    (``hooks.num_sms``), at least one ``GEMV_BLOCK_K`` step each, and partials ``[S, T, E]`` of at most an
    eighth of the weight's bytes (``S <= H / (8 T)``)."""
    steps = triton.cdiv(hidden, GEMV_BLOCK_K)
    want = triton.cdiv(hooks.num_sms(device), triton.cdiv(experts, GEMV_BLOCK_E))
    return max(1, min(steps, want, hidden // (8 * max(tokens, 1))))


def router_logits_split_k(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp32 partial products ``[S, T, E]`` of ``x [T, H] @ weight [E, H]^T`` (their sum over S, in order,
    is the router logits); ``T <= SPLIT_K_MAX_TOKENS``."""
    T, H = x.shape
    E = weight.shape[0]
    if not 0 < T <= GEMV_BLOCK_T:
        raise ValueError(f"router_logits_split_k: the GEMV takes 1..{GEMV_BLOCK_T} rows; got {T}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    splits = split_count(E, H, T, x.device)
    k_split = triton.cdiv(triton.cdiv(H, splits), GEMV_BLOCK_K) * GEMV_BLOCK_K
    splits = triton.cdiv(H, k_split)  # no empty range after rounding to whole steps
    part = torch.empty(splits, T, E, dtype=torch.float32, device=x.device)
    router_gemv_kernel[(triton.cdiv(E, GEMV_BLOCK_E), splits)](
        x, weight.contiguous(), part, T, E, H, x.stride(0), k_split, BLOCK_T=GEMV_BLOCK_T, BLOCK_E=GEMV_BLOCK_E,
        BLOCK_K=GEMV_BLOCK_K, num_warps=4, **hooks.launch_options(x.device, "router_gemv"))
    return part


def router_topk(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, k: int, multiplier: float,
                scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``router_topk`` op: the fp32 product (split-K GEMV at decode, the vendor BLAS beyond; see the
    module docstring), then the choice kernel.

    Example::

        weights, ids = router_topk(m, w_router, e_score_correction_bias, 8, 0.1768, 1.0)  # [T,8] fp32, long
    """
    T, E = x.shape[0], weight.shape[0]
    if weight.dtype != torch.float32 or bias.dtype != torch.float32:
        raise TypeError(f"router_topk: the router weight and bias are kept fp32 (MODEL.md); got {weight.dtype} "
                        f"and {bias.dtype}")
    if not 0 < k <= E:
        raise ValueError(f"router_topk: k must be in 1..{E} (the number of experts); got {k}")
    if k > MAX_TOP_K:
        return ref.router_topk(x, weight, bias, k, multiplier, scaling)
    if uses_split_k(T):
        logits = router_logits_split_k(x, weight)  # [S,T,E] fp32 partials, summed by the choice kernel
    else:
        logits = F.linear(x.float(), weight)[None]  # [1,T,E] fp32
    weights = torch.empty(T, k, dtype=torch.float32, device=x.device)
    ids = torch.empty(T, k, dtype=torch.int64, device=x.device)
    if T:
        block = triton.next_power_of_2(E)
        # 2k + 1 dependent reductions per row: within one warp they are shuffles, across warps each is
        # a shared-memory round trip and a barrier (4 warps took ~3 us per row at E = 64).
        router_topk_kernel[(T,)](logits, bias.contiguous(), weights, ids, E, logits.stride(1), logits.shape[0],
                                 logits.stride(0), k, multiplier, scaling, K=triton.next_power_of_2(k), BLOCK=block,
                                 num_warps=1 if block <= 512 else 4, **hooks.launch_options(x.device, "router_topk"))
    return weights, ids


ONE_LAUNCH_BLOCK_E = 64  # experts per program of the one-launch router
# Hidden columns per program of the one-token router launches: None, the backend's (``hooks.router_block_k``), else
# DEFAULT_ONE_LAUNCH_BLOCK_K (32: 2048 fp32 weights per one-warp program at 64 experts). Read at call time (lab A/B).
ONE_LAUNCH_BLOCK_K: int | None = None
DEFAULT_ONE_LAUNCH_BLOCK_K = 32
ONE_LAUNCH_MAX_E = 1024  # the last program holds every expert's logit in one block
# The router + pooler launch's pooler rows per program and warps per program (the router's programs run on as many
# warps); the pooler's last program runs the pre-expert norm over the whole row on them. None: the backend's
# (``hooks.row_op_cut``), else ``dense_gemv``'s. Read at call time (lab A/B: ``cuda_fused_ab.py``'s ``rp_*`` modes).
ROUTER_POOLER_BLOCK_N: int | None = None
ROUTER_POOLER_WARPS: int | None = None


def _one_token_router(what: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, k: int
                      ) -> tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    """The one-launch router's operands checked, and what its programs (:func:`router_program`) need: ``(n_e, n_s,
    part, weights, ids, constexprs)`` for an ``n_e x n_s`` grid of them."""
    E, H = weight.shape
    if x.shape != (1, H) or weight.dtype != torch.float32 or bias.dtype != torch.float32 or bias.shape != (E,) \
            or not 0 < k <= min(E, MAX_TOP_K) or E > ONE_LAUNCH_MAX_E:
        raise ValueError(f"{what} takes one token x [1, {H}], an fp32 router [E, H] with E <= {ONE_LAUNCH_MAX_E}, an "
                         f"fp32 bias [E] and k in 1..min(E, {MAX_TOP_K}); got x {list(x.shape)}, router {weight.dtype} "
                         f"{list(weight.shape)}, bias {bias.dtype} {list(bias.shape)}, k {k}")
    block_k = ONE_LAUNCH_BLOCK_K or hooks.router_block_k(x.device) or DEFAULT_ONE_LAUNCH_BLOCK_K
    n_s = triton.cdiv(H, block_k)
    part = torch.empty(n_s, E, dtype=torch.float32, device=x.device)
    weights = torch.empty(1, k, dtype=torch.float32, device=x.device)
    ids = torch.empty(1, k, dtype=torch.int64, device=x.device)
    block = triton.next_power_of_2(E)
    constexprs = dict(BLOCK_E=ONE_LAUNCH_BLOCK_E, BLOCK_K=block_k, BLOCK_S=max(1, 2048 // block),
                      K=triton.next_power_of_2(k), BLOCK=block, WARM=hooks.l2_warm(x.device))
    return triton.cdiv(E, ONE_LAUNCH_BLOCK_E), n_s, part, weights, ids, constexprs


def router_topk_one_launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, k: int, multiplier: float,
                           scaling: float, counter: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`router_topk` of one token ``x [1, H]`` in one launch (``router_one_launch_kernel``): the split-K
    product and the choice, which the last program to finish makes. ``counter`` is an int32 zero that the launch
    takes and gives back (zero again); it belongs to one call site, and two launches sharing one must not overlap
    (one stream). Same numerics as :func:`router_topk` up to the order of the fp32 sums (about 1e-7 relative)."""
    E, H = weight.shape
    n_e, n_s, part, weights, ids, constexprs = _one_token_router("router_topk_one_launch", x, weight, bias, k)
    if counter.dtype != torch.int32:
        raise ValueError(f"router_topk_one_launch takes an int32 counter; got {counter.dtype}")
    router_one_launch_kernel[(n_e, n_s)](
        x.contiguous(), weight.contiguous(), part, counter, bias.contiguous(), weights, ids, E, H, k, multiplier,
        scaling, **constexprs, num_warps=1, **hooks.launch_options(x.device, "router_one_launch"))
    return weights, ids


@triton.jit
def router_pooler_kernel(x_ptr, w_ptr, part_ptr, count_ptr, bias_ptr, wout_ptr, ids_ptr, E, H, k, multiplier, scaling,
                         pooler_ptr, z_ptr, pool_count_ptr, norm_w_ptr, normed_ptr, N, eps, n_e, n_s,
                         res_ptr, post_w_ptr, alpha_ptr, beta_ptr, next_w_ptr, new_res_ptr, post_eps, res_eps,
                         BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr, K: tl.constexpr,
                         BLOCK: tl.constexpr, GEMV_N: tl.constexpr, GEMV_K: tl.constexpr, BLOCK_NORM: tl.constexpr,
                         PDL: tl.constexpr, EARLY: tl.constexpr, WARM: tl.constexpr = False,
                         GEMV_K_STATIC: tl.constexpr = 0, DEFERRED: tl.constexpr = False,
                         HAS_POST: tl.constexpr = False, HAS_NEXT: tl.constexpr = False):
    """The router's ``n_e x n_s`` programs (:func:`router_program`) first, then the pooler GEMV's row blocks with the
    pre-expert norm in its last one (``dense_gemv.gemv_program``): two independent products of one input in one
    launch, each with its own ticket. ``DEFERRED``: that input is ``residual_norm(res, x, post_w, alpha, beta,
    next_w, post_eps, res_eps)``'s normed row, which every program works out from the whole row
    (``norms.deferred_input``; the pooler's programs in :func:`pooler_deferred_program`, whose first stores the new
    residual)."""
    pid = tl.program_id(0)
    routers = n_e * n_s
    if pid < routers:
        if DEFERRED:
            offs_e, offs_k, em, km, w = router_weights(pid % n_e, pid // n_e, w_ptr, bias_ptr, E, H, BLOCK_E, BLOCK_K,
                                                       WARM)
            _, x = norms.deferred_input(offs_k, km, x_ptr, res_ptr, post_w_ptr, alpha_ptr, beta_ptr, next_w_ptr, H,
                                        post_eps, res_eps, HAS_POST, HAS_NEXT, GEMV_K, False, PDL)
            router_partial(pid // n_e, n_e, n_s, w, x, offs_e, em, part_ptr, count_ptr, bias_ptr, wout_ptr, ids_ptr,
                           E, k, multiplier, scaling, BLOCK_S, K, BLOCK)
        else:
            router_program(pid % n_e, pid // n_e, n_e, n_s, x_ptr, w_ptr, part_ptr, count_ptr, bias_ptr, wout_ptr,
                           ids_ptr, E, H, k, multiplier, scaling, BLOCK_E, BLOCK_K, BLOCK_S, K, BLOCK, PDL, WARM)
    elif DEFERRED:
        pooler_deferred_program(pid - routers, tl.num_programs(0) - routers, pooler_ptr, z_ptr, N, H, pool_count_ptr,
                                norm_w_ptr, normed_ptr, eps, x_ptr, res_ptr, post_w_ptr, alpha_ptr, beta_ptr,
                                next_w_ptr, new_res_ptr, post_eps, res_eps, HAS_POST, HAS_NEXT, GEMV_N, GEMV_K,
                                BLOCK_NORM, PDL, EARLY, WARM)
    else:
        # GEMV number tl.program_id(1) = 0 of a 1-D grid (a tensor: gemv_program casts it)
        dense_gemv.gemv_program(pid - routers, tl.program_id(1), tl.num_programs(0) - routers, x_ptr, pooler_ptr,
                                pooler_ptr, x_ptr, z_ptr, N, H, H, 0, 1, pool_count_ptr, z_ptr, z_ptr, z_ptr, z_ptr,
                                norm_w_ptr, z_ptr, normed_ptr, 0.0, eps, GEMV_N, GEMV_K, False, False, PDL, EARLY,
                                False, 1, False, True, BLOCK_NORM, WARM, GEMV_K_STATIC)


@triton.jit
def pooler_deferred_program(pid, programs, pooler_ptr, z_ptr, N, H, count_ptr, norm_w_ptr, normed_ptr, eps, out_ptr,
                            res_ptr, post_w_ptr, alpha_ptr, beta_ptr, next_w_ptr, new_res_ptr, post_eps, res_eps,
                            HAS_POST: tl.constexpr, HAS_NEXT: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, BLOCK_NORM: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr,
                            WARM: tl.constexpr):
    """Row block ``pid`` of the pooler GEMV whose input is the deferred residual norm's normed row
    (``dense_gemv.deferred_gemv_program``; block 0 stores the new residual), then the pre-expert norm in the program
    that draws the last of ``programs`` tickets, as ``dense_gemv(norm=)``."""
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    if WARM:
        hooks.prefetch_l2(norm_w_ptr + rows, rows < N)
    dense_gemv.deferred_gemv_program(pid, out_ptr, pooler_ptr, z_ptr, N, H, H, res_ptr, post_w_ptr, alpha_ptr,
                                     beta_ptr, next_w_ptr, new_res_ptr, post_eps, res_eps, HAS_POST, HAS_NEXT,
                                     BLOCK_N, BLOCK_K, PDL, EARLY)
    tl.debug_barrier()  # every thread's rows are stored before the ticket is taken
    if dense_gemv.last_ticket(count_ptr, programs):
        dense_gemv.norm_row(z_ptr, norm_w_ptr, normed_ptr, N, eps, True, BLOCK_NORM)


def router_pooler_one_launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, k: int, multiplier: float,
                             scaling: float, pooler: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                             counters: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`router_topk_one_launch` and ``dense_gemv(x, pooler, norm=(norm_weight, eps, ...))`` of one token ``x [1,
    H]`` in one launch (``router_pooler_kernel``): ``(weights, ids, normed)``. Both products read only ``x``, so the
    router's programs run beside the pooler's instead of before them, and a MoE block at decode has one dependent
    kernel fewer. ``counters``: two int32 zeros (the router's ticket, the pooler's), given back zero, owned by one
    call site as in :func:`router_topk_one_launch`. The pooler's bits are the two calls'; the router's sums run in the
    pooler's warps (2, or the backend's ``hooks.row_op_cut``) instead of one, so they may group differently (weights
    within ~1e-8 on the H200)."""
    return _router_pooler("router_pooler_one_launch", x, weight, bias, k, multiplier, scaling, pooler, norm_weight,
                          eps, counters, None)[:3]


def router_pooler_deferred(residual_norm: tuple, weight: torch.Tensor, bias: torch.Tensor, k: int, multiplier: float,
                           scaling: float, pooler: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                           counters: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`router_pooler_one_launch` of ``residual_norm(residual, out, post_w, alpha, beta, next_w, post_eps,
    res_eps)``'s normed row for one token, the op run in the launch's own programs rather than in the last program of
    the GEMV that wrote ``out`` (a serial tail that launch no longer has): ``residual_norm = (out [1, H], residual [1,
    H], post_w | None, alpha, beta, next_w | None, post_eps, res_eps)`` as ``MuseModel`` hands it on
    (:class:`musecore.model.DeferredNorm`). Returns ``(weights, ids, normed, new_residual)``. Every program works out
    the whole row's two rms factors (the op's sums, perhaps grouped otherwise than the op's kernel groups them) and
    then its own elements with the op's roundings; the pooler's first program stores the new residual. Takes
    ``H`` up to one chunk of the pooler's GEMV (``dense_gemv.deferred_fits``)."""
    return _router_pooler("router_pooler_deferred", residual_norm[0], weight, bias, k, multiplier, scaling, pooler,
                          norm_weight, eps, counters, residual_norm)


def _router_pooler(what: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, k: int, multiplier: float,
                   scaling: float, pooler: torch.Tensor, norm_weight: torch.Tensor, eps: float, counters: torch.Tensor,
                   deferred: tuple | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The router + pooler launch on ``x`` (``deferred``: the residual norm's operands, ``x`` its ``out``):
    ``(weights, ids, normed, new_residual)``, the last ``x`` itself where nothing is deferred."""
    E, H = weight.shape
    n_e, n_s, part, weights, ids, constexprs = _one_token_router(what, x, weight, bias, k)
    n = pooler.shape[0]
    if pooler.dim() != 2 or pooler.shape[1] != H or pooler.stride(1) != 1 or pooler.dtype != x.dtype \
            or pooler.dtype not in (torch.bfloat16, torch.float16) or norm_weight.shape != (n,) \
            or counters.dtype != torch.int32 or counters.numel() != 2:
        raise ValueError(f"{what} takes a row-major 16-bit pooler [n, {H}] of x's dtype, its norm weight [n] and two "
                         f"int32 counters; got pooler {pooler.dtype} {list(pooler.shape)} strides {pooler.stride()} (x "
                         f"{x.dtype}), norm {list(norm_weight.shape)}, counters {counters.dtype} "
                         f"{list(counters.shape)}")
    z, normed = (torch.empty(1, n, dtype=x.dtype, device=x.device) for _ in range(2))
    _, gemv_k, gemv_k_static = dense_gemv.gemv_blocks(H)
    gemv_n, warps = dense_gemv.row_op_cut(H, x.device, "router_pooler", ROUTER_POOLER_BLOCK_N, ROUTER_POOLER_WARPS)
    operands, flags, new_res = dense_gemv.deferred_operands(what, deferred, H, x)
    flat = counters.view(-1)
    router_pooler_kernel[(n_e * n_s + triton.cdiv(n, gemv_n),)](
        x.contiguous(), weight.contiguous(), part, flat[0:1], bias.contiguous(), weights, ids, E, H, k, multiplier,
        scaling, pooler, z, flat[1:2], norm_weight.contiguous(), normed, n, eps, n_e, n_s, *operands, **constexprs,
        GEMV_N=gemv_n, GEMV_K=gemv_k, GEMV_K_STATIC=gemv_k_static, BLOCK_NORM=triton.next_power_of_2(n),
        num_warps=warps, **flags,
        EARLY=hooks.early_trigger(x.device, "router_pooler"), **hooks.launch_options(x.device, "router_pooler"))
    return weights, ids, normed, new_res
