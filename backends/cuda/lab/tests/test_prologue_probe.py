"""The prologue probe's consumer (``backends/cuda/lab/prologue_probe.py``): the residual norm in every program of the
next GEMV gives what ``dense_gemv``'s last-program tail then a plain ``dense_gemv`` give (to the row sums' order), and
the reference op's values, in Triton's interpreter without a GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from musecore.ops.reference import residual_norm, rms_norm as reference_rms_norm
from musecore_triton.testing import DEVICE, SMALL_DTYPES, assert_nmse

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # backends/cuda/lab
import prologue_probe as pr  # noqa: E402

TOLERANCE = 1e-5  # NMSE against fp32 products that round each op's output to the activations' dtype
EPS = 1e-6


def reference_chain(inputs: dict, post: bool, nxt: bool):
    x, residual = inputs["x"], inputs["residual"]
    for i in range(inputs["wa"].shape[0]):
        o = (x.float() @ inputs["wa"][i].float().T).to(x.dtype)
        residual, normed = residual_norm(residual, o, inputs["post_w"] if post else None, inputs["alpha"],
                                         inputs["beta"], inputs["next_w"] if nxt else None, EPS, EPS)
        x = (normed.float() @ inputs["wb"][i].float().T).to(x.dtype)
    return x, residual


@pytest.mark.parametrize("dtype", SMALL_DTYPES)
@pytest.mark.parametrize("pairs,d", [(1, 64), (2, 96), (2, 200)])
@pytest.mark.parametrize("post,nxt", [(True, True), (False, True), (True, False)])
def test_the_row_op_in_the_consumer_prologue_is_the_tail_chain(pairs, d, dtype, post, nxt):
    inputs = pr.pair_inputs(pairs, d, dtype, DEVICE)
    got_x, got_res = pr.run_chain(inputs, *pr.prologue_pair(inputs, post, nxt, EPS))
    tail_x, tail_res = pr.run_chain(inputs, *pr.tail_pair(inputs, post, nxt, EPS))
    want_x, want_res = reference_chain(inputs, post, nxt)
    what = f"pairs={pairs} d={d} {dtype} post={post} next={nxt}"
    assert_nmse(want_x.float(), got_x.float(), TOLERANCE, f"prologue chain output, {what}")
    assert_nmse(want_res.float(), got_res.float(), TOLERANCE, f"prologue chain residual, {what}")
    assert_nmse(tail_x.float(), got_x.float(), TOLERANCE, f"prologue against tail chain, {what}")
    assert_nmse(tail_res.float(), got_res.float(), TOLERANCE, f"prologue against tail residual, {what}")


@pytest.mark.parametrize("dtype", SMALL_DTYPES)
@pytest.mark.parametrize("block_n,num_warps", [(4, 4), (8, 8), (16, 16)])
def test_wider_consumer_programs_are_the_same_chain(block_n, num_warps, dtype):
    """The probe's wider cuts (fewer programs, so fewer reads of the row): dense_gemv's cut's values (to the sums'
    order: on a GPU other warp counts reduce in another order) and the reference's."""
    inputs = pr.pair_inputs(2, 200, dtype, DEVICE)
    got = pr.run_chain(inputs, *pr.prologue_pair(inputs, eps=EPS, block_n=block_n, num_warps=num_warps))
    narrow = pr.run_chain(inputs, *pr.prologue_pair(inputs, eps=EPS))
    want_x, want_res = reference_chain(inputs, True, True)
    what = f"{block_n} rows x {num_warps} warps, {dtype}"
    assert_nmse(want_x.float(), got[0].float(), TOLERANCE, f"prologue chain output, {what}")
    assert_nmse(want_res.float(), got[1].float(), TOLERANCE, f"prologue residual, {what}")
    assert_nmse(narrow[0].float(), got[0].float(), TOLERANCE, f"{what} against {pr.BLOCK_N} rows")


def test_prologue_gemv_refuses_a_row_wider_than_one_chunk():
    d = pr.MAX_BLOCK_K + 64
    w = torch.zeros(8, d, dtype=torch.bfloat16, device=DEVICE)
    row = torch.zeros(1, d, dtype=torch.bfloat16, device=DEVICE)
    vec = torch.ones(d, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="K <= 2048"):
        pr.prologue_gemv(row, row, vec, vec, vec, vec, EPS, EPS, w)


def verdict_row(mode: str, us_per_pair: float, pdl: bool = True, err: float = 0.0, d: int = 1536) -> dict:
    return {"D": d, "mode": mode, "pdl": pdl, "us_per_pair": us_per_pair, "nmse_vs_tail": err}


def test_the_verdict_takes_the_best_valid_prologue_with_pdl():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import cuda_prologue_probe as script

    rows = [verdict_row("tail", 9.0), verdict_row("tail", 10.0, pdl=False), verdict_row("prologue_2x2w", 8.8),
            verdict_row("prologue_8x8w", 7.0, err=1e-2), verdict_row("prologue_4x4w", 6.0, pdl=False),
            verdict_row("prologue_4x4w", 8.2)]
    v = script.verdict(rows, margin_us=0.5)
    assert v["verdict"] is True and v["best"] == "prologue_4x4w" and v["gain_us_per_pair"] == 0.8, v
    v = script.verdict(rows[:3], margin_us=0.5)  # 0.2 us per pair: under the margin
    assert v["verdict"] is False and v["best"] == "prologue_2x2w", v
    assert script.verdict(rows[:2], margin_us=0.5)["verdict"] is None


def test_the_verdict_compares_each_prologue_with_the_tail_of_its_own_width():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import cuda_prologue_probe as script

    # at D = 4096 the prologue is faster than D = 1536's tail but 0.1 us slower than its own: no gain there
    rows = [verdict_row("tail", 9.0), verdict_row("prologue_4x4w", 8.8), verdict_row("tail", 20.0, d=4096),
            verdict_row("prologue_4x4w", 20.1, d=4096)]
    v = script.verdict(rows, margin_us=0.5)
    assert v["verdict"] is False and v["D"] == 1536 and v["gain_us_per_pair"] == 0.2, v
    rows[3] = verdict_row("prologue_8x8w", 19.0, d=4096)
    v = script.verdict(rows, margin_us=0.5)
    assert v["verdict"] is True and (v["D"], v["best"], v["gain_us_per_pair"]) == (4096, "prologue_8x8w", 1.0), v


def test_each_chain_has_its_own_verdict_against_its_own_baseline():
    """The finalize chain's rows are judged against its ``separate`` mode, never against the residual chain's tail
    (rows without a ``chain`` are the residual chain's, as session 70's were)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import cuda_prologue_probe as script

    rows = [verdict_row("tail", 9.0), verdict_row("prologue_4x4w", 8.8),
            {**verdict_row("separate", 12.0, d=768), "chain": "finalize"},
            {**verdict_row("prologue_16x16w", 10.5, d=768), "chain": "finalize"}]
    v = script.verdict(rows, margin_us=0.5, chain="finalize")
    assert v["verdict"] is True and (v["chain"], v["best"], v["gain_us_per_pair"]) == ("finalize",
                                                                                      "prologue_16x16w", 1.5), v
    v = script.verdict(rows, margin_us=0.5)
    assert v["verdict"] is False and (v["chain"], v["gain_us_per_pair"]) == ("residual", 0.2), v
    assert script.verdict(rows[:2], margin_us=0.5, chain="finalize")["verdict"] is None


def reference_moe_chain(inputs: dict, eps: float) -> torch.Tensor:
    """The finalize chain in PyTorch: each pair's down rows (fp32 products, rounded to the activations' dtype), the
    reference's scale-first post-expert norm, the routing-weighted sum in fp32 (as the reference ``moe`` op) and the
    unpooler on the sum rounded to the activations' dtype."""
    x, weights = inputs["x"], inputs["weights"].float()
    dtype = x.dtype
    for i in range(inputs["down"].shape[0]):
        o = torch.stack([x.float()[0] @ w.float().T for w in inputs["down"][i]]).to(dtype)
        normed = reference_rms_norm(o, inputs["post_norm"], eps, scale_first=True).float()
        y = (normed * weights.T).sum(0, keepdim=True)
        x = (y.to(dtype).float() @ inputs["wb"][i].float().T).to(dtype)
    return x


@pytest.mark.parametrize("dtype", SMALL_DTYPES)
@pytest.mark.parametrize("pairs,d,topk", [(1, 64, 2), (2, 96, 8), (2, 200, 5)])
def test_the_finalize_in_the_unpooler_prologue_is_the_separate_chain(pairs, d, topk, dtype):
    """finalize_gemv: moe.finalize's launch then dense_gemv, in one launch, at dense_gemv's cut and a wide one."""
    inputs = pr.moe_chain_inputs(pairs, d, topk, dtype, DEVICE)
    want = reference_moe_chain(inputs, EPS)
    separate = pr.run_moe_chain(inputs, pr.finalize_tails(inputs, EPS)["separate"])
    what = f"pairs={pairs} d={d} top-{topk} {dtype}"
    assert_nmse(want.float(), separate.float(), TOLERANCE, f"separate finalize chain, {what}")
    for block_n, num_warps in ((pr.BLOCK_N, pr.NUM_WARPS), (16, 16)):
        got = pr.run_moe_chain(inputs, pr.finalize_tails(inputs, EPS, block_n, num_warps)["prologue"])
        assert_nmse(want.float(), got.float(), TOLERANCE, f"finalize prologue chain, {block_n}x{num_warps}, {what}")
        assert_nmse(separate.float(), got.float(), TOLERANCE, f"prologue against separate, {block_n}x{num_warps}, "
                    f"{what}")
