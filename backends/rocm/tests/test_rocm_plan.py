"""On a ROCm host (faked: torch.version.hip set, a gfx950 visible), the plan for ``device="mi355x"`` and an
NVFP4 checkpoint picks this backend: experts requantized to MXFP4 with MXFP4 activations, every op bound
to ``rocm``, and (never run on AMD hardware yet) at the ``emulated`` tier, so strict plans name the gap."""

from __future__ import annotations

import types

import pytest
import torch

import musecore
import musecore.api
from musecore.backends import registry
from musecore_rocm import RocmBackend

PRESET = "muse-spark-open-816b-a42b"


@pytest.fixture
def rocm_host(monkeypatch):
    props = types.SimpleNamespace(gcnArchName="gfx950:sramecc+:xnack-", name="AMD Instinct MI355X",
                                  multi_processor_count=256)
    monkeypatch.setattr(torch.version, "hip", "7.0.0", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=0: props)
    records = registry.discover()
    if "rocm" not in records:  # not pip-installed in this environment: register it as its entry point would
        records["rocm"] = registry.PluginRecord(name="rocm", target="musecore_rocm:RocmBackend",
                                                distribution="musecore-rocm", backend_class=RocmBackend,
                                                probe=RocmBackend("cuda").probe())
    monkeypatch.setattr(musecore.api, "discover", lambda *a, **k: records)
    return records


def test_auto_device_on_a_gfx950_host_is_mi355x(rocm_host):
    assert musecore.api.resolve_device("auto", rocm_host)[0] == "mi355x"
    assert musecore.api.resolve_device("cuda:0", rocm_host)[0] == "mi355x"  # torch's device type on ROCm


def test_nvfp4_checkpoint_on_mi355x_plans_mxfp4_w4a4_on_this_backend(rocm_host):
    plan = musecore.plan(PRESET, "mi355x", checkpoint_format="nvfp4", allow_emulation=True)
    assert plan.backend == "rocm" and not plan.gaps, plan.gaps
    experts = [g for g in plan.groups if g.group.startswith("experts (quantized")]
    assert experts and "requantize nvfp4->mxfp4" in experts[0].action
    moe = [o for o in plan.ops if o.op == "moe" and o.weight_format == "mxfp4"]
    assert moe and moe[0].act_format == "mxfp4" and moe[0].implementation == "rocm"
    assert all(o.implementation == "rocm" for o in plan.ops), [(o.op, o.implementation) for o in plan.ops]
    assert all(o.tier == "emulated" and "not yet run on gfx950 hardware" in o.reason for o in plan.ops)


def test_a_strict_plan_names_the_unverified_kernels(rocm_host):
    plan = musecore.plan(PRESET, "mi355x", checkpoint_format="nvfp4")
    assert plan.gaps and any("allow_emulation" in o.reason for o in plan.ops)
