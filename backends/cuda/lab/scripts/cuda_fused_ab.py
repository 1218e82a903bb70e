"""A/B of the CUDA backend's fused blocks (``musecore_cuda.fused``) in muse-small's batch-1 decode, in one process:
graph replay per step, kernels per step and ``generate`` per token, with the fused blocks, with the fused blocks but
the router and the pooler as two launches (``apart``: session 47's ``router_pooler_one_launch`` undone), and with
every block's separate ops (session 43, issue 26 item 3); and ``stepped``: the fused blocks with ``generate``'s
greedy steps as the decode graph's replay plus its position update and argmax launched beside it (before session 48's
``GreedyGraphStep`` took them into the graph); ``embed_ops``: the fused blocks with the embedding stage through its
ops (before session 48's ``fuse_embed``); ``no_warm``: the fused blocks without the L2 prefetch of the GEMV tails'
row-op weights (``hooks.l2_warm``, session 49); ``rope_apart``: the fused blocks with the q/k norms, RoPE and the KV
write as their own launch after the q/k/v/gate GEMV (before session 50's ``qkv_gemv_rope``); ``unroll``: the
16-bit GEMVs with K's chunks unrolled, one row per program (``dense_gemv.UNROLL_K``, off by default since run 45);
``lm_head_unrolled``: only the lm_head (N > 16384) through the GEMV with that cut instead of cuBLAS; ``attn_bn64`` /
``attn_bn256``: decode attention with 64 (before session 51) / 256 keys per loop step (``attention.DECODE_BLOCK_N``,
128; run 56 also timed 32); ``attend_in_qkv``: attention in the q/k/v/gate GEMV's launch (``fused.ATTENTION_IN_QKV``,
off; session 51, not timed yet; 4 warps, 64 keys a step; ``_w2_32``: 2 warps, 32 keys; ``_w4_128``: 4 warps, 128
keys); ``triton_argmax``: greedy sampling through the Triton argmax
(``musecore_cuda.backend.TRITON_ARGMAX``, on since session 52) and ``torch_argmax`` through PyTorch's;
``both_new``: both; ``shared_pool``: every graph captured into one memory pool (``torch.cuda.graph(pool=)``), so a
later capture places its intermediates where the first did (is where they lie the reason only a process's first
greedy capture runs fast? session 51; run 64: no); ``attn_prefetch``: decode attention loading each step's key
positions during the step before (``attention.PREFETCH_POSITIONS``, off: run 69 timed -2 us);
``greedy_state``: the greedy graph's position update in one Triton launch and its argmax written straight into
the tokens (``musecore_triton.graphs.FUSED_STATE``, on since run 69; ``greedy_torch_state`` forces it off);
``attn_eager``: decode attention loading its first step's k and v with that step's key positions
(``attention.EAGER_FIRST_STEP``; since run 69 the CUDA backend's default through ``hooks.eager_first_step``;
``attn_lazy`` forces it off), ``attn_eager_prefetch`` that and ``attn_prefetch`` together, ``all_new53`` both and
``greedy_state``; ``fin_2x2`` / ``fin_4x4`` / ``fin_8x8`` / ``fin_16x16``: the MoE block's finalize in every program
of the unpooler GEMV (``moe.finalize_gemv``, on since session 75 at 16 x 16) at that many rows x warps per program;
``fin_apart``: the finalize its own launch (``fused.FINALIZE_IN_UNPOOLER`` off, before session 75); ``rn_RxW`` /
``rp_RxW`` / ``qkv_RxW`` (session 76): the launches whose last program runs a row op over the whole row at R rows x W
warps per program instead of ``dense_gemv``'s 2 x 2: the GEMVs with the residual norm (o_proj; the unpooler beside
16-bit experts: ``dense_gemv.RESIDUAL_NORM_BLOCK_N`` / ``_WARPS``), the router + pooler launch (the pre-expert norm and
the router's choice: ``router.ROUTER_POOLER_BLOCK_N`` / ``_WARPS``), the q/k/v/gate GEMV (each head's q/k norm and
RoPE: ``dense_gemv.QKV_BLOCK_N`` / ``QKV_WARPS``); modes joined by ``+`` (``rn_8x8+rp_4x4``) run together;
``attn_early``: the one-token attention kernel lets the kernel after it (o_proj's GEMV) start right after its own
wait (``pdl.EARLY_DEFAULT`` with ``attention``; the default since session 76, ``attn_late`` without);
``experts_early``: the FP4 expert GEMVs (gate/up, down) signalling early too (the finalize + unpooler GEMV loads
its weights during the down GEMV; the default since session 77 on grids of at most
``fp4_gemv_cuda.EXPERTS_EARLY_BLOCKS_PER_SM`` blocks per SM, which muse-small's are; ``experts_late`` without);
``embed_early``: the decode embed kernel signalling right after its wait (the first q/k/v/gate GEMV's weights);
``defer_norm`` (session 79): the residual norm after attention run in the router + pooler launch's programs instead of
o_proj's last one (``fused.DEFER_RESIDUAL_NORM``; ``norm_tail`` forces it off); ``defer_moe_norm``: the norm after the
MoE block run in the next layer's q/k/v/gate launch instead of the unpooler's last program (``fused.DEFER_MOE_NORM``,
at the backend's ``qkv_deferred`` cut); ``defer_both``: the two;
``set:module.NAME=value`` (``set:musecore_triton.kernels.router.ONE_LAUNCH_BLOCK_K=64``): that module constant set to
that Python literal.
Same random weights, same
prompt, alternated ``--rounds`` times; ``--modes`` picks some; ``--pad-mb`` holds device buffers of random sizes while
each (round, mode) captures (``cuda_decode_host_probe.placement_pad``, after the kept generation cache is freed).

    python backends/cuda/lab/scripts/cuda_fused_ab.py [--preset muse-small] [--pad-mb 16] [--out ab.json]
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import importlib
from unittest import mock

import torch

# (this folder is sys.path[0] when run as a script)
from cuda_decode_host_probe import (ab_arguments, decode_numbers, output_check, placement_pad, print_medians,
                                    save_rows, step_kernels)
from musecore.api import load_random
from musecore.model import separate_ops
from musecore_cuda import backend as cuda_backend
from musecore_cuda import fused
from musecore_cuda.kernels import pdl
from musecore_triton import graphs, hooks
from musecore_triton.kernels import attention as attention_module
from musecore_triton.kernels import dense_gemv as dense_gemv_module
from musecore_triton.kernels import moe as moe_module
from musecore_triton.kernels import router as router_module
from musecore_triton.kernels.dense_gemv import dense_gemv
from musecore_triton.kernels.norms import qk_norm_rope_kv_write
from musecore_triton.kernels.router import router_topk_one_launch

MODES = ("fused", "unroll", "lm_head_unrolled", "rope_apart", "no_warm", "embed_ops", "stepped", "apart", "separate",
         "attn_bn64", "attn_bn256", "attend_in_qkv", "attend_in_qkv_w2_32", "attend_in_qkv_w4_128", "triton_argmax",
         "torch_argmax", "both_new", "shared_pool", "attn_prefetch", "greedy_state",
         "attn_eager", "attn_eager_prefetch", "all_new53", "attn_lazy", "greedy_torch_state",
         "fin_2x2", "fin_4x4", "fin_8x8", "fin_16x16", "fin_apart",
         "attn_early", "attn_late", "experts_early", "experts_late", "embed_early", "rn_4x4", "rn_8x8", "rn_16x16",
         "rp_4x4", "rp_8x8", "rp_16x4", "rp_16x16", "qkv_4x4", "qkv_8x8", "qkv_16x16", "defer_norm", "norm_tail",
         "defer_moe_norm", "defer_both")
FINALIZE_CUTS = {"fin_2x2": (2, 2), "fin_4x4": (4, 4), "fin_8x8": (8, 8), "fin_16x16": (16, 16)}
# (module, its rows constant, its warps constant) of each row-op launch's cut, by mode prefix
ROW_OP_CUTS = {"rn": (dense_gemv_module, "RESIDUAL_NORM_BLOCK_N", "RESIDUAL_NORM_WARPS"),
               "rp": (router_module, "ROUTER_POOLER_BLOCK_N", "ROUTER_POOLER_WARPS"),
               "qkv": (dense_gemv_module, "QKV_BLOCK_N", "QKV_WARPS")}


def set_patches(mode: str) -> list[tuple]:
    """``set:module.NAME=value``: that constant patched (the module imported, the value a Python literal); [] for
    other modes."""
    if not mode.startswith("set:") or "=" not in mode:
        return []
    path, _, value = mode[4:].partition("=")
    module, _, name = path.rpartition(".")
    target = importlib.import_module(module)
    if not hasattr(target, name):
        raise SystemExit(f"mode {mode!r}: {module} has no {name}")
    return [(target, name, ast.literal_eval(value))]


@dataclasses.dataclass(frozen=True)
class EarlyEdit:
    """``kernel`` put into ``pdl.EARLY_DEFAULT`` (``early``) or taken out of it; :func:`patches` folds a joined
    mode's edits into one set (each computed from the shipped set would keep only the last)."""

    kernel: str
    early: bool


def early_set(kernel: str, early: bool) -> list[tuple]:
    return [(pdl, "EARLY_DEFAULT", EarlyEdit(kernel, early))]


def row_op_cut_patches(mode: str) -> list[tuple]:
    """``rn_RxW`` / ``rp_RxW`` / ``qkv_RxW``: that launch's cut constants patched; [] for other modes."""
    prefix, _, cut = mode.rpartition("_")
    if prefix not in ROW_OP_CUTS or "x" not in cut:
        return []
    module, rows_name, warps_name = ROW_OP_CUTS[prefix]
    rows, warps = (int(v) for v in cut.split("x"))
    return [(module, rows_name, rows), (module, warps_name, warps)]


def router_then_pooler(x, weight, bias, k, multiplier, scaling, pooler, norm_weight, eps, counters):
    """``router_pooler_one_launch`` as the two launches it replaced."""
    weights, ids = router_topk_one_launch(x, weight, bias, k, multiplier, scaling, counters[0])
    return weights, ids, dense_gemv(x, pooler, norm=(norm_weight, eps, counters[1]))


def gemv_then_rope(x, w, nq, nkv, cos, sin, eps, q_scale, cache_k, cache_v, cache_pos, pos_new, capacity, ring,
                   counters):
    """``qkv_gemv_rope`` as the two launches it replaced."""
    y = dense_gemv(x, w)
    q, k, v, _ = y.view(1, 1, -1, cache_k.shape[-1]).split_with_sizes([nq, nkv, nkv, nq], -2)
    return y, qk_norm_rope_kv_write(q, k, v, cos, sin, eps, q_scale, cache_k, cache_v, cache_pos, pos_new, capacity,
                                    ring)


def patches(model, mode: str) -> list[tuple]:
    """``(object, attribute, value)`` for each attribute ``mode`` replaces while it runs (``a+b``: both's; their
    early-set edits applied in turn to the shipped set)."""
    parts = [p for part in mode.split("+") for p in part_patches(model, part)]
    edits = [value for _, _, value in parts if isinstance(value, EarlyEdit)]
    names = pdl.EARLY_DEFAULT
    for edit in edits:
        names = tuple(n for n in names if n != edit.kernel) + ((edit.kernel,) if edit.early else ())
    return [p for p in parts if not isinstance(p[2], EarlyEdit)] + ([(pdl, "EARLY_DEFAULT", names)] if edits else [])


def part_patches(model, mode: str) -> list[tuple]:
    """:func:`patches` of one mode (no ``+``)."""
    use, gemv = cuda_backend.use_dense_gemv, cuda_backend.dense_gemv
    wide = lambda w: w.shape[0] > 16384 and w.shape[1] <= 2048  # noqa: E731  (the lm_head)
    return {
        "embed_ops": [(model, "fused_embed", None)],
        "stepped": [(model.backend, "make_greedy_decode_step", lambda model, cache: None)],
        "no_warm": [(hooks, "_l2_warm", lambda device: False)],
        "unroll": [(dense_gemv_module, "UNROLL_K", True)],
        "lm_head_unrolled": [
            (cuda_backend, "use_dense_gemv",
             lambda x2, w: use(x2, w) or (x2.shape[0] == 1 and wide(w) and w.stride(1) == 1)),
            (cuda_backend, "dense_gemv",
             lambda x2, w, **kw: gemv(x2, w, (1, 256, w.shape[1]) if wide(w) else None, **kw))],
        "rope_apart": [(fused, "qkv_gemv_rope", gemv_then_rope)],
        "attn_bn64": [(attention_module, "DECODE_BLOCK_N", 64)],
        "attn_bn256": [(attention_module, "DECODE_BLOCK_N", 256)],
        "attn_prefetch": [(attention_module, "PREFETCH_POSITIONS", True)],
        "attn_eager": [(attention_module, "EAGER_FIRST_STEP", True)],
        "attn_eager_prefetch": [(attention_module, "EAGER_FIRST_STEP", True),
                                (attention_module, "PREFETCH_POSITIONS", True)],
        "all_new53": [(attention_module, "EAGER_FIRST_STEP", True), (attention_module, "PREFETCH_POSITIONS", True),
                      (graphs, "FUSED_STATE", True)],
        "greedy_state": [(graphs, "FUSED_STATE", True)],
        "greedy_torch_state": [(graphs, "FUSED_STATE", False)],
        "attn_lazy": [(attention_module, "EAGER_FIRST_STEP", False)],
        "attend_in_qkv": [(fused, "ATTENTION_IN_QKV", True)],
        "attend_in_qkv_w2_32": [(fused, "ATTENTION_IN_QKV", True), (dense_gemv_module, "ATTEND_WARPS", 2),
                                (dense_gemv_module, "ATTEND_BLOCK_N", 32)],
        "attend_in_qkv_w4_128": [(fused, "ATTENTION_IN_QKV", True), (dense_gemv_module, "ATTEND_BLOCK_N", 128)],
        "triton_argmax": [(cuda_backend, "TRITON_ARGMAX", True)],
        "torch_argmax": [(cuda_backend, "TRITON_ARGMAX", False)],
        "shared_pool": [(torch.cuda, "graph", shared_pool_graph)],
        "both_new": [(fused, "ATTENTION_IN_QKV", True), (cuda_backend, "TRITON_ARGMAX", True)],
        "apart": [(fused, "router_pooler_one_launch", router_then_pooler)],
        "fin_apart": [(fused, "FINALIZE_IN_UNPOOLER", False)],
        "defer_norm": [(fused, "DEFER_RESIDUAL_NORM", True)],
        "norm_tail": [(fused, "DEFER_RESIDUAL_NORM", False)],
        "defer_moe_norm": [(fused, "DEFER_MOE_NORM", True)],
        "defer_both": [(fused, "DEFER_RESIDUAL_NORM", True), (fused, "DEFER_MOE_NORM", True)],
        "attn_early": early_set("attention", True),
        "attn_late": early_set("attention", False),
        "experts_early": early_set("fp4_gemv_mma_experts", True),
        "experts_late": early_set("fp4_gemv_mma_experts", False),
        "embed_early": early_set("decode_embed", True),
        **{name: [(moe_module, "FINALIZE_GEMV_BLOCK_N", rows), (moe_module, "FINALIZE_GEMV_WARPS", warps)]
           for name, (rows, warps) in FINALIZE_CUTS.items()},
    }.get(mode, row_op_cut_patches(mode) or set_patches(mode))


_POOL: list = []


def shared_pool_graph(cuda_graph, **kwargs):
    """``torch.cuda.graph(cuda_graph)`` in the one pool every ``shared_pool`` capture of the process shares. The
    first graph captured into it is kept, so the pool outlives the graphs freed between rounds (a pool whose graphs
    are all gone may not take another capture: run 63's assert)."""
    if not _POOL:
        _POOL.extend([torch.cuda.graph_pool_handle(), cuda_graph])
    return GRAPH(cuda_graph, pool=_POOL[0], **kwargs)


GRAPH = torch.cuda.graph


@contextlib.contextmanager
def mode_of(model, mode: str):
    """The model as ``mode`` runs it (``separate``: every block's separate ops; the others: :func:`patches`), put
    back afterwards (an instance attribute shadowing a method is deleted again)."""
    with contextlib.ExitStack() as stack:
        if mode == "separate":
            stack.enter_context(separate_ops(model))
        for obj, name, value in patches(model, mode):
            stack.enter_context(mock.patch.object(obj, name, value))
        yield


def main() -> None:
    args = ab_arguments("cuda_fused_ab.json")
    modes = args.modes.split(",") if args.modes else MODES
    unknown = {part for mode in modes for part in mode.split("+")
               if part not in MODES and not row_op_cut_patches(part) and not set_patches(part)}
    if unknown:
        raise SystemExit(f"unknown modes {sorted(unknown)}; the modes: {', '.join(MODES)}")
    model = load_random(args.preset, "h200", checkpoint_format=args.format)
    blocks = sum(b.fused is not None for layer in model.layers for b in (layer.self_attn, layer.mlp))
    print(f"{blocks} fused blocks of {2 * len(model.layers)}")
    prompt = torch.randint(0, model.config.vocab_size, (1, 32)).tolist()
    rows = []
    for r in range(args.rounds):
        first: dict = {}
        for i, mode in enumerate(modes):
            model.release_generation_cache()  # (else the new cache reuses the old one's blocks, pad or not)
            pad = placement_pad(args.pad_mb, 1000 * r + i)  # held while the mode captures and runs
            with mode_of(model, mode):
                outputs: dict = {}
                row = {"round": r, "mode": mode, **decode_numbers(model, prompt, kernels=False, outputs=outputs)}
                first = first or outputs  # each mode's tokens and logits against the round's first mode's
                row.update(output_check(outputs, first))
                if pad:
                    row["pad_bytes"] = sum(t.numel() for t in pad)
                print(row)
                rows.append(row)
            del pad
    for mode in modes:  # counted after every timed round: the profiler may slow later replays (session 48, run 31)
        with mode_of(model, mode):
            counted = step_kernels(model, prompt)
        for row in rows:
            if row["mode"] == mode:
                row["kernels_per_step"] = counted
    print_medians(rows, modes)
    for mode in modes[1:]:
        mine = [r for r in rows if r["mode"] == mode]
        worst = max((r["logits_nmse_vs_first"] for r in mine), key=lambda v: (v != v, v))  # a NaN counts as worst
        print(f"{mode}: logits NMSE vs {modes[0]} up to {worst:.3g}, tokens equal in "
              f"{sum(r['tokens_equal_first'] for r in mine)} of {len(mine)} rounds")
    save_rows(args.out, args, rows)


if __name__ == "__main__":
    main()
