"""Scales outside their domain: refused when a quantized weight is read, naming the tensor.

NaN/Inf are caught by ``layout.check_finite``; these are the finite values that decode without
any error to wrong weights (FORMATS.md gives the producers' rules they break):

- NVFP4 ``weight_scale_2`` (or compressed-tensors' inverse ``weight_global_scale``) and any
  ``input_scale`` must be > 0: 0 zeroes the whole tensor, a negative one flips every sign.
- E4M3 block scales (NVFP4) must not be negative (no producer writes one: ``amax / ...``), and a
  zero block scale must not sit over nonzero codes (ModelOpt never writes 0; those values would
  silently read as 0).
- E8M0 block scales (MXFP4): 0xFF is NaN; 0xFE is 2^127, a valid exponent that no producer
  writes (the largest finite amax gives 0xFD), and codes of magnitude >= 2 under it overflow fp32
  to Inf, so such a block is refused.
- FP8 scales: a per-tensor ``weight_scale`` must be > 0; 128x128 block scales must not be
  negative nor zero over nonzero codes.

The checks read only scales, unless a suspicious scale is present, and then only the codes of
the blocks concerned are looked at. INT4 scales are not checked: AutoRound's symmetric scales
are legitimately negative (FORMATS.md).
"""

from __future__ import annotations

from typing import Mapping

import torch

from .errors import InvalidScaleError
from .layout import WeightEntry

_E4M3_NAN = 0x7F
_E8M0_NAN, _E8M0_MAX_FINITE = 0xFF, 0xFE
_FP4_MAGNITUDE_2 = 4  # E2M1 codes 4..7 are 2, 3, 4, 6


def check_scales(entry: WeightEntry, t: Mapping[str, torch.Tensor]) -> None:
    """Raise ``InvalidScaleError`` naming the tensor if a scale of ``entry`` would decode silently wrong."""
    kind = entry.kind
    if kind == "dense-nvfp4":
        _positive(entry, t, "weight_scale_2", "the NVFP4 global scale (amax / 2688)")
        _positive(entry, t, "input_scale", "the NVFP4 activation global scale")
        _e4m3_blocks(entry, t, "weight_scale", "weight", 8)
    elif kind == "ct-nvfp4":
        _positive(entry, t, "weight_global_scale", "the inverse NVFP4 global scale (2688 / amax)")
        _positive(entry, t, "input_global_scale", "the inverse NVFP4 activation global scale")
        _e4m3_blocks(entry, t, "weight_scale", "weight_packed", 8)
    elif kind in ("dense-mxfp4", "gpt-oss-mxfp4"):
        role = entry.options.get("e8m0_roles", ("weight_scale",))[0]
        _e8m0_blocks(entry, t, role, "blocks" if kind == "gpt-oss-mxfp4" else "weight")
    elif kind == "dense-fp8-tensor":
        _positive(entry, t, "weight_scale", "the per-tensor FP8 scale (amax / 448)")
        _positive(entry, t, "input_scale", "the FP8 activation scale")
    elif kind == "dense-fp8-block":
        _positive(entry, t, "input_scale", "the FP8 activation scale")
        _fp8_blocks(entry, t, entry.options["scale_role"])


def _fail(entry: WeightEntry, role: str, what: str) -> InvalidScaleError:
    h = entry.parts[role]
    return InvalidScaleError(f"{h.file}: tensor {h.key!r} (weight {entry.name!r}): {what}; decoding it would give "
                             "wrong weights without any error: the checkpoint is corrupt or hand-edited, "
                             "re-download or re-export it", path=h.file, tensor=h.key)


def _positive(entry: WeightEntry, t: Mapping[str, torch.Tensor], role: str, what: str) -> None:
    if role not in t:
        return
    values = t[role].to(torch.float32).reshape(-1)
    bad = values[~(values > 0)]  # NaN fails too; check_finite names it first when enabled
    if bad.numel():
        raise _fail(entry, role, f"{what} is {bad[0].item()}, expected > 0")


def _e4m3_blocks(entry: WeightEntry, t: Mapping[str, torch.Tensor], role: str, codes_role: str,
                 bytes_per_block: int) -> None:
    bits = t[role].view(torch.uint8)
    magnitude = bits & 0x7F
    negative = (bits > 0x80) & (magnitude != _E4M3_NAN)
    if bool(negative.any()):
        index = negative.nonzero()[0].tolist()
        raise _fail(entry, role, f"block scale at {index} is negative ({t[role][tuple(index)].item()}); E4M3 block "
                                 "scales are amax / (6 * weight_scale_2) >= 0")
    zero = magnitude == 0
    if bool(zero.any()):
        codes = t[codes_role].reshape(*bits.shape, bytes_per_block)
        lost = zero & ((codes & 0x77) != 0).any(dim=-1)  # a nonzero E2M1 magnitude in either nibble
        if bool(lost.any()):
            index = lost.nonzero()[0].tolist()
            raise _fail(entry, role, f"block scale at {index} is 0 over nonzero codes; those values would read as 0")


def _e8m0_blocks(entry: WeightEntry, t: Mapping[str, torch.Tensor], role: str, codes_role: str) -> None:
    scale = t[role]
    if scale.numel() == 0 or int(scale.amax()) < _E8M0_MAX_FINITE:
        return
    nan = scale == _E8M0_NAN
    if bool(nan.any()):
        raise _fail(entry, role, f"{int(nan.sum())} E8M0 block scale(s) are 0xFF, which is NaN in OCP MX, e.g. at "
                                 f"{nan.nonzero()[0].tolist()}")
    codes = t[codes_role].reshape(*scale.shape, -1)
    large = ((codes & 0x7) >= _FP4_MAGNITUDE_2) | (((codes >> 4) & 0x7) >= _FP4_MAGNITUDE_2)
    overflow = (scale == _E8M0_MAX_FINITE) & large.any(dim=-1)
    if bool(overflow.any()):
        raise _fail(entry, role, f"E8M0 block scale 0xFE (2^127) at {overflow.nonzero()[0].tolist()} multiplies "
                                 "codes >= 2 beyond the fp32 range (Inf); no producer writes a scale above 0xFD")


def _fp8_blocks(entry: WeightEntry, t: Mapping[str, torch.Tensor], role: str) -> None:
    scale = t[role].to(torch.float32)
    if bool((scale < 0).any()):
        index = (scale < 0).nonzero()[0].tolist()
        raise _fail(entry, role, f"block scale at {index} is negative ({scale[tuple(index)].item()}); FP8 block "
                                 "scales are amax / 448 >= 0")
    zero = scale == 0
    if bool(zero.any()):
        data = t["weight"]
        block = entry.group_size
        rows, cols = data.shape[-2:]
        mask = zero.repeat_interleave(block, dim=-2).repeat_interleave(block, dim=-1)[..., :rows, :cols]
        lost = mask & ((data.view(torch.uint8) & 0x7F) != 0)
        if bool(lost.any()):
            index = lost.nonzero()[0].tolist()
            raise _fail(entry, role, f"block scale over element {index} is 0 while its codes are nonzero; those "
                                     "values would read as 0")
