"""The Muse rule trusts config.json's ``num_hidden_layers`` only within bounds and only when the checkpoint's
tensors agree: ``10**12`` layers made ``convert`` build a regex of a trillion alternatives (killed for
memory), and a config saying 6 layers over a 4-layer checkpoint quantized the real last layer, which must
stay BF16. Both are now one-line errors naming config.json's num_hidden_layers, and nothing is written."""

import json
import re

import pytest

from musecore_quant import muse_rule
from musecore_quant.checkpoint import CheckpointError
from musecore_quant.checkpoint.experts import MAX_LAYERS, check_layer_count
from musecore_quant.cli import main
from musecore_quant.convert import default_include
from test_checkpoint_helpers import LAYERS, PREFIX, muse_config, muse_tensors, write_hf_checkpoint



def _checkpoint(tmp_path, layers_in_config):
    config = {**muse_config(), "num_hidden_layers": layers_in_config}
    return write_hf_checkpoint(tmp_path / "src", muse_tensors(), config, shards=1)


def _refused(tmp_path, capsys, src, *extra):
    dst = tmp_path / "out"
    code = main(["convert", str(src), str(dst), "--to", "nvfp4", "--no-progress", *extra])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, (code, err)
    assert not any(p.name.startswith("out") for p in tmp_path.iterdir()), sorted(p.name for p in tmp_path.iterdir())
    return err


@pytest.mark.parametrize("layers", [10**12, 0, -3])
def test_an_absurd_num_hidden_layers_is_a_one_line_error(tmp_path, capsys, layers):
    err = _refused(tmp_path, capsys, _checkpoint(tmp_path, layers))
    assert "num_hidden_layers" in err and "config.json" in err, err
    with pytest.raises(CheckpointError, match=f"1..{MAX_LAYERS}"):
        muse_rule(10**12)


@pytest.mark.parametrize("layers", [LAYERS + 2, LAYERS - 1])
@pytest.mark.parametrize("flag", [[], ["--muse-rule"]])
def test_a_config_layer_count_that_contradicts_the_tensors_is_refused(tmp_path, capsys, layers, flag):
    err = _refused(tmp_path, capsys, _checkpoint(tmp_path, layers), *flag)
    assert f"num_hidden_layers is {layers}" in err and f"decoder layers 0..{LAYERS - 1}" in err, err
    assert "contradicts the checkpoint" in err and "config.json" in err, err


def test_the_layer_count_check_ignores_tower_layers_and_accepts_a_matching_config():
    names = [f"{PREFIX}layers.{i}.mlp.experts.0.up_proj.weight" for i in range(LAYERS)]
    names += [f"model.vision_tower.layers.{i}.mlp.fc1.weight" for i in range(40)]  # a deeper tower: not the decoder
    check_layer_count(LAYERS, names)
    include, why = default_include({**muse_config(), "num_hidden_layers": LAYERS}, names)
    assert include == muse_rule(LAYERS) and "Muse rule" in why, (include, why)
    with pytest.raises(CheckpointError, match="contradicts the checkpoint"):
        default_include({**muse_config(), "num_hidden_layers": 40}, names)


@pytest.mark.parametrize("layers", [3, 4, 10, 11, 12, 62, 100, 101, 102, 1000, 1001, MAX_LAYERS])
def test_muse_rule_selects_exactly_layers_1_to_L_minus_2(layers):
    (pattern,) = muse_rule(layers)
    rule = re.compile(pattern)
    selected = {i for i in range(MAX_LAYERS + 100)
                if rule.search(f"{PREFIX}layers.{i}.mlp.experts.gate_up_proj")}
    assert selected == set(range(1, layers - 1)), sorted(set(range(1, layers - 1)) ^ selected)[:5]
    assert not rule.search(f"{PREFIX}layers.01.mlp.experts.gate_up_proj")  # no leading zeros


def test_a_matching_config_still_converts_with_the_muse_rule(tmp_path, capsys):
    src = _checkpoint(tmp_path, LAYERS)
    code = main(["convert", str(src), str(tmp_path / "nv"), "--to", "nvfp4", "--no-progress", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    report = json.loads(out)
    assert report["summary"]["actions"]["quantize"] == (LAYERS - 2) * 2 * 3, report["summary"]
