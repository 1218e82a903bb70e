"""The contract between musecore and a backend plugin (API version 1.0).

A backend is a class registered under the ``musecore.backends`` entry-point group. It says
whether its hardware is here (:meth:`Backend.probe`), which ops it runs and how well
(:meth:`Backend.supports`), turns checkpoint weights into its resident layout once at load
(:meth:`Backend.prepare_weight`, :meth:`Backend.prepare_experts`), and implements any subset of
the ops in :mod:`musecore.ops` as methods of the same names. Core rejects a plugin of another
major API version; a minor bump only adds optional methods.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional, Union

import torch

from musecore.ops import OpSpec

API_VERSION: tuple[int, int] = (1, 0)


class Tier(str, enum.Enum):
    NATIVE = "native"      # the hardware's own kernels and number formats
    EMULATED = "emulated"  # the target's numerics, computed by slower kernels
    NO = "no"


@dataclass(frozen=True)
class Support:
    ok: bool
    tier: Tier
    reason: str

    @classmethod
    def native(cls, reason: str = "") -> "Support":
        return cls(True, Tier.NATIVE, reason)

    @classmethod
    def emulated(cls, reason: str) -> "Support":
        return cls(True, Tier.EMULATED, reason)

    @classmethod
    def no(cls, reason: str) -> "Support":
        return cls(False, Tier.NO, reason)


@dataclass
class Probe:
    """What :meth:`Backend.probe` found: cheap to compute, never raises."""

    available: bool
    score: int = 0
    devices: list[str] = field(default_factory=list)  # catalog names this hardware serves
    reason: str = ""  # why not available, or a one-line description of what was found
    details: dict[str, Any] = field(default_factory=dict)


WeightIn = Union[torch.Tensor, "musecore_quant.QTensor"]  # noqa: F821


class Backend:
    """Base class for backends; subclasses set ``name`` and override what they implement."""

    name: ClassVar[str] = ""
    api_version: ClassVar[tuple[int, int]] = API_VERSION

    def __init__(self, device: Optional[Union[str, torch.device]] = None) -> None:
        self.device = torch.device(device) if device is not None else torch.device("cpu")

    def probe(self) -> Probe:
        raise NotImplementedError

    def supports(self, op: str, spec: OpSpec) -> Support:
        raise NotImplementedError

    def prepare_weight(self, weight: WeightIn, role: str, *, act_format: Optional[str] = None,
                       dtype: torch.dtype = torch.bfloat16) -> Any:
        """Turn a checkpoint weight (dense tensor or QTensor) into this backend's layout, once."""
        raise NotImplementedError

    def prepare_experts(self, gate: WeightIn, up: WeightIn, down: WeightIn, *,
                        act_format: Optional[str] = None, dtype: torch.dtype = torch.bfloat16) -> Any:
        """Stacked ``[E, out, in]`` expert projections (dense or QTensor) -> the layout ``moe`` takes."""
        raise NotImplementedError

    # Optional, looked up with getattr by the core (a backend without them runs the reference path):
    #   wants_static_cache = True     generate() gives it fixed-shape, sync-free KV caches;
    #   make_decode_step(model, cache) -> step(ids, positions): a faster repeated decode step (CUDA graphs);
    #   kv_write(k, v, positions, k_new, v_new, pos_new, capacity, ring): a static cache's write, same
    #       semantics as musecore.kv_cache.write_static (its reference);
    #   benchmarks() -> {case: callable}: the cases of ``musecore bench --backend NAME``.

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} api {self.api_version[0]}.{self.api_version[1]} on {self.device}>"
