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
    """QuantError of ``approx`` against ``reference`` (same shape, any float dtypes; sums in float64)."""
    if tuple(reference.shape) != tuple(approx.shape):
        raise ValueError(f"quant_error needs tensors of one shape; got reference {list(reference.shape)} "
                         f"and approx {list(approx.shape)}")
    if reference.numel() == 0:
        raise ValueError("quant_error of empty tensors is undefined")
    ref = reference.detach().to(torch.float64)
    err = approx.detach().to(device=ref.device, dtype=torch.float64) - ref
    signal = float((ref * ref).sum())
    noise = float((err * err).sum())
    if noise == 0.0:
        sqnr_db, nmse = math.inf, 0.0
    elif signal == 0.0:
        sqnr_db, nmse = -math.inf, math.inf
    else:
        sqnr_db, nmse = 10.0 * math.log10(signal / noise), noise / signal
    return QuantError(sqnr_db=sqnr_db, max_abs_error=float(err.abs().max()),
                      rmse=math.sqrt(noise / ref.numel()), nmse=nmse)
