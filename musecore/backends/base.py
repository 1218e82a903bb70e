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
from typing import Any, Callable, ClassVar, Iterable, Optional, Sequence, Union

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


@dataclass(frozen=True)
class LinearShape:
    """One linear (or stacked expert projection) of the model, as the plan asks backends about it."""

    name: str                     # e.g. "q_proj", "experts gate/up"
    out_features: int
    in_features: int
    weight_format: str            # "bf16", "nvfp4", "mxfp4", "int4", "fp8"
    act_format: Optional[str] = None
    experts: int = 0              # > 0: grouped over this many experts, ``top_k`` per token
    top_k: int = 0


@dataclass(frozen=True)
class KernelChoice:
    """One kernel decision, as ``musecore plan`` shows it."""

    what: str                     # the decision, e.g. "linear nvfp4 8192x8192, M <= 16"
    choice: str                   # what runs, e.g. "CUDA C++ GEMV (NVRTC)"
    reason: str = ""              # why: measured crossover, hardware, or the env override in force
    env: str = ""                 # the environment variable that overrides it, if any


@dataclass(frozen=True)
class EnvSetting:
    """An environment variable a backend reads."""

    name: str
    value: Optional[str]          # None: unset
    default: str
    effect: str


WeightIn = Union[torch.Tensor, "musecore_quant.QTensor"]  # noqa: F821


def expert_format(formats: Iterable[str]) -> str:
    """The one format of an expert triple's gate, up and down (what ``prepare_experts`` takes); a ValueError
    naming them where they differ."""
    found = set(formats)
    if len(found) != 1:
        raise ValueError(f"gate, up and down must share one format; got {sorted(found)}")
    return found.pop()


class Backend:
    """Base class for backends; subclasses set ``name`` and override what they implement."""

    name: ClassVar[str] = ""
    api_version: ClassVar[tuple[int, int]] = API_VERSION
    verified_on: ClassVar[str] = ""
    """One line that ``musecore doctor`` shows on any host: the real chips this backend's kernels have run and
    been checked on, and those it serves but has never run on (empty: the plugin does not say)."""

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

    # -- optional hooks: the defaults below are the reference behaviour; override what you speed up ----

    wants_static_cache: ClassVar[bool] = False
    """True: ``generate()`` gives this backend fixed-shape, sync-free KV caches (what CUDA graphs need)."""

    def make_decode_step(self, model: Any, cache: Any) -> Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
        """A faster repeated decode step ``step(ids [B,1], positions [B,1]) -> logits`` on a static
        ``cache``, computing what ``model.forward`` computes (the CUDA backend replays a CUDA graph);
        None (the default): the core calls ``model.forward`` each step."""
        return None

    def make_greedy_decode_step(self, model: Any, cache: Any) -> Optional[Any]:
        """A decode step that also takes its argmax tokens on the device, for greedy ``generate()`` on a static
        ``cache``: an object with ``start(tokens [B], next_position [B], live [B])``, ``set_live(live [B])``, a
        call that runs one step and returns its tokens ``[B]`` and ``logits`` ``[B,1,V]`` (the contract of
        ``musecore_triton.graphs.GreedyGraphStep``, which the CUDA and ROCm backends capture as one graph). None
        (the default): ``generate()`` runs :meth:`make_decode_step`'s step and samples after it."""
        return None

    def make_prefill_step(self, model: Any, cache: Any, tokens: int
                          ) -> Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
        """A replayable prefill ``step(ids [B,tokens], positions [B,tokens]) -> logits [B,1,V]`` (the last position's,
        as ``model.forward(..., last_only=True)``) on a static ``cache`` whose rows it fills; prompts are left-padded
        at position -1. None (the default): the caller runs ``model.forward``."""
        return None

    def fuse_embed(self, model: Any) -> Optional[Callable[..., Optional[tuple]]]:
        """Optional: ``embed(input_ids, positions, cache) -> (x, a, positions, rope)``, what ``MuseModel.embed``
        returns, in fewer launches for the inputs it takes (a decode step), returning None for others (the model
        then runs its ops). Asked for by ``MuseModel.fuse_blocks``; the default None keeps the ops."""
        return None

    def fuse_block(self, block: Any) -> Optional[Callable[..., Optional[torch.Tensor]]]:
        """Optional: a callable with the signature of ``block.__call__`` (a ``musecore.model.MoE``: ``(m)``; an
        ``Attention``: ``(a, positions, rope, cache)``) computing what the block's ops compute in fewer calls at the
        sizes it takes (the xeon backend: one C call per block at decode), returning None for inputs it does not
        take; None (the default): the model runs the block's ops. Asked once per block after loading
        (``MuseModel.fuse_blocks``); its output must equal the ops' (each backend tests that, and says where a sum
        is grouped differently).

        The callable may also have a ``sublayer(residual, norm, *block_args)`` method: the block followed by the
        ``residual_norm`` op the model applies after it, ``norm`` being that op's arguments after ``out``
        (``post_weight, alpha, beta, next_weight, post_eps, eps``); it returns ``(residual', normed)`` or None, and
        the model then runs the block and the op (the CUDA backend: the norm in the last program of the block's
        final GEMV).

        A sublayer's op may also be handed to the next block's fused form unrun (``musecore.model.DeferredNorm``):
        where that form has ``takes_deferred`` true, the model calls ``sublayer(..., defer=True)``, which may return
        a ``DeferredNorm`` (the block's output, the op not run), and passes it on as the next ``sublayer``'s
        ``residual`` (its block input None); that form runs the op in its own first launch, or returns None and the
        model resolves it with the ops (the CUDA backend: the norm after attention in the router + pooler launch's
        programs instead of o_proj's last one)."""
        return None

    def kv_write(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, k_new: torch.Tensor,
                 v_new: torch.Tensor, pos_new: torch.Tensor, capacity: int, ring: bool) -> None:
        """A static cache's write; same semantics as :func:`musecore.kv_cache.write_static` (the default)."""
        from musecore.kv_cache import write_static
        write_static(k, v, positions, k_new, v_new, pos_new, capacity, ring)

    kv_write_row: Optional[Callable[..., bool]] = None
    """Optional: a method ``kv_write_row(k, v, positions, k_new, v_new, slot, position) -> bool`` that copies one
    decode entry per batch row into ``slot`` of a non-static CPU layer cache in one call and returns False where it
    does not apply (:data:`musecore.kv_cache.RowWriter`; the xeon backend's is one C call). None (the default): the
    cache writes by narrowing. The entries must be the same either way."""

    def kernel_choices(self, linears: Sequence["LinearShape"], profile: Any) -> list["KernelChoice"]:
        """Every kernel decision this backend would make for a model with these linears on the device
        ``profile`` (a :class:`musecore.devices.DeviceProfile`): the linear path per shape and M range,
        crossovers, launch features (PDL), the native binding. Shown by ``musecore plan`` /
        ``model.plan``. Must not need the hardware: what is only known on the device says so in its
        reason. Never raises; the default (a backend with one path per op) says nothing."""
        return []

    def env_settings(self) -> list["EnvSetting"]:
        """Every environment variable this backend reads, with its value now (None: unset) and its
        effect; ``musecore doctor`` and the plan show those that are set."""
        return []

    def resident_bytes(self, weight_format: str, out_features: int, in_features: int, *,
                       experts: int = 0) -> Optional[int]:
        """Bytes this backend keeps resident for one weight of this format and shape (``experts`` > 0:
        the stacked ``[experts, out, in]`` tensor), including any extra copy or padded layout it
        keeps; None (the default): exactly the checkpoint format's bytes (``musecore_quant``)."""
        return None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} api {self.api_version[0]}.{self.api_version[1]} on {self.device}>"
