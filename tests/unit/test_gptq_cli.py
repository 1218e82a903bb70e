"""``musecore-quant convert --method gptq``: the GPTQ calibrator musecore registers under the
``musecore_quant.calibrators`` entry point, end to end on muse-tiny, and its bad-input error."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

MUSE_TINY = Path(__file__).resolve().parents[2] / "musecore" / "data" / "muse-tiny"
SLICE = Path(__file__).resolve().parents[2] / "musecore" / "data" / "eval" / "stdlib_heldout_slice.jsonl"


def _convert(src: Path, dst: Path, calibration: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "musecore_quant.cli", "convert", str(src), str(dst), "--to", "int4",
                           "--method", "gptq", "--calibration", str(calibration), "--no-progress"],
                          capture_output=True, text=True, timeout=600, env={**__import__("os").environ,
                                                                             "OMP_NUM_THREADS": "1"})


def test_gptq_is_a_registered_calibrator():
    assert "gptq" in [ep.name for ep in entry_points(group="musecore_quant.calibrators")]


def test_cli_gptq_writes_an_int4_checkpoint_musecore_loads(tmp_path):
    import musecore
    text = "".join(json.loads(line)["text"] for line in SLICE.read_text().splitlines())[:6000]
    (tmp_path / "calib.txt").write_text(text)
    out = tmp_path / "tiny-gptq"
    run = _convert(MUSE_TINY, out, tmp_path / "calib.txt")
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads((out / "gptq_report.json").read_text())
    assert report["calibration_tokens"] >= 512 and report["experts"], report
    model = musecore.load(out, device="cpu", progress=False)
    assert len(model.generate("def f(x):\n    return ", max_new_tokens=4, temperature=0.0)) > 0


def test_cli_gptq_too_little_calibration_is_one_line(tmp_path):
    (tmp_path / "calib.txt").write_text("def add(a, b):\n    return a + b\n")
    run = _convert(MUSE_TINY, tmp_path / "out", tmp_path / "calib.txt")
    assert run.returncode != 0
    lines = [line for line in run.stderr.strip().splitlines() if line]
    assert len(lines) == 1 and "--method gptq" in lines[0] and "calibration has" in lines[0], run.stderr
    assert "internal error" not in run.stderr and "Traceback" not in run.stderr, run.stderr
    assert not (tmp_path / "out" / "model.safetensors.index.json").exists()


def test_the_gptq_calibrator_offers_mxfp4_fitted_to_mxfp4_activations(monkeypatch, tmp_path):
    from musecore import calibrate_gptq

    assert tuple(calibrate_gptq.cli_calibrator.formats) == ("int4", "mxfp4")
    seen = {}
    monkeypatch.setattr(calibrate_gptq, "convert_gptq", lambda folder, dst, ids, **kw: (seen.update(kw), None))
    (tmp_path / "calib.txt").write_text("x = 1\n" * 200)
    calibrate_gptq.cli_calibrator(MUSE_TINY, tmp_path / "out", calibration=tmp_path / "calib.txt", fmt="mxfp4")
    assert seen["fmt"] == "mxfp4" and seen["act_format"] == "mxfp4", seen
    calibrate_gptq.cli_calibrator(MUSE_TINY, tmp_path / "out", calibration=tmp_path / "calib.txt")
    assert seen["fmt"] == "int4" and seen["act_format"] is None, seen


@pytest.mark.parametrize("declares, to, passed", [(("int4", "mxfp4"), "mxfp4", {"fmt": "mxfp4"}),
                                                  (None, "int4", {}), (None, "mxfp4", "produces INT4; use --to int4")])
def test_musecore_quant_passes_to_only_to_calibrators_that_declare_formats(monkeypatch, capsys, tmp_path, declares,
                                                                             to, passed):
    import importlib.metadata

    from musecore_quant.cli import main

    calls = []

    def calibrator(src, dst, **kwargs):
        calls.append({k: v for k, v in kwargs.items() if k not in ("calibration", "progress", "resume")})
        raise ValueError("stop here")

    if declares:
        calibrator.formats = declares
    entry = type("EP", (), {"name": "gptq", "load": lambda self: calibrator})()  # a third-party calibrator's place
    real = importlib.metadata.entry_points
    monkeypatch.setattr(importlib.metadata, "entry_points",
                        lambda **kw: [entry] if kw.get("group") == "musecore_quant.calibrators" else real(**kw))
    (tmp_path / "calib.txt").write_text("x")
    code = main(["convert", str(MUSE_TINY), str(tmp_path / "out"), "--to", to, "--method", "gptq",
                 "--calibration", str(tmp_path / "calib.txt")])
    err = capsys.readouterr().err
    assert code == 2
    if isinstance(passed, str):
        assert passed in err and not calls, err
    else:
        assert calls == [passed] and "--method gptq: stop here" in err, (calls, err)
