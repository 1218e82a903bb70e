"""A weight whose range the target format cannot hold is refused, naming the tensor, never written with
NaN/Inf scales or a misleading SQNR. Found by QA: one 1e6 in a bf16 expert gave an Inf INT4 scale (exit 0,
"nan dB", a checkpoint ``verify`` then failed); a 3e38 crashed MXFP4's report (``math domain error``,
exit 3) and, in NVFP4 and FP8, flushed every other value of the expert to zero while the report said
745 dB. Also: ``--option group_size=true`` (a bool is an int in Python) wrote a config its reader rejects."""

import math

import pytest
import torch

from musecore_quant import dequantize, quant_error, quantize
from musecore_quant.checkpoint import CheckpointError
from musecore_quant.cli import main
from musecore_quant.convert import convert
from musecore_quant.formats.int4 import int4_quantize
from musecore_quant.metrics import MAX_FLUSHED_FRACTION, conversion_problem
from test_checkpoint_helpers import PREFIX, muse_config, muse_tensors, write_hf_checkpoint

EXPERT = PREFIX + "layers.1.mlp.experts.0.gate_proj.weight"  # selected by the Muse rule


def _with_outlier(tmp_path, value):
    tensors = muse_tensors()
    tensors[EXPERT] = tensors[EXPERT].clone()
    tensors[EXPERT][0, 0] = value
    return write_hf_checkpoint(tmp_path / "src", tensors, muse_config(), shards=1)


@pytest.mark.parametrize("to, value", [("int4", 1e6), ("int4", 3e38), ("mxfp4", 3e38), ("nvfp4", 3e38),
                                       ("fp8", 3e38), ("nvfp4", 1e6), ("fp8", 1e6)])
def test_convert_refuses_a_range_the_format_cannot_hold_naming_the_tensor(tmp_path, capsys, to, value):
    src = _with_outlier(tmp_path, value)
    code = main(["convert", str(src), str(tmp_path / "out"), "--to", to, "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code == 2, f"exit {code} (expected 2, bad input): {err}"
    assert len(err.splitlines()) == 1 and EXPERT in err and "internal error" not in err, err
    assert not any(p.name.startswith("out") for p in tmp_path.iterdir()), "a partial or finished output was left"


def test_the_int4_quantizer_refuses_a_scale_over_fp16():
    w = torch.randn(8, 128) * 0.02
    w[3, 5] = 1e6  # symmetric scale 1e6 / 8 > 65504
    for sym in (True, False):
        with pytest.raises(ValueError, match="INT4 scale overflows fp16.*row 3 group 0"):
            int4_quantize(w, sym=sym)
    w[3, 5] = 5e5  # 62500: fits fp16, so quantizes (the group's other values round to 0, the rest are intact)
    qt = int4_quantize(w)
    assert bool(torch.isfinite(qt.scale.float()).all()), qt.scale.abs().max()


def test_an_outlier_within_range_still_converts(tmp_path):
    """MXFP4's per-32 E8M0 scales hold a 1e6 outlier without touching other blocks: converted, finite SQNR."""
    report = convert(_with_outlier(tmp_path, 1e6), tmp_path / "mx", to="mxfp4", include=[r"experts\.0\.gate"],
                     progress=False)
    sqnr = {t.name: t.sqnr_db for t in report.tensors}[EXPERT]
    assert math.isfinite(sqnr) and sqnr > 10, f"SQNR {sqnr} dB (expected finite and > 10 dB)"


def test_quant_error_of_non_finite_values_does_not_crash():
    ref = torch.tensor([[3e38, 1.0]])
    err = quant_error(ref, torch.tensor([[float("inf"), 1.0]]))
    assert err.sqnr_db == -math.inf and err.nmse == math.inf, err
    # signal 1e-300, noise 1e40: their quotient underflows float64 to 0, and log10(0) raised
    err = quant_error(torch.tensor([[1e-150, 0.0]], dtype=torch.float64), torch.tensor([[1e20, 0.0]]))
    assert err.sqnr_db == pytest.approx(-3400.0), err
    assert math.isnan(quant_error(torch.tensor([[float("nan")]]), torch.tensor([[1.0]])).sqnr_db)


def test_conversion_problem_names_what_is_wrong_and_accepts_ordinary_weights():
    w = torch.randn(4, 64, 128) * 0.02
    for fmt in ("nvfp4", "mxfp4", "int4", "fp8"):
        qt = quantize(w, fmt)
        assert conversion_problem(w, dequantize(qt), qt) is None, fmt
    w[2, 0, 0] = 3e38
    qt = quantize(w, "nvfp4")
    problem = conversion_problem(w, dequantize(qt), qt)
    assert problem is not None and "its matrix 2" in problem, problem
    flushed = int(((w[2] != 0) & (dequantize(qt)[2] == 0)).sum()) / int((w[2] != 0).sum())
    assert flushed > MAX_FLUSHED_FRACTION, flushed
    qt.scale = qt.scale.float()
    qt.scale[0, 0, 0] = float("inf")
    assert "NaN or Inf" in conversion_problem(w, dequantize(qt), qt)


@pytest.mark.parametrize("group_size", [True, False, 0, -2, 1.5])
def test_a_group_size_that_is_not_a_positive_int_is_refused(tmp_path, capsys, group_size):
    with pytest.raises(ValueError, match="group_size must be a positive int"):
        int4_quantize(torch.randn(8, 128), group_size=group_size)
    src = write_hf_checkpoint(tmp_path / "src", muse_tensors(), muse_config(), shards=1)
    with pytest.raises(CheckpointError, match="group_size"):
        convert(src, tmp_path / "out", to="int4", quantize_options={"group_size": group_size}, progress=False)
    code = main(["convert", str(src), str(tmp_path / "cli"), "--to", "int4", "--no-progress",
                 "--option", f"group_size={str(group_size).lower()}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "group_size" in err, (code, err)
    assert not any(p.name.startswith(("out", "cli")) for p in tmp_path.iterdir())
