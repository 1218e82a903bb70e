"""``musecore-quant`` option values that were silently ignored or misread, and a codec refusal that came out
as an internal error: each is now one line on stderr with exit 2, naming the option (or file and tensor),
before any work. ``--max-shard-bytes 0`` was ignored (while -5 was an error), ``--top -1`` listed all
tensors but one, ``diff --min-sqnr nan`` could never fail, and an act-order GPTQ ``g_idx`` was
``internal error (ValueError: ...)``, exit 3, without the file."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from musecore_quant import muse_rule
from musecore_quant.checkpoint import CheckpointError, open_checkpoint
from musecore_quant.cli import main
from musecore_quant.convert import convert
from test_checkpoint_helpers import LAYERS, PREFIX, muse_config, muse_tensors, write_hf_checkpoint


@pytest.fixture
def src(tmp_path):
    return write_hf_checkpoint(tmp_path / "src", muse_tensors(), muse_config(), shards=1)


def _one_line_exit_2(capsys, argv, *fragments):
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, (code, err)
    for fragment in fragments:
        assert fragment in err, err
    return err


@pytest.mark.parametrize("value", ["0", "-5"])
def test_max_shard_bytes_must_be_positive(tmp_path, capsys, src, value):
    _one_line_exit_2(capsys, ["convert", str(src), str(tmp_path / "out"), "--to", "nvfp4", "--no-progress",
                              "--max-shard-bytes", value], "--max-shard-bytes", value)
    assert not (tmp_path / "out").exists()


def test_convert_top_must_not_be_negative(tmp_path, capsys, src):
    _one_line_exit_2(capsys, ["convert", str(src), str(tmp_path / "out"), "--to", "nvfp4", "--no-progress",
                              "--top", "-1"], "--top")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv, fragment", [(["--top", "-1"], "--top"), (["--min-sqnr", "nan"], "--min-sqnr"),
                                            (["--min-sqnr", "inf"], "--min-sqnr"), (["--min-sqnr=-inf"], "--min-sqnr")])
def test_diff_refuses_negative_top_and_non_finite_min_sqnr(capsys, src, argv, fragment):
    _one_line_exit_2(capsys, ["diff", str(src), str(src), *argv], fragment)


def test_diff_with_a_finite_min_sqnr_still_works(capsys, src):
    assert main(["diff", str(src), str(src), "--min-sqnr", "30", "--top", "0"]) == 0, capsys.readouterr().err


def test_an_act_order_g_idx_names_the_file_and_tensor(tmp_path, capsys, src):
    convert(src, tmp_path / "int4", to="int4", include=muse_rule(LAYERS), progress=False)
    shard = next((tmp_path / "int4").glob("model-*.safetensors"))
    tensors = load_file(shard)
    module = PREFIX + "layers.1.mlp.experts.0.down_proj"  # in_features 256: two groups of 128
    tensors[module + ".g_idx"] = torch.flip(tensors[module + ".g_idx"], [0]).contiguous()
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as info, open_checkpoint(tmp_path / "int4") as reader:
        reader.read(module + ".weight")
    assert shard.name in str(info.value) and module in str(info.value) and "act-order" in str(info.value)
    _one_line_exit_2(capsys, ["convert", str(tmp_path / "int4"), str(tmp_path / "bf16"), "--to", "bf16",
                              "--no-progress"], "act-order", shard.name, module)
