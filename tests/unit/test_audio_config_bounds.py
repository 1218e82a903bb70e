"""``audio_config.depths`` (conv blocks per audio stage) is bounded before anything iterates over it:
a depth of 10**9 was a hang with growing memory in ``musecore plan`` and ``generate`` (``audio_shapes``
built a billion blocks' tensor names); it is a one-line error naming the field, before any loop."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from musecore.cli import main
from musecore.config import MAX_LAYERS, ConfigError, MuseConfig
from musecore.towers.audio import audio_shapes

TINY = Path(__file__).resolve().parents[2] / "musecore" / "data" / "muse-tiny"


def _tiny_config(**audio) -> dict:
    data = json.loads((TINY / "config.json").read_text())
    data["audio_config"].update(audio)
    return data


@pytest.mark.parametrize("depths, fragment", [
    ([10**9, 1, 1, 1], "positive integers"),
    ([0, 1, 1, 1], "positive integers"),
    ([1.5, 1, 1, 1], "positive integers"),
    ([True, 1, 1, 1], "positive integers"),
    (4, "positive integers"),
    ([MAX_LAYERS, MAX_LAYERS, 1, 1], f"over musecore's limit of {MAX_LAYERS}"),
])
def test_absurd_audio_depths_are_a_config_error_naming_the_field(depths, fragment):
    with pytest.raises(ConfigError) as info:
        MuseConfig.from_dict(_tiny_config(depths=depths), source="x/config.json")
    message = str(info.value)
    assert "audio_config.depths" in message and fragment in message and "\n" not in message, message


def test_an_infinite_mlp_ratio_is_a_config_error_not_an_overflow():
    with pytest.raises(ConfigError, match="audio_config.mlp_ratio"):
        MuseConfig.from_dict(_tiny_config(mlp_ratio=float("inf")))


def test_audio_shapes_checks_depths_before_iterating():
    config = MuseConfig.from_pretrained(TINY)
    assert len(audio_shapes(config)) > 0
    config.audio_config["depths"] = [10**9, 1, 1, 1]  # changed after validation: still refused, never looped
    with pytest.raises(ConfigError, match="audio_config.depths"):
        audio_shapes(config)


def test_plan_with_huge_audio_depths_is_one_line_exit_2(tmp_path, capsys):
    bad = tmp_path / "k_audio"
    shutil.copytree(TINY, bad)
    (bad / "config.json").write_text(json.dumps(_tiny_config(depths=[10**9, 1, 1, 1])))
    code = main(["plan", "--model", str(bad), "--device", "h200"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "audio_config.depths" in err, (code, err)


def test_the_bundled_audio_config_still_loads():
    config = MuseConfig.from_pretrained(TINY)
    assert config.audio_config["depths"] == [1, 1, 1, 1]


@pytest.mark.parametrize("cap", [1e-300, 0.5])
def test_a_softcap_below_one_is_a_config_error(cap):
    """A cap below 1 squeezes every logit into (-cap, cap): near-uniform sampling, silently (the QA pass generated
    "<|start|>" four times at 1e-300)."""
    data = json.loads((TINY / "config.json").read_text())
    (data.get("text_config") or data)["final_logit_softcapping"] = cap
    with pytest.raises(ConfigError, match="final_logit_softcapping"):
        MuseConfig.from_dict(data)
