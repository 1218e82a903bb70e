"""FP4 E2M1, the 4-bit element format under both NVFP4 and MXFP4.

NVFP4 and MXFP4 store identical element codes packed identically; they differ only in how a block
is scaled. The element codec therefore lives here, once, so a rounding fix reaches both formats.

E2M1 is 1 sign bit, 2 exponent bits (bias 1) and 1 mantissa bit, with no Inf or NaN:

    code  0x0  0x1  0x2  0x3  0x4  0x5  0x6  0x7     (0x8..0xF: the same magnitudes, negative)
    value 0    0.5  1    1.5  2    3    4    6

Two producers' rounding rules are offered (FORMATS.md): round-to-nearest-even (ModelOpt, torchao,
compressed-tensors, Quark C++; the default) and ties-away-from-zero (aiter, Quark's Triton kernel).
Both saturate to +-6. The sign follows ModelOpt, which tests ``x < 0``: -0.0 becomes code 0x0
(torchao writes 0x8), while a small negative value that rounds to zero keeps its sign (0x8).
Decoding is the same either way.

Packing puts two codes in a byte along the last (input, K) dimension, element ``2i`` in the low
nibble: ``[1.0, -2.0, 0.5, 6.0]`` -> codes ``2 C 1 7`` -> bytes ``C2 71``.

Example::

    codes = fp4_encode(torch.tensor([1.0, -2.0, 0.5, 6.0]))   # tensor([2, 12, 1, 7], dtype=uint8)
    packed = pack_nibbles(codes)                              # tensor([0xC2, 0x71], dtype=uint8)
    fp4_decode(unpack_nibbles(packed))                        # tensor([1., -2., 0.5, 6.])
"""

from __future__ import annotations

import torch

FP4_MAX = 6.0
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Midpoints between neighbouring magnitudes; a value's magnitude code is how many it exceeds.
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
# The midpoints whose upper neighbour has an even code (mantissa bit 0): RNE rounds these ties up.
_TIES_ROUNDED_UP_BY_RNE = (0.75, 1.75, 3.5)
ROUNDINGS = ("rne", "away")


def check_rounding(rounding: str) -> None:
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {ROUNDINGS} ('rne': round half to even, as ModelOpt and "
                         f"torchao; 'away': ties away from zero, as aiter); got {rounding!r}")


def fp4_encode(x: torch.Tensor, rounding: str = "rne") -> torch.Tensor:
    """E2M1 codes (uint8, 0..15) of ``x``, already divided by its block scale; saturates at +-6.

    ``rounding="rne"`` rounds ties to the even code (0.25->0, 0.75->1, 2.5->2, 5->4);
    ``rounding="away"`` rounds them away from zero (0.25->0.5, 2.5->3, 5->6). NaN is not checked
    here (callers reject it) and encodes as +-6.
    """
    check_rounding(rounding)
    x = x.float()
    magnitude = x.abs()
    midpoints = torch.tensor(_MIDPOINTS, dtype=torch.float32, device=x.device)
    # searchsorted counts midpoints strictly below (ties go down) or, with right=True, at or below
    # (ties go up); values above 5 land past the last midpoint, which is the saturation to 6.
    ordinal = torch.searchsorted(midpoints, magnitude, right=(rounding == "away"), out_int32=True)
    if rounding == "rne":
        tie_up = torch.zeros_like(magnitude, dtype=torch.bool)
        for tie in _TIES_ROUNDED_UP_BY_RNE:
            tie_up |= magnitude == tie
        ordinal += tie_up
    sign = (x < 0).to(torch.int32) << 3  # -0.0 is not < 0, so it encodes as 0x0 like ModelOpt
    return (sign | ordinal).to(torch.uint8)


def e2m1_table(device: torch.device | str | None = None) -> torch.Tensor:
    """The 16 values of the E2M1 codes as fp32 (code 0x8, negative zero, decodes to 0.0)."""
    values = list(E2M1_MAGNITUDES) + [0.0] + [-m for m in E2M1_MAGNITUDES[1:]]
    return torch.tensor(values, dtype=torch.float32, device=device)


def fp4_decode(codes: torch.Tensor) -> torch.Tensor:
    """fp32 values of E2M1 codes (any integer dtype, values 0..15), same shape."""
    if codes.dtype.is_floating_point or codes.dtype == torch.bool:
        raise TypeError(f"fp4_decode expects integer E2M1 codes (uint8 0..15); got dtype {codes.dtype}")
    return e2m1_table(codes.device)[codes.to(torch.int32)]


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes ``[..., K]`` into bytes ``[..., K/2]``, element ``2i`` in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_nibbles needs an even last dimension; got shape {list(codes.shape)}")
    if codes.dtype.is_floating_point or codes.dtype == torch.bool:
        raise TypeError(f"pack_nibbles expects integer 4-bit codes; got dtype {codes.dtype}")
    codes = codes.to(torch.uint8)
    return (codes[..., 1::2] << 4) | (codes[..., 0::2] & 0x0F)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Unpack bytes ``[..., K/2]`` into 4-bit codes ``[..., K]`` (uint8); inverse of ``pack_nibbles``."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_nibbles expects uint8 packed bytes; got dtype {packed.dtype}")
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)
