"""Quantization error measures, one definition for converter reports, tests and the accuracy matrix.

Every conversion prints its per-tensor error (DESIGN.md), and tests compare against a reference
with a stated tolerance (STYLE.md rule 7). Both use these numbers, so a report and a failing test
speak the same units: SQNR in dB (torchao's habit), NMSE (ggml's), RMSE and the worst element.

Example::

    err = quant_error(w, musecore_quant.dequantize(qt))
    print(err)              # SQNR 21.43 dB  NMSE 7.2e-03  RMSE 1.9e-02  max|err| 9.8e-02
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Optional

import torch


@dataclass(frozen=True)
class QuantError:
    """How far an approximation is from its reference, over all elements.

    ``sqnr_db = 10*log10(sum(ref^2) / sum(err^2))`` (inf when exact), ``nmse = sum(err^2) / sum(ref^2)``,
    ``rmse = sqrt(mean(err^2))``, ``max_abs_error = max |err|``.
    """

    sqnr_db: float
    max_abs_error: float
    rmse: float
    nmse: float

    def as_dict(self) -> dict[str, float]:
        return asdict(self)

    def __str__(self) -> str:
        return (f"SQNR {self.sqnr_db:.2f} dB  NMSE {self.nmse:.3g}  RMSE {self.rmse:.3g}  "
                f"max|err| {self.max_abs_error:.3g}")


def quant_error(reference: torch.Tensor, approx: torch.Tensor) -> QuantError:
    """QuantError of ``approx`` against ``reference`` (same shape, any float dtypes; sums in float64).

    Non-finite values never crash it: an infinite error (an Inf in ``approx``) is ``sqnr_db = -inf``, and a
    non-finite ``reference`` (no signal to compare against) makes every measure NaN."""
    if tuple(reference.shape) != tuple(approx.shape):
        raise ValueError(f"quant_error needs tensors of one shape; got reference {list(reference.shape)} "
                         f"and approx {list(approx.shape)}")
    if reference.numel() == 0:
        raise ValueError("quant_error of empty tensors is undefined")
    ref = reference.detach().to(torch.float64)
    err = approx.detach().to(device=ref.device, dtype=torch.float64) - ref
    signal = float((ref * ref).sum())
    noise = float((err * err).sum())
    if not math.isfinite(signal):
        return QuantError(sqnr_db=math.nan, max_abs_error=math.nan, rmse=math.nan, nmse=math.nan)
    if noise == 0.0:
        sqnr_db, nmse = math.inf, 0.0
    elif signal == 0.0 or math.isinf(noise):
        sqnr_db, nmse = -math.inf, math.inf
    elif math.isnan(noise):
        sqnr_db, nmse = math.nan, math.nan
    else:  # a difference of logs: signal / noise can underflow to 0 where both are finite and positive
        sqnr_db, nmse = 10.0 * (math.log10(signal) - math.log10(noise)), noise / signal
    return QuantError(sqnr_db=sqnr_db, max_abs_error=float(err.abs().max()),
                      rmse=math.sqrt(noise / ref.numel()), nmse=nmse)


# A matrix whose quantization turns more than this fraction of its nonzero values into zeros is refused.
# SQNR alone cannot see it: it weighs each value by its square, so when one huge value (3e38, or 1e6
# among weights of 0.02) sets the scale, every other value underflows to zero and the SQNR still reads
# hundreds of dB, because the one value that survived carries all the energy. Such a tensor's range
# cannot be represented by the format: its other values are erased, not quantized (the same happens to
# a matrix of values all below a format's smallest scale, e.g. INT4's 1e-5 floor). Round to nearest
# zeroes only the values below half the smallest nonzero level (|x| < amax/24 in an NVFP4 block,
# amax/16 to amax/32 in an MXFP4 block, half an INT4 step): at most 16% of any muse-tiny weight's
# values in every format. A majority means the scales no longer fit the values they cover.
MAX_FLUSHED_FRACTION = 0.5


def conversion_problem(reference: torch.Tensor, approx: torch.Tensor, converted: Any = None) -> Optional[str]:
    """Why a converted weight must not be kept, or None: ``approx`` (its dequantized values, same shape as
    the source values ``reference``) or ``converted``'s scales (a ``QTensor``; floating scales only) hold
    NaN/Inf (a scale overflowed its format), or a matrix ``[out, in]`` of it lost more than
    :data:`MAX_FLUSHED_FRACTION` of its nonzero values to zero (its range cannot be represented).

    Example::

        problem = conversion_problem(w, dequantize(qt), qt)
        if problem:
            raise ValueError(f"{name}: {problem}")
    """
    for role in ("scale", "global_scale", "input_scale"):
        t = getattr(converted, role, None)
        if t is not None and t.dtype.is_floating_point and t.numel():
            bad = int((~torch.isfinite(t.float())).sum())
            if bad:
                return (f"{bad} of its {t.numel()} {role.replace('_', ' ')}s are NaN or Inf (the scale overflows "
                        "its format)")
    if approx.numel() == 0:
        return None
    low, high = approx.aminmax()  # NaN propagates and an Inf shows, without a full-size temporary
    if not bool(torch.isfinite(low) & torch.isfinite(high)):
        bad = int((~torch.isfinite(approx)).sum())
        return (f"{bad} of its {approx.numel()} values dequantize to NaN or Inf (a value beyond the format's "
                "range: the scale overflows)")
    cols = reference.shape[-1] * (reference.shape[-2] if reference.dim() >= 2 else 1)
    ref, out = reference.reshape(-1, cols), approx.reshape(-1, cols)  # one row per matrix (expert)
    counts, flushed = [], []
    for start in range(0, ref.shape[0], 16):  # 16 matrices at a time: bounded temporaries, few syncs
        nonzero = ref[start:start + 16] != 0
        counts.append(nonzero.sum(1))
        flushed.append((nonzero & (out[start:start + 16].to(ref.device) == 0)).sum(1))
    counts, flushed = torch.cat(counts), torch.cat(flushed)
    bad = (flushed > MAX_FLUSHED_FRACTION * counts) & (counts > 0)
    if not bool(bad.any()):
        return None
    i = int(bad.nonzero()[0])
    where = f"its matrix {i}" if reference.dim() > 2 else "it"
    return (f"{int(flushed[i])} of the {int(counts[i])} nonzero values of {where} become 0 (amax "
            f"{float(ref[i].abs().max()):.3g}): the format's scales cannot represent this range of values")
