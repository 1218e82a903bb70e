"""``musecore-quant`` on a real tiny checkpoint: inspect, convert, verify, diff, exit codes, --json."""

import json
import re
import shutil
import subprocess
import sys

import pytest

from musecore_quant.cli import main
from test_checkpoint_helpers import MUSE_EXPERT_RULE, PREFIX, bf16_checkpoint  # noqa: F401

EXPERT = PREFIX + "layers.1.mlp.experts.0.gate_proj.weight"


def _run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _convert(capsys, src, dst, to="nvfp4", *extra):
    code, out, err = _run(capsys, "convert", src, dst, "--to", to, "--include", MUSE_EXPERT_RULE,
                          "--no-progress", "--json", *extra)
    assert code == 0, err
    return json.loads(out)


def test_convert_json_report_and_inspect_json(tmp_path, capsys, bf16_checkpoint):
    src, tensors = bf16_checkpoint
    report = _convert(capsys, src, tmp_path / "nv")
    assert report["to"] == "nvfp4" and report["summary"]["actions"]["quantize"] == 12
    assert report["summary"]["min_sqnr_db"] > 19.5, report["summary"]
    code, out, _ = _run(capsys, "inspect", tmp_path / "nv", "--json")
    info = json.loads(out)
    assert code == 0 and (info["format"], info["producer"]) == ("nvfp4", "modelopt")
    assert len(info["weights"]) == len(tensors) and info["weights"][EXPERT]["format"] == "nvfp4"
    assert info["weights"][EXPERT]["shape"] == list(tensors[EXPERT].shape)
    assert info["layers"][PREFIX + "layers.1"] == {"bf16": 20, "nvfp4": 6}
    assert info["layers"][PREFIX + "layers.0"] == {"bf16": 26}
    stats = info["scale_stats"]["nvfp4"]
    assert stats["weights"] == 12 and 0 < stats["block_scale"]["min"] <= stats["block_scale"]["max"] <= 448
    assert stats["global_scale"]["min"] > 0


def test_inspect_human_output_names_format_and_layers(tmp_path, capsys, bf16_checkpoint):
    src, _ = bf16_checkpoint
    _convert(capsys, src, tmp_path / "mx", "mxfp4")
    code, out, _ = _run(capsys, "inspect", tmp_path / "mx")
    assert code == 0 and "format      mxfp4" in out and "producer quark" in out
    assert "block_scale_exponent" in out and "layers.1" in out


def test_verify_passes_then_fails_on_a_flipped_byte(tmp_path, capsys, bf16_checkpoint):
    src, _ = bf16_checkpoint
    _convert(capsys, src, tmp_path / "nv")
    code, out, _ = _run(capsys, "verify", tmp_path / "nv", "--json")
    result = json.loads(out)
    assert code == 0 and result["ok"] and result["sha256_verified"] == result["shards"] == 1
    shard = next((tmp_path / "nv").glob("model-*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x01
    shard.write_bytes(bytes(data))
    code, out, _ = _run(capsys, "verify", tmp_path / "nv")
    assert code == 1 and "FAILED" in out and "sha256 differs" in out


def test_verify_rejects_a_partial_folder(tmp_path, capsys, bf16_checkpoint):
    src, _ = bf16_checkpoint
    shutil.copytree(src, tmp_path / "x.partial-0")
    code, out, _ = _run(capsys, "verify", tmp_path / "x.partial-0")
    assert code == 1 and "incomplete conversion" in out


def test_diff_reports_per_tensor_error_and_fails_on_structure(tmp_path, capsys, bf16_checkpoint):
    src, _ = bf16_checkpoint
    _convert(capsys, src, tmp_path / "nv")
    code, out, _ = _run(capsys, "diff", src, tmp_path / "nv", "--json")
    result = json.loads(out)
    assert code == 0 and result["ok"]
    by_name = {t["name"]: t for t in result["tensors"]}
    assert by_name[EXPERT]["format_b"] == "nvfp4" and 19.5 < by_name[EXPERT]["sqnr_db"] < 30, by_name[EXPERT]
    assert result["summary"]["identical"] == len(result["tensors"]) - 12
    code, out, _ = _run(capsys, "diff", src, tmp_path / "nv", "--min-sqnr", "40")
    assert code == 1 and "below --min-sqnr 40" in out
    other = tmp_path / "other"
    shutil.copytree(src, other)
    index = json.loads((other / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if k != "lm_head.weight"}
    shard = other / json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]["lm_head.weight"]
    from safetensors.torch import load_file, save_file
    kept = {k: v for k, v in load_file(str(shard)).items() if k != "lm_head.weight"}
    save_file(kept, str(shard))
    (other / "model.safetensors.index.json").write_text(json.dumps(index))
    code, out, _ = _run(capsys, "diff", src, other, "--json")
    assert code == 1 and json.loads(out)["only_in_a"] == ["lm_head.weight"]


@pytest.mark.parametrize("argv,message", [
    (["inspect", "{tmp}/nope"], "not a checkpoint folder"),
    (["verify", "{tmp}/nope"], "no such checkpoint folder"),
    # with a calibrator plugin installed (musecore registers one) the missing input is --calibration;
    # without one the error names the plugin to install
    (["convert", "{src}", "{tmp}/y", "--to", "int4", "--method", "autoround"], "--calibration|calibrator plugin"),
    (["convert", "{src}", "{tmp}/y", "--to", "nvfp4", "--method", "autoround", "--calibration", "{tmp}/c.txt"],
     "produces INT4|calibrator plugin"),
    (["convert", "{src}", "{tmp}/y", "--to", "nvfp4", "--option", "rounding"], "KEY=VALUE"),
])
def test_bad_input_is_one_line_on_stderr_with_exit_2(tmp_path, capsys, bf16_checkpoint, argv, message):
    src, _ = bf16_checkpoint
    code, out, err = _run(capsys, *(a.format(tmp=tmp_path, src=src) for a in argv))
    assert code == 2 and re.search(message, err), err
    assert err.count("\n") == 1 and "Traceback" not in err and out == ""


def test_console_script_runs_as_a_process(tmp_path, bf16_checkpoint):
    src, _ = bf16_checkpoint
    proc = subprocess.run([sys.executable, "-m", "musecore_quant.cli", "inspect", str(src), "--json", "--no-stats"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["format"] == "bf16"
    proc = subprocess.run([sys.executable, "-m", "musecore_quant.cli", "inspect", str(tmp_path / "nope")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stderr.startswith("musecore-quant: error:")
