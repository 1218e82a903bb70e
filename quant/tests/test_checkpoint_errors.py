"""Bad input gets a CheckpointError naming the file and tensor and saying what to do."""

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from musecore_quant import quantize
from musecore_quant.checkpoint import CheckpointError, open_checkpoint, verify_checkpoint
from musecore_quant.checkpoint.safetensors_io import read_header
from test_checkpoint_helpers import muse_config, write_hf_checkpoint, write_raw_safetensors

W = "model.layers.1.mlp.experts.0.up_proj"


def _raises(folder, *fragments):
    """open_checkpoint(folder) raises a CheckpointError whose message holds every fragment."""
    with pytest.raises(CheckpointError) as info:
        open_checkpoint(folder)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} missing from: {message}"
    return message


def _single(tmp_path, tensors, config=None):
    folder = tmp_path / "ckpt"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config or muse_config()))
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def _sharded(tmp_path, n=3):
    tensors = {f"t{i}.weight": torch.full((8, 8), float(i), dtype=torch.bfloat16) for i in range(n)}
    return write_hf_checkpoint(tmp_path / "ckpt", tensors, muse_config(), shards=n)


def _index(folder):
    return json.loads((folder / "model.safetensors.index.json").read_text())


def _set_index(folder, index):
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def test_missing_config_json(tmp_path):
    folder = _single(tmp_path, {"a.weight": torch.ones(2, 2)})
    os.remove(folder / "config.json")
    _raises(folder, "config.json is missing", str(folder))


def test_missing_weights_and_pickle_files_are_never_read(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    _raises(folder, "no model.safetensors", "Download the weights")
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04 pickle")
    _raises(folder, "pytorch_model.bin", "never read")


def test_truncated_shard_names_file_and_tensor(tmp_path):
    folder = _single(tmp_path, {"a.weight": torch.ones(4, 4), "b.weight": torch.ones(4, 4)})
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-10])
    _raises(folder, str(path), "'b.weight'", "end beyond the file", "re-download")


def test_header_length_beyond_file(tmp_path):
    path = write_raw_safetensors(tmp_path / "x.safetensors", {}, b"", declared_length=5000)
    with pytest.raises(CheckpointError, match="only .* after the length field; the file is truncated") as info:
        read_header(path)
    assert str(path) in str(info.value)


def test_header_larger_than_the_sane_limit(tmp_path):
    path = write_raw_safetensors(tmp_path / "x.safetensors", {}, b"", declared_length=200 * 1024 * 1024)
    with pytest.raises(CheckpointError, match="more than the limit of 104857600"):
        read_header(path)


def test_data_offsets_beyond_file_size(tmp_path):
    header = {"a.weight": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}
    path = write_raw_safetensors(tmp_path / "x.safetensors", header, b"\0" * 8)
    with pytest.raises(CheckpointError, match=r"tensor 'a.weight'.*end beyond the file"):
        read_header(path)


def test_json_garbage_header(tmp_path):
    path = tmp_path / "x.safetensors"
    path.write_bytes((9).to_bytes(8, "little") + b"{not json")
    with pytest.raises(CheckpointError, match="not valid UTF-8 JSON"):
        read_header(path)


@pytest.mark.parametrize("entry,expected", [
    ({"dtype": "Q4", "shape": [2], "data_offsets": [0, 2]}, "dtype 'Q4' is not supported"),
    ({"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}, "non-negative integers"),
    ({"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}, "needs 12"),
])
def test_malformed_header_entries(tmp_path, entry, expected):
    path = write_raw_safetensors(tmp_path / "x.safetensors", {"a.weight": entry}, b"\0" * 8)
    with pytest.raises(CheckpointError, match=expected):
        read_header(path)


def test_overlapping_tensors(tmp_path):
    header = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
              "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}
    path = write_raw_safetensors(tmp_path / "x.safetensors", header, b"\0" * 12)
    with pytest.raises(CheckpointError, match="tensor 'b'.*overlaps"):
        read_header(path)


@pytest.mark.parametrize("bad", ["../outside.safetensors", "/etc/passwd.safetensors", "sub/../../x.safetensors"])
def test_index_entries_pointing_outside_the_folder(tmp_path, bad):
    folder = _sharded(tmp_path)
    index = _index(folder)
    index["weight_map"]["t1.weight"] = bad
    _set_index(folder, index)
    _raises(folder, "model.safetensors.index.json", "'t1.weight'", "outside the checkpoint folder")


def test_symlink_escaping_the_folder(tmp_path):
    folder = _sharded(tmp_path)
    outside = tmp_path / "elsewhere.safetensors"
    os.replace(folder / "model-00002-of-00003.safetensors", outside)
    os.symlink(outside, folder / "model-00002-of-00003.safetensors")
    _raises(folder, "a symlink escapes it", "'t1.weight'")


def test_index_pointing_at_a_pickle_file(tmp_path):
    folder = _sharded(tmp_path)
    index = _index(folder)
    index["weight_map"]["t1.weight"] = "pytorch_model-00001.bin"
    _set_index(folder, index)
    _raises(folder, "not a .safetensors file", "never pickle")


def test_shard_listed_in_index_but_missing(tmp_path):
    folder = _sharded(tmp_path)
    os.remove(folder / "model-00003-of-00003.safetensors")
    _raises(folder, "'model-00003-of-00003.safetensors'", "'t2.weight'", "missing from the folder")


def test_tensor_in_index_but_not_in_shard_and_vice_versa(tmp_path):
    tensors = {f"t{i}.weight": torch.full((8, 8), float(i), dtype=torch.bfloat16) for i in range(4)}
    folder = write_hf_checkpoint(tmp_path / "ckpt", tensors, muse_config(), shards=2)
    index = _index(folder)
    index["weight_map"]["ghost.weight"] = "model-00001-of-00002.safetensors"
    _set_index(folder, index)
    _raises(folder, "'ghost.weight'", "header does not contain it")
    del index["weight_map"]["ghost.weight"]
    del index["weight_map"]["t3.weight"]
    _set_index(folder, index)
    _raises(folder, "model-00002-of-00002.safetensors", "'t3.weight'", "index does not list it")


def test_nan_in_a_weight_is_found_when_read(tmp_path):
    w = torch.ones(4, 4, dtype=torch.bfloat16)
    w[1, 2] = float("nan")
    folder = _single(tmp_path, {"a.weight": w, "b.weight": torch.ones(2)})
    ckpt = open_checkpoint(folder)  # headers are fine
    with pytest.raises(CheckpointError, match=r"model.safetensors: tensor 'a.weight'.*1 of 16 values are NaN or Inf"):
        ckpt.read("a.weight")
    report = verify_checkpoint(folder)
    assert not report.ok and "a.weight" in report.problems[0] and report.weights == 1


def test_nan_in_an_nvfp4_block_scale(tmp_path):
    qt = quantize(torch.randn(128, 64), "nvfp4")
    scale = qt.scale.view(torch.uint8).clone()
    scale[3, 1] = 0x7F  # E4M3 NaN
    folder = _single(tmp_path, {f"{W}.weight": qt.data, f"{W}.weight_scale": scale.view(torch.float8_e4m3fn),
                                f"{W}.weight_scale_2": qt.global_scale},
                     {"quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4"}})
    with pytest.raises(CheckpointError, match=rf"tensor '{W}.weight_scale'.*NaN or Inf"):
        open_checkpoint(folder).read(f"{W}.weight")


def test_unknown_quant_method(tmp_path):
    folder = _single(tmp_path, {"a.weight": torch.ones(2, 2)},
                     {"quantization_config": {"quant_method": "bitsandbytes"}})
    _raises(folder, "config.json", "'bitsandbytes' is not supported", "supported:")


@pytest.mark.parametrize("drop,missing", [("weight_scale", ".weight_scale'"), ("weight_scale_2", ".weight_scale_2'")])
def test_nvfp4_companion_missing(tmp_path, drop, missing):
    qt = quantize(torch.randn(128, 64), "nvfp4")
    tensors = {f"{W}.weight": qt.data, f"{W}.weight_scale": qt.scale, f"{W}.weight_scale_2": qt.global_scale}
    del tensors[f"{W}.{drop}"]
    folder = _single(tmp_path, tensors, {"quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4"}})
    _raises(folder, "model.safetensors", f"{W}{missing}", "no companion tensor")


def test_companion_without_its_weight(tmp_path):
    folder = _single(tmp_path, {"a.weight": torch.ones(2, 2), f"{W}.weight_scale_2": torch.tensor(1.0)},
                     {"quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4"}})
    _raises(folder, f"'{W}.weight_scale_2'", f"'{W}.weight' is not in the checkpoint")


def test_quantized_tensors_without_a_quantization_config(tmp_path):
    qt = quantize(torch.randn(128, 64), "nvfp4")
    folder = _single(tmp_path, {f"{W}.weight": qt.data, f"{W}.weight_scale": qt.scale,
                                f"{W}.weight_scale_2": qt.global_scale})
    _raises(folder, f"'{W}.weight'", "no quantization_config")


def test_config_and_shards_disagree(tmp_path):
    qt = quantize(torch.randn(128, 64), "nvfp4")
    tensors = {f"{W}.weight": qt.data, f"{W}.weight_scale": qt.scale, f"{W}.weight_scale_2": qt.global_scale,
               "lm_head.weight": torch.ones(4, 4)}
    folder = _single(tmp_path, tensors)
    hf_quant = {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "NVFP4",
                                                                  "exclude_modules": ["model.layers.1.mlp*"]}}
    (folder / "hf_quant_config.json").write_text(json.dumps(hf_quant))
    _raises(folder, f"'{W}.weight'", "exclude_modules says it is not quantized")
    hf_quant["quantization"] = {"quant_algo": "MIXED_PRECISION",
                                "quantized_layers": {"lm_head": {"quant_algo": "FP8"}, W: {"quant_algo": "NVFP4"}}}
    (folder / "hf_quant_config.json").write_text(json.dumps(hf_quant))
    _raises(folder, "lists 'lm_head' as FP8", "no quantized lm_head.weight")


def test_partial_folders_are_rejected(tmp_path):
    folder = _single(tmp_path, {"a.weight": torch.ones(2, 2)})
    partial = tmp_path / "out.partial-1234"
    os.replace(folder, partial)
    _raises(partial, "incomplete conversion", "rerun the converter to resume")
    os.replace(partial, folder)
    (folder / ".partial").write_text("")
    _raises(folder, "incomplete conversion")
    assert not verify_checkpoint(folder).ok


def test_hugging_face_cache_snapshot_links_into_its_blobs_are_allowed(tmp_path):
    repo = tmp_path / "models--org--muse"
    blobs, snapshot = repo / "blobs", repo / "snapshots" / "abc123"
    built = _sharded(tmp_path)
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for path in built.iterdir():
        os.replace(path, blobs / f"sha-{path.name}")
        os.symlink(f"../../blobs/sha-{path.name}", snapshot / path.name)
    assert len(open_checkpoint(snapshot).weight_names()) == 3
    os.symlink(tmp_path / "elsewhere.safetensors", snapshot / "model-00009-of-00009.safetensors")
    index = _index(snapshot)
    index["weight_map"]["t1.weight"] = "model-00009-of-00009.safetensors"
    (snapshot / "model.safetensors.index.json").unlink()
    _set_index(snapshot, index)
    _raises(snapshot, "a symlink escapes it")  # anywhere but the repo's blobs/ is still refused
