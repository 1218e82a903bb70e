"""Does a residual norm cost less in the next GEMV's prologue than in the last program of the GEMV before it? (issue 26,
session 70; muse-small's decode step)

Today ``dense_gemv(residual_norm=...)`` runs the ``residual_norm`` op after o_proj's and the unpooler's product in the
program that draws the launch's last ticket: a serial tail of an atomic, a round trip for the row and the op's own
reductions while the rest of the GPU idles (session 49's ncu: o_proj with it, 4.7 MB, 7.36 us; the q/k/v/gate GEMV
without one, 10.6 MB, 6.11 us). Here the producer GEMV has no tail, and every program of the consumer GEMV redoes the
row op on the whole row after its PDL wait, keeping the normed row in registers as its ``x`` (the consumer reads all of
K in one chunk, up to ``MAX_BLOCK_K`` columns, as ``dense_gemv`` does at muse-small's 1536). One program also stores
the new residual. The cost moves from one serial program to a little more work in every program, and from one row's
reads to one per program (at ``dense_gemv``'s 2 rows per program, 768 programs of six 1536-element vectors: ~14 MB of
L2 reads a launch where ``x`` took 2.4 MB), which is what the timing has to decide.

Compiled for sm90 on the CPU (this machine's Triton, ``cuobjdump -res-usage``), K = 1536: at ``dense_gemv``'s cut
(2 rows, 2 warps) the consumer takes 255 registers and spills 104 bytes (the six row vectors beside its weights);
4 x 4 warps 185 registers, 8 x 8 131, 16 x 16 108, no spills (``dense_gemv`` itself 183, with the tail 214). So the
wider cuts are the ones to time.

:func:`prologue_gemv` is that consumer; its numerics are the tail's (the same roundings, the row's sums perhaps in
another order). The timing script is ``scripts/cuda_prologue_probe.py``; the interpreter test
``tests/test_prologue_probe.py``.

Session 72 adds a second chain (``finalize_gemv``, in the product since session 75 as
``musecore_triton.kernels.moe.finalize_gemv``): the MoE block's finalize (each token's top-k expert rows through
the shared post-expert norm, weighted and summed; ``moe.finalize``, its own launch today) in every program of the
unpooler GEMV after it, so muse-small's step would lose a launch per layer (16) rather than a serial tail. Each
program re-reads the token's ``topk x h`` fp32 rows (24 KB at muse-small's top-8 x 768): fewer, wider programs again.
Compiled for sm90 on the CPU (Triton 3.6, ``cuobjdump -res-usage``), top-8, h = 768: 195 registers at 2 rows x 2 warps,
127 at 4 x 4, 100 at 8 x 8, 80 at 16 x 16, no spills.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from musecore_triton import hooks
from musecore_triton.kernels import norms
from musecore_triton.kernels.dense_gemv import (BLOCK_N, MAX_BLOCK_K, NUM_WARPS, dense_gemv, expert_gemv,
                                                 store_row_products, whole_k_tile)
from musecore_triton.kernels.moe import finalize, finalize_gemv


@triton.jit
def prologue_gemv_kernel(o_ptr, res_ptr, post_w_ptr, alpha_ptr, beta_ptr, next_w_ptr, new_res_ptr, w_ptr, y_ptr, N, K,
                         stride_w, post_eps, eps, HAS_POST: tl.constexpr, HAS_NEXT: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr):
    """``y[rows] = W[rows] @ normed`` where ``(new_res, normed) = residual_norm(res, o, ...)`` of the kernel before's
    product ``o``; every program computes the row op, program 0 stores ``new_res``."""
    rows, rmask, kk, kmask, wv = whole_k_tile(tl.program_id(0), w_ptr, N, K, stride_w, BLOCK_N,
                                              BLOCK_K)  # no kernel's: before the wait
    hooks.pdl_launch_dependents(EARLY)
    hooks.pdl_wait(PDL)
    o = tl.load(o_ptr + kk, mask=kmask, other=0.0).to(tl.float32)
    post = tl.load(post_w_ptr + kk, mask=kmask, other=0.0).to(tl.float32)
    alpha = tl.load(alpha_ptr + kk, mask=kmask, other=0.0).to(tl.float32)
    beta = tl.load(beta_ptr + kk, mask=kmask, other=0.0).to(tl.float32)
    res = tl.load(res_ptr + kk, mask=kmask, other=0.0).to(tl.float32)
    nxt = tl.load(next_w_ptr + kk, mask=kmask, other=0.0).to(tl.float32)
    # norms.residual_norm_row's steps and roundings, the normed row kept in registers
    h = norms._norm(o, post, kmask, K, post_eps, HAS_POST, True, o_ptr.dtype.element_ty)
    h = h.to(o_ptr.dtype.element_ty).to(tl.float32)
    new_res = (alpha * res + beta * h).to(new_res_ptr.dtype.element_ty)
    if tl.program_id(0) == 0:
        tl.store(new_res_ptr + kk, new_res, mask=kmask)
    x = norms._norm(new_res.to(tl.float32), nxt, kmask, K, eps, HAS_NEXT, False, new_res_ptr.dtype.element_ty)
    x = x.to(new_res_ptr.dtype.element_ty).to(tl.float32)  # the normed row as the tail stores it, as x is loaded
    store_row_products(wv, x, y_ptr, rows, rmask)


def prologue_gemv(o: torch.Tensor, residual: torch.Tensor, post_w: torch.Tensor | None, alpha: torch.Tensor,
                  beta: torch.Tensor, next_w: torch.Tensor | None, post_eps: float, eps: float,
                  w: torch.Tensor, block_n: int = BLOCK_N, num_warps: int = NUM_WARPS) -> tuple[torch.Tensor,
                                                                                               torch.Tensor]:
    """``(W @ normed [1, N], new_residual [1, K])`` for ``(new_residual, normed) = residual_norm(residual, o,
    post_w, alpha, beta, next_w, post_eps, eps)`` (``o``, ``residual`` ``[1, K]``; ``w [N, K]`` of their dtype,
    ``K <= MAX_BLOCK_K``): what ``dense_gemv(o_input, W_o, residual_norm=...)`` then ``dense_gemv(normed, w)``
    compute, with the row op in this launch's prologue."""
    n, k = w.shape
    if k > MAX_BLOCK_K or o.shape != (1, k) or residual.shape != (1, k) or w.stride(1) != 1 \
            or o.dtype != w.dtype or residual.dtype != w.dtype:
        raise ValueError(f"prologue_gemv takes o, residual [1, K] and w [N, K] of one 16-bit dtype, K <= "
                         f"{MAX_BLOCK_K}; got o {o.dtype} {list(o.shape)}, residual {list(residual.shape)}, w "
                         f"{w.dtype} {list(w.shape)}")
    y = torch.empty(1, n, dtype=w.dtype, device=w.device)
    new_res = torch.empty_like(residual)
    prologue_gemv_kernel[(triton.cdiv(n, block_n),)](
        o.contiguous(), residual.contiguous(), o if post_w is None else post_w.contiguous(), alpha.contiguous(),
        beta.contiguous(), o if next_w is None else next_w.contiguous(), new_res, w, y, n, k, w.stride(0), post_eps,
        eps, HAS_POST=post_w is not None, HAS_NEXT=next_w is not None, BLOCK_N=block_n,
        BLOCK_K=triton.next_power_of_2(k), num_warps=num_warps, EARLY=hooks.early_trigger(w.device, "dense_gemv"),
        **hooks.launch_options(w.device, "dense_gemv"))
    return y, new_res


def pair_inputs(pairs: int, d: int, dtype: torch.dtype, device: torch.device, seed: int = 0) -> dict:
    """A chain of ``pairs`` (producer, consumer) ``[d, d]`` weight pairs with one residual norm between the two GEMVs
    of each pair (a sandwich post norm, gated residual, next norm, as the model's): the first input and residual."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(device, dtype)
    return {"wa": randn(pairs, d, d, scale=d ** -0.5), "wb": randn(pairs, d, d, scale=d ** -0.5),
            "x": randn(1, d), "residual": randn(1, d), "post_w": 1 + randn(d, scale=0.1),
            "alpha": 1 + randn(d, scale=0.1), "beta": randn(d, scale=0.5), "next_w": 1 + randn(d, scale=0.1)}


def run_chain(inputs: dict, producer: callable, consumer: callable) -> tuple[torch.Tensor, torch.Tensor]:
    """The chain's last output and residual: each pair's ``producer(x, wa[i], residual)`` gives the consumer's
    arguments, ``consumer(args, wb[i])`` the next ``(x, residual)``."""
    x, residual = inputs["x"], inputs["residual"]
    for i in range(inputs["wa"].shape[0]):
        x, residual = consumer(producer(x, inputs["wa"][i], residual), inputs["wb"][i])
    return x, residual


def tail_pair(inputs: dict, post: bool = True, nxt: bool = True, eps: float = 1e-6) -> tuple:
    """Today's (producer, consumer) for :func:`run_chain`: the row op in the producer's last program
    (``dense_gemv(residual_norm=...)``), then a plain ``dense_gemv`` of the normed row."""
    counter = torch.zeros(1, dtype=torch.int32, device=inputs["x"].device)
    post_w, next_w = inputs["post_w"] if post else None, inputs["next_w"] if nxt else None

    def producer(x: torch.Tensor, wa: torch.Tensor, residual: torch.Tensor) -> tuple:
        return dense_gemv(x, wa, residual_norm=(residual, post_w, inputs["alpha"], inputs["beta"], next_w, eps, eps,
                                                counter))

    def consumer(args: tuple, wb: torch.Tensor) -> tuple:
        new_res, normed = args
        return dense_gemv(normed, wb), new_res
    return producer, consumer


def prologue_pair(inputs: dict, post: bool = True, nxt: bool = True, eps: float = 1e-6, block_n: int = BLOCK_N,
                  num_warps: int = NUM_WARPS) -> tuple:
    """The probe's (producer, consumer) for :func:`run_chain`: a plain ``dense_gemv``, then :func:`prologue_gemv`
    (``block_n`` rows per program on ``num_warps`` warps)."""
    post_w, next_w = inputs["post_w"] if post else None, inputs["next_w"] if nxt else None

    def producer(x: torch.Tensor, wa: torch.Tensor, residual: torch.Tensor) -> tuple:
        return dense_gemv(x, wa), residual

    def consumer(args: tuple, wb: torch.Tensor) -> tuple:
        o, residual = args
        return prologue_gemv(o, residual, post_w, inputs["alpha"], inputs["beta"], next_w, eps, eps, wb, block_n,
                             num_warps)
    return producer, consumer


def moe_chain_inputs(pairs: int, d: int, topk: int, dtype: torch.dtype, device: torch.device, seed: int = 0) -> dict:
    """A chain of ``pairs`` MoE tails: each a down-projection stack ``[topk, d, d]`` (the token's ``topk`` experts,
    one GEMV per assignment, fp32 out as the decode MoE's), the finalize and an unpooler ``[d, d]``; the first input
    ``x [1, d]``, the routing weights and the post-expert norm."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(device, dtype)
    weights = torch.softmax(torch.randn(1, topk, generator=gen), -1).to(device)
    return {"down": randn(pairs, topk, d, d, scale=d ** -0.5), "wb": randn(pairs, d, d, scale=d ** -0.5),
            "x": randn(1, d), "weights": weights, "ids": torch.arange(topk, device=device).view(1, topk),
            "post_norm": 1 + randn(d, scale=0.1)}


def run_moe_chain(inputs: dict, tail: callable) -> torch.Tensor:
    """The chain's last output: for each pair the down GEMVs (``expert_gemv``, one per assignment, fp32 rows) then
    ``tail(o, wb[i])``, the finalize and the unpooler GEMV in one way or the other."""
    x, ids = inputs["x"], inputs["ids"]
    for i in range(inputs["down"].shape[0]):
        o = expert_gemv(x.expand(ids.shape[1], -1), inputs["down"][i], ids, 1, out_dtype=torch.float32)
        x = tail(o, inputs["wb"][i])
    return x


def finalize_tails(inputs: dict, post_eps: float = 1e-6, block_n: int = BLOCK_N,
                   num_warps: int = NUM_WARPS) -> dict[str, callable]:
    """The two ``tail``s for :func:`run_moe_chain`: ``separate`` (today: ``moe.finalize``'s launch, then
    ``dense_gemv`` rounding its fp32 output as it loads) and ``prologue`` (:func:`finalize_gemv` at ``block_n`` rows
    on ``num_warps`` warps)."""
    ids, weights, norm = inputs["ids"], inputs["weights"], inputs["post_norm"]

    def separate(o: torch.Tensor, wb: torch.Tensor) -> torch.Tensor:
        return dense_gemv(finalize(o, ids.reshape(-1), ids, weights, norm, post_eps, sorted_rows=False,
                                   act_dtype=wb.dtype), wb)

    def prologue(o: torch.Tensor, wb: torch.Tensor) -> torch.Tensor:
        return finalize_gemv(o, weights, norm, post_eps, wb, block_n, num_warps)
    return {"separate": separate, "prologue": prologue}
