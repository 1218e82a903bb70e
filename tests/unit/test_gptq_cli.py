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
