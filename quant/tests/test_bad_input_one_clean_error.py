"""Every bad input raised by quant code is one CheckpointError naming the file, and one CLI line with exit 2
(issue 29, item 4): headers the safetensors library would reject, deep JSON, wrong JSON types in
quantization configs and the index, symlink loops, long names, a full disk."""

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError, safe_open

import musecore_quant.checkpoint.safetensors_io as safetensors_io
from musecore_quant import quantize
from musecore_quant.checkpoint import CheckpointError, open_checkpoint, verify_checkpoint
from musecore_quant.checkpoint.errors import CheckpointIOError
from musecore_quant.checkpoint.safetensors_io import read_header
from musecore_quant.cli import main
from musecore_quant.convert import convert
from test_checkpoint_helpers import (MUSE_EXPERT_RULE, bf16_checkpoint, muse_config,  # noqa: F401
                                     write_hf_checkpoint, write_raw_safetensors)

F32 = {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}


def _raw(tmp_path, header_bytes: bytes, data: bytes = b"\0" * 4) -> Path:
    path = tmp_path / "x.safetensors"
    path.write_bytes(len(header_bytes).to_bytes(8, "little") + header_bytes + data)
    return path


@pytest.mark.parametrize("header, fragment", [
    (b'{"__metadata__": {"a": 1}, "t": ' + json.dumps(F32).encode() + b"}", "__metadata__"),
    (b'{"t": {"dtype": "F32", "shape": [NaN], "data_offsets": [0, 4]}}', "NaN is not a JSON number"),
    (b'{"\\ud800": ' + json.dumps(F32).encode() + b"}", "surrogate"),
    (b'{"t": ' + json.dumps(F32).encode() + b', "t": ' + json.dumps(F32).encode() + b"}", "duplicate key"),
    (b'{"t": {"dtype": "F32", "shape": [9223372036854775808, 4, 0], "data_offsets": [0, 0]}}', "64-bit"),
    (b'{"t": {"dtype": ["BF16"], "shape": [1], "data_offsets": [0, 4]}}', "dtype ['BF16'] is not supported"),
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    (b'{"t": ' * 50_000 + b"1" + b"}" * 50_000, "nested too deeply"),
])
def test_headers_the_safetensors_library_rejects_are_checkpoint_errors(tmp_path, header, fragment):
    path = _raw(tmp_path, header, b"" if b"[0, 0]" in header else b"\0" * 4)
    with pytest.raises(CheckpointError, match=None) as info:
        read_header(path)
    assert fragment in str(info.value) and str(path) in str(info.value), str(info.value)[:300]


def test_a_header_read_header_accepts_is_one_safetensors_reads(tmp_path):
    """The property the fuzz suite checks at scale, on the corner cases above done right."""
    path = _raw(tmp_path, b'{"__metadata__": {"a": "b"}, "t": {"dtype": "F32", "shape": [1, 0, 3], '
                          b'"data_offsets": [0, 0]}, "u": ' + json.dumps(F32).encode() + b"}")
    assert set(read_header(path)) == {"t", "u"}
    with safe_open(str(path), framework="pt") as f:
        assert f.get_tensor("u").shape == (1,)


def _ckpt(tmp_path, n=2):
    tensors = {f"t{i}.weight": torch.full((8, 8), float(i), dtype=torch.bfloat16) for i in range(n)}
    return write_hf_checkpoint(tmp_path / "ckpt", tensors, muse_config(), shards=n)


def _set_index(folder, index):
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def test_deeply_nested_config_and_index(tmp_path):
    folder = _ckpt(tmp_path)
    (folder / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(CheckpointError, match="config.json is JSON nested too deeply"):
        open_checkpoint(folder)
    folder = _ckpt(tmp_path / "b")
    (folder / "model.safetensors.index.json").write_text('{"weight_map": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(CheckpointError, match="nested too deeply"):
        open_checkpoint(folder)


def test_symlink_loop_in_the_index(tmp_path):
    folder = _ckpt(tmp_path)
    (folder / "a.safetensors").symlink_to(folder / "b.safetensors")
    (folder / "b.safetensors").symlink_to(folder / "a.safetensors")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"]["t0.weight"] = "a.safetensors"
    _set_index(folder, index)
    with pytest.raises(CheckpointError, match="a.safetensors"):
        open_checkpoint(folder)


def test_shard_name_longer_than_the_file_system_allows(tmp_path):
    folder = _ckpt(tmp_path)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"]["t0.weight"] = "x" * 300 + ".safetensors"
    _set_index(folder, index)
    with pytest.raises(CheckpointError, match="too long"):
        open_checkpoint(folder)


def test_index_metadata_of_the_wrong_type_is_a_verify_problem_not_a_crash(tmp_path, capsys):
    folder = _ckpt(tmp_path)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["metadata"] = ["x"]
    _set_index(folder, index)
    report = verify_checkpoint(folder)
    assert not report.ok and any("metadata is a JSON list" in p for p in report.problems)
    assert main(["verify", str(folder)]) == 1 and "Traceback" not in capsys.readouterr().err


def test_fp8_weight_without_its_scale(tmp_path):
    folder = tmp_path / "ckpt"
    qt = quantize(torch.randn(128, 128), "fp8")
    write_hf_checkpoint(folder, {"model.layers.1.mlp.experts.0.up_proj.weight": qt.data.clone(),
                                 "model.layers.1.mlp.experts.1.up_proj.weight": qt.data,
                                 "model.layers.1.mlp.experts.1.up_proj.weight_scale": qt.scale},
                        {**muse_config(), "quantization_config": {"quant_method": "modelopt", "quant_algo": "FP8"}},
                        shards=1)
    with pytest.raises(CheckpointError, match=r"experts.0.up_proj.weight_scale'; the checkpoint is incomplete"):
        open_checkpoint(folder)


MOD = "model.layers.1.mlp.experts.0.up_proj"


def _nvfp4_tensors():
    qt = quantize(torch.randn(64, 64), "nvfp4")
    return {f"{MOD}.weight": qt.data, f"{MOD}.weight_scale": qt.scale, f"{MOD}.weight_scale_2": qt.global_scale}


@pytest.mark.parametrize("qc, hf_quant, fragment", [
    (None, {"producer": "modelopt", "quantization": {"quant_algo": "NVFP4"}}, "producer is str"),
    ({"quant_method": "modelopt"}, {"quantization": ["NVFP4"]}, "quantization is list"),
    ({"quant_method": "modelopt", "quant_algo": ["NVFP4"]}, None, "quant_algo ['NVFP4'] is not supported"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4", "ignore": [1, 2]}, None, "ignore is list"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4", "ignore": "lm_head"}, None, "ignore is str"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4", "ignore": ["re:("]}, None, "invalid regular expression"),
    ({"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION", "quantized_layers": {MOD: {"quant_algo": []}}},
     None, "quantized_layers"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": "16"}, None, "group_size is str"),
    ({"quant_method": "quark", "global_quant_config": []}, None, "global_quant_config is list"),
    ({"quant_method": "quark", "global_quant_config": {"weight": {"dtype": {}}}}, None, "weight.dtype is {}"),
    ({"quant_method": "quark", "global_quant_config": {"weight": {"dtype": "fp4"}}, "exclude": {"a": 1}}, None,
     "exclude is dict"),
    ({"quant_method": "auto-round", "packing_format": ["auto_gptq"]}, None, "packing_format is list"),
    ({"quant_method": "auto-round", "group_size": 12.5}, None, "group_size is float"),
    ({"quant_method": "auto-round", "extra_config": {"m": 3}}, None, "extra_config['m'] is int"),
    ({"quant_method": "compressed-tensors", "config_groups": ["g"]}, None, "config_groups is list"),
    ({"quant_method": "compressed-tensors", "format": ["x"]}, None, "format is list"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"format": {}}}}, None, "format is dict"),
])
def test_quantization_config_fields_of_the_wrong_type(tmp_path, qc, hf_quant, fragment):
    config = muse_config() if qc is None else {**muse_config(), "quantization_config": qc}
    folder = write_hf_checkpoint(tmp_path / "ckpt", _nvfp4_tensors(), config, shards=1, hf_quant_config=hf_quant)
    with pytest.raises(CheckpointError) as info:
        open_checkpoint(folder)
    assert fragment in str(info.value), str(info.value)


def _disk_full_on_first_shard(monkeypatch, exc):
    def full(*args, **kwargs):
        raise exc
    monkeypatch.setattr(safetensors_io, "save_file", full)


@pytest.mark.parametrize("exc", [
    SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left '
                    'on device" })'),
    OSError(errno.ENOSPC, "No space left on device"),
])
def test_disk_full_is_one_error_saying_so(tmp_path, bf16_checkpoint, monkeypatch, capsys, exc):
    src, _ = bf16_checkpoint
    _disk_full_on_first_shard(monkeypatch, exc)
    with pytest.raises(CheckpointIOError, match="the disk is full") as info:
        convert(src, tmp_path / "out", to="fp8", include=[MUSE_EXPERT_RULE], progress=False)
    assert info.value.errno == errno.ENOSPC
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bf16"], "nothing finished: nothing left behind"
    code = main(["convert", str(src), str(tmp_path / "out"), "--to", "fp8", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "the disk is full" in err, err


def test_cli_one_line_exit_2_and_traceback_only_with_musecore_debug(tmp_path):
    folder = _ckpt(tmp_path)
    (folder / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    env = {k: v for k, v in os.environ.items() if k != "MUSECORE_DEBUG"}
    quant_root = str(Path(safetensors_io.__file__).parents[2])
    env["PYTHONPATH"] = os.pathsep.join([quant_root, env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "musecore_quant.cli", "inspect", str(folder)]
    plain = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert plain.returncode == 2 and plain.stderr.count("\n") == 1 and "nested too deeply" in plain.stderr
    debug = subprocess.run(cmd, capture_output=True, text=True, env={**env, "MUSECORE_DEBUG": "1"}, timeout=120)
    assert debug.returncode != 0 and "Traceback" in debug.stderr


def test_cli_internal_error_is_one_line_with_exit_3(tmp_path, bf16_checkpoint, monkeypatch, capsys):
    import musecore_quant.cli as cli
    monkeypatch.setattr(cli, "verify_checkpoint", lambda *a, **k: {}["bug"])
    code = main(["verify", str(bf16_checkpoint[0])])
    err = capsys.readouterr().err
    assert code == 3 and err.count("\n") == 1 and "internal error (KeyError" in err and "MUSECORE_DEBUG=1" in err


def test_error_messages_with_lone_surrogates_print(tmp_path, capsys):
    folder = _ckpt(tmp_path)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"]["t0.weight"] = "\ud800.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))  # ensure_ascii: \ud800 escape
    assert main(["inspect", str(folder)]) == 2
    assert "surrogate" in capsys.readouterr().err
