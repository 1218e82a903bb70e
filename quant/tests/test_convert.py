"""The streaming converter: selection, sibling scales, requantization, reports, crash and resume."""

import json

import pytest
import torch

import musecore_quant.convert as convert_module
from musecore_quant import dequantize, quant_error, quantize, requantize
from musecore_quant.checkpoint import CheckpointError, open_checkpoint, verify_checkpoint
from musecore_quant.convert import convert
from musecore_quant.formats.nvfp4 import nvfp4_shared_global_amax
from test_checkpoint_helpers import (MUSE_EXPERT_RULE, PREFIX, assert_same_qtensor, bf16_checkpoint,  # noqa: F401
                                     muse_config, write_hf_checkpoint)

EXPERT = PREFIX + "layers.1.mlp.experts.0."
# SQNR floors for N(0, 0.02^2) weights, measured here: NVFP4 20.4 dB, MXFP4 18.9, INT4 g128 19.6, FP8 31.5
SQNR_FLOOR = {"nvfp4": 19.5, "mxfp4": 18.0, "int4": 18.5, "fp8": 30.0}


def _selected(tensors):
    return [n for n in tensors if ".mlp.experts." in n and n.endswith("_proj.weight")
            and (".layers.1." in n or ".layers.2." in n)]


@pytest.mark.parametrize("to", ["nvfp4", "mxfp4", "int4", "fp8"])
def test_bf16_converts_only_the_selected_experts(tmp_path, bf16_checkpoint, to):
    src, tensors = bf16_checkpoint
    report = convert(src, tmp_path / to, to=to, include=[MUSE_EXPERT_RULE], progress=False)
    ckpt = open_checkpoint(tmp_path / to)
    selected = _selected(tensors)
    assert ckpt.format == to and sorted(ckpt.weight_names()) == sorted(tensors)
    for n in tensors:
        assert ckpt.weight_format(n) == (to if n in selected else "bf16"), n
    records = {t.name: t for t in report.tensors}
    for n in selected:
        r = records[n]
        assert r.action == "quantize" and r.source_format == "bf16" and r.target_format == to
        assert r.sqnr_db > SQNR_FLOOR[to], f"{n}: SQNR {r.sqnr_db:.2f} dB, max|err| {r.max_abs_error:.3g}"
        if not (to == "nvfp4" and "down_proj" not in n):  # gate/up share a global scale, checked below
            assert_same_qtensor(ckpt.read(n), quantize(tensors[n], to), n)
    on_disk = json.loads((tmp_path / to / "conversion_report.json").read_text())
    assert on_disk["summary"]["actions"] == {"quantize": len(selected), "copy": len(tensors) - len(selected)}
    assert on_disk["throughput_mb_s"] > 0 and on_disk["source_bytes_read"] == open_checkpoint(src).tensor_nbytes()
    assert (tmp_path / to / "tokenizer.json").exists()
    assert verify_checkpoint(tmp_path / to).ok


def test_nvfp4_gate_and_up_share_one_weight_scale_2(tmp_path, bf16_checkpoint):
    src, tensors = bf16_checkpoint
    convert(src, tmp_path / "nv", to="nvfp4", include=[MUSE_EXPERT_RULE], progress=False)
    ckpt = open_checkpoint(tmp_path / "nv")
    gate, up, down = (EXPERT + p + "_proj.weight" for p in ("gate", "up", "down"))
    amax = nvfp4_shared_global_amax(tensors[gate], tensors[up])
    for n in (gate, up):
        assert_same_qtensor(ckpt.read(n), quantize(tensors[n], "nvfp4", global_amax=amax), n)
    assert ckpt.read(gate).global_scale.item() == ckpt.read(up).global_scale.item()
    assert ckpt.read(down).global_scale.item() != ckpt.read(gate).global_scale.item()


def test_nvfp4_to_mxfp4_requantizes_and_reports_error_against_the_source(tmp_path, bf16_checkpoint):
    src, tensors = bf16_checkpoint
    convert(src, tmp_path / "nv", to="nvfp4", include=[MUSE_EXPERT_RULE], progress=False)
    report = convert(tmp_path / "nv", tmp_path / "mx", to="mxfp4", include=[MUSE_EXPERT_RULE], progress=False)
    nv, mx = open_checkpoint(tmp_path / "nv"), open_checkpoint(tmp_path / "mx")
    assert (mx.format, mx.producer) == ("mxfp4", "quark")
    for record in report.tensors:
        if record.name not in _selected(tensors):
            assert record.action == "copy"
            continue
        source = nv.read(record.name)
        expected = requantize(source, "mxfp4")
        assert_same_qtensor(mx.read(record.name), expected, record.name)
        err = quant_error(dequantize(source), dequantize(expected))
        assert (record.action, record.source_format) == ("requantize", "nvfp4")
        assert record.sqnr_db == pytest.approx(err.sqnr_db), f"{record.name}: {record.sqnr_db} vs {err}"


def test_mxfp4_to_nvfp4_siblings_are_exact(tmp_path, bf16_checkpoint):
    src, _ = bf16_checkpoint
    convert(src, tmp_path / "mx", to="mxfp4", include=[MUSE_EXPERT_RULE], progress=False)
    report = convert(tmp_path / "mx", tmp_path / "nv", to="nvfp4", include=[MUSE_EXPERT_RULE], progress=False)
    changed = [t for t in report.tensors if t.action == "requantize"]
    assert changed and all(t.sqnr_db == float("inf") for t in changed), [(t.name, t.sqnr_db) for t in changed]
    on_disk = json.loads((tmp_path / "nv" / "conversion_report.json").read_text())
    assert all(t["sqnr_db"] is None for t in on_disk["tensors"] if t["action"] == "requantize"), "inf -> null"
    nv = open_checkpoint(tmp_path / "nv")
    gate, up = EXPERT + "gate_proj.weight", EXPERT + "up_proj.weight"
    assert nv.read(gate).global_scale.item() == nv.read(up).global_scale.item()


def test_to_bf16_dequantizes_every_quantized_weight(tmp_path, bf16_checkpoint):
    src, tensors = bf16_checkpoint
    convert(src, tmp_path / "nv", to="nvfp4", include=[MUSE_EXPERT_RULE], progress=False)
    report = convert(tmp_path / "nv", tmp_path / "bf", to="bf16", progress=False)
    nv, bf = open_checkpoint(tmp_path / "nv"), open_checkpoint(tmp_path / "bf")
    assert (bf.format, bf.producer) == ("bf16", "none")
    assert "quantization_config" not in bf.config and not (tmp_path / "bf" / "hf_quant_config.json").exists()
    for n in _selected(tensors):
        assert torch.equal(bf.read(n), dequantize(nv.read(n), torch.bfloat16)), n
    assert report.summary()["actions"]["dequantize"] == len(_selected(tensors))


def test_quantized_weights_the_target_cannot_store_are_dequantized(tmp_path, bf16_checkpoint):
    src, _ = bf16_checkpoint
    convert(src, tmp_path / "nv", to="nvfp4", include=[MUSE_EXPERT_RULE], progress=False)
    only_layer_1 = [r"layers\.1\.mlp\.experts\.\d+\..*_proj\.weight$"]
    report = convert(tmp_path / "nv", tmp_path / "mx", to="mxfp4", include=only_layer_1, progress=False)
    mx = open_checkpoint(tmp_path / "mx")
    layer2 = PREFIX + "layers.2.mlp.experts.1.down_proj.weight"
    assert mx.weight_format(layer2) == "bf16" and mx.weight_format(EXPERT + "down_proj.weight") == "mxfp4"
    assert {t.name: t.action for t in report.tensors}[layer2] == "dequantize"


def test_autoround_needs_a_calibrated_quantizer_hook(tmp_path, bf16_checkpoint):
    src, tensors = bf16_checkpoint
    with pytest.raises(NotImplementedError, match="calibrated_quantizer"):
        convert(src, tmp_path / "a", to="int4", method="autoround", progress=False)
    seen = []

    def hook(name, w):
        assert w.dtype == torch.float32
        seen.append(name)
        return quantize(w, "int4", group_size=128)

    convert(src, tmp_path / "a", to="int4", method="autoround", include=[MUSE_EXPERT_RULE], progress=False,
            calibrated_quantizer=hook)
    assert sorted(seen) == sorted(_selected(tensors))
    assert open_checkpoint(tmp_path / "a").weight_format(seen[0]) == "int4"
    with pytest.raises(CheckpointError, match="calibrated_quantizer returned"):
        convert(src, tmp_path / "b", to="int4", method="autoround", progress=False,
                calibrated_quantizer=lambda name, w: quantize(w, "fp8"))


def test_bad_requests_are_refused_before_writing(tmp_path, bf16_checkpoint):
    src, _ = bf16_checkpoint
    with pytest.raises(CheckpointError, match="invalid --include pattern"):
        convert(src, tmp_path / "x", to="nvfp4", include=["("], progress=False)
    with pytest.raises(CheckpointError, match="already exists"):
        convert(src, src, to="nvfp4", progress=False)
    with pytest.raises(CheckpointError, match="unknown target format 'fp4'"):
        convert(src, tmp_path / "x", to="fp4", progress=False)
    assert not list(tmp_path.glob("x*"))


def test_weight_the_format_cannot_hold_names_it_and_says_exclude(tmp_path):
    tensors = {"model.layers.0.mlp.experts.0.up_proj.weight": torch.randn(128, 100, dtype=torch.bfloat16)}
    src = write_hf_checkpoint(tmp_path / "odd", tensors, muse_config(), shards=1)
    with pytest.raises(CheckpointError, match=r"up_proj.weight.*divisible by 16.*Exclude this layer"):
        convert(src, tmp_path / "nv", to="nvfp4", progress=False)


def _crash_after(monkeypatch, calls):
    original, count = convert_module._Converter._add, {"n": 0}

    def add(self, *args, **kwargs):
        count["n"] += 1
        if count["n"] > calls:
            raise RuntimeError("simulated crash")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(convert_module._Converter, "_add", add)


def test_crash_mid_conversion_then_resume_gives_a_verified_checkpoint(tmp_path, bf16_checkpoint, monkeypatch):
    src, tensors = bf16_checkpoint
    dst = tmp_path / "nv"
    kwargs = dict(to="nvfp4", include=[MUSE_EXPERT_RULE], progress=False, max_shard_bytes=200_000)
    with monkeypatch.context() as m:
        _crash_after(m, 60)
        with pytest.raises(RuntimeError, match="simulated crash"):
            convert(src, dst, **kwargs)
    partial = list(tmp_path.glob("nv.partial-*"))
    assert len(partial) == 1 and not dst.exists()
    assert len(list(partial[0].glob("shard-*.safetensors"))) >= 2, "some shards were finished before the crash"
    with pytest.raises(CheckpointError, match="incomplete conversion; rerun the converter to resume"):
        open_checkpoint(partial[0])
    assert not verify_checkpoint(partial[0]).ok

    report = convert(src, dst, **kwargs)
    assert 0 < report.resumed_weights < len(tensors)
    assert report.source_bytes_read < open_checkpoint(src).tensor_nbytes(), "finished shards are not redone"
    assert verify_checkpoint(dst).ok and not list(tmp_path.glob("nv.partial-*"))
    assert len(report.tensors) == len(tensors) and report.summary()["actions"]["quantize"] == len(_selected(tensors))
    convert(src, tmp_path / "clean", **kwargs)
    resumed, clean = open_checkpoint(dst), open_checkpoint(tmp_path / "clean")
    for n in tensors:
        a, b = resumed.read(n), clean.read(n)
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), n
        else:
            assert_same_qtensor(a, b, n)


def test_resume_redoes_a_shard_whose_sha256_no_longer_matches(tmp_path, bf16_checkpoint, monkeypatch):
    src, _ = bf16_checkpoint
    kwargs = dict(to="fp8", include=[MUSE_EXPERT_RULE], progress=False, max_shard_bytes=200_000)
    with monkeypatch.context() as m:
        _crash_after(m, 60)
        with pytest.raises(RuntimeError):
            convert(src, tmp_path / "f", **kwargs)
    partial = next(tmp_path.glob("f.partial-*"))
    first = partial / "shard-00001.safetensors"
    data = bytearray(first.read_bytes())
    data[-1] ^= 0xFF
    first.write_bytes(bytes(data))
    report = convert(src, tmp_path / "f", **kwargs)
    assert report.resumed_weights == 0, "a corrupt first shard invalidates it and every later shard"
    assert verify_checkpoint(tmp_path / "f").ok


def test_package_level_convert_is_callable_as_designed(tmp_path, bf16_checkpoint):
    import musecore_quant
    import musecore_quant.checkpoint

    src, _ = bf16_checkpoint
    assert musecore_quant.checkpoint.convert is convert
    report = musecore_quant.convert(src, tmp_path / "f", to="fp8", include=[MUSE_EXPERT_RULE], progress=False)
    assert report.to == "fp8" and open_checkpoint(tmp_path / "f").format == "fp8"


def test_crash_while_finishing_leaves_no_stale_shards_after_resume(tmp_path, bf16_checkpoint, monkeypatch):
    import musecore_quant.checkpoint.writer as writer_module

    src, _ = bf16_checkpoint
    kwargs = dict(to="mxfp4", include=[MUSE_EXPERT_RULE], progress=False, max_shard_bytes=200_000)
    real_write_json = writer_module.write_json

    def failing_write_json(path, obj):
        if path.name == "model.safetensors.index.json":
            raise OSError("disk full while writing the index")
        real_write_json(path, obj)

    with monkeypatch.context() as m:
        m.setattr(writer_module, "write_json", failing_write_json)
        with pytest.raises(OSError, match="disk full"):
            convert(src, tmp_path / "mx", **kwargs)
    partial = next(tmp_path.glob("mx.partial-*"))
    assert list(partial.glob("model-*-of-*.safetensors")), "shards were renamed before the crash"
    convert(src, tmp_path / "mx", **kwargs)
    index = json.loads((tmp_path / "mx" / "model.safetensors.index.json").read_text())
    on_disk = {p.name for p in (tmp_path / "mx").glob("*.safetensors")}
    assert on_disk == set(index["weight_map"].values()) == set(index["metadata"]["sha256"]), "no stale shard"
    assert verify_checkpoint(tmp_path / "mx").ok


def test_fp8_target_refuses_block_scales_upfront(tmp_path, bf16_checkpoint):
    src, _ = bf16_checkpoint
    with pytest.raises(CheckpointError, match="one scale per tensor"):
        convert(src, tmp_path / "f", to="fp8", quantize_options={"block_size": 128}, progress=False)
