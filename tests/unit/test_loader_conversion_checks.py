"""What the loader converts it checks, and what a real checkpoint holds it stacks exactly.

QA found: a BF16 expert weight holding one 1e6 loaded on xeon (``emulate=True``, INT4 at load) with an
Inf fp16 scale, an SQNR of NaN and NaN outputs; and an INT4 ``sym=False`` checkpoint where one expert's
zero points all happen to be 8 (so the reader gives that expert no zeros) crashed the load with
``TypeError: expected Tensor as element 1 ... got NoneType`` (or, when it was expert 0, silently dropped
every other expert's zero points)."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

import musecore
from musecore.loader import ConversionError, Placer
from musecore_quant import dequantize, quantize
from musecore_quant.checkpoint import open_checkpoint
from musecore_quant.convert import convert, default_include

TINY = Path(__file__).resolve().parents[2] / "musecore" / "data" / "muse-tiny"
FUSED = "model.language_model.layers.2.mlp.experts.gate_up_proj"


def test_a_weight_whose_int4_scale_overflows_is_refused_at_load_naming_it(tmp_path):
    src = shutil.copytree(TINY, tmp_path / "tiny")
    tensors = load_file(src / "model.safetensors")
    tensors[FUSED][0, 0, 0] = 1e6  # AutoRound's symmetric scale 1e6 / 8 is over fp16's 65504
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError) as info:
        musecore.load(src, device="xeon", emulate=True)
    message = str(info.value)
    assert FUSED in message and "int4" in message and "overflows fp16" in message and "\n" not in message, message


def _placer() -> Placer:
    return Placer(plan=None, backends={"reference": SimpleNamespace(device=torch.device("cpu"))},
                  dtype=torch.float32)


def test_a_converted_tensor_with_inf_scales_or_an_erased_matrix_is_never_placed():
    placer = _placer()
    w = torch.randn(64, 128) * 0.02
    qt = quantize(w, "nvfp4")
    assert placer._record("ok.weight", w, qt, None, "bf16") is qt and len(placer.report) == 1
    broken = quantize(w, "int4")
    broken.scale = broken.scale.clone()
    broken.scale[0, 0] = float("inf")
    with pytest.raises(ConversionError, match="'inf.weight'.*NaN or Inf"):
        placer._record("inf.weight", w, broken, None, "bf16")
    w[5, 7] = 3e38  # the per-tensor scale leaves every other value below NVFP4's smallest step: all become 0
    with pytest.raises(ConversionError, match="'huge.weight'.*become 0"):
        placer._record("huge.weight", w, quantize(w, "nvfp4"), None, "bf16")
    assert len(placer.report) == 1, "a refused conversion was reported as done"


def test_an_int4_checkpoint_whose_experts_disagree_on_zero_points_loads_exactly(tmp_path):
    config = open_checkpoint(TINY).config
    with open_checkpoint(TINY) as reader:
        include, _ = default_include(config, reader.weight_names())
    convert(TINY, tmp_path / "int4", to="int4", include=include, quantize_options={"sym": False}, progress=False)
    shard = next((tmp_path / "int4").glob("model-*.safetensors"))
    tensors = load_file(shard)
    for e in (0, 3):  # expert 0 (was silently wrong) and expert 3 (was the crash)
        key = f"model.language_model.layers.1.mlp.experts.{e}.gate_proj.qzeros"
        tensors[key] = torch.full_like(tensors[key], 0x77777777)  # GPTQ v1 stores z - 1: every zero point is 8
    save_file(tensors, str(shard), metadata={"format": "pt"})
    model = musecore.load(tmp_path / "int4", device="xeon", emulate=True)
    loaded = model.layers[1].mlp.experts.gate
    with open_checkpoint(tmp_path / "int4") as reader:
        experts = [reader.read(f"model.language_model.layers.1.mlp.experts.{e}.gate_proj.weight")
                   for e in range(loaded.shape[0])]
    assert experts[0].zero is None and experts[3].zero is None and experts[1].zero is not None
    for e, expert in enumerate(experts):
        want = dequantize(expert).to(loaded.dtype)
        assert torch.equal(loaded[e], want), \
            f"expert {e}: max |diff| {float((loaded[e].float() - want.float()).abs().max()):.3g} (tolerance: exact)"
