"""The persistent-kernel probe (``backends/cuda/lab/persistent_probe.py``): its one-launch chain of GEMVs against the
reference and against ``dense_gemv`` launched once per phase (same cut, same body: the same bits), and its barrier's
bound (a grid whose programs are not all resident raises the flag instead of hanging). In the interpreter the
programs run one after another, so only a one-program grid passes its barriers there; a GPU runs more."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from musecore_triton.kernels.dense_gemv import dense_gemv
from musecore_triton.testing import DEVICE, HAS_GPU, SMALL_DTYPES, assert_nmse

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # backends/cuda/lab
import persistent_probe as pp  # noqa: E402

TOLERANCE = 1e-5  # NMSE against the fp32 chain that rounds each phase's output to the weights' dtype


@pytest.mark.parametrize("dtype", SMALL_DTYPES)
@pytest.mark.parametrize("P,D,blocks", [(1, 64, None), (3, 96, None), (4, 256, None), (3, 256, (4, 64, 0))])
@pytest.mark.parametrize("prefetch", [False, True])
def test_persistent_chain_is_the_chain_of_gemvs(P, D, blocks, dtype, prefetch):
    w, y = pp.chain_inputs(P, D, dtype, DEVICE)
    counters = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    flag = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    programs = min(pp.row_blocks(D, blocks), 132) if HAS_GPU else 1
    got = pp.persistent_chain(w, y, counters, flag, programs, prefetch=prefetch, blocks=blocks).clone()
    assert int(flag) == 0, "a barrier gave up"
    assert counters.tolist() == [0, 0], f"the counters were not reset: {counters.tolist()}"
    assert_nmse(pp.reference_chain(w, y[0]), got.float(), TOLERANCE, f"persistent chain P={P} D={D} {dtype}")
    x = y[0][None]
    for p in range(P):  # the backend's GEMV once per phase: the same cut and body, so the same bits
        x = dense_gemv(x, w[p], blocks)
    diff = (got.float() - x[0].float()).abs().max()
    assert torch.equal(got, x[0]), f"persistent vs dense_gemv chain: max diff {diff}"
    again = pp.persistent_chain(w, torch.cat([y[:1], torch.zeros_like(y[1:])]), counters, flag, programs,
                                blocks=blocks)
    assert torch.equal(again, got), "a second launch (counters reset by the first) differs"


@pytest.mark.skipif(HAS_GPU, reason="on a GPU two programs are resident together and pass their barriers")
def test_a_barrier_that_cannot_be_met_raises_the_flag_instead_of_hanging():
    """In the interpreter program 0 runs alone to its end before program 1 starts: its barriers are never met, so
    each gives up after ``spin_limit`` reads and the flag says so."""
    w, y = pp.chain_inputs(2, 64, torch.float16, DEVICE)
    counters = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    flag = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    pp.persistent_chain(w, y, counters, flag, programs=2, spin_limit=3)
    assert int(flag) == 1
    assert counters.tolist() == [0, 0]


@pytest.mark.parametrize("dtype", SMALL_DTYPES)
@pytest.mark.parametrize("P,D,block_n", [(1, 64, 64), (3, 96, 128), (4, 200, 256)])
def test_the_holding_kernel_is_the_chain_to_rounding(P, D, block_n, dtype):
    """One program per row block holding its next phase's rows; in the interpreter one program, so ``block_n >= D``
    (on a GPU smaller blocks, all resident)."""
    w, y = pp.chain_inputs(P, D, dtype, DEVICE)
    counters = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    flag = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    block = min(block_n, 16) if HAS_GPU else block_n
    pp.persistent_hold(w, y, counters, flag, block)
    assert int(flag) == 0 and counters.tolist() == [0, 0]
    assert_nmse(pp.reference_chain(w, y[0]), y[P].float(), TOLERANCE, f"holding chain P={P} D={D} {dtype}")
