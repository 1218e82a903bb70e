"""Discovery and honesty: probe never raises, supports() says no/emulated where it must."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from musecore.backends.base import API_VERSION, Tier
from musecore.ops import OPS, OpSpec

from musecore_cuda import CudaBackend


def test_probe_never_raises_and_explains_absence():
    probe = CudaBackend().probe()
    if torch.cuda.is_available():
        assert probe.available and probe.devices
    else:
        assert not probe.available
        assert probe.reason == "no CUDA device: torch.cuda.is_available() is False"


def test_identity_and_every_op_is_implemented():
    be = CudaBackend()
    assert be.name == "cuda" and be.api_version == API_VERSION
    assert all(callable(getattr(be, op, None)) for op in OPS)


def test_entry_point_is_declared():
    text = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    assert 'cuda = "musecore_cuda:CudaBackend"' in text


@pytest.fixture
def on_sm(monkeypatch):
    def set_sm(major):
        monkeypatch.setattr(CudaBackend, "_sm_major", lambda self: major)
        return CudaBackend()
    return set_sm


def test_sm90_runs_fp4_weights_with_16bit_activations_natively(on_sm):
    be = on_sm(9)
    for fmt in ("nvfp4", "mxfp4"):
        for op in ("linear", "moe"):
            assert be.supports(op, OpSpec(op, weight_format=fmt)).tier is Tier.NATIVE


def test_w4a4_is_not_native_on_sm90(on_sm):
    support = on_sm(9).supports("linear", OpSpec("linear", weight_format="nvfp4", act_format="nvfp4"))
    assert support.tier is Tier.NO and "FP4 tensor cores" in support.reason


def test_sm100_fp4_is_not_claimed_native_before_it_ran_there(on_sm):
    be = on_sm(10)
    assert be.supports("linear", OpSpec("linear", weight_format="nvfp4")).tier is Tier.EMULATED
    assert be.supports("moe", OpSpec("moe", weight_format="mxfp4", act_format="mxfp4")).tier is Tier.NO


def test_int4_weights_and_weight_only_fp8_are_refused_with_a_reason(on_sm):
    be = on_sm(9)
    support = be.supports("linear", OpSpec("linear", weight_format="int4"))
    assert support.tier is Tier.NO and "int4" in support.reason
    support = be.supports("linear", OpSpec("linear", weight_format="fp8"))  # 16-bit activations
    assert support.tier is Tier.NO and "W8A8" in support.reason, support.reason
    support = be.supports("moe", OpSpec("moe", weight_format="fp8", act_format="fp8"))
    assert support.tier is Tier.NO and "linear only" in support.reason, support.reason


def test_fp8_w8a8_linear_is_native_on_sm90_only_with_fp8_activations(on_sm):
    support = on_sm(9).supports("linear", OpSpec("linear", weight_format="fp8", act_format="fp8"))
    assert support.tier is Tier.NATIVE and "_scaled_mm" in support.reason, support.reason


def test_without_a_device_nothing_is_supported(on_sm):
    be = on_sm(None)
    assert be.supports("rms_norm", OpSpec("rms_norm")).tier is Tier.NO


def test_every_op_of_the_new_contract_is_claimed_on_sm90_with_its_kernel(on_sm):
    be = on_sm(9)
    for op in ("rms_norm", "residual_norm", "qk_norm_rope", "head_norm_gate", "router_topk", "silu_mul",
               "logit_softcap"):
        support = be.supports(op, OpSpec(op))
        assert support.tier is Tier.NATIVE and "Triton" in support.reason, (op, support.reason)


def test_head_kernels_refuse_a_head_dim_they_cannot_hold(on_sm):
    be = on_sm(9)
    assert be.supports("attention", OpSpec("attention", shape=(("head_dim", 64),))).tier is Tier.NATIVE
    for op in ("attention", "qk_norm_rope", "head_norm_gate"):
        support = be.supports(op, OpSpec(op, shape=(("head_dim", 96),)))
        assert support.tier is Tier.NO and "96" in support.reason, (op, support.reason)


def test_doctor_line_names_the_chips_run_on_and_those_never_run_on():
    from musecore_cuda.backend import RAN_ON, SM_DEVICES, VERIFIED_SM, CudaBackend

    line = CudaBackend.verified_on
    ran, _, never = line.partition("; never run on ")
    assert set(VERIFIED_SM) <= set(RAN_ON), (VERIFIED_SM, RAN_ON)
    for sm in VERIFIED_SM:
        assert f"SM{sm}0" in ran and all(chip in ran for chip in RAN_ON[sm]), line
        untried = [d.upper() for d in SM_DEVICES[sm] if not d.endswith("-fp8") and d.upper() not in RAN_ON[sm]]
        assert not untried or all(chip in ran.partition("never run on")[2] for chip in untried), line
    for sm in set(SM_DEVICES) - set(VERIFIED_SM):
        assert f"SM{sm}0" in never and all(d.upper() in never for d in SM_DEVICES[sm]), line
