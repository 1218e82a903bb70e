"""The operator interface: every computation the Muse graph asks of a backend.

The model graph (``musecore/model.py``) calls only these operators, through an :class:`Ops`
table that the plan binds to backend implementations. ``musecore/ops/reference.py`` implements
all of them in plain PyTorch with fp32 math; it is the living definition that every backend is
tested against (``musecore.testing``), and each op's tolerance lives here, beside its signature.

Shapes use ``B`` batch, ``T`` new tokens, ``S`` cached keys, ``H`` hidden, ``nq``/``nkv`` heads,
``d`` head dim, ``E`` experts, ``k`` experts per token, ``l`` latent width, ``V`` vocabulary.

==================  =========================================================================
op                  signature and semantics (MODEL.md section 1)
==================  =========================================================================
embedding           ``(ids [B,T] long, table: Weight) -> [B,T,H]``
rms_norm            ``(x [...,n], weight [n], eps) -> [...,n]``; fp32 math, output in x.dtype
residual_norm       ``(residual, out, post_weight, gate, next_weight, eps) -> (residual', normed)``:
                    ``residual' = residual + gate * rms_norm(out, post_weight)``;
                    ``normed = rms_norm(residual', next_weight)``
qk_norm_rope        ``(q [B,T,nq,d], k [B,T,nkv,d], q_weight [d], k_weight [d], cos [B,T,d],
                    sin [B,T,d], eps) -> (q, k)``: per-head RMSNorm, then HF-convention RoPE
attention           ``(q [B,T,nq,d], k [B,S,nkv,d], v [B,S,nkv,d], q_pos [B,T], k_pos [B,S],
                    window, scale, k_scale=None, v_scale=None) -> [B,T,nq,d]``: causal GQA;
                    key j is visible to query i iff ``0 <= k_pos[j] <= q_pos[i]`` and, with a
                    window W, ``q_pos[i] - k_pos[j] < W``; ``k_pos = -1`` marks an empty slot.
                    fp8 k/v are dequantized with their per-tensor scales; fp32 softmax. A query
                    that sees no key (padding) returns zeros.
head_norm_gate      ``(o [B,T,nq,d], weight [d], gate_logits [B,T,nq], eps) -> [B,T,nq,d]``:
                    ``rms_norm(o) * sigmoid(gate)``
linear              ``(x [...,K], w: Weight) -> [...,N]``: ``x @ W.T`` for a prepared weight in
                    any format; W4A4 targets fake- or really-quantize x per ``w.act_format``
router_topk         ``(logits [T,E], k, renormalize) -> (weights fp32 [T,k], ids long [T,k])``:
                    fp32 softmax over all experts, top-k, optional renormalisation
moe                 ``(z [T,l], weights [T,k], ids [T,k], experts: ExpertWeights,
                    output_norm [E,l], eps) -> y fp32 [T,l]``:
                    ``y[t] = sum_j w[t,j] * rms_norm(down(silu(gate(z)) * up(z)), norm[id])``
sample              ``(logits [B,V], temperature, top_k, top_p, generator) -> ids [B]``
==================  =========================================================================
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

OPS: tuple[str, ...] = ("embedding", "rms_norm", "residual_norm", "qk_norm_rope", "attention",
                        "head_norm_gate", "linear", "router_topk", "moe", "sample")

WEIGHT_FORMATS: tuple[str, ...] = ("bf16", "fp16", "fp32", "fp8", "nvfp4", "mxfp4", "int4")
ACTIVATION_FORMATS: tuple[Optional[str], ...] = (None, "fp8", "nvfp4", "mxfp4")

# Normalised-MSE thresholds of a backend op against the reference (ggml test-backend-ops style).
# 16-bit compute of the same math stays far below 1e-4; quantized weights are compared against the
# reference run on the *same* quantized weights, so only kernel arithmetic differs, not the format.
TOLERANCE_NMSE: dict[str, float] = {
    "embedding": 0.0,
    "rms_norm": 1e-5,
    "residual_norm": 1e-5,
    "qk_norm_rope": 1e-5,
    "attention": 1e-4,
    "head_norm_gate": 1e-5,
    "linear": 1e-4,
    "router_topk": 1e-6,
    "moe": 2e-4,
    "sample": 0.0,
}


def tolerance(op: str, spec: "OpSpec | None" = None) -> float:
    """NMSE tolerance of ``op``; activation quantization (W4A4) may flip a rounding, so it gets 10x."""
    tol = TOLERANCE_NMSE[op]
    if spec is not None and spec.act_format in ("nvfp4", "mxfp4"):
        tol *= 10
    return tol


@dataclass(frozen=True)
class OpSpec:
    """What a backend is asked to run: the op, its formats and dtypes, and the shapes involved."""

    op: str
    weight_format: str = "bf16"
    act_format: Optional[str] = None
    dtype: torch.dtype = torch.bfloat16
    kv_format: str = "bf16"
    shape: tuple[tuple[str, int], ...] = ()
    device: str = ""  # the catalog device planned for (e.g. "h200"), so one backend can answer per target

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"unknown op {self.op!r}; the operator interface has {OPS}")


@dataclass
class Weight:
    """A weight as a backend prepared it for ``linear`` / ``embedding``.

    ``format`` is the checkpoint format it came from, ``act_format`` the activation quantization
    that the target applies before the matmul (``None`` for 16-bit activations), ``data`` the
    backend's resident payload (a dense tensor for the reference, packed bytes for kernels).
    """

    data: Any
    format: str
    out_features: int
    in_features: int
    act_format: Optional[str] = None
    input_scale: Optional[torch.Tensor] = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class ExpertWeights:
    """The routed experts of one MoE layer, stacked ``[E, out, in]`` in a backend's layout."""

    gate: Any
    up: Any
    down: Any
    format: str
    num_experts: int
    act_format: Optional[str] = None
    gate_up_input_scale: Optional[torch.Tensor] = None  # [E] static activation scales (NVFP4 W4A4)
    down_input_scale: Optional[torch.Tensor] = None     # [E]
    extra: dict[str, Any] = field(default_factory=dict)


class Ops:
    """A table of op implementations, one callable per op name; the graph calls ``ops.linear(...)``.

    Example::

        ops = Ops.from_backend(ReferenceBackend())
        y = ops.rms_norm(x, w, 1e-6)
    """

    def __init__(self, table: dict[str, Callable[..., Any]], sources: dict[str, str]) -> None:
        missing = [op for op in OPS if op not in table]
        if missing:
            raise ValueError(f"op table lacks {missing}")
        self._table = table
        self.sources = sources  # op -> "backend.method", for the plan and error messages
        for op, fn in table.items():
            setattr(self, op, fn)

    @classmethod
    def from_backend(cls, backend: Any, fallback: Any = None) -> "Ops":
        """Bind every op to ``backend``; ops it does not implement go to ``fallback`` if given."""
        table, sources = {}, {}
        for op in OPS:
            impl = getattr(backend, op, None)
            owner = backend
            if impl is None and fallback is not None:
                impl, owner = getattr(fallback, op), fallback
            if impl is None:
                raise ValueError(f"backend {backend.name!r} does not implement {op!r} and no fallback was allowed")
            table[op], sources[op] = impl, f"{owner.name}.{op}"
        return cls(table, sources)
