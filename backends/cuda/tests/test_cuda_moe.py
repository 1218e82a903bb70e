"""Routed MoE (NVFP4, MXFP4, dense experts) against ``musecore.ops.reference.moe``."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import musecore_quant
from musecore.ops import ExpertWeights, tolerance
from musecore.ops import reference as ref

from musecore_triton.testing import DEVICE, SMALL_DTYPES, assert_nmse, nmse

from musecore_cuda import CudaBackend
from musecore_cuda.kernels import fp4_gemv_cuda, fp4_gluon_plan
from musecore_cuda.kernels.fp4_gemv_cuda import GemvPlan
from musecore_cuda.kernels.moe_decode import RUNS_FROM_TOKENS, moe_decode_gemv, use_gemv
from musecore_triton.kernels.moe import align_assignments, moe_decode_dense


def make_layer(fmt: str, experts: int, width: int, inter: int, dtype: torch.dtype, device):
    gate = torch.randn(experts, inter, width, device=device) * width ** -0.5
    up = torch.randn(experts, inter, width, device=device) * width ** -0.5
    down = torch.randn(experts, width, inter, device=device) * inter ** -0.5
    be = CudaBackend(device)
    if fmt == "dense":
        ws = [w.to(dtype) for w in (gate, up, down)]
        dense = [w.float() for w in ws]
    else:
        ws = [musecore_quant.quantize(w, fmt) for w in (gate, up, down)]
        dense = [musecore_quant.dequantize(q).to(device) for q in ws]
    prepared = be.prepare_experts(*ws, dtype=dtype)
    reference = ExpertWeights(gate=dense[0], up=dense[1], down=dense[2], format=fmt, num_experts=experts)
    norm = (1.0 + 0.5 * torch.randn(width, device=device)).to(dtype)  # the shared post-expert norm, 1 + w folded
    return be, prepared, reference, norm


def route(tokens: int, experts: int, topk: int, device):
    """Sigmoid router weights and ids from random logits (uncorrelated with z)."""
    x = torch.randn(tokens, 32, device=device)
    return ref.router_topk(x, torch.randn(experts, 32, device=device), torch.zeros(experts, device=device), topk,
                           1.0, 1.0)


def test_alignment_gives_each_block_one_expert_and_inverts():
    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [2, 3]])
    sorted_ids, blk_expert, position = align_assignments(ids, num_experts=5, block_m=2)
    flat = ids.reshape(-1)
    for a in range(flat.numel()):
        p = int(position[a])
        assert int(sorted_ids[p]) == a
        assert int(blk_expert[p // 2]) == int(flat[a])
    assert (sorted_ids[sorted_ids < flat.numel()].sort().values == torch.arange(flat.numel())).all()
    assert int(blk_expert[-1]) == -1  # the bound leaves spare blocks, marked unused


@pytest.mark.parametrize("fmt,tokens", [("nvfp4", 1), ("nvfp4", 6), ("mxfp4", 6), ("dense", 1), ("dense", 6)])
@pytest.mark.parametrize("dtype", SMALL_DTYPES)
def test_moe_matches_reference(fmt, tokens, dtype):
    be, prepared, reference, norm = make_layer(fmt, experts=6, width=128, inter=128, dtype=dtype, device=DEVICE)
    weights, ids = route(tokens, 6, 2, DEVICE)
    z = torch.randn(tokens, 128, device=DEVICE).to(dtype)
    y = be.moe(z, weights, ids, prepared, norm, 1e-8)
    assert y.dtype == torch.float32
    expected = ref.moe(z, weights, ids, reference, norm, 1e-8)
    assert_nmse(expected, y, tolerance("moe"), f"moe {fmt} T={tokens} {dtype}")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("tokens", [1, 3])
def test_moe_decode_gemv_matches_reference(fmt, tokens):
    """The per-assignment GEMV path (few assignments per expert); MXFP4 up weights 2**10 larger than
    gate, so the two stacks start with different folds and must share one."""
    experts, topk = 16, 2
    be, prepared, reference, norm = make_layer(fmt, experts=experts, width=128, inter=256, dtype=torch.float16,
                                               device=DEVICE)
    if fmt == "mxfp4":
        up = musecore_quant.quantize(reference.up.cpu() * 1024, fmt)
        gate = musecore_quant.quantize(reference.gate.cpu(), fmt)
        down = musecore_quant.quantize(reference.down.cpu(), fmt)
        prepared = be.prepare_experts(gate, up, down, dtype=torch.float16)
        reference = ExpertWeights(gate=musecore_quant.dequantize(gate).to(DEVICE),
                                  up=musecore_quant.dequantize(up).to(DEVICE),
                                  down=musecore_quant.dequantize(down).to(DEVICE), format=fmt, num_experts=experts)
        assert prepared.gate.fold_log2 == prepared.up.fold_log2
    assert use_gemv(prepared.gate, tokens * topk, experts)
    weights, ids = route(tokens, experts, topk, DEVICE)
    ids[0] = torch.tensor([5, 5 if tokens == 1 else 7])  # the same expert twice in one token's routing
    z = torch.randn(tokens, 128, device=DEVICE).half()
    y = be.moe(z, weights, ids, prepared, norm, 1e-8)
    expected = ref.moe(z, weights, ids, reference, norm, 1e-8)
    assert_nmse(expected, y, tolerance("moe"), f"moe GEMV {fmt} T={tokens}")


def test_gemv_launch_rejects_a_split_that_does_not_divide_k():
    """A cut of K = 128 (one chunk) in two would read chunk -1: refused before any launch (no GPU needed)."""
    x = torch.zeros(1, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="does not divide it"):
        fp4_gemv_cuda.launch(x, torch.zeros(64, 64, dtype=torch.uint8), torch.zeros(64, 8, dtype=torch.uint8),
                             torch.ones(1), wfmt=1, fold_log2=0, n=64, k=128, out=torch.zeros(1, 64),
                             plan=GemvPlan("mma", 1, 1, split_k=2))


def test_run_plan_fits_the_staged_rows_of_a_run_in_shared_memory():
    """Runs stage up to 8 tokens' activations per program: 5 fit beside the 816B experts' K = 4096 (41 KB of the
    48 KB), 8 at muse-small's 768; a split halves each block's K range, so more fit; only M=1 MMA plans extend."""
    assert fp4_gemv_cuda.run_plan(GemvPlan("mma", 1, 1), 4096, swiglu=True).m == 5
    assert fp4_gemv_cuda.run_plan(GemvPlan("mma", 1, 1, split_k=2), 4096).m == 8
    assert fp4_gemv_cuda.run_plan(GemvPlan("mma", 1, 1), 768, swiglu=True).m == 8
    assert fp4_gemv_cuda.run_plan(GemvPlan("mma", 1, 1), 22 * 1024) is None  # not even 2 rows fit
    for plan in (GemvPlan("mma", 2, 1), GemvPlan("fma", 1, 8)):
        with pytest.raises(ValueError, match="runs extend an M=1 MMA plan"):
            fp4_gemv_cuda.run_plan(plan, 4096)


def test_lean_path_for_split_k_linears_and_expert_gemvs_off_runs():
    """The MMA kernel's lean path where it measured faster on the H200 (lab NOTES, session 56): linear cuts whose
    warps split K, expert GEMVs with one program per assignment; plain for the split-8 linear cut and on runs; a
    plan's own ``lean`` wins. The kernel's name carries the choice (its template argument before ``min_blocks``)."""
    lean = fp4_gemv_cuda.lean_path
    assert lean(GemvPlan("mma", 1, 1, k_warps=4), experts=False)
    assert not lean(GemvPlan("mma", 2, 1, split_k=8), experts=False)
    assert lean(GemvPlan("mma", 1, 1), experts=True)
    assert not lean(GemvPlan("mma", 5, 1), experts=True, runs=True)
    assert not lean(GemvPlan("mma", 1, 1, lean=False), experts=True)
    assert lean(GemvPlan("mma", 2, 1, split_k=8, lean=True), experts=False)
    up = GemvPlan("mma", 1, 1)
    runs = fp4_gemv_cuda.run_plan(up, 4096, swiglu=True)
    name = fp4_gemv_cuda.plan_kernel_name
    assert name(up, 1, True, True).endswith(", true, 0>")
    assert name(runs, 1, True, True, runs=True).endswith(", false, 0>")


@pytest.mark.gpu
def test_moe_decode_lean_and_plain_paths_give_the_same_bits():
    """The lean path changes instructions, not arithmetic: both expert GEMVs forced onto it and off it, for a cut with
    one warp per K range and one whose warps split K, with and without runs: the same bits."""
    be, prepared, _, norm = make_layer("nvfp4", experts=6, width=512, inter=512, dtype=torch.bfloat16,
                                       device="cuda")
    weights, ids = route(4, 6, 2, "cuda")
    z = torch.randn(4, 512, device="cuda", dtype=torch.bfloat16)
    args = (z, weights, ids, prepared.gate, prepared.up, prepared.down, norm, 1e-8)
    for kw in (1, 2):
        for runs in (False, True):
            outs = {lean: moe_decode_gemv(*args, plans=(GemvPlan("mma", 1, 1, k_warps=kw, lean=lean),) * 2,
                                          runs=runs) for lean in (True, False)}
            assert torch.equal(outs[True], outs[False]), \
                f"k_warps={kw} runs={runs}: max |diff| {(outs[True] - outs[False]).abs().max().item():.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("width,inter,experts,tokens", [
    (128, 256, 20, 10),               # experts 0 and 1 chosen by 9 tokens: runs chunked at 8 staged rows
    (4096, 4096, 24, 12),             # the 816B expert shape: runs of 9 chunked at 5 (K = 4096 fills shared memory)
    (4096, 4096, 24, RUNS_FROM_TOKENS),
])
def test_moe_decode_runs_of_one_expert_give_the_same_bits(width, inter, experts, tokens, monkeypatch):
    """Sorted assignments, each GEMV program computing a run (chunk) of one expert's tokens: the same bits as one
    program per assignment (mma columns are independent), for the default cut, a cluster split-K cut and a cut
    whose warps split K; NMSE against the reference; and replayed from a CUDA graph (the sort included). The grouped
    Gluon GEMM, which takes these batches of the 816B-sized experts where it can run, is switched off."""
    from musecore_cuda.kernels import moe_prefill
    monkeypatch.setenv(moe_prefill.GLUON_MOE_ENV, "0")
    be, prepared, reference, norm = make_layer("nvfp4", experts=experts, width=width, inter=inter,
                                               dtype=torch.bfloat16, device="cuda")
    topk = 2  # T x 2 <= E assignments: be.moe takes the GEMVs
    weights, ids = route(tokens, experts, topk, "cuda")
    ids[:min(9, tokens)] = torch.tensor([0, 1])  # a run of 9 (or T) on experts 0 and 1; the rest as routed
    z = torch.randn(tokens, width, device="cuda", dtype=torch.bfloat16)
    args = (z, weights, ids, prepared.gate, prepared.up, prepared.down, norm, 1e-8)
    assert use_gemv(prepared.gate, ids.numel(), experts)
    cap = fp4_gemv_cuda.run_plan(GemvPlan("mma", 1, 1), width, swiglu=True).m
    assert cap == (8 if width == 128 else 5)
    assert int(torch.bincount(ids.reshape(-1)).max()) > cap or tokens == RUNS_FROM_TOKENS  # some run is chunked
    wide = width == 4096  # (K = 128 is one chunk: no split of it)
    for cuts in (None,) + ((GemvPlan("mma", 1, 1, split_k=2), GemvPlan("mma", 1, 1, split_k=2)),
                           (GemvPlan("mma", 1, 1, k_warps=2), GemvPlan("mma", 1, 1, k_warps=2))) * wide:
        each = moe_decode_gemv(*args, plans=cuts, runs=False)
        runs = moe_decode_gemv(*args, plans=cuts, runs=True)
        assert torch.equal(each, runs), f"runs differ from per-assignment programs (cuts {cuts}): " \
                                        f"max |diff| {(each - runs).abs().max().item():.3g}"
    expected = ref.moe(z, weights, ids, reference, norm, 1e-8)
    y = be.moe(z, weights, ids, prepared, norm, 1e-8)  # the default: runs from RUNS_FROM_TOKENS tokens
    assert torch.equal(y, moe_decode_gemv(*args, runs=True)), "be.moe did not take the runs path"
    assert_nmse(expected, y, tolerance("moe"), f"moe runs T={tokens} {width}x{inter}")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = be.moe(z, weights, ids, prepared, norm, 1e-8)
    ids.copy_(ids.flip(0))  # new routing in place: the graph's sort must see it
    graph.replay()
    assert torch.equal(captured, moe_decode_gemv(*args, runs=False)), "graph replay of the runs path differs"


def test_handoff_counts_the_producer_warps_per_program_and_takes_only_mma_launches():
    """The consumer waits for every warp of its program in the producer's grid: row blocks x split x 4 warps."""
    warps = fp4_gemv_cuda.Handoff.producer_warps
    assert warps(GemvPlan("mma", 1, 1), 4096) == 64 * 4       # 64-row blocks
    assert warps(GemvPlan("mma", 1, 1, split_k=2), 4096) == 128 * 4  # two blocks of a cluster per row block
    assert warps(GemvPlan("mma", 1, 2, k_warps=2), 770) == 13 * 4    # 2 x 32-row groups per block: 64 rows
    with pytest.raises(ValueError, match="MMA producer"):
        fp4_gemv_cuda.Handoff(GemvPlan("fma", 1, 8), 64, 4, torch.device("cpu"))
    with pytest.raises(ValueError, match="1..1024 programs"):
        fp4_gemv_cuda.Handoff(GemvPlan("mma", 1, 1), 64, fp4_gemv_cuda.HANDOFF_SLOTS + 1, torch.device("cpu"))
    h = object.__new__(fp4_gemv_cuda.Handoff)  # (its counters need a GPU; a plain launch is refused before them)
    h.programs = 4
    with pytest.raises(ValueError, match="hand-off joins two MMA expert launches"):
        x = torch.zeros(1, 128, dtype=torch.bfloat16)
        fp4_gemv_cuda.launch(x, torch.zeros(64, 64, dtype=torch.uint8), torch.zeros(64, 8, dtype=torch.uint8),
                             torch.ones(1), wfmt=1, fold_log2=0, n=64, k=128, out=torch.zeros(1, 64),
                             plan=GemvPlan("mma", 1, 1), handoff=(h, fp4_gemv_cuda.CONSUMER))


@pytest.mark.gpu
@pytest.mark.parametrize("width,inter,experts,tokens,topk", [
    (4096, 4096, 16, 1, 8),    # the 816B expert shape at batch 1: 8 assignments, 512 producer blocks (1.3 waves)
    (4096, 4096, 24, 12, 2),   # runs of one expert (chunks of 5), non-head programs included
    (768, 768, 64, 1, 8),      # muse-small's experts: warps splitting K
])
def test_moe_decode_handoff_gives_the_same_bits_and_leaves_its_counters_at_zero(width, inter, experts, tokens, topk):
    """The down GEMV started in the gate/up GEMV's last wave, each block waiting for its own program's producer
    warps: the same bits as the two launches one after the other, for the default cut and cluster / warp split-K
    cuts, eager (20 calls in a row, no sync between) and replayed from CUDA graphs captured with and without PDL;
    every counter back at zero afterwards (the consumer resets them for the next launch)."""
    from musecore_cuda.kernels import pdl

    be, prepared, reference, norm = make_layer("nvfp4", experts=experts, width=width, inter=inter,
                                               dtype=torch.bfloat16, device="cuda")
    weights, ids = route(tokens, experts, topk, "cuda")
    if tokens > 1:
        ids[:9] = torch.tensor([0, 1])  # runs of 9 on experts 0 and 1, chunked
    z = torch.randn(tokens, width, device="cuda", dtype=torch.bfloat16)
    args = (z, weights, ids, prepared.gate, prepared.up, prepared.down, norm, 1e-8)
    wide = width == 4096
    for cuts in (None,) + ((GemvPlan("mma", 1, 1, split_k=2), GemvPlan("mma", 1, 1, split_k=2)),
                           (GemvPlan("mma", 1, 1, k_warps=2), GemvPlan("mma", 1, 1, k_warps=2))) * wide:
        off = moe_decode_gemv(*args, plans=cuts, handoff=False)
        outs = [moe_decode_gemv(*args, plans=cuts, handoff=True) for _ in range(20)]
        for i, on in enumerate(outs):
            assert torch.equal(on, off), f"hand-off call {i} differs (cuts {cuts}): max |diff| " \
                                         f"{(on - off).abs().max().item():.3g}"
    counters = fp4_gemv_cuda._COUNTERS[torch.device("cuda", torch.cuda.current_device())]
    torch.cuda.synchronize()
    assert int(counters.count_nonzero()) == 0, f"counters left set: {counters.nonzero().flatten()[:8].tolist()}"
    assert_nmse(ref.moe(z, weights, ids, reference, norm, 1e-8), off, tolerance("moe"), f"moe T={tokens}")
    for with_pdl in (False, True):
        graph = torch.cuda.CUDAGraph()
        with pdl.scope(with_pdl), torch.cuda.graph(graph):
            captured = moe_decode_gemv(*args, handoff=True)
        for _ in range(10):
            ids.copy_(ids.roll(1, 0))  # new routing in place
            graph.replay()
            expected = moe_decode_gemv(*args, handoff=False)
            assert torch.equal(captured, expected), f"graph replay (PDL {with_pdl}) differs"
    torch.cuda.synchronize()
    assert int(counters.count_nonzero()) == 0


@pytest.mark.parametrize("dtype", SMALL_DTYPES)
@pytest.mark.parametrize("tokens", [1, 3])
def test_moe_decode_dense_matches_reference(dtype, tokens):
    """16-bit experts at decode (few assignments): one GEMV per assignment, gate+up+SwiGLU fused, the
    same expert twice in one token; the backend's moe takes this path (same bits as calling it)."""
    experts, topk = 16, 2
    # Small, not powers of two: the interpreter runs one program per 2 output rows per assignment.
    be, prepared, reference, norm = make_layer("dense", experts=experts, width=48, inter=40, dtype=dtype,
                                               device=DEVICE)
    weights, ids = route(tokens, experts, topk, DEVICE)
    ids[0] = torch.tensor([5, 5 if tokens == 1 else 7])
    z = torch.randn(tokens, 48, device=DEVICE).to(dtype)
    y = moe_decode_dense(z, weights, ids, prepared.gate, prepared.up, prepared.down, norm, 1e-8)
    expected = ref.moe(z, weights, ids, reference, norm, 1e-8)
    assert_nmse(expected, y, tolerance("moe"), f"dense decode moe {dtype} T={tokens}")
    assert torch.equal(be.moe(z, weights, ids, prepared, norm, 1e-8), y)


def test_shared_post_expert_norm_is_applied_scale_first_before_routing_weight():
    """Spelled out per token: each expert's output rounded to z's dtype, ``rms(round(e * w))`` with the one
    shared weight, rounded, then its routing weight."""
    be, prepared, reference, norm = make_layer("nvfp4", experts=4, width=128, inter=128, dtype=torch.float16,
                                               device=DEVICE)
    z = torch.randn(3, 128, device=DEVICE).half()
    ids = torch.tensor([[0, 1], [2, 3], [1, 2]], device=DEVICE)
    weights = torch.tensor([[0.9, 0.1], [0.5, 0.5], [0.25, 0.75]], device=DEVICE)
    y = be.moe(z, weights, ids, prepared, norm, 1e-8)
    scale_after = torch.zeros_like(y)  # the old per-expert order (rms(e) * w): must be told apart
    for t in range(3):
        rows = []
        for j, e in enumerate(ids[t].tolist()):
            out = ref.expert_forward(z[t:t + 1], reference, e).half()
            rows.append(ref.rms((out.float() * norm.float()).half(), 1e-8).half().float())
            scale_after[t] += weights[t, j] * (ref.rms(out, 1e-8) * norm.float())[0]
        expected = weights[t, 0] * rows[0] + weights[t, 1] * rows[1]
        assert_nmse(expected[0], y[t], tolerance("moe"), f"token {t}")
    assert nmse(scale_after, y) > 10 * tolerance("moe"), "a scale-after norm is indistinguishable here"


def test_moe_rejects_a_norm_weight_per_expert():
    be, prepared, _, norm = make_layer("dense", experts=4, width=64, inter=64, dtype=torch.float16, device=DEVICE)
    weights, ids = route(2, 4, 2, DEVICE)
    with pytest.raises(ValueError, match="shared by every expert"):
        be.moe(torch.randn(2, 64, device=DEVICE).half(), weights, ids, prepared, norm.expand(4, 64), 1e-8)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "dense"])
@pytest.mark.parametrize("tokens", [1, 16, 64, 600])
def test_moe_at_model_width_on_gpu(fmt, tokens):
    """The 816B expert shapes (h = I = 4096), 16 of its 256 experts, top-8."""
    be, prepared, reference, norm = make_layer(fmt, experts=16, width=4096, inter=4096, dtype=torch.bfloat16,
                                               device="cuda")
    weights, ids = route(tokens, 16, 8, "cuda")
    z = torch.randn(tokens, 4096, device="cuda", dtype=torch.bfloat16)
    y = be.moe(z, weights, ids, prepared, norm, 1e-8)
    expected = ref.moe(z, weights, ids, reference, norm, 1e-8)
    assert_nmse(expected, y, tolerance("moe"), f"moe {fmt} T={tokens}")


@pytest.mark.parametrize("fmt,tokens", [("nvfp4", 1), ("nvfp4", 20), ("dense", 20)])
def test_moe_one_slot_per_row_summed_by_the_token_equals_the_routed_op(fmt, tokens):
    """What an expert-parallel rank runs (musecore.model.MoE.parallel): each routed (token, slot) row
    alone with weight 1, the token's rank then adding ``weight * output`` over its experts in ascending
    id order (musecore.distributed.weighted_sum). Checked against the op on the whole routing."""
    from musecore.distributed import weighted_sum

    dtype = torch.bfloat16
    be, prepared, reference, norm = make_layer(fmt, experts=6, width=128, inter=128, dtype=dtype, device=DEVICE)
    weights, ids = route(tokens, 6, 2, DEVICE)
    z = torch.randn(tokens, 128, device=DEVICE).to(dtype)
    rows = z.repeat_interleave(2, dim=0)  # one row per (token, slot)
    ones = torch.ones(rows.shape[0], 1, dtype=torch.float32, device=DEVICE)
    per_slot = be.moe(rows, ones, ids.reshape(-1, 1).contiguous(), prepared, norm, 1e-8)
    y = weighted_sum(per_slot.view(tokens, 2, -1), weights, ids)
    assert_nmse(be.moe(z, weights, ids, prepared, norm, 1e-8), y, tolerance("moe"), f"per-slot moe {fmt} T={tokens}")


@pytest.mark.gpu
def test_be_moe_takes_runs_past_e_assignments_and_matches_the_reference():
    """48 assignments over 16 experts (3x E, 24 tokens): beyond one program per assignment, within runs of one expert
    (use_gemv's RUNS_MAX_ASSIGNMENTS); fp16 activations (no runs: the FMA kernel) stay on the grouped GEMM."""
    experts, topk, tokens = 16, 2, 24
    be, prepared, reference, norm = make_layer("nvfp4", experts=experts, width=128, inter=256, dtype=torch.bfloat16,
                                               device="cuda")
    assert use_gemv(prepared.gate, tokens * topk, experts, tokens=tokens, dtype=torch.bfloat16)
    assert not use_gemv(prepared.gate, tokens * topk, experts, tokens=tokens, dtype=torch.float16)
    weights, ids = route(tokens, experts, topk, "cuda")
    z = torch.randn(tokens, 128, device="cuda", dtype=torch.bfloat16)
    y = be.moe(z, weights, ids, prepared, norm, 1e-8)
    assert_nmse(ref.moe(z, weights, ids, reference, norm, 1e-8), y, tolerance("moe"), "moe on runs, 48 assignments")


# --- the grouped Gluon GEMM (moe_prefill; opt-in with MUSECORE_CUDA_GLUON_MOE=1 until measured) --------------------

def _needs_gluon_moe() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    reason = fp4_gluon_plan.unavailable_reason(torch.device("cuda"))
    if reason:
        pytest.skip(reason)


def skewed_ids(tokens: int, experts: int, topk: int, device) -> torch.Tensor:
    """Every token chooses expert 0 (a segment of several token tiles) and ``topk - 1`` distinct others among
    1..E-2; expert E-1 none."""
    others = torch.rand(tokens, experts - 2, device=device).argsort(dim=1)[:, :topk - 1] + 1
    return torch.cat([torch.zeros(tokens, 1, dtype=torch.long, device=device), others], dim=1)


def _grouped_launches(xs: torch.Tensor, blk_expert: torch.Tensor, prepared, cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """Both grouped launches on sorted, aligned rows ``xs``: gate/up with SwiGLU (h), then down (o), into outputs
    filled with NaN (a row the kernel skips stays NaN)."""
    from musecore_cuda.kernels import fp4_gemm_gluon
    g, u, d = prepared.gate, prepared.up, prepared.down
    h = torch.full((xs.shape[0], g.out_features), float("nan"), device=xs.device, dtype=torch.bfloat16)
    fp4_gemm_gluon.launch_grouped(xs, blk_expert, (g.packed, g.scales, g.out_scale), h, fold_log2=g.fold_log2, cfg=cfg,
                                  stack2=(u.packed, u.scales, u.out_scale))
    o = torch.full((xs.shape[0], d.out_features), float("nan"), device=xs.device, dtype=torch.bfloat16)
    fp4_gemm_gluon.launch_grouped(h, blk_expert, (d.packed, d.scales, d.out_scale), o, fold_log2=d.fold_log2, cfg=cfg)
    return h, o


@pytest.mark.gpu
@pytest.mark.parametrize("block_n,block_m,stages,ctas", [(64, 16, 4, 1), (64, 64, 4, 1), (64, 128, 4, 1),
                                                        (64, 256, 3, 1), (128, 16, 4, 1), (128, 32, 4, 1),
                                                        (128, 64, 4, 1), (128, 256, 3, 1), (64, 16, 4, 2)])
def test_gluon_grouped_gemms_match_the_experts_row_by_row(block_n, block_m, stages, ctas):
    """Both grouped launches against each sorted row's own expert in fp32: gate/up with SwiGLU (h) and down (o),
    on routing with a multi-tile expert, empty experts and spare tiles (blk_expert -1). pick_moe_config takes
    64 x 16 at two CTAs per SM for the 816B layer up to 256 tokens (decode batches from 6 tokens, session 68), and
    elsewhere 128 x 16 up to 128 tokens and 128 x 32 from 129 to ~630 (128 x 16, which its model ranks first at
    129-289, is left out there on its times: MOE_LEFT_OUT_TILES)."""
    _needs_gluon_moe()
    experts, topk, tokens, width, inter = 6, 2, 150, 256, 384
    _, prepared, reference, _ = make_layer("nvfp4", experts, width, inter, torch.bfloat16, "cuda")
    ids = skewed_ids(tokens, experts, topk, "cuda")
    cfg = fp4_gluon_plan.GluonConfig(block_n, block_m, 1, stages, upcast="packed", ctas_per_sm=ctas)
    sorted_ids, blk_expert, _ = align_assignments(ids, experts, block_m)
    z = torch.randn(tokens, width, device="cuda", dtype=torch.bfloat16)
    xs = z.index_select(0, (sorted_ids // topk).clamp(max=tokens - 1))
    h, o = _grouped_launches(xs, blk_expert, prepared, cfg)
    real = (sorted_ids < tokens * topk).nonzero().squeeze(1)
    expert = blk_expert[real // block_m].long()
    assert (expert >= 0).all()
    x = xs[real].float()
    h_ref = (torch.nn.functional.silu(torch.einsum("rk,rnk->rn", x, reference.gate[expert]))
             * torch.einsum("rk,rnk->rn", x, reference.up[expert]))
    assert_nmse(h_ref, h[real].float(), tolerance("linear"), f"grouped gate/up+SwiGLU {cfg.label()}")
    o_ref = torch.einsum("rk,rnk->rn", h[real].float(), reference.down[expert])
    assert_nmse(o_ref, o[real].float(), tolerance("linear"), f"grouped down {cfg.label()}")
    assert not o[real].isnan().any() and not h[real].isnan().any()


@pytest.mark.gpu
@pytest.mark.parametrize("cut", ["128,16,1,8,packed,1,pair,late,ahead2", "128,32,1,8,packed,1,pair,late,ahead2",
                                 "128,16,1,4,packed,1,late,ahead2", "64,16,1,6,packed,1,pair,late",
                                 "128,16,1,8,packed", "64,16,1,4,packed,2", "64,16,1,8,packed,2,pair,late,ahead2"])
def test_gluon_grouped_consumer_variants_give_the_plain_launchs_bits(cut):
    """The linear's consumer variants in the grouped kernel (paired ring stages, late release, scale words two
    chunks ahead; session 67), a deeper ring and two CTAs per SM (128 registers): the same bits as the plain launch
    of that tile, on 4 and 6 chunks of K (pairs need an even number) with a multi-tile expert, empty experts and
    spare tiles."""
    _needs_gluon_moe()
    cfg = fp4_gluon_plan.GluonConfig.parse(cut)
    experts, topk, tokens, width, inter = 6, 2, 150, 512, 768
    _, prepared, _, _ = make_layer("nvfp4", experts, width, inter, torch.bfloat16, "cuda")
    ids = skewed_ids(tokens, experts, topk, "cuda")
    sorted_ids, blk_expert, _ = align_assignments(ids, experts, cfg.block_m)
    z = torch.randn(tokens, width, device="cuda", dtype=torch.bfloat16)
    xs = z.index_select(0, (sorted_ids // topk).clamp(max=tokens - 1))
    plain = fp4_gluon_plan.GluonConfig(cfg.block_n, cfg.block_m, 1, 4, upcast="packed")
    real = (sorted_ids < tokens * topk).nonzero().squeeze(1)
    for what, got, want in zip(("gate/up", "down"), _grouped_launches(xs, blk_expert, prepared, cfg),
                               _grouped_launches(xs, blk_expert, prepared, plain)):
        assert not want[real].isnan().any()
        diff = (got[real].float() - want[real].float()).abs().max().item()
        assert torch.equal(got[real], want[real]), f"{cut} {what}: max |diff| {diff} against {plain.label()}"


@pytest.mark.gpu
@pytest.mark.parametrize("width,inter,experts,topk,tokens", [(256, 256, 6, 2, 600), (4096, 4096, 16, 8, 200)])
def test_be_moe_takes_the_gluon_grouped_gemm_when_opted_in(width, inter, experts, topk, tokens, monkeypatch):
    """Beyond the decode GEMVs, with MUSECORE_CUDA_GLUON_MOE=1: the whole op against the reference, and within the
    MoE tolerance of the grouped Triton GEMM it replaces (the 816B expert shapes in the second case)."""
    _needs_gluon_moe()
    from musecore_cuda.kernels import moe_prefill
    be, prepared, reference, norm = make_layer("nvfp4", experts, width, inter, torch.bfloat16, "cuda")
    weights, ids = route(tokens, experts, topk, "cuda")
    assert not use_gemv(prepared.gate, tokens * topk, experts, tokens=tokens, dtype=torch.bfloat16)
    z = torch.randn(tokens, width, device="cuda", dtype=torch.bfloat16)
    monkeypatch.setenv(moe_prefill.GLUON_MOE_ENV, "0")
    triton_y = be.moe(z, weights, ids, prepared, norm, 1e-8)
    monkeypatch.setenv(moe_prefill.GLUON_MOE_ENV, "1")
    assert moe_prefill.unavailable_reason(z, prepared.gate, prepared.up, prepared.down) is None
    y = be.moe(z, weights, ids, prepared, norm, 1e-8)
    assert y.dtype == torch.float32 and y.shape == (tokens, width)
    assert_nmse(ref.moe(z, weights, ids, reference, norm, 1e-8), y, tolerance("moe"), f"gluon moe T={tokens}")
    assert_nmse(triton_y, y, tolerance("moe"), f"gluon moe vs the Triton grouped GEMM T={tokens}")


@pytest.mark.gpu
def test_be_moe_takes_the_gluon_grouped_gemm_at_decode_batches_of_816b_sized_experts(monkeypatch):
    """From moe_prefill.DECODE_FROM_TOKENS tokens on experts of the 816B layer's size the grouped Gluon GEMM takes the
    batch from the decode GEMVs (session 65): the op against the reference and the GEMVs, and its CUDA-graph replay
    (the decode loop's form) bit-equal to the eager call on the same inputs."""
    _needs_gluon_moe()
    from musecore_cuda.kernels import moe_prefill
    monkeypatch.delenv(moe_prefill.GLUON_MOE_ENV, raising=False)
    experts, topk, tokens, width = 64, 8, moe_prefill.DECODE_FROM_TOKENS, 4096  # (T - 1) * k <= E: the GEMVs below
    be, prepared, reference, norm = make_layer("nvfp4", experts, width, width, torch.bfloat16, "cuda")
    weights, ids = route(tokens, experts, topk, "cuda")
    z = torch.randn(tokens, width, device="cuda", dtype=torch.bfloat16)
    assert moe_prefill.unavailable_reason(z, prepared.gate, prepared.up, prepared.down) is None
    assert not use_gemv(prepared.gate, tokens * topk, experts, tokens=tokens, gluon=True)
    assert use_gemv(prepared.gate, (tokens - 1) * topk, experts, tokens=tokens - 1, gluon=True)
    calls = []
    gluon_forward = moe_prefill.moe_forward_gluon
    monkeypatch.setattr(moe_prefill, "moe_forward_gluon", lambda *a, **k: calls.append(1) or gluon_forward(*a, **k))
    y = be.moe(z, weights, ids, prepared, norm, 1e-8)
    assert calls, "be.moe did not take the grouped Gluon GEMM"
    assert_nmse(ref.moe(z, weights, ids, reference, norm, 1e-8), y, tolerance("moe"), f"gluon moe decode T={tokens}")
    gemv = moe_decode_gemv(z, weights, ids, prepared.gate, prepared.up, prepared.down, norm, 1e-8)
    assert_nmse(gemv, y, tolerance("moe"), f"gluon moe vs the decode GEMVs T={tokens}")
    graph, out = torch.cuda.CUDAGraph(), {}
    with torch.cuda.graph(graph):
        out["y"] = be.moe(z, weights, ids, prepared, norm, 1e-8)
    z.copy_(torch.randn_like(z))
    graph.replay()
    torch.cuda.synchronize()
    eager = be.moe(z, weights, ids, prepared, norm, 1e-8)
    assert torch.equal(out["y"], eager), f"graph replay differs from eager: {(out['y'] - eager).abs().max().item()}"


def _emulated_grouped_launch(dense: dict):
    """``fp4_gemm_gluon.launch_grouped``'s contract in PyTorch (its argument checks are the real ones): each token tile
    of an expert against that expert's dense weights (``dense`` maps a stack's ``packed`` pointer to them)."""
    from musecore_cuda.kernels import fp4_gemm_gluon

    def launch(x, blk_expert, stack, out, *, fold_log2, cfg, stack2=None):
        fp4_gemm_gluon.check_grouped(x, blk_expert, stack, out, fold_log2=fold_log2, cfg=cfg, stack2=stack2)
        for tile, e in enumerate(blk_expert.tolist()):
            if e >= 0:
                rows = slice(tile * cfg.block_m, (tile + 1) * cfg.block_m)
                y = x[rows].float() @ dense[stack[0].data_ptr()][e].T
                if stack2 is not None:
                    y = torch.nn.functional.silu(y) * (x[rows].float() @ dense[stack2[0].data_ptr()][e].T)
                out[rows] = y.to(out.dtype)
        return out
    return launch


@pytest.mark.parametrize("block_m", [16, 64])
def test_gluon_moe_steps_around_the_kernel_match_the_reference(block_m, monkeypatch):
    """moe_prefill's alignment, gather, padding rows and finalize, with the grouped kernel replaced by its contract in
    PyTorch (the kernel itself: the GPU tests above): skewed routing, a multi-tile expert, an empty one."""
    from musecore_cuda.kernels import fp4_gemm_gluon, moe_prefill
    experts, topk, tokens, width = 6, 2, 40, 256
    _, prepared, reference, norm = make_layer("nvfp4", experts, width, width, torch.bfloat16, DEVICE)
    dense = {prepared.gate.packed.data_ptr(): reference.gate, prepared.up.packed.data_ptr(): reference.up,
             prepared.down.packed.data_ptr(): reference.down}
    monkeypatch.setattr(fp4_gemm_gluon, "launch_grouped", _emulated_grouped_launch(dense))
    ids = skewed_ids(tokens, experts, topk, DEVICE)
    weights = torch.rand(tokens, topk, device=DEVICE)
    z = torch.randn(tokens, width, device=DEVICE).to(torch.bfloat16)
    cfg = fp4_gluon_plan.GluonConfig(64, block_m, 1, 4, upcast="packed")
    y = moe_prefill.moe_forward_gluon(z, weights, ids, prepared.gate, prepared.up, prepared.down, experts, norm, 1e-8,
                                      cfg=cfg)
    assert_nmse(ref.moe(z, weights, ids, reference, norm, 1e-8), y, tolerance("moe"), f"gluon moe steps {block_m}")


def test_gluon_moe_says_why_a_layer_keeps_the_triton_gemm(monkeypatch):
    from musecore_cuda.kernels import moe_prefill
    _, prepared, _, _ = make_layer("nvfp4", 4, 128, 128, torch.bfloat16, DEVICE)
    z = torch.zeros(2, 128, dtype=torch.bfloat16, device=DEVICE)
    stacks = (prepared.gate, prepared.up, prepared.down)
    monkeypatch.setenv(moe_prefill.GLUON_MOE_ENV, "0")
    assert "MUSECORE_CUDA_GLUON_MOE=0" in moe_prefill.unavailable_reason(z, *stacks)
    monkeypatch.setenv(moe_prefill.GLUON_MOE_ENV, "yes")
    with pytest.raises(ValueError, match="MUSECORE_CUDA_GLUON_MOE must be 0"):
        moe_prefill.unavailable_reason(z, *stacks)
    monkeypatch.setenv(moe_prefill.GLUON_MOE_ENV, "1")
    assert "bf16 activations" in moe_prefill.unavailable_reason(z.half(), *stacks)
    strided = dataclasses.replace(prepared.down, packed=prepared.down.packed.transpose(1, 2))
    assert "not contiguous" in moe_prefill.unavailable_reason(z, prepared.gate, prepared.up, strided)
    if DEVICE == "cpu":
        assert "NVIDIA" in moe_prefill.unavailable_reason(z, *stacks)
    assert "NVFP4" in moe_prefill.shape_problem("mxfp4", 128, 128, (9, 9, 9))
    assert "divisible by 128" in moe_prefill.shape_problem("nvfp4", 128, 192, (9, 9, 9))
    assert "one fold" in moe_prefill.shape_problem("nvfp4", 128, 128, (9, 10, 9))
    assert moe_prefill.shape_problem("nvfp4", 4096, 4096, (9, 9, 9)) is None


def test_gluon_grouped_launch_refuses_what_it_cannot_run():
    from musecore_cuda.kernels import fp4_gemm_gluon
    _, prepared, _, _ = make_layer("nvfp4", 4, 128, 128, torch.bfloat16, DEVICE)
    g = prepared.gate
    stack = (g.packed, g.scales, g.out_scale)
    cfg = fp4_gluon_plan.GluonConfig(64, 16, 1, 4, upcast="packed")
    x = torch.zeros(32, 128, dtype=torch.bfloat16, device=DEVICE)
    tiles = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    out = torch.empty(32, 128, dtype=torch.bfloat16, device=DEVICE)
    fp4_gemm_gluon.check_grouped(x, tiles, stack, out, fold_log2=9, cfg=cfg)  # the valid call
    with pytest.raises(TypeError, match="bf16"):
        fp4_gemm_gluon.check_grouped(x.half(), tiles, stack, out, fold_log2=9, cfg=cfg)
    with pytest.raises(ValueError, match="rows a multiple of block_m"):
        fp4_gemm_gluon.check_grouped(x[:24], tiles, stack, out[:24], fold_log2=9, cfg=cfg)
    with pytest.raises(ValueError, match="7 <= fold_log2 <= 116"):
        fp4_gemm_gluon.check_grouped(x, tiles, stack, out, fold_log2=3, cfg=cfg)
    for cut in ((64, 16, 2, 4), (64, 16, 1, 4, True)):  # split-K; a persistent grid (not written for this kernel)
        with pytest.raises(ValueError, match="without split-K"):
            fp4_gemm_gluon.check_grouped(x, tiles, stack, out, fold_log2=9,
                                         cfg=fp4_gluon_plan.GluonConfig(*cut[:4], upcast="packed",
                                                                        persistent=cut[4:] == (True,)))
    with pytest.raises(ValueError, match="stack must be contiguous"):
        fp4_gemm_gluon.check_grouped(x, tiles, (g.packed, g.scales[..., :4], g.out_scale), out, fold_log2=9, cfg=cfg)
    with pytest.raises(ValueError, match="even number of 128-element chunks; K=128"):
        fp4_gemm_gluon.check_grouped(x, tiles, stack, out, fold_log2=9,
                                     cfg=fp4_gluon_plan.GluonConfig(64, 16, 1, 4, upcast="packed", pair=True))
    with pytest.raises(ValueError, match="output"):
        fp4_gemm_gluon.check_grouped(x, tiles, stack, out[:, :64], fold_log2=9, cfg=cfg)
