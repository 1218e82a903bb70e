"""The split-K router GEMV of the shared router (``musecore_triton.kernels.router``), the decode path of the
``router_topk`` op (T <= 16), against the reference: in Triton's interpreter without a GPU, compiled for the GPU
with ``-m gpu``. Its compilation for gfx950/gfx942 is in ``test_rocm_compile.py``."""

from __future__ import annotations

import pytest
import torch

from musecore.ops import reference as ref
from musecore_triton.kernels import router
from musecore_triton.testing import DEVICE, assert_nmse

MULTIPLIER, SCALING = 0.1767766952966369, 2.5


def clear_case(tokens: int, experts: int, hidden: int, k: int, seed: int = 0):
    """Router inputs whose k-th and (k+1)-th ``score + bias`` differ by more than 1e-4 in every row, so the
    order of the fp32 sums (about 1e-6 here) cannot change the choice: the ids must then be equal. The first
    of 100 seeds from ``seed`` on that has no near-tie (deterministic)."""
    for attempt in range(100):
        g = torch.Generator().manual_seed(seed + 1000 * attempt)
        x = torch.randn(tokens, hidden, generator=g).to(torch.float16)
        weight = torch.randn(experts, hidden, generator=g) * 4 * hidden ** -0.5
        bias = torch.randn(experts, generator=g) * 0.3
        chosen = (torch.sigmoid((x.float() @ weight.T) * MULTIPLIER) + bias).sort(-1, descending=True).values
        if (chosen[:, :k] - chosen[:, 1:k + 1]).min() > 1e-4:
            return x.to(DEVICE), weight.to(DEVICE), bias.to(DEVICE)
    raise AssertionError(f"no router input without a near-tie in 100 seeds (T={tokens}, E={experts}, k={k})")


@pytest.mark.parametrize("tokens, experts, hidden", [(1, 64, 256), (5, 40, 384), (16, 96, 320)])
def test_split_k_partials_sum_to_the_fp32_product(tokens, experts, hidden):
    """Tolerance: |sum_s part - x @ W^T| <= 1e-5 * (|x| @ |W|^T) elementwise (fp32 sums in another order)."""
    x, weight, _ = clear_case(tokens, experts, hidden, 4)
    part = router.router_logits_split_k(x, weight)
    assert part.dtype == torch.float32 and part.shape[1:] == (tokens, experts)
    want = x.float() @ weight.T
    bound = 1e-5 * (x.float().abs() @ weight.abs().T)
    err = (part.sum(0) - want).abs()
    assert (err <= bound).all(), f"worst error {err.max():.3e} vs bound {bound.min():.3e} ({part.shape[0]} splits)"


@pytest.mark.parametrize("tokens, experts, hidden, k", [(1, 64, 256, 8), (4, 40, 384, 6), (16, 256, 128, 8)])
def test_decode_router_matches_the_reference(tokens, experts, hidden, k):
    """Same ids in the same order; fp32 weights within NMSE 1e-10 (they differ by the fp32 sum order only)."""
    assert router.uses_split_k(tokens)
    x, weight, bias = clear_case(tokens, experts, hidden, k)
    w, ids = router.router_topk(x, weight, bias, k, MULTIPLIER, SCALING)
    ew, eids = ref.router_topk(x, weight, bias, k, MULTIPLIER, SCALING)
    assert torch.equal(ids, eids), f"ids {ids.tolist()} vs reference {eids.tolist()}"
    assert_nmse(ew, w, 1e-10, f"split-K router weights T={tokens} E={experts}")


def test_the_split_is_chosen_by_shape_and_spreads_over_the_compute_units():
    assert router.uses_split_k(1) and router.uses_split_k(router.SPLIT_K_MAX_TOKENS)
    assert not router.uses_split_k(router.SPLIT_K_MAX_TOKENS + 1) and not router.uses_split_k(0)
    gpu = torch.device("cpu")  # num_sms is 4 here; the rule is what matters
    assert router.split_count(256, 8192, 1, gpu) == 1  # 4 expert blocks already cover 4 "CUs"
    assert router.split_count(64, 8192, 1, gpu) == 4
    assert router.split_count(64, 256, 16, gpu) == 2  # partials capped at an eighth of the weight bytes


def test_split_k_refuses_a_prefill_sized_input():
    with pytest.raises(ValueError, match="1..16 rows"):
        router.router_logits_split_k(torch.zeros(17, 64, device=DEVICE), torch.zeros(8, 64, device=DEVICE))


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8, 16])
def test_decode_router_at_816b_shapes_on_a_gpu(tokens):
    x, weight, bias = clear_case(tokens, 256, 8192, 8, seed=tokens)
    x = x.to(torch.bfloat16)
    w, ids = router.router_topk(x, weight, bias, 8, MULTIPLIER, SCALING)
    ew, eids = ref.router_topk(x, weight, bias, 8, MULTIPLIER, SCALING)
    assert torch.equal(ids, eids)
    assert_nmse(ew, w, 1e-10, f"816b router T={tokens}")
