"""How on-disk tensors group into logical weights, producer-neutral.

Every producer stores a quantized Linear as one primary tensor plus companions beside it
(``X.weight`` + ``X.weight_scale`` + ``X.weight_scale_2``; ``X.qweight`` + ``X.qzeros`` +
``X.scales``; ``X.weight_packed`` + ``X.weight_global_scale``; ``X_blocks`` + ``X_scales``). A
``GroupingRule`` names those suffixes; ``group_tensors`` applies the rules a producer uses to
the header keys and returns one ``WeightEntry`` per logical weight (``X.weight``), so the reader
lists, sizes and decodes weights, not loose tensors. Producer modules classify each group
(which format, which logical shape) and decode it into a ``QTensor``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Union

import torch

from ..qtensor import QTensor
from .errors import CheckpointError
from .safetensors_io import DTYPE_NAMES, FLOAT_DTYPES, TensorHeader

Weight = Union[torch.Tensor, QTensor]


@dataclass(frozen=True)
class GroupingRule:
    """A primary tensor suffix, the companion suffixes stored beside it, the logical suffix."""

    name: str
    primary: str
    companions: tuple[str, ...]
    logical: str

    @staticmethod
    def role(suffix: str) -> str:
        return suffix.lstrip("._")


@dataclass(frozen=True)
class WeightEntry:
    """One logical weight: its on-disk parts (by role), format, logical shape, decoder kind."""

    name: str
    kind: str
    format: str
    shape: tuple[int, ...]
    parts: Mapping[str, TensorHeader]
    group_size: int = 0
    options: Mapping[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(h.nbytes for h in self.parts.values())

    @property
    def quantized(self) -> bool:
        return self.kind != "plain"



def group_tensors(headers: Mapping[str, TensorHeader], rules: tuple[GroupingRule, ...],
                  ) -> tuple[dict[str, tuple[GroupingRule, dict[str, TensorHeader]]], dict[str, TensorHeader]]:
    """Split header keys into rule groups (by logical name) and plain tensors (by key).

    A companion whose primary is absent is an error: the checkpoint lost a tensor.
    """
    primaries: dict[str, GroupingRule] = {}
    for key, h in headers.items():
        for rule in rules:
            if key.endswith(rule.primary):
                base = key[: -len(rule.primary)]
                if base in primaries and primaries[base] is not rule:
                    raise CheckpointError(
                        f"{h.file}: tensor {key!r} and {base + primaries[base].primary!r} both claim "
                        f"module {base!r} ({rule.name} and {primaries[base].name} layouts); a checkpoint "
                        "stores one layout per module: re-export it", path=h.file, tensor=key)
                primaries[base] = rule
    groups: dict[str, tuple[GroupingRule, dict[str, TensorHeader]]] = {}
    for base, rule in primaries.items():
        groups[base + rule.logical] = (rule, {GroupingRule.role(rule.primary): headers[base + rule.primary]})
    plain: dict[str, TensorHeader] = {}
    for key, h in headers.items():
        if any(key.endswith(r.primary) and primaries.get(key[: -len(r.primary)]) is r for r in rules):
            continue
        matched = [(r, s) for r in rules for s in r.companions if key.endswith(s)]
        owner = next(((r, s) for r, s in matched if primaries.get(key[: -len(s)]) is r), None)
        if owner is not None:
            rule, suffix = owner
            base = key[: -len(suffix)]
            groups[base + rule.logical][1][GroupingRule.role(suffix)] = h
        elif matched:
            rule, suffix = matched[0]
            raise CheckpointError(
                f"{h.file}: tensor {key!r} is a {rule.name} companion but its primary tensor "
                f"{key[: -len(suffix)] + rule.primary!r} is not in the checkpoint; the checkpoint is "
                "incomplete: re-download or re-export it", path=h.file, tensor=key)
        else:
            plain[key] = h
    return groups, plain


def plain_entry(key: str, h: TensorHeader) -> WeightEntry:
    fmt = DTYPE_NAMES.get(h.dtype, h.dtype.lower())
    return WeightEntry(key, "plain", fmt, h.shape, {"tensor": h})


def decode_plain(entry: WeightEntry, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    return tensors["tensor"]


def fail(entry_name: str, h: TensorHeader, what: str) -> CheckpointError:
    """An error about one part of one weight, naming the file and the tensor."""
    return CheckpointError(f"{h.file}: tensor {h.key!r} (weight {entry_name!r}): {what}",
                           path=h.file, tensor=h.key)


def require(name: str, parts: dict[str, TensorHeader], role: str, suffix: str, why: str) -> TensorHeader:
    """The part ``role`` of a weight, or a clear 'companion missing' error."""
    if role in parts:
        return parts[role]
    primary = next(iter(parts.values()))
    base = primary.key.rsplit(".", 1)[0] if "." in primary.key else primary.key
    raise CheckpointError(
        f"{primary.file}: weight {name!r} ({why}) has no companion tensor {base + suffix!r}; the "
        "checkpoint is incomplete or was exported by a different tool: re-download or re-export it",
        path=primary.file, tensor=primary.key)


def expect_shape(name: str, h: TensorHeader, shape: tuple[int, ...], why: str) -> None:
    if tuple(h.shape) != tuple(shape):
        raise fail(name, h, f"has shape {list(h.shape)}, expected {list(shape)} ({why}); the "
                            "checkpoint is inconsistent: re-export it")


def expect_dtype(name: str, h: TensorHeader, dtypes: tuple[str, ...], why: str) -> None:
    if h.dtype not in dtypes:
        raise fail(name, h, f"has dtype {h.dtype}, expected {' or '.join(dtypes)} ({why})")


def expect_scalar(name: str, h: TensorHeader, why: str) -> None:
    expect_dtype(name, h, ("F32", "BF16", "F16"), why)
    if math.prod(h.shape) != 1:
        raise fail(name, h, f"has shape {list(h.shape)}, expected one value ({why})")


def count_non_finite(h: TensorHeader, t: torch.Tensor, e8m0: bool = False) -> int:
    """NaN/Inf values in one stored tensor (E4M3 NaN is 0x7F/0xFF; E8M0 NaN is 0xFF)."""
    # A max-reduction first: it is much cheaper than building a mask, and almost always clean.
    if t.numel() == 0:
        return 0
    if e8m0:
        return 0 if int(t.amax()) != 0xFF else int((t == 0xFF).sum())
    if h.dtype in ("F8_E4M3", "F8_E5M2"):
        mask = 0x7F if h.dtype == "F8_E4M3" else 0x7C  # E4M3: S.1111.111 is NaN; E5M2: exponent 11111
        bits = t.view(torch.uint8) & mask
        return 0 if int(bits.amax()) != mask else int((bits == mask).sum())
    if h.dtype in FLOAT_DTYPES:
        return 0 if bool(torch.isfinite(t.abs().amax())) else int((~torch.isfinite(t)).sum())
    return 0


def check_finite(entry: WeightEntry, tensors: dict[str, torch.Tensor]) -> None:
    """Raise if any stored value or scale of ``entry`` is NaN or Inf."""
    e8m0_roles = entry.options.get("e8m0_roles", ())
    for role, t in tensors.items():
        h = entry.parts[role]
        bad = count_non_finite(h, t, e8m0=role in e8m0_roles)
        if bad:
            raise fail(entry.name, h, f"{bad} of {t.numel()} values are NaN or Inf; the checkpoint is "
                                      "corrupt (or the export overflowed): re-download or re-export it")


def to_fp32_scalar(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(()).to(torch.float32)
