"""Fewer launches for a layer's attention and MoE blocks at one-token decode (issue 26 item 3: the decode step's
kernel count).

A muse-small decode step is ~290 dependent kernels of 1-7 us; most of its time is their launch, ramp and tail, not
bytes (backends/cuda/lab/NOTES.md, session 43). Each fused block runs the same kernels' work with launch
boundaries removed.

``musecore.model.MoE`` through the separate ops is nine launches: the router's split-K GEMV and its choice, the pooler
GEMV, the pre-expert norm, the experts' gate/up and down GEMVs and their finalize, the fp32 -> bf16 cast, the
unpooler GEMV. :class:`FusedMoE` runs four at decode (five where the experts take a grouped GEMM):

* the router and the pooler in one launch (:func:`musecore_triton.kernels.router.router_pooler_one_launch`; both
  read only the block's input, so they run side by side): the program that finishes the router's split-K product
  last makes the choice, the pooler GEMV's last program applies the pre-expert norm;
* the experts' gate/up and down GEMVs, one per assignment (``CUDABackend.moe_rows``);
* the unpooler GEMV with the finalize in every program (:func:`musecore_triton.kernels.moe.finalize_gemv`: each
  program re-reads the token's top-k fp32 rows and keeps their finalized sum, rounded as the cast rounds it, as its
  ``x``). Where the experts take a grouped GEMM, the finalize is its own launch and the unpooler GEMV reads its fp32
  output, rounding it as it loads (the cast's bits, no cast kernel).

``musecore.model.Attention`` is six: the q/k/v/gate GEMV, the q/k norms and RoPE, the KV write, attention, the head
norm and gate, o_proj. :class:`FusedAttention` runs three: the q/k/v/gate GEMV runs each q/k head's norms and RoPE in
the last program to finish that head's rows, which writes k and v straight into the static cache
(``dense_gemv.qkv_gemv_rope``, where the KV write puts them), and the head norm and gate run in the attention
kernel's epilogue (``attention(gate=)``; after the merge when long contexts split the keys).

:func:`fuse_embed` does the same for ``MuseModel.embed`` at decode (one token per row, any batch): ~18 launches
(the cache's next position, the rotary rows, the placeholder mask, the embedding, two norms) become one
(:func:`musecore_triton.kernels.embed.decode_embed`).

Both blocks also fuse the ``residual_norm`` op the model applies after the block (``sublayer``, see
``Backend.fuse_block``): it runs in the last program of the block's final GEMV (o_proj, the unpooler;
``dense_gemv(residual_norm=)``). A MoE sublayer is then four launches instead of ten, an attention sublayer three
instead of seven: muse-small's decode step 294 -> 150 (133 with ``fuse_embed``, 117 with the finalize in the unpooler
GEMV).

With ``DEFER_RESIDUAL_NORM`` the residual norm between a layer's attention and MoE blocks moves once more: the
attention block's ``sublayer(..., defer=True)`` ends with o_proj's plain GEMV and hands the norm on unrun
(``musecore.model.DeferredNorm``), and every program of the MoE block's router + pooler launch works it out over the
whole row for itself (``router.router_pooler_deferred``; the pooler's first program stores the new residual): o_proj's
launch loses its serial tail, the same launch count. ``DEFER_MOE_NORM`` (on) does the same with the norm after the MoE
block: the unpooler's GEMV ends plain and every program of the next layer's q/k/v/gate launch runs the norm
(``dense_gemv.qkv_gemv_rope_deferred``; its program 0 stores the new residual).

The last-program steps take a ticket on an int32 counter that each fused block owns (zeroed once here, reset by
the kernel that used it), so one block's launches must not overlap one another: a block runs on one stream at a
time, as a model's forward does.

Numerics: every step computes the separate ops' values. Some sums may group their fp32 terms differently: the
pre-expert and residual norms' (in the GEMV's warps: 4 and 8, ``triton_hooks.ROW_OP_CUTS``; the norm kernels' 4), the
q/k norms' (two warps, not one), the head norm's (in the attention kernel's tile) and the router's partials (another
order than the op's split-K GEMV, about 1e-7 relative, so an expert choice can differ only where two ``score + bias``
values tie to that precision). ``test_cuda_fused.py`` checks each block against its separate ops on the GPU.

Taken for one token of one sequence (the model dtype) where the projections are 16-bit weights on the dense GEMV's
path (and, MoE, the router is a contiguous fp32 ``[E, H]`` with a bias; attention, the loader fused q/k/v/gate and
the cache layer is static, of the model dtype); anything else returns None and the separate ops run.
``MUSECORE_CUDA_FUSED_BLOCKS=0`` turns fusion off.

Example::

    fused = backend.fuse_block(model.layers[3].mlp)   # None: not fusable (the reason at debug level)
    y = fused(m)                                      # [1, 1, H], or None for inputs it does not take
    out = backend.fuse_block(model.layers[3].self_attn)(a, positions, rope, cache)
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any, Callable, Optional

import torch

from musecore.model import Attention, DeferredNorm, MoE
from musecore_triton.kernels.attention import attention
from musecore_triton.kernels.dense_gemv import (DENSE_GEMV_MAX_BYTES, MAX_BLOCK_K, attention_fits, deferred_fits,
                                                dense_gemv, qkv_attention, qkv_gemv_rope, qkv_gemv_rope_deferred)
from musecore_triton.kernels.embed import model_decode_embed
from musecore_triton.kernels.moe import finalize_gemv
from musecore_triton.kernels.router import (MAX_TOP_K, ONE_LAUNCH_MAX_E, router_pooler_deferred,
                                            router_pooler_one_launch)

FUSED_ENV = "MUSECORE_CUDA_FUSED_BLOCKS"
# Attention in the q/k/v/gate GEMV's launch (``qkv_attention``: each KV head's group attends in the last program to
# finish it; 2 launches per attention block instead of 3, caches up to ``ATTEND_MAX_KEYS``). Off: it passes the GPU
# tests but is slower in muse-small's decode graph (session 52, run 61, cuda_fused_ab.py mode ``attend_in_qkv``: 700.2
# against 684.7 us per replay, 749.1 against 717.9 us per generated token; 2 warps with 32-key steps: 787.4). The
# group's attention runs in one program after its GEMV rows, where the separate kernel overlapped the GEMV's tail.
ATTENTION_IN_QKV = False
# The MoE finalize in every program of the unpooler GEMV (``moe.finalize_gemv``), where the experts take one GEMV per
# assignment and the unpooler's K fits one chunk: one launch per MoE block fewer. On: muse-small's decode graph 714.5
# against 733.1 us per replay on an H100, 117 kernels per step against 133 (session 75, run 144; cuda_fused_ab.py's
# ``fin_apart`` is it switched off).
FINALIZE_IN_UNPOOLER = True
# The residual norm after attention run in the router + pooler launch's programs (``router_pooler_deferred``, the
# model's ``DeferredNorm``) instead of in the last program of o_proj's GEMV: one serial tail per layer fewer, each
# router + pooler program redoing the norm's two sums over the whole row. Off: muse-small's decode graph on an H100
# (session 79, run 159, cuda_fused_ab.py, 5 rounds) 653.6 us per replay against 654.5, within the rounds' spread, and
# beside DEFER_MOE_NORM 652.3 against 649.6 for that one alone (mode ``defer_norm`` / ``defer_both``).
DEFER_RESIDUAL_NORM = False
# The residual norm after the MoE block run in every program of the next layer's q/k/v/gate launch
# (``dense_gemv.qkv_gemv_rope_deferred``, at the backend's ``qkv_deferred`` cut) instead of in the last program of the
# unpooler's GEMV (the last layer's stays there: the final norm before lm_head). On: muse-small's decode graph on an
# H200 (session 80, run 164, cuda_fused_ab.py, 3 rounds twice) 611.0 and 611.2 us per replay against 613.6 and 614.8,
# on an H100 (session 79, run 159) 649.6 against 654.5; at a 4 x 4 cut 628.7. The whole GPU suite passed with it on
# (run 163, H200; run 165, H100). Its sums run in another order than the undeferred path's (the q/k/v/gate GEMV over
# 8 warps instead of 2, and the norm's own mean square; run 165: the plain launch at 8 x 8 too left the tokens
# apart), so a bf16 element now and then rounds the other way; on random weights that grows layer by layer into
# other router choices (run 163, cuda_defer_chain.py: the first difference at layer 6, NMSE 1.5e-5, a flip at layer
# 11), as any one-ulp change does (test_cuda_model.py). Session 79's "0.386 NMSE" came from a replayed step whose
# cache had been freed.
DEFER_MOE_NORM = True
log = logging.getLogger("musecore.cuda")


def disabled() -> bool:
    return os.environ.get(FUSED_ENV, "").strip().lower() in ("0", "off", "no", "false")


def fuse_block(backend: Any, block: Any) -> Optional[Callable[..., Optional[torch.Tensor]]]:
    """``block`` (a ``musecore.model.MoE`` or ``Attention`` whose weights ``backend`` prepared) -> a callable with
    the block's call signature running it in fewer launches for one token, returning None for other inputs (and a
    ``sublayer`` method: the block and the residual norm after it); None here when the block cannot be fused (the
    reason at debug level). The callable checks on each call that the block still holds the weights it bound
    (anything replaced since: None, and the separate ops run)."""
    if disabled():
        fused, why = None, f"{FUSED_ENV}=0"
    elif isinstance(block, MoE):
        fused, why = _fuse_moe(backend, block)
    elif isinstance(block, Attention):
        fused, why = _fuse_attention(block)
    else:
        fused, why = None, f"no fused form of {type(block).__name__} in the CUDA backend"
    if fused is None:
        log.debug("layer %s: %s not fused: %s", getattr(block, "layer", "?"), type(block).__name__, why)
    return fused


def fuse_embed(model: Any) -> Optional[Callable[..., Optional[tuple]]]:
    """``model.embed`` for one token per row through a static cache in one launch (the shared
    :func:`musecore_triton.kernels.embed.model_decode_embed`), or None when ``MUSECORE_CUDA_FUSED_BLOCKS=0`` or the
    model's weights do not fit it (the reason at debug level)."""
    embed, why = (None, f"{FUSED_ENV}=0") if disabled() else model_decode_embed(model)
    if embed is None:
        log.debug("embed not fused: %s", why)
    return embed


def _dense(weight: Any, what: str) -> tuple[Optional[torch.Tensor], str]:
    data = getattr(weight, "data", None)
    if not isinstance(data, torch.Tensor) or data.dtype not in (torch.bfloat16, torch.float16) or data.dim() != 2 \
            or data.stride(1) != 1 or not data.is_cuda:
        return None, f"the {what} is not a 16-bit CUDA tensor (format {getattr(weight, 'format', '?')})"
    if data.numel() * data.element_size() > DENSE_GEMV_MAX_BYTES:
        return None, f"the {what} is larger than the dense GEMV takes ({DENSE_GEMV_MAX_BYTES >> 20} MiB)"
    return data, ""


def _fuse_moe(backend: Any, block: Any) -> tuple[Optional["FusedMoE"], str]:
    router, bias = block.router, block.correction_bias
    if not isinstance(router, torch.Tensor) or router.dtype is not torch.float32 or router.dim() != 2 \
            or not router.is_contiguous() or not router.is_cuda:
        return None, "the router weight is not a contiguous fp32 [E, H] CUDA tensor"
    E, H = router.shape
    if not isinstance(bias, torch.Tensor) or bias.dtype is not torch.float32 or bias.shape != (E,):
        return None, "the router has no fp32 correction bias [E]"
    if E > ONE_LAUNCH_MAX_E or not 0 < block.top_k <= min(E, MAX_TOP_K):
        return None, f"{E} experts, top-{block.top_k}: beyond the one-launch router ({ONE_LAUNCH_MAX_E}, {MAX_TOP_K})"
    pooler, why = _dense(block.pre_expert_proj, "pooler")
    unpooler, why2 = _dense(block.post_expert_proj, "unpooler")
    if pooler is None or unpooler is None:
        return None, why or why2
    h = pooler.shape[0]
    if pooler.shape[1] != H or unpooler.shape != (H, h) or unpooler.dtype != pooler.dtype \
            or block.pre_expert_norm is None or block.pre_expert_norm.shape != (h,):
        return None, "the block's shapes do not chain (router, pooler and its norm, unpooler)"
    return FusedMoE(backend, block, pooler, unpooler), ""


class _Fused:
    """A fused block: the block, the weights it was made from (``weights(block)``, checked by identity on every
    call: a replaced weight makes the fused form step aside) and the int32 tickets of its last-program steps."""

    __slots__ = ("block", "held", "counters")

    @staticmethod
    def weights(block: Any) -> tuple:
        raise NotImplementedError

    def __init__(self, block: Any, tickets: int, device: torch.device) -> None:
        self.block, self.held = block, self.weights(block)
        self.counters = torch.zeros(tickets, 1, dtype=torch.int32, device=device)

    def bound(self) -> bool:
        """Whether the block still holds the weights this was made from."""
        return all(now is then for now, then in zip(self.weights(self.block), self.held))

    def _sublayer(self, residual: Any, norm: tuple, x: Optional[torch.Tensor], defer: bool,
                  run: Callable[..., Any]) -> Optional[Any]:
        """The ``sublayer`` method of both blocks: ``run(x, then, deferred, defer)`` (their ``_run`` with its other
        arguments bound) on ``x`` with ``then = (residual, norm)``, where ``residual`` may be a ``DeferredNorm``
        (``x`` None; only where :attr:`takes_deferred`: ``x`` is its ``out``), and with ``defer`` this block's own
        norm handed on as a ``DeferredNorm``. None where the block does not take these inputs."""
        deferred = residual if isinstance(residual, DeferredNorm) else None
        if deferred is not None:
            if not self.takes_deferred:
                return None
            residual, x = deferred.residual, deferred.out
        if residual.shape != x.shape or residual.dtype != x.dtype:
            return None
        out = run(x, (residual, norm), deferred, defer)
        return DeferredNorm(*out, norm) if defer and out is not None else out


class FusedMoE(_Fused):
    """``fused(m)``: the MoE block's output for one token ``m [..., H]`` in the pooler's dtype, or None."""

    __slots__ = ("backend", "pooler", "unpooler")

    @staticmethod
    def weights(block: Any) -> tuple:
        return (block.router, block.correction_bias, block.experts, block.pre_expert_proj, block.post_expert_proj,
                block.pre_expert_norm, block.post_expert_norm)

    def __init__(self, backend: Any, block: Any, pooler: torch.Tensor, unpooler: torch.Tensor) -> None:
        super().__init__(block, 3, pooler.device)  # tickets: router, pooler (one launch), unpooler
        self.backend, self.pooler, self.unpooler = backend, pooler, unpooler

    def __call__(self, m: torch.Tensor) -> Optional[torch.Tensor]:
        return self._run(m, None)

    def sublayer(self, residual: Any, norm: tuple, m: Optional[torch.Tensor], defer: bool = False) -> Optional[Any]:
        """The block, then ``residual_norm(residual, out, *norm)`` in the unpooler GEMV's last program. ``residual``
        may be the attention sublayer's ``DeferredNorm`` (``m`` None; where :attr:`takes_deferred`): the router +
        pooler launch runs it and stores the new residual this block's own norm takes. With ``defer`` this block's
        norm is handed on unrun instead (a ``DeferredNorm``)."""
        return self._sublayer(residual, norm, m, defer, self._run)

    @property
    def takes_deferred(self) -> bool:
        """Whether :meth:`sublayer` takes a ``DeferredNorm`` (``DEFER_RESIDUAL_NORM``, and a hidden width the
        pooler's programs hold whole)."""
        return DEFER_RESIDUAL_NORM and deferred_fits(self.pooler.shape[1])

    def _run(self, m: torch.Tensor, then: Optional[tuple], deferred: Optional[DeferredNorm] = None,
             defer: bool = False) -> Any:
        """The block's launches on ``m``: its output, or with ``then = (residual, norm)`` the residual norm's pair
        (``defer``: ``(residual, output)``, the norm not run); ``deferred``: ``m`` is that norm's ``out``, and the
        router + pooler launch runs it, its new residual standing in for ``then``'s."""
        routed = self._route(m, deferred)
        if routed is None:
            return None
        (weights, ids, z, new_res), block = routed, self.block
        if deferred is not None:
            then = (new_res.view(m.shape), then[1])
        rows = (self.backend.moe_rows(z, ids, block.experts)
                if FINALIZE_IN_UNPOOLER and self.unpooler.shape[1] <= MAX_BLOCK_K else None)
        if rows is not None:  # the expert rows [k, h] fp32; their finalize runs in every program of the unpooler
            unpool = functools.partial(finalize_gemv, rows, weights, block.post_expert_norm, block.post_eps,
                                       self.unpooler)
        else:
            y = self.backend.moe(z, weights, ids, block.experts, block.post_expert_norm, block.post_eps)  # [1,h] fp32
            unpool = functools.partial(dense_gemv, y, self.unpooler)  # y rounded to the model dtype as it loads
        return _unpool(unpool, m.shape, then, self.counters[2], defer)

    def _route(self, m: torch.Tensor, deferred: Optional[DeferredNorm]
               ) -> Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]]:
        """The router + pooler launch on one token ``m``: ``(weights, ids, z [1, h], new residual)``, or None where
        ``m`` is not the one token of the pooler's dtype and device this block was fused for, or the block's weights
        changed. ``deferred``: ``m`` is the attention block's output and the launch runs the residual norm after it
        (the new residual [1, H]; otherwise None)."""
        block, pooler = self.block, self.pooler
        H = pooler.shape[1]
        if m.numel() != H or m.dtype != pooler.dtype or m.device != pooler.device or not self.bound():
            return None
        route = (block.router, block.correction_bias, block.top_k, block.multiplier, block.scaling, pooler,
                 block.pre_expert_norm, block.eps, self.counters[:2])
        if deferred is None:
            return router_pooler_one_launch(m.reshape(1, H), *route) + (None,)
        return router_pooler_deferred((m.reshape(1, H), deferred.residual.reshape(1, H), *deferred.norm), *route)


def _unpool(gemv: Callable[..., Any], shape: torch.Size, then: Optional[tuple], counter: torch.Tensor,
            defer: bool = False) -> Any:
    """The block's last GEMV (``gemv(residual_norm=None)``, ``dense_gemv``'s keyword): its output ``[shape]``, or
    with ``then = (residual, norm)`` the residual_norm op's pair, or with ``defer`` as well ``(residual, output)``
    (the op left to the next block)."""
    if then is None:
        return gemv().view(shape)
    if defer:
        return then[0], gemv().view(shape)
    residual, norm = then
    new_res, normed = gemv(residual_norm=(residual.reshape(1, -1), *norm, counter))
    return new_res.view(shape), normed.view(shape)


def _fuse_attention(block: Any) -> tuple[Optional["FusedAttention"], str]:
    problem = block.fused_projection_problem()
    if problem:
        return None, problem
    nq, d = block.nq, block.d
    in_proj, why = _dense(block.in_proj.weight, "fused q/k/v/gate projection")
    o_proj, why2 = _dense(block.o_proj, "o_proj")
    if in_proj is None or o_proj is None:
        return None, why or why2
    if o_proj.shape != (in_proj.shape[1], nq * d) or o_proj.dtype != in_proj.dtype:
        return None, "the projections' shapes do not chain"
    return FusedAttention(block, in_proj, o_proj), ""


class FusedAttention(_Fused):
    """``fused(a, positions, rope, cache)``: the attention block's output for one new token of one sequence through
    a static cache layer of the model dtype (written as the separate ops write it), or None. Three launches instead
    of six: the q/k/v/gate GEMV with the q/k norms, RoPE and the KV write in each head's last program
    (``qkv_gemv_rope``); attention with the head norm and gate in its epilogue (``attention(gate=)``); o_proj."""

    __slots__ = ("in_proj", "o_proj")

    @staticmethod
    def weights(block: Any) -> tuple:
        return block.in_proj, getattr(block.in_proj, "weight", None), block.o_proj

    def __init__(self, block: Any, in_proj: torch.Tensor, o_proj: torch.Tensor) -> None:
        # tickets: o_proj's, one per q/k head, one per KV head's group (qkv_attention)
        super().__init__(block, 1 + block.nq + 2 * block.nkv, in_proj.device)
        self.in_proj, self.o_proj = in_proj, o_proj

    def __call__(self, a: torch.Tensor, positions: torch.Tensor, rope: Any, cache: Any) -> Optional[torch.Tensor]:
        return self._run(a, positions, rope, cache, None)

    def sublayer(self, residual: Any, norm: tuple, a: Optional[torch.Tensor], positions: torch.Tensor, rope: Any,
                 cache: Any, defer: bool = False) -> Optional[Any]:
        """The block, then ``residual_norm(residual, out, *norm)`` in the o_proj GEMV's last program; with ``defer``
        the block alone, the norm handed on unrun (a ``DeferredNorm`` for the MoE block's router + pooler launch).
        ``residual`` may be the layer before's ``DeferredNorm`` (``a`` None; where :attr:`takes_deferred`): the
        q/k/v/gate launch runs it (``qkv_gemv_rope_deferred``) and stores the new residual this block's norm takes."""
        return self._sublayer(residual, norm, a, defer, lambda a, then, deferred, defer: self._run(
            a, positions, rope, cache, then, deferred, defer))

    @property
    def takes_deferred(self) -> bool:
        """Whether :meth:`sublayer` takes a ``DeferredNorm`` (``DEFER_MOE_NORM``, the q/k/v/gate GEMV holding the
        whole row, attention not in its launch)."""
        return DEFER_MOE_NORM and not ATTENTION_IN_QKV and deferred_fits(self.in_proj.shape[1])

    def _run(self, a: torch.Tensor, positions: torch.Tensor, rope: Any, cache: Any, then: Optional[tuple],
             deferred: Optional[DeferredNorm] = None, defer: bool = False) -> Any:
        """The block's launches on ``a``: its output, or with ``then = (residual, norm)`` the residual norm's pair
        (``defer``: ``(residual, output)``, the norm not run); ``deferred``: ``a`` is that norm's ``out``, and the
        q/k/v/gate launch runs it, its new residual standing in for ``then``'s."""
        block, in_proj = self.block, self.in_proj
        if cache is None or positions.shape != (1, 1) or a.numel() != in_proj.shape[1] or a.dtype != in_proj.dtype \
                or a.device != in_proj.device or not self.bound():
            return None
        lc = cache[block.layer]
        if not lc.static or lc.kv_format != "bf16" or lc.k.dtype != a.dtype:
            return None
        nq, nkv, d = block.nq, block.nkv, block.d
        cos, sin = rope if block.rope else (None, None)  # NoPE on the full-attention layers
        view = lc.stored()  # views of the cache: the launch's KV write shows through them
        if ATTENTION_IN_QKV and attention_fits(nq, nkv, view.k.shape[1]) and deferred is None:
            o = qkv_attention(a.reshape(1, -1), in_proj, nq, nkv, cos, sin, block.eps, block.q_scale, lc.k, lc.v,
                              lc.positions, positions, lc.capacity, lc.ring, self.counters[1:],
                              (view.k, view.v, view.positions), block.window, block.scale, block.eps)
        else:
            qkv = (in_proj, nq, nkv, cos, sin, block.eps, block.q_scale, lc.k, lc.v, lc.positions, positions,
                   lc.capacity, lc.ring, self.counters[1:])
            if deferred is None:
                y, q = qkv_gemv_rope(a.reshape(1, -1), *qkv)
            else:
                y, q, new_res = qkv_gemv_rope_deferred((a.reshape(1, -1), deferred.residual.reshape(1, -1),
                                                        *deferred.norm), *qkv)
                then = (new_res.view(a.shape), then[1])
            gate = y.view(1, 1, -1, d)[:, :, nq + 2 * nkv:]  # [1,1, nq + 2 nkv + nq, d]: q, k, v, gate heads
            o = attention(q, view.k, view.v, positions, view.positions, block.window, block.scale,
                          gate=(gate, block.eps))
        return _unpool(functools.partial(dense_gemv, o.reshape(1, nq * d), self.o_proj), a.shape, then,
                       self.counters[0], defer)
