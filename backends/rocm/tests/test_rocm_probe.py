"""Probe, per-arch supports, plan data and optional-library status, with the hardware faked."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from musecore.backends.base import LinearShape, Tier
from musecore.devices import CATALOG
from musecore.ops import OpSpec
from musecore_rocm import RocmBackend
from musecore_rocm.aiter_adapter import aiter_status
from musecore_rocm.arch import ARCHES, DEVICE_ARCH, arch_of
from musecore_triton import hooks


def fake_rocm(monkeypatch, gcn: str, name: str = "AMD Instinct MI355X", cus: int = 256) -> None:
    props = types.SimpleNamespace(gcnArchName=gcn, name=name, multi_processor_count=cus)
    monkeypatch.setattr(torch.version, "hip", "7.0.0", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=0: props)


def test_probe_says_why_without_a_rocm_torch(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    probe = RocmBackend("cuda").probe()
    assert not probe.available and "torch.version.hip is None" in probe.reason


def test_probe_says_why_without_a_visible_gpu(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", "7.0.0", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    probe = RocmBackend("cuda").probe()
    assert not probe.available and "sees no GPU" in probe.reason


@pytest.mark.parametrize("gcn, devices", [("gfx950:sramecc+:xnack-", ["mi355x", "mi350x"]),
                                          ("gfx942:sramecc+:xnack-", ["mi300x"])])
def test_probe_maps_gcn_arch_to_catalog_devices(monkeypatch, gcn, devices):
    fake_rocm(monkeypatch, gcn)
    probe = RocmBackend("cuda").probe()
    assert probe.available, probe.reason
    assert probe.devices == devices and probe.details["arch"] == arch_of(gcn)
    assert probe.score == 50  # not yet verified on hardware: below a verified backend's 100
    assert "no kernel of this backend has run on" in probe.reason  # what `musecore doctor` shows


def test_probe_names_an_unsupported_arch(monkeypatch):
    fake_rocm(monkeypatch, "gfx90a:sramecc+:xnack-", name="AMD Instinct MI250X")
    probe = RocmBackend("cuda").probe()
    assert not probe.available and "gfx90a" in probe.reason and "gfx950" in probe.reason


def test_probe_never_raises(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", "7.0.0", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=0: 1 / 0)
    probe = RocmBackend("cuda").probe()
    assert not probe.available and "ZeroDivisionError" in probe.reason


def test_catalog_devices_of_each_arch_name_this_backend():
    for name, arch in DEVICE_ARCH.items():
        assert CATALOG[name].backend == "rocm" and CATALOG[name].arch == arch


def test_gfx950_runs_mxfp4_w4a4_on_scaled_mfma_and_says_it_is_unverified(monkeypatch):
    fake_rocm(monkeypatch, "gfx950")
    answer = RocmBackend("cuda").supports("linear", OpSpec("linear", weight_format="mxfp4", act_format="mxfp4"))
    assert answer.ok and answer.tier == Tier.EMULATED
    assert "scaled MFMA" in answer.reason and "not yet run on gfx950 hardware" in answer.reason


def test_gfx942_runs_mxfp4_as_w4a16_and_w4a4_only_emulated(monkeypatch):
    fake_rocm(monkeypatch, "gfx942", name="AMD Instinct MI300X", cus=304)
    be = RocmBackend("cuda")
    w4a16 = be.supports("moe", OpSpec("moe", weight_format="mxfp4"))
    w4a4 = be.supports("linear", OpSpec("linear", weight_format="mxfp4", act_format="mxfp4"))
    assert w4a16.ok and "W4A16" in w4a16.reason
    assert w4a4.ok and w4a4.tier == Tier.EMULATED and "no FP4 matrix cores" in w4a4.reason


def test_gfx942_fp8_uses_fnuz_and_gfx950_ocp(monkeypatch):
    spec = OpSpec("linear", weight_format="fp8", act_format="fp8")
    fake_rocm(monkeypatch, "gfx942")
    assert "e4m3fnuz" in RocmBackend("cuda").supports("linear", spec).reason
    fake_rocm(monkeypatch, "gfx950")
    assert "e4m3fn " in RocmBackend("cuda").supports("linear", spec).reason + " "


def test_without_hardware_supports_says_no_and_what_the_target_would_run(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    answer = RocmBackend("cuda").supports("linear", OpSpec("linear", weight_format="mxfp4", act_format="mxfp4",
                                                           device="mi355x"))
    assert not answer.ok and "torch.version.hip is None" in answer.reason and "scaled MFMA" in answer.reason


def test_unimplemented_formats_are_declined_with_reasons(monkeypatch):
    fake_rocm(monkeypatch, "gfx950")
    be = RocmBackend("cuda")
    for spec in (OpSpec("linear", weight_format="int4"), OpSpec("linear", weight_format="nvfp4", act_format="nvfp4"),
                 OpSpec("moe", weight_format="fp8", act_format="fp8")):
        answer = be.supports(spec.op, spec)
        assert not answer.ok and answer.reason


def test_kernel_choices_need_no_hardware_and_name_the_moe_candidates():
    linears = [LinearShape("q_proj", 8192, 8192, "mxfp4", "mxfp4"),
               LinearShape("experts gate/up", 8192, 4096, "mxfp4", "mxfp4", experts=256, top_k=8),
               LinearShape("o_proj", 8192, 8192, "fp8", "fp8")]
    gfx950 = RocmBackend("cuda").kernel_choices(linears, CATALOG["mi355x"])
    assert "dot_scaled(e2m1, e2m1)" in gfx950[0].choice and "v_mfma_scale" in gfx950[0].reason
    assert "FlyDSL (gate/up, down, finalize)" in gfx950[1].reason and "never executed" in gfx950[1].reason
    assert "aiter" in gfx950[1].reason and "aiter" in gfx950[0].reason
    assert any(c.what == "decode step" and "HIP graph" in c.choice for c in gfx950)
    assert any(c.what.startswith("router") and "split-K" in c.choice for c in gfx950)
    assert any(c.what == "attention" and "aiter unified_attention" in c.reason for c in gfx950)
    gfx942 = RocmBackend("cuda").kernel_choices(linears, CATALOG["mi300x"])
    assert "e4m3fnuz" in gfx942[2].choice and "upcast" in gfx942[0].reason
    assert RocmBackend("cuda").kernel_choices(linears, CATALOG["h200"])[0].choice == "none"


def test_resident_bytes_are_the_checkpoint_bytes_for_mxfp4():
    be = RocmBackend("cuda")
    assert be.resident_bytes("mxfp4", 4096, 4096, experts=256) is None
    assert be.resident_bytes("nvfp4", 4096, 4096, experts=2) is None
    assert [e.name for e in be.env_settings()] == ["MUSECORE_ROCM_AITER"]


def test_rocm_hooks_are_installed_only_on_a_rocm_torch():
    if torch.version.hip is None:
        assert hooks.owner() != "rocm"
    else:
        assert hooks.owner() == "rocm"


def test_aiter_absent_or_foreign_is_a_reason_not_an_error(monkeypatch):
    ok, reason = aiter_status()
    assert not ok and reason
    monkeypatch.setitem(sys.modules, "aiter", types.ModuleType("aiter"))  # PyPI's unrelated asyncio 'aiter'
    monkeypatch.setattr("importlib.util.find_spec", lambda name: object())
    ok, reason = aiter_status()
    assert not ok and "not AMD's aiter" in reason


def test_arch_table_matches_the_catalog_formats():
    for arch in ARCHES.values():
        for device in arch.devices:
            profile = CATALOG[device]
            assert ("mxfp4" in profile.activation_formats) == arch.mxfp4_w4a4


def test_doctor_line_says_which_archs_never_ran_and_moves_with_verified_arches():
    from musecore_rocm.backend import VERIFIED_ARCHES, verified_on

    line = RocmBackend.verified_on
    assert line == verified_on(VERIFIED_ARCHES)
    assert line.startswith("never run on AMD hardware") == (not VERIFIED_ARCHES), line
    for arch in set(ARCHES) - set(VERIFIED_ARCHES):
        assert arch in line.partition("never run on")[2], line
    one = verified_on(("gfx950",))
    ran, _, never = one.partition("; never run on ")
    assert "gfx950 (MI355X / MI350X)" in ran and "gfx950" not in never and "gfx942 (MI300X)" in never, one
    assert "never" not in verified_on(tuple(ARCHES)), verified_on(tuple(ARCHES))
