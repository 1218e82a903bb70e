"""``musecore-quant convert``'s default selection (the Muse rule for a Muse checkpoint), the flags that
override it, an ``--include`` that matches nothing, and progress on stderr for convert and verify."""

import io
import json
import re

from musecore_quant import muse_rule
from musecore_quant.cli import main
from musecore_quant.progress import progress
from test_checkpoint_helpers import (LAYERS, PREFIX, bf16_checkpoint, muse_config, muse_tensors,  # noqa: F401
                                     write_hf_checkpoint)

FIRST = PREFIX + "layers.0.mlp.experts.0.gate_proj.weight"       # a BF16-expert layer under the Muse rule
MIDDLE = PREFIX + f"layers.{LAYERS - 2}.mlp.experts.1.down_proj.weight"
LAST = PREFIX + f"layers.{LAYERS - 1}.mlp.experts.0.up_proj.weight"


def _convert(capsys, src, dst, *extra):
    code = main(["convert", str(src), str(dst), "--to", "nvfp4", "--no-progress", "--json", *map(str, extra)])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if code == 0 else None), err


def _formats(report):
    return {t["name"]: t["target_format"] for t in report["tensors"]}


def test_a_muse_checkpoint_gets_the_muse_rule_by_default(tmp_path, capsys, bf16_checkpoint):
    src, _ = bf16_checkpoint
    code, report, err = _convert(capsys, src, tmp_path / "nv")
    assert code == 0, err
    formats = _formats(report)
    assert report["include"] == muse_rule(LAYERS), report["include"]
    assert (formats[FIRST], formats[MIDDLE], formats[LAST]) == ("bf16", "nvfp4", "bf16"), formats
    assert "Muse rule" in report["selection"], report["selection"]
    # layers 1..L-2 of 2 experts x 3 projections
    assert report["summary"]["actions"]["quantize"] == (LAYERS - 2) * 2 * 3, report["summary"]


def test_all_experts_and_include_override_the_default(tmp_path, capsys, bf16_checkpoint):
    src, _ = bf16_checkpoint
    code, report, err = _convert(capsys, src, tmp_path / "all", "--all-experts")
    assert code == 0, err
    assert _formats(report)[FIRST] == _formats(report)[LAST] == "nvfp4"
    code, report, err = _convert(capsys, src, tmp_path / "one", "--include", r"layers\.0\.mlp\.experts\.0\.")
    assert code == 0, err
    assert report["summary"]["actions"]["quantize"] == 3 and _formats(report)[FIRST] == "nvfp4", report["summary"]
    assert report["selection"] == "--include"


def test_another_models_checkpoint_defaults_to_every_routed_expert(tmp_path, capsys):
    config = {**muse_config(), "model_type": "mixtral"}
    src = write_hf_checkpoint(tmp_path / "other", muse_tensors(), config)
    code, report, err = _convert(capsys, src, tmp_path / "nv")
    assert code == 0, err
    assert _formats(report)[FIRST] == "nvfp4" and "every routed expert" in report["selection"]


def test_an_include_that_matches_nothing_is_one_line_exit_2_and_writes_nothing(tmp_path, capsys, bf16_checkpoint):
    src, _ = bf16_checkpoint
    dst = tmp_path / "nv"
    code, _, err = _convert(capsys, src, dst, "--include", r"experts\.0\.gate_proj\.weight$", "--include", "no_such")
    assert code == 2, err
    assert err.count("\n") == 1 and "no weight matches include 'no_such'" in err, err
    assert not any(tmp_path.glob("nv*")), sorted(p.name for p in tmp_path.iterdir())


def test_two_selection_flags_are_refused(tmp_path, capsys, bf16_checkpoint):
    src, _ = bf16_checkpoint
    code, _, err = _convert(capsys, src, tmp_path / "nv", "--muse-rule", "--all-experts")
    assert code == 2 and "--muse-rule and --all-experts" in err and err.count("\n") == 1, err


def test_convert_and_verify_write_one_line_each_to_a_log(tmp_path, capsys, bf16_checkpoint):
    """stderr is not a terminal under pytest: no bar, no carriage return, one line per stage."""
    src, _ = bf16_checkpoint
    assert main(["convert", str(src), str(tmp_path / "nv"), "--to", "nvfp4"]) == 0
    _, err = capsys.readouterr()
    assert "\r" not in err and re.fullmatch(r"convert -> nvfp4: [\d.]+ [kM]?B in [\d.]+ s.*\n", err), repr(err)
    assert main(["verify", str(tmp_path / "nv")]) == 0
    _, err = capsys.readouterr()
    assert "\r" not in err and re.fullmatch(r"verify: \d+ weight in [\d.]+ s\n", err), repr(err)
    assert main(["verify", str(tmp_path / "nv"), "--no-progress"]) == 0
    assert capsys.readouterr().err == ""


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_draws_a_bar_only_on_a_terminal_and_says_when_a_stage_stopped():
    tty, log = _Terminal(), io.StringIO()
    with progress("verify", total=4, unit="weight", stream=tty) as bar:
        bar.update(4)
    assert "\r" in tty.getvalue() and "4/4" in tty.getvalue(), repr(tty.getvalue())
    try:
        with progress("verify", total=4, unit="weight", stream=log) as bar:
            bar.update(1)
            raise KeyboardInterrupt
    except KeyboardInterrupt:
        pass
    assert re.fullmatch(r"verify: stopped after 1/4 weight in [\d.]+ s\n", log.getvalue()), repr(log.getvalue())
    quiet = io.StringIO()
    with progress("verify", total=4, stream=quiet, enabled=False) as bar:
        bar.update(4)
    assert quiet.getvalue() == ""
