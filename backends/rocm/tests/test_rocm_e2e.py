"""``musecore.load(nvfp4_checkpoint, device="mi355x")`` on a (faked) ROCm host picks this backend and runs the
bundled muse-tiny through its kernels (Triton's interpreter standing in for gfx950), and every routed-expert
call computes exactly what ``emulate=True`` computes for that call.

The comparison is per op on the real model's inputs: end to end, two correct implementations that round
differently (fp16 attention, norms) can route a token differently where two router scores nearly tie, and
from there their logits part (seen on this model: a flip at the third MoE call, whose inputs differed by an
NMSE of 4.5e-7). The whole-model numbers are printed, not asserted.
"""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch

import musecore
import musecore.api
import musecore_quant
import musecore_rocm.backend as rocm_backend
from musecore.backends import registry
from musecore.ops import ExpertWeights
from musecore.ops import reference as ref
from musecore.quantize import convert_muse_checkpoint
from musecore.testing import nmse
from musecore_rocm import RocmBackend
from musecore_triton.kernels.mx_moe import MxExperts

pytestmark = pytest.mark.slow
IDS = torch.tensor([[0, 414, 286, 1290, 17, 9]])


@pytest.fixture(scope="module")
def nvfp4_tiny(tmp_path_factory):
    bf16 = Path(musecore.__file__).parent / "data" / "muse-tiny"
    out = tmp_path_factory.mktemp("rocm-e2e") / "tiny-nvfp4"
    convert_muse_checkpoint(bf16, out, to="nvfp4", progress=False)
    return out


@pytest.fixture
def rocm_host(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("runs the kernels in Triton's interpreter; a GPU machine runs the conformance suite instead")
    props = types.SimpleNamespace(gcnArchName="gfx950:sramecc+:xnack-", name="AMD Instinct MI355X",
                                  multi_processor_count=256)
    monkeypatch.setattr(torch.version, "hip", "7.0.0", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=0: props)
    records = registry.discover()
    records["rocm"] = registry.PluginRecord(name="rocm", target="musecore_rocm:RocmBackend",
                                            distribution="musecore-rocm", backend_class=RocmBackend,
                                            probe=RocmBackend("cuda").probe())
    monkeypatch.setattr(musecore.api, "discover", lambda *a, **k: records)
    monkeypatch.setitem(musecore.api.TORCH_DEVICE_TYPE, "rocm", "cpu")  # the interpreter stands in for the GPU


def _dequantized(experts: MxExperts, act_format):
    def deq(packed, scales):
        shape = (packed.shape[0], packed.shape[1], packed.shape[2] * 2)
        return musecore_quant.dequantize(musecore_quant.QTensor(format="mxfp4", data=packed, scale=scales,
                                                                shape=shape, group_size=32))
    return ExpertWeights(deq(experts.gate, experts.gate_scales), deq(experts.up, experts.up_scales),
                         deq(experts.down, experts.down_scales), format="mxfp4", num_experts=experts.num_experts,
                         act_format=act_format)


def test_nvfp4_checkpoint_on_mi355x_runs_on_rocm_kernels_with_the_emulated_numerics(nvfp4_tiny, rocm_host,
                                                                                    monkeypatch):
    calls = []
    kernel = rocm_backend.mx_moe_forward

    def checked(z, weights, ids, experts, post, eps, *, quantize_activations):
        y = kernel(z, weights, ids, experts, post, eps, quantize_activations=quantize_activations)
        want = ref.moe(z, weights, ids, _dequantized(experts, "mxfp4" if quantize_activations else None), post, eps)
        calls.append((quantize_activations, nmse(want, y)))
        return y

    monkeypatch.setattr(rocm_backend, "mx_moe_forward", checked)
    model = musecore.load(nvfp4_tiny, device="mi355x", allow_emulation=True, dtype=torch.float16, progress=False)
    assert type(model.backend) is RocmBackend and model.plan.backend == "rocm"
    assert any(o.op == "moe" and o.weight_format == "mxfp4" and o.act_format == "mxfp4" for o in model.plan.ops)
    logits = model.forward(IDS)
    assert torch.isfinite(logits).all()
    assert calls and all(w4a4 for w4a4, _ in calls), calls  # every quantized layer ran the W4A4 kernels
    worst = max(err for _, err in calls)
    print(f"\n{len(calls)} MXFP4 W4A4 MoE calls; worst NMSE vs the emulated op on the same inputs: {worst:.2e}")
    assert worst <= 1e-10, calls
    emulated = musecore.load(nvfp4_tiny, device="mi355x", emulate=True, dtype=torch.float16).forward(IDS)
    print(f"whole model vs emulate=True: logits NMSE {nmse(emulated.float(), logits.float()):.2e}, top-1 agreement "
          f"{(emulated.argmax(-1) == logits.argmax(-1)).float().mean().item():.2f}")
