"""musecore.load on broken checkpoints: each error names the file or tensor and says what to do."""

import json
import struct

import pytest
import torch

import musecore
from tests.helpers import random_tensors, small_config, write_checkpoint

EXPERT = "model.language_model.layers.1.mlp.experts.gate_up_proj"


@pytest.fixture
def good(tmp_path):
    config = small_config()
    return write_checkpoint(tmp_path / "ckpt", config, random_tensors(config), shards=2), config


def shard(folder, n=0):
    return sorted(folder.glob("*.safetensors"))[n]


def test_truncated_shard_names_the_file(good):
    folder, _ = good
    f = shard(folder)
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(ValueError, match=f"{f.name}.*") as e:
        musecore.load(folder, device="cpu")
    assert "re-download" in str(e.value) or "truncated" in str(e.value) or "past the end" in str(e.value), str(e.value)


def test_corrupt_header_json_names_the_file(good):
    folder, _ = good
    f = shard(folder)
    data = bytearray(f.read_bytes())
    data[8:12] = b"\xff\xfe{{"
    f.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=f.name):
        musecore.load(folder, device="cpu")


def test_oversized_header_is_rejected_before_reading_it(good):
    folder, _ = good
    f = shard(folder)
    data = f.read_bytes()
    f.write_bytes(struct.pack("<Q", 2**40) + data[8:])
    with pytest.raises(ValueError, match=f"{f.name}.*header"):
        musecore.load(folder, device="cpu")


def test_index_entry_outside_the_checkpoint_folder_is_refused(good, tmp_path):
    folder, _ = good
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    outside = tmp_path / "evil.safetensors"
    outside.write_bytes(shard(folder).read_bytes())
    index["weight_map"][EXPERT] = "../evil.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"outside|\.\./evil"):
        musecore.load(folder, device="cpu")


def test_missing_shard_listed_in_the_index(good):
    folder, _ = good
    f = shard(folder, 1)
    f.unlink()
    with pytest.raises(ValueError, match=f.name):
        musecore.load(folder, device="cpu")


def test_nan_in_a_weight_names_the_tensor(tmp_path):
    config = small_config()
    tensors = random_tensors(config)
    tensors[EXPERT][0, 3, 5] = float("nan")
    folder = write_checkpoint(tmp_path / "nan", config, tensors)
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.experts\.gate_up_proj.*(NaN|non-finite)"):
        musecore.load(folder, device="cpu")


def test_wrong_dtype_for_a_weight_is_named(tmp_path):
    config = small_config()
    tensors = random_tensors(config)
    tensors[EXPERT] = torch.zeros_like(tensors[EXPERT], dtype=torch.int32)
    folder = write_checkpoint(tmp_path / "dtype", config, tensors)
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.experts\.gate_up_proj.*(int32|i32|I32|dtype)"):
        musecore.load(folder, device="cpu")


def test_unknown_quant_method_is_named(tmp_path):
    config = small_config()
    folder = write_checkpoint(tmp_path / "q", config, random_tensors(config))
    data = json.loads((folder / "config.json").read_text())
    data["quantization_config"] = {"quant_method": "magic-bits"}
    (folder / "config.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="magic-bits"):
        musecore.load(folder, device="cpu")


def test_not_a_folder_or_preset(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint folder"):
        musecore.load(tmp_path / "nope", device="cpu")


def test_pickle_checkpoints_are_not_read(tmp_path):
    config = small_config()
    folder = tmp_path / "pt"
    folder.mkdir()
    config.save_pretrained(folder)
    torch.save(random_tensors(config), folder / "pytorch_model.bin")
    with pytest.raises(ValueError, match="safetensors"):
        musecore.load(folder, device="cpu")
