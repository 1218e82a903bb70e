"""Requantization while loading: the least-error rule by default, producer bytes when asked for."""

import pytest
import torch

import musecore
from musecore.quantize import convert_muse_checkpoint
from musecore_quant import dequantize, requantize
from musecore_quant.checkpoint import open_checkpoint
from tests.helpers import random_tensors, small_config, write_checkpoint

EXPERT = "model.language_model.layers.1.mlp.experts.3.up_proj.weight"


@pytest.fixture(scope="module")
def nvfp4_checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("requant")
    config = small_config(hidden_size=128, moe_hidden_size=128, moe_intermediate_size=128, head_dim=32)
    tensors = random_tensors(config, dtype=torch.bfloat16)
    # heavy-tailed rows (Student-t-like), so some 32-blocks have an outlier and EVEN-1 wins there
    for name, value in tensors.items():
        if ".mlp.experts." in name and value.dim() >= 2:
            tensors[name] = (value.float() / torch.rand_like(value.float()).clamp(min=0.05).sqrt()).to(value.dtype)
    bf16 = write_checkpoint(root / "bf16", config, tensors)
    convert_muse_checkpoint(bf16, root / "nvfp4", to="nvfp4", progress=False)
    return root / "nvfp4"


def _up3(model):
    return model.layers[1].mlp.experts.up[3]


def test_producer_parity_gives_quark_even_bytes(nvfp4_checkpoint, monkeypatch):
    monkeypatch.setenv("MUSECORE_REQUANTIZATION", "producer")
    model = musecore.load(nvfp4_checkpoint, device="mi355x", emulate=True, dtype=torch.float32)
    source = open_checkpoint(nvfp4_checkpoint).read(EXPERT)
    assert torch.equal(_up3(model), dequantize(requantize(source, "mxfp4", scale_mode="even", rounding="rne")))
    assert {r.rule for r in model.conversion_report} == {"producer"}
    assert all(r.producer_sqnr_db is None for r in model.conversion_report)


def test_default_load_searches_scales_and_reports_both_sqnrs(nvfp4_checkpoint, monkeypatch):
    monkeypatch.delenv("MUSECORE_REQUANTIZATION", raising=False)
    model = musecore.load(nvfp4_checkpoint, device="mi355x", emulate=True, dtype=torch.float32)
    source = open_checkpoint(nvfp4_checkpoint).read(EXPERT)
    assert torch.equal(_up3(model), dequantize(requantize(source, "mxfp4", scale_mode="mse")))
    report = [r for r in model.conversion_report if r.source == "nvfp4"]
    assert report and {r.rule for r in report} == {"least error"}
    gains = [r.sqnr_db - r.producer_sqnr_db for r in report]
    assert min(gains) >= -1e-9, f"a tensor lost SQNR to the search: {min(gains):.3e} dB"
    assert max(gains) > 0, f"no tensor gained on heavy-tailed weights: gains {gains[:5]}"


def test_unknown_requantization_rule_is_refused_with_the_choices(nvfp4_checkpoint, monkeypatch):
    monkeypatch.setenv("MUSECORE_REQUANTIZATION", "best")
    with pytest.raises(ValueError, match="least-error.*producer"):
        musecore.load(nvfp4_checkpoint, device="mi355x", emulate=True, dtype=torch.float32)
