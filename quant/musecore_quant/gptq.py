"""GPTQ: 4-bit weights rounded column by column with Hessian-based error feedback.

Round to nearest (RTN) minimises each weight's own error. What a Linear's output loses is
``||(W - Q) X||^2`` over its inputs ``X``, a quadratic form in the weight error with the input
Hessian ``H = X^T X``. GPTQ (Frantar et al., 2022, "GPTQ: Accurate Post-Training Quantization for
Generative Pre-trained Transformers", building on Optimal Brain Quantization) rounds one input
column at a time and moves that column's rounding error onto the columns not rounded yet, weighted
by the inverse Hessian, so correlated inputs absorb each other's error:

- ``H`` is damped (``+ damp * mean(diag H) * I``); an input that never fires (``H_ii = 0``) gets
  ``H_ii = 1`` and its weight column is irrelevant to the output.
- The inverse is used through its upper Cholesky factor ``U`` (``H^-1 = U^T U``): rounding column
  ``i`` with error ``e = (w_i - q_i) / U_ii`` updates the later columns by ``- e * U_i,j``.
- Columns go in blocks of ``block_size`` (a lazy batch update: within a block the updates are
  rank-1, the rest of the matrix is updated once per block); the result is the same as one column
  at a time.
- ``act_order=True`` rounds the columns with the largest ``H_ii`` first; the groups then keep their
  place in the layout (their scales are chosen on the original weights, "static groups"), so the
  checkpoint is laid out like any other.

The grid is the target format's, and so are the bytes: a group's scale is what that format's own
quantizer picks for the group (INT4: AutoRound's full-range symmetric RTN scale, or the least-error
shrink with ``scale_mode="mse"``; MXFP4: the E8M0 exponent of Quark's EVEN rule, or the least-error
search), chosen when the group's first column is reached, on the weights as updated so far. Only
the rounding of each value differs from RTN, so every reader decodes the result unchanged.

Example::

    x = calibration_inputs                     # [n, in]: what the Linear receives
    qt, stats = gptq_quantize(w, input_hessian(x), "int4", group_size=128)
    stats.output_error, stats.rtn_output_error   # tr((W-Q) H (W-Q)^T), GPTQ and RTN
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .formats.fp4 import fp4_encode, pack_nibbles
from .formats.int4 import (DEFAULT_GROUP_SIZE, INT4_MAX_CODE, INT4_SYMMETRIC_ZERO, int4_quantize,
                           int4_quantize_min_error)
from .formats.mxfp4 import MXFP4_BLOCK_SIZE, e8m0_to_float, fp4_round, mxfp4_quantize
from .qtensor import QTensor

GPTQ_FORMATS = ("int4", "mxfp4")
SCALE_MODES = ("producer", "mse")
DEFAULT_DAMP = 0.01        # the paper's 1% of the mean diagonal
DEFAULT_BLOCK_SIZE = 128   # the paper's lazy-batch width


@dataclass(frozen=True)
class GPTQStats:
    """What GPTQ did to one weight: the output-error proxy ``tr((W-Q) H (W-Q)^T) / tr(W H W^T)``
    (relative, on the damped-free Hessian it was given) for GPTQ and for RTN with the same scale rule."""

    output_error: float
    rtn_output_error: float
    columns: int
    dead_columns: int       # inputs that never fired (H_ii = 0)

    @property
    def reduction(self) -> float:
        """1 - GPTQ / RTN output error (0.3 = 30% less output error than RTN)."""
        return 1.0 - self.output_error / self.rtn_output_error if self.rtn_output_error > 0 else 0.0


def input_hessian(x: torch.Tensor) -> torch.Tensor:
    """``X^T X / n`` (float64 ``[in, in]``) of input rows ``x`` ``[n, in]`` (or ``[..., in]``)."""
    if not isinstance(x, torch.Tensor) or x.dim() < 2 or x.numel() == 0:
        raise ValueError(f"GPTQ inputs must be a non-empty tensor [n, in]; got "
                         f"{list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    rows = x.reshape(-1, x.shape[-1]).double()
    if not torch.isfinite(rows).all():
        raise ValueError("GPTQ inputs hold NaN or Inf; calibrate on finite activations")
    return rows.T @ rows / rows.shape[0]


def _check(weight: torch.Tensor, hessian: torch.Tensor, fmt: str, group_size: int, damp: float,
           block_size: int, scale_mode: str) -> None:
    if fmt not in GPTQ_FORMATS:
        raise ValueError(f"GPTQ writes {GPTQ_FORMATS}; got {fmt!r} (NVFP4/FP8: quantize with musecore_quant.quantize)")
    if scale_mode not in SCALE_MODES:
        raise ValueError(f"scale_mode must be one of {SCALE_MODES}; got {scale_mode!r}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not weight.dtype.is_floating_point:
        raise ValueError("GPTQ quantizes one floating-point weight [out, in]; got "
                         f"{list(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__}"
                         " (quantize stacked experts one expert at a time, each with its own Hessian)")
    out_features, in_features = weight.shape
    if not torch.isfinite(weight).all():
        raise ValueError("GPTQ weight holds NaN or Inf")
    if not isinstance(hessian, torch.Tensor) or tuple(hessian.shape) != (in_features, in_features):
        raise ValueError(f"GPTQ Hessian must be [in, in] = [{in_features}, {in_features}] for a weight "
                         f"{list(weight.shape)}; got {list(hessian.shape) if isinstance(hessian, torch.Tensor) else hessian!r}")
    if not torch.isfinite(hessian).all():
        raise ValueError("GPTQ Hessian holds NaN or Inf")
    g = MXFP4_BLOCK_SIZE if fmt == "mxfp4" else group_size
    if fmt == "mxfp4" and group_size not in (MXFP4_BLOCK_SIZE, DEFAULT_GROUP_SIZE):
        raise ValueError(f"MXFP4 blocks are {MXFP4_BLOCK_SIZE} inputs; group_size does not apply (got {group_size})")
    if g <= 0 or in_features % g or in_features % 2:
        raise ValueError(f"GPTQ {fmt}: in_features {in_features} must be divisible by the group size {g}")
    if not damp > 0:
        raise ValueError(f"damp must be > 0 (a fraction of the Hessian's mean diagonal, e.g. 0.01); got {damp}")
    if block_size <= 0 or block_size % g:
        raise ValueError(f"block_size must be a positive multiple of the group size {g}; got {block_size}")


class _Grid:
    """One format's group scales and rounding, for GPTQ's column loop."""

    def __init__(self, fmt: str, group_size: int, scale_mode: str) -> None:
        self.fmt, self.scale_mode = fmt, scale_mode
        self.g = MXFP4_BLOCK_SIZE if fmt == "mxfp4" else group_size

    def scales(self, w: torch.Tensor) -> torch.Tensor:
        """The stored scale per row of the group ``w`` ``[out, g]`` (fp16 for INT4, E8M0 bytes for MXFP4),
        as the format's own quantizer chooses it."""
        if self.fmt == "int4":
            qt = (int4_quantize_min_error(w, group_size=self.g)[0] if self.scale_mode == "mse"
                  else int4_quantize(w, group_size=self.g, sym=True))
        else:
            qt = mxfp4_quantize(w, scale_mode="mse" if self.scale_mode == "mse" else "even")
        return qt.scale[:, 0]

    def values(self, w: torch.Tensor, stored: torch.Tensor) -> torch.Tensor:
        """Column ``w`` ``[out]`` (or columns ``[out, k]`` with scales ``[out, 1]``) rounded to the grid of
        the stored scales (fp64 values)."""
        if self.fmt == "int4":
            s = stored.double()
            return (w / s).round().clamp(-INT4_SYMMETRIC_ZERO, INT4_MAX_CODE - INT4_SYMMETRIC_ZERO) * s
        s = e8m0_to_float(stored).double()
        return fp4_round((w / s).float()).double() * s

    def pack(self, values: torch.Tensor, stored: torch.Tensor, shape: tuple[int, int]) -> QTensor:
        """The QTensor whose decoding is exactly ``values`` ``[out, in]`` (already on the grid of ``stored``)."""
        groups = values.unflatten(-1, (-1, self.g))
        if self.fmt == "int4":
            codes = (groups / stored.double().unsqueeze(-1)).round() + INT4_SYMMETRIC_ZERO
            data = pack_nibbles(codes.clamp(0, INT4_MAX_CODE).to(torch.uint8).flatten(-2))
            return QTensor(format="int4", data=data, scale=stored.to(torch.float16), shape=shape, group_size=self.g,
                           zero=None)
        scaled = (groups / e8m0_to_float(stored).double().unsqueeze(-1)).float()
        # the sign bit as the producer writes it: a negative value that rounds to zero is -0 (code 8)
        codes = fp4_encode(scaled.abs()) | (torch.signbit(scaled).to(torch.uint8) << 3)
        data = pack_nibbles(codes.flatten(-2))
        return QTensor(format="mxfp4", data=data, scale=stored, shape=shape, group_size=MXFP4_BLOCK_SIZE)


def _proxy(err: torch.Tensor, h: torch.Tensor) -> float:
    return float(((err @ h) * err).sum())


def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor, fmt: str = "int4", *,
                  group_size: int = DEFAULT_GROUP_SIZE, act_order: bool = False, damp: float = DEFAULT_DAMP,
                  block_size: int = DEFAULT_BLOCK_SIZE, scale_mode: str = "producer") -> tuple[QTensor, GPTQStats]:
    """GPTQ of ``weight`` ``[out, in]`` against the input Hessian ``hessian`` ``[in, in]``
    (:func:`input_hessian` of the Linear's calibration inputs) into ``fmt`` (``"int4"``: symmetric,
    ``group_size`` inputs per fp16 scale; ``"mxfp4"``: 32-input E8M0 blocks).

    ``scale_mode``: ``"producer"`` (each group's scale by the format's producer rule: AutoRound RTN,
    Quark EVEN) or ``"mse"`` (the least-error scale search), on the weights as updated when the group
    is reached (on the original weights with ``act_order``). Returns the QTensor (the format's
    canonical layout) and :class:`GPTQStats` (output-error proxy against RTN with the same rule).

    Example::

        qt, stats = gptq_quantize(w, input_hessian(x), "int4", act_order=True)
        assert stats.output_error <= stats.rtn_output_error
    """
    _check(weight, hessian, fmt, group_size, damp, block_size, scale_mode)
    grid = _Grid(fmt, group_size, scale_mode)
    out_features, in_features = weight.shape
    w0 = weight.detach().double().cpu().clone()
    h = hessian.detach().double().cpu().clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    w0[:, dead] = 0.0
    h_damped = h + damp * torch.diag(h).mean() * torch.eye(in_features, dtype=torch.float64)

    perm = torch.argsort(torch.diag(h), descending=True, stable=True) if act_order else torch.arange(in_features)
    stored = torch.empty(out_features, in_features // grid.g, dtype=grid.scales(w0[:, :grid.g]).dtype)
    if act_order:  # static groups: scales from the original weights, so the layout keeps its groups
        for k in range(in_features // grid.g):
            stored[:, k] = grid.scales(w0[:, k * grid.g:(k + 1) * grid.g].float())
    try:
        chol = torch.linalg.cholesky(h_damped[perm][:, perm])
        u = torch.linalg.cholesky(torch.cholesky_inverse(chol), upper=True)   # H^-1 = U^T U
    except torch.linalg.LinAlgError as err:
        raise ValueError(f"GPTQ: the damped Hessian is not positive definite ({err}); raise damp above {damp}") from None

    w = w0[:, perm].clone()
    q = torch.zeros_like(w)
    for i1 in range(0, in_features, block_size):
        i2 = min(i1 + block_size, in_features)
        block, errors = w[:, i1:i2].clone(), torch.zeros(out_features, i2 - i1, dtype=torch.float64)
        u_block = u[i1:i2, i1:i2]
        for j in range(i2 - i1):
            col = int(perm[i1 + j])
            group = col // grid.g
            if not act_order and col % grid.g == 0:  # in order: the group's scale on the updated weights
                stored[:, group] = grid.scales(block[:, j:j + grid.g].float())  # block_size % g == 0
            column = block[:, j]
            q[:, i1 + j] = grid.values(column, stored[:, group])
            e = (column - q[:, i1 + j]) / u_block[j, j]
            block[:, j:] -= e.unsqueeze(1) * u_block[j, j:].unsqueeze(0)
            errors[:, j] = e
        w[:, i2:] -= errors @ u[i1:i2, i2:]

    values = torch.empty_like(q)
    values[:, perm] = q
    qt = grid.pack(values, stored, (out_features, in_features))
    rtn_values = _rtn(grid, w0)
    signal = _proxy(w0, h)
    return qt, GPTQStats(_proxy(values - w0, h) / signal if signal else 0.0,
                         _proxy(rtn_values - w0, h) / signal if signal else 0.0, in_features, int(dead.sum()))


def _rtn(grid: _Grid, w: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest values of ``w`` with the same scale rule (the baseline GPTQ is measured against)."""
    cols = []
    for k in range(w.shape[1] // grid.g):
        part = w[:, k * grid.g:(k + 1) * grid.g]
        stored = grid.scales(part.float())
        cols.append(grid.values(part, stored.unsqueeze(1)))
    return torch.cat(cols, dim=1)
