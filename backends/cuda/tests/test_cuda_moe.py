"""Routed MoE (NVFP4, MXFP4, dense experts) against ``musecore.ops.reference.moe``."""

from __future__ import annotations

import pytest
import torch

import musecore_quant
from musecore.ops import ExpertWeights, tolerance
from musecore.ops import reference as ref

from musecore_triton.testing import DEVICE, SMALL_DTYPES, assert_nmse, nmse

from musecore_cuda import CudaBackend
from musecore_cuda.kernels import fp4_gemv_cuda
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
def test_moe_decode_runs_of_one_expert_give_the_same_bits(width, inter, experts, tokens):
    """Sorted assignments, each GEMV program computing a run (chunk) of one expert's tokens: the same bits as one
    program per assignment (mma columns are independent), for the default cut, a cluster split-K cut and a cut
    whose warps split K; NMSE against the reference; and replayed from a CUDA graph (the sort included)."""
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
