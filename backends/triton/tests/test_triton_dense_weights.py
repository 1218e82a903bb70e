"""Dense weights in the GPU backends: kept in the model dtype and labelled by it, linears and experts alike
(``musecore_triton.ops.dense_weight`` / ``dense_experts``, which the CUDA and ROCm backends share)."""

from __future__ import annotations

import importlib

import pytest
import torch

from musecore_triton.ops import dense_experts, dense_weight
from musecore_triton.testing import DEVICE


@pytest.mark.parametrize("dtype,label", [(torch.float16, "fp16"), (torch.float32, "fp32")])
def test_dense_helpers_convert_and_label_by_the_model_dtype(dtype, label):
    w = torch.randn(6, 10, dtype=torch.bfloat16)
    prepared = dense_weight(w, DEVICE, dtype)
    assert (prepared.format, prepared.data.dtype, prepared.out_features, prepared.in_features) == (label, dtype, 6, 10)
    assert torch.equal(prepared.data.cpu(), w.to(dtype))
    bias = dense_weight(torch.randn(10, dtype=torch.bfloat16), DEVICE, dtype)  # a 1-D weight is one output row
    assert (bias.out_features, bias.in_features) == (1, 10)
    gate, up, down = (torch.randn(3, 8, 4, dtype=torch.bfloat16), torch.randn(3, 8, 4, dtype=torch.bfloat16),
                      torch.randn(3, 4, 8, dtype=torch.bfloat16))
    experts = dense_experts(gate, up, down, DEVICE, dtype)
    assert (experts.format, experts.num_experts, experts.act_format) == (label, 3, None)
    for got, want in zip((experts.gate, experts.up, experts.down), (gate, up, down)):
        assert got.dtype == dtype and got.is_contiguous() and torch.equal(got.cpu(), want.to(dtype))


@pytest.mark.parametrize("module,cls", [("musecore_cuda", "CudaBackend"), ("musecore_rocm", "RocmBackend")])
def test_vendor_backends_label_dense_experts_as_their_linears(module, cls):
    """A BF16 checkpoint loaded in fp16: the experts are fp16 and say so, as the linears do (the plan's ops
    dispatch on the label; the CUDA backend used to keep the checkpoint's label on converted experts)."""
    backend = getattr(importlib.import_module(module), cls)(DEVICE)
    gate, up, down = torch.randn(2, 8, 4), torch.randn(2, 8, 4), torch.randn(2, 4, 8)
    experts = backend.prepare_experts(*(w.bfloat16() for w in (gate, up, down)), dtype=torch.float16)
    linear = backend.prepare_weight(torch.randn(8, 4).bfloat16(), "test", dtype=torch.float16)
    assert experts.format == linear.format == "fp16", (experts.format, linear.format)
    assert experts.gate.dtype == linear.data.dtype == torch.float16
