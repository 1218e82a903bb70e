"""GPTQ through musecore's calibration path (musecore.calibrate_gptq): experts on what the router sent
them, dense Linears on their captured inputs, written in the checkpoint's own INT4/MXFP4 codec."""

import json

import pytest
import torch

import musecore
from musecore.calibrate_gptq import GPTQ_REPORT_FILE, DenseGPTQQuantizer, ExpertGPTQQuantizer, GPTQOptions, convert_gptq
from musecore.model import PREFIX
from musecore_quant import dequantize, quantize
from tests.helpers import random_tensors, small_config, write_checkpoint

# hidden 32 / intermediate 64: INT4 groups of 32; layer 0 dense MLP, layer 3 BF16 experts: layers 1, 2 quantized
CONFIG = dict(moe_hidden_size=32, moe_intermediate_size=64, mlp_layer_types=["dense", "sparse", "sparse", "sparse"])
OPTIONS = GPTQOptions(group_size=32, block_size=32)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    torch.set_num_threads(1)
    config = small_config(**CONFIG)
    tensors = random_tensors(config, seed=14, dtype=torch.bfloat16)
    folder = write_checkpoint(tmp_path_factory.mktemp("ckpt") / "small", config, tensors)
    model = musecore.load(folder, device="cpu", dtype=torch.float32, progress=False)
    ids = torch.randint(0, config.vocab_size, (8, 40), generator=torch.Generator().manual_seed(7))
    return folder, config, tensors, model, ids


def test_expert_gptq_lowers_each_experts_output_error_proxy_against_rtn(small):
    _, config, tensors, model, ids = small
    quantizer = ExpertGPTQQuantizer(model, ids, options=OPTIONS)
    report = quantizer.report()
    assert report["layers"] == [1, 2] and report["gptq_experts"] + report["rtn_experts"] == 2 * config.num_local_experts
    # on each expert's own rows GPTQ's Hessian-weighted error is below RTN's: measured mean ~0.3-0.5
    assert report["mean_proxy_error_reduction"] > 0.1, report["mean_proxy_error_reduction"]
    fused = f"{PREFIX}layers.1.mlp.experts.gate_up_proj"
    qt = quantizer(fused, tensors[fused].float())
    assert qt.format == "int4" and tuple(qt.shape) == tuple(tensors[fused].shape) and qt.group_size == 32


def test_mxfp4_experts_fitted_to_quantized_activations_are_mxfp4_of_the_same_weights(small):
    _, config, tensors, model, ids = small
    quantizer = ExpertGPTQQuantizer(model, ids, fmt="mxfp4", act_format="mxfp4", layers=[1], options=OPTIONS)
    down = f"{PREFIX}layers.1.mlp.experts.down_proj"
    qt = quantizer(down, tensors[down].float())
    values = dequantize(qt)
    assert qt.format == "mxfp4" and qt.scale.dtype == torch.uint8
    assert torch.equal(dequantize(quantize(values, "mxfp4")), values), "GPTQ values must lie on the MXFP4 grid"
    reduction = quantizer.report()["mean_proxy_error_reduction"]
    assert reduction > 0.1, f"output-error proxy on the MXFP4-quantized routed inputs: {reduction:+.2f} vs RTN"


def test_dense_gptq_beats_rtn_on_held_out_rows_of_most_linears(small):
    folder, _, tensors, model, ids = small
    dense = DenseGPTQQuantizer(model, folder, ids, ("pooler/unpooler", "attention"), options=OPTIONS)
    report = dense.report()
    assert report["mean_heldout_output_error_reduction"] > 0, report["linears"]
    name = dense.names[0]
    qt = dense(name, tensors[name].float())
    assert qt.format == "int4" and qt.zero is None
    with pytest.raises(ValueError, match="differs from the weight that was calibrated"):
        dense(name, tensors[name].float() + 1)
    with pytest.raises(ValueError, match="was not quantized by GPTQ"):
        dense("lm_head.weight", tensors["lm_head.weight"].float())


def test_convert_gptq_writes_a_checkpoint_that_xeon_keeps_as_written(small, tmp_path):
    folder, config, tensors, _, ids = small
    conv, report = convert_gptq(folder, tmp_path / "gptq", ids.flatten(), tokens=ids.numel(), seq_len=40,
                                dense_groups=("pooler/unpooler",), options=OPTIONS, progress=False)
    saved = json.loads((tmp_path / "gptq" / GPTQ_REPORT_FILE).read_text())
    assert saved["experts"]["gptq_experts"] == report["experts"]["gptq_experts"] > 0
    assert conv.method == "gptq"
    model = musecore.load(tmp_path / "gptq", device="xeon", emulate=True, progress=False, quantize_dense=False)
    pooler = next(r for r in model.plan.groups if r.group == "pooler/unpooler")
    assert (pooler.source_format, pooler.action) == ("int4", "keep"), pooler
    logits = model.forward(ids[:1])
    assert torch.isfinite(logits).all()


def test_bad_gptq_requests_are_one_clear_error(small, tmp_path):
    folder, _, _, model, ids = small
    with pytest.raises(ValueError, match=r"GPTQ experts are written as \('int4', 'mxfp4'\)"):
        ExpertGPTQQuantizer(model, ids, fmt="nvfp4")
    with pytest.raises(ValueError, match="dense groups are quantized to INT4"):
        convert_gptq(folder, tmp_path / "x", ids.flatten(), fmt="mxfp4", dense_groups=("lm_head",), seq_len=40)
    with pytest.raises(ValueError, match="heldout_fraction must be in"):
        GPTQOptions(heldout_fraction=1.0)
