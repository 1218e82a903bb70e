"""Where programmatic dependent launch is used (``musecore_cuda.kernels.pdl``): the policy, on any machine.

Whether PDL itself keeps the kernels ordered is tested on the GPU by the whole suite run with
``MUSECORE_CUDA_PDL=1`` and by ``backends/cuda/lab/scripts/cuda_pdl_bisect.py`` (the generated tokens match PDL off)."""

from __future__ import annotations

import types

import pytest
import torch

from musecore_cuda.kernels import pdl

GPU = torch.device("cuda", 0)


@pytest.fixture
def sm90(monkeypatch):
    """Pretend the device supports PDL, and start with neither variable set."""
    monkeypatch.setattr(pdl, "_supported", lambda index: True)
    monkeypatch.delenv(pdl.ENV, raising=False)
    monkeypatch.delenv(pdl.EARLY_ENV, raising=False)
    return monkeypatch


def test_off_outside_a_scope_and_on_inside(sm90):
    assert not pdl.enabled(GPU, "rms_norm")
    with pdl.scope(True):
        assert pdl.enabled(GPU, "rms_norm")
        with pdl.scope(False):
            assert not pdl.enabled(GPU, "rms_norm")
        assert pdl.enabled(GPU, "rms_norm")
    assert not pdl.enabled(GPU, "rms_norm")


def test_the_variable_overrides_the_scope(sm90):
    sm90.setenv(pdl.ENV, "0")
    with pdl.scope(True):
        assert not pdl.enabled(GPU, "rms_norm")
    sm90.setenv(pdl.ENV, "1")
    assert pdl.enabled(GPU, "rms_norm")
    sm90.setenv(pdl.ENV, "dense_gemv,moe_finalize")
    assert pdl.enabled(GPU, "moe_finalize") and not pdl.enabled(GPU, "rms_norm")


def test_only_decode_gemvs_and_attention_trigger_early(sm90):
    with pdl.scope(True):
        assert pdl.early(GPU, "fp4_gemv_mma") and pdl.early(GPU, "dense_gemv")
        assert pdl.early(GPU, "attention")  # after its own wait (run 150: 708.0 -> 672.0 us per muse-small replay)
        assert not pdl.early(GPU, "attention_merge")
        assert pdl.early(GPU, "fp4_gemv_mma_experts")  # on light grids only (fp4_gemv_cuda.signals_early)
        assert not pdl.early(GPU, "rms_norm")
        sm90.setenv(pdl.EARLY_ENV, "0")
        assert not pdl.early(GPU, "fp4_gemv_mma")
    assert not pdl.early(GPU, "fp4_gemv_mma")  # never early without PDL


def test_never_on_a_cpu_or_without_sm90(monkeypatch):
    monkeypatch.setenv(pdl.ENV, "1")
    assert not pdl.enabled(torch.device("cpu"), "rms_norm")
    monkeypatch.setattr(pdl, "_supported", lambda index: False)
    assert not pdl.enabled(GPU, "rms_norm")


@pytest.mark.parametrize("raw, setting", [("1", "1"), ("on", "1"), (" TRUE ", "1"), ("yes", "1"), ("0", "0"),
                                          ("off", "0"), ("false", "0"), ("fp4_gemv_mma, dense_gemv",
                                                                          "fp4_gemv_mma,dense_gemv")])
def test_the_pdl_switch_takes_on_off_words_and_kernel_names(monkeypatch, raw, setting):
    """``on`` used to be read as a kernel named "on" (so PDL silently off everywhere)."""
    monkeypatch.setenv(pdl.ENV, raw)
    assert pdl.env_setting() == setting


@pytest.mark.parametrize("raw", ["garbage!", "1,", "on off"])
def test_a_pdl_switch_that_is_neither_is_one_line(monkeypatch, raw):
    monkeypatch.setenv(pdl.ENV, raw)
    with pytest.raises(ValueError, match="set 1 \\(on\\), 0 \\(off\\) or a comma list of kernel names"):
        pdl.env_setting()


def test_expert_gemvs_signal_early_only_on_light_grids(sm90):
    """muse-small's expert grids (192 blocks on 132 SMs) signal early; the 816B layer's batch-1 grid (512 blocks) does
    not (run 153: 0.971x with it); plain GEMVs on any grid; nothing without the early set or outside a PDL scope."""
    fp4_gemv_cuda = pytest.importorskip("musecore_cuda.kernels.fp4_gemv_cuda")
    sm90.setattr(torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(multi_processor_count=132))
    small = fp4_gemv_cuda.make_plan(1, 768, 768, torch.bfloat16, GPU, programs=8, swiglu=True)
    big = fp4_gemv_cuda.make_plan(1, 4096, 4096, torch.bfloat16, GPU, programs=8, swiglu=True)
    grids = {plan: plan.grid(n, 8) for plan, n in ((small, 768), (big, 4096))}
    assert [g[0] * g[1] * g[2] for g in grids.values()] == [192, 512]

    def early(plan, experts=True):
        return fp4_gemv_cuda.signals_early(GPU, plan, grids[plan], experts=experts)

    assert not early(small)  # no PDL scope
    with pdl.scope(True):
        assert early(small) and not early(big) and early(big, experts=False)
        sm90.setattr(fp4_gemv_cuda, "EXPERTS_EARLY_BLOCKS_PER_SM", 4)
        assert early(big)
        sm90.setenv(pdl.EARLY_ENV, "fp4_gemv_mma")
        assert not early(small) and early(big, experts=False)
