"""Emulation: a target's weight conversion and activation quantization on the local reference kernels."""

from pathlib import Path

import pytest
import torch

import musecore
from musecore.quantize import convert_muse_checkpoint
from musecore_quant import dequantize, requantize
from musecore_quant.checkpoint import open_checkpoint
from tests.conftest import nmse
from tests.helpers import random_tensors, small_config, write_checkpoint

EXPERT = "model.language_model.layers.1.mlp.experts.3.up_proj.weight"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("emu")
    config = small_config(hidden_size=128, moe_hidden_size=128, moe_intermediate_size=128, head_dim=32)
    bf16 = write_checkpoint(root / "bf16", config, random_tensors(config, dtype=torch.bfloat16))
    nvfp4 = root / "nvfp4"
    convert_muse_checkpoint(bf16, nvfp4, to="nvfp4", progress=False)
    return bf16, nvfp4


IDS = torch.tensor([[5, 1, 9, 33, 2, 71, 8, 8, 40]])


@pytest.fixture(scope="module")
def tiny_checkpoints(tmp_path_factory):
    """The bundled, trained muse-tiny and its NVFP4 conversion: "close to BF16" is a property of a
    trained model (a random one flips routing choices on any rounding and moves by NMSE 0.1-0.2)."""
    bf16 = Path(musecore.__file__).parent / "data" / "muse-tiny"
    nvfp4 = tmp_path_factory.mktemp("emu") / "tiny-nvfp4"
    convert_muse_checkpoint(bf16, nvfp4, to="nvfp4", progress=False)
    return bf16, nvfp4


TINY_IDS = torch.tensor([[0, 414, 286, 1290, 17, 9, 300, 41, 12, 2000, 77, 5, 600, 31, 8, 1000]])


def test_nvfp4_checkpoint_on_mi355x_is_requantized_to_mxfp4_while_loading(checkpoints, monkeypatch):
    """With producer parity asked for (MUSECORE_REQUANTIZATION=producer), the resident experts are Quark's
    EVEN/RNE requantization byte for byte (the default least-error rule is tested in test_requant_at_load)."""
    monkeypatch.setenv("MUSECORE_REQUANTIZATION", "producer")
    _, nvfp4 = checkpoints
    model = musecore.load(nvfp4, device="mi355x", emulate=True, dtype=torch.float32)
    experts = model.layers[1].mlp.experts
    assert (experts.format, experts.act_format) == ("mxfp4", "mxfp4")
    source = open_checkpoint(nvfp4).read(EXPERT)
    assert source.format == "nvfp4"
    want = dequantize(requantize(source, "mxfp4", scale_mode="even", rounding="rne"))
    assert torch.equal(experts.up[3], want), "resident weights must be the EVEN/RNE MXFP4 requantization"
    report = {r.name: r for r in model.conversion_report}
    assert report[EXPERT].source == "nvfp4" and report[EXPERT].target == "mxfp4"
    assert 10 < report[EXPERT].sqnr_db < 40, report[EXPERT]


def test_h200_w4a16_emulation_equals_reference_on_the_same_nvfp4_weights(checkpoints):
    _, nvfp4 = checkpoints
    h200 = musecore.load(nvfp4, device="h200", emulate=True, dtype=torch.float32)
    cpu = musecore.load(nvfp4, device="cpu", dtype=torch.float32)
    assert h200.layers[1].mlp.experts.act_format is None
    assert torch.equal(h200.forward(IDS), cpu.forward(IDS)), "W4A16 keeps activations in 16 bits: same numbers"


def test_b300_w4a4_quantizes_activations_and_changes_the_logits_a_little(tiny_checkpoints):
    _, nvfp4 = tiny_checkpoints
    b300 = musecore.load(nvfp4, device="b300", emulate=True, dtype=torch.float32)
    h200 = musecore.load(nvfp4, device="h200", emulate=True, dtype=torch.float32)
    assert b300.layers[1].mlp.experts.act_format == "nvfp4"
    err = nmse(h200.forward(TINY_IDS), b300.forward(TINY_IDS))
    assert 0 < err < 0.05, f"NMSE of W4A4 vs W4A16 logits: {err:.3e} (expected small but non-zero)"


def test_quantized_targets_stay_close_to_bf16(tiny_checkpoints):
    """The checkpoint's NVFP4 experts as each target converts them (quantize_dense=False: xeon6 would
    also quantize the dense projections)."""
    bf16, nvfp4 = tiny_checkpoints
    ref = musecore.load(bf16, device="cpu", dtype=torch.float32).forward(TINY_IDS)
    for device in ("h200", "mi355x", "xeon6", "tpu-v6e"):
        out = musecore.load(nvfp4, device=device, emulate=True, dtype=torch.float32,
                            quantize_dense=False).forward(TINY_IDS)
        err = nmse(ref, out)
        assert torch.isfinite(out).all() and err < 0.1, f"{device}: NMSE vs BF16 {err:.3e}"
