"""The operator interface: every computation the Muse graph asks of a backend.

The model graph (``musecore/model.py``) calls only these operators, through an :class:`Ops`
table that the plan binds to backend implementations. ``musecore/ops/reference.py`` implements
all of them in plain PyTorch with fp32 math; it is the living definition that every backend is
tested against (``musecore.testing``), and each op's tolerance lives here, beside its signature.

Shapes use ``B`` batch, ``T`` new tokens, ``S`` cached keys, ``H`` hidden, ``nq``/``nkv`` heads,
``d`` head dim, ``E`` experts, ``k`` experts per token, ``h`` the experts' width
(``moe_hidden_size``), ``V`` vocabulary.

==================  =========================================================================
op                  signature and semantics (MODEL.md section 1)
==================  =========================================================================
embedding           ``(ids [B,T] long, table: Weight) -> [B,T,H]`` (the lookup; the graph then
                    applies the weightless embedding norm with ``rms_norm``)
rms_norm            ``(x [...,n], weight [n] | None, eps, scale_first=False) -> [...,n]``; fp32 math,
                    output in x.dtype. ``rms(x) = x * (mean(x^2) + eps)^-1/2``.
                    ``scale_first=False``: ``rms(x) * weight`` (``rms(x)`` when weight is None);
                    ``scale_first=True``: ``rms(round(x * weight))``, the product rounded to
                    x.dtype before the norm (transformers' InputScaledRMSNorm).
                    Centred norms (``1 + w``) reach the ops with ``1 + w`` already folded into
                    the weight by the loader (computed in the model dtype, as transformers does).
residual_norm       ``(residual, out, post_weight | None, alpha [H] fp32, beta [H] fp32,
                    next_weight, post_eps, eps) -> (residual', normed)``:
                    ``h = rms_norm(out, post_weight, post_eps, scale_first=True)`` (weightless
                    ``rms(out)`` when post_weight is None), rounded to out.dtype;
                    ``residual' = alpha * residual + beta * h`` in fp32, rounded to residual.dtype;
                    ``normed = rms_norm(residual', next_weight, eps)``. ``alpha, beta`` are the
                    residual gate's coefficients (:func:`musecore.ops.reference.residual_gate_coefficients`).
qk_norm_rope        ``(q [B,T,nq,d], k [B,T,nkv,d], cos [B,T,d] | None, sin | None, eps, q_scale)
                    -> (q, k)``: weightless per-head RMSNorm, ``q *= q_scale``, then HF-convention
                    RoPE (rotate_half) when cos/sin are given (None: a NoPE layer)
attention           ``(q [B,T,nq,d], k [B,S,nkv,d], v [B,S,nkv,d], q_pos [B,T], k_pos [B,S],
                    window, scale, k_scale=None, v_scale=None) -> [B,T,nq,d]``: causal GQA;
                    key j is visible to query i iff ``0 <= k_pos[j] <= q_pos[i]`` and, with a
                    window W, ``q_pos[i] - k_pos[j] < W``; ``k_pos = -1`` marks an empty slot.
                    fp8 k/v are dequantized with their per-tensor scales; fp32 softmax. A query
                    that sees no key (padding) returns zeros.
head_norm_gate      ``(o [B,T,nq,d], gate_logits [B,T,nq,d], eps) -> [B,T,nq,d]``:
                    ``rms(o) * sigmoid(gate)``, element-wise (weightless norm per head)
linear              ``(x [...,K], w: Weight) -> [...,N]``: ``x @ W.T`` for a prepared weight in
                    any format; W4A4 targets fake- or really-quantize x per ``w.act_format``
router_topk         ``(x [T,H], weight [E,H] fp32, bias [E] fp32, k, multiplier, scaling)
                    -> (weights fp32 [T,k], ids long [T,k])``: ``s = sigmoid(fp32(x) @ W^T *
                    multiplier)``; ids = top-k of ``s + bias`` (the bias only chooses);
                    ``weights = s[ids] / (sum s[ids] + 1e-15) * scaling``
moe                 ``(z [T,h], weights [T,k], ids [T,k], experts: ExpertWeights,
                    post_norm [h], post_eps) -> y fp32 [T,h]``: for each chosen expert
                    ``e = down(silu(gate(z)) * up(z))`` rounded to z.dtype, then the post-expert
                    norm ``rms_norm(e, post_norm, post_eps, scale_first=True)`` (one weight,
                    shared by all experts), then ``y[t] += w[t,j] * that`` summed in fp32
silu_mul            ``(gate [...,n], up [...,n]) -> silu(gate) * up`` (dense-MLP layers), x.dtype
logit_softcap       ``(logits [...,V], multiplier, cap) -> fp32 cap * tanh(logits * multiplier / cap)``
sample              ``(logits [B,V], temperature, top_k, top_p, generator) -> ids [B]``
==================  =========================================================================

The vision and audio towers (MODEL.md section 2) add five ops, :data:`TOWER_OPS`. ``N`` is the
number of packed patches (every image and video frame of one call, one after another), ``nh``/``d``
the tower's heads and head dim, ``C`` channels, ``K`` a conv kernel. A plan asks for them only when
it loads a tower (``musecore.load(..., towers=)``); a backend may leave them out, and then its
text-only plans are unchanged (see ``musecore.planning`` for the rule).

==================  =========================================================================
op                  signature and semantics (MODEL.md section 2)
==================  =========================================================================
layer_norm          ``(x [...,n], weight [n] | None, bias [n] | None, eps) -> [...,n]``:
                    ``(x - mean) / sqrt(var + eps) * weight + bias`` over the last dim (biased
                    variance, as ``torch.nn.LayerNorm``); fp32 math, output x.dtype
gelu                ``(x, approximate="none") -> x.dtype``: ``approximate="none"`` the exact erf
                    GELU (transformers' ``"gelu"``), ``"tanh"`` the tanh approximation
                    (``"gelu_pytorch_tanh"``); fp32 math
varlen_attention    ``(q [N,nh,d], k [N,nh,d], v [N,nh,d], cu_seqlens int32 [S+1], scale)
                    -> [N,nh,d]``: bidirectional softmax attention inside each segment
                    ``[cu[i], cu[i+1])`` only (no mask within a segment, nothing across
                    segments); ``cu[0] = 0``, ``cu[S] = N``, non-decreasing (an empty segment is
                    allowed and produces nothing); scores ``q k^T * scale``, fp32 softmax;
                    output q.dtype
causal_conv1d       ``(x [B,C,T], weight [C,1,K], bias [C] | None, state [B,C,K-1] | None)
                    -> (y [B,C,T], state' [B,C,K-1])``: depthwise (groups=C) causal conv:
                    ``xp = cat(state or zeros, x)`` along time, ``y[b,c,t] = bias[c] +
                    sum_j weight[c,0,j] * xp[b,c,t+j]``; ``state' = xp[..., -(K-1):]``, the last
                    K-1 input columns (old state included when T < K-1), so feeding a signal in
                    chunks with the returned state equals one pass. fp32 math; y and state' in
                    x.dtype
rope                ``(x [N,nh,d], cos [N,d], sin [N,d]) -> [N,nh,d]``: ``x * cos +
                    rotate_half(x) * sin`` (HF rotate_half: ``cat(-x2, x1)`` of the two halves),
                    the same cos/sin for every head; fp32 math, output x.dtype. The vision
                    tower's axial 2-D table is built by the graph (``musecore.towers.vision``)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

TEXT_OPS: tuple[str, ...] = ("embedding", "rms_norm", "residual_norm", "qk_norm_rope", "attention",
                             "head_norm_gate", "linear", "router_topk", "moe", "silu_mul", "logit_softcap", "sample")
# The towers' own ops (the towers also call ``linear`` and ``rms_norm``); a plan binds them only when
# it loads a tower, so a backend without them still runs every text-only plan.
TOWER_OPS: tuple[str, ...] = ("layer_norm", "gelu", "varlen_attention", "causal_conv1d", "rope")
OPS: tuple[str, ...] = TEXT_OPS + TOWER_OPS

WEIGHT_FORMATS: tuple[str, ...] = ("bf16", "fp16", "fp32", "fp8", "int8", "nvfp4", "mxfp4", "int4")
# static-scale formats, then the dynamic per-token 8-bit rules of the FP8/INT8 throughput options
ACTIVATION_FORMATS: tuple[Optional[str], ...] = (None, "fp8", "nvfp4", "mxfp4", "fp8-token", "int8-token")

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
    "silu_mul": 1e-5,
    "logit_softcap": 1e-6,
    "sample": 0.0,
    "layer_norm": 1e-5,
    "gelu": 1e-5,
    "varlen_attention": 1e-4,
    "causal_conv1d": 1e-5,
    "rope": 1e-5,
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
    """The routed experts of one MoE layer, stacked ``[E, out, in]`` in a backend's layout.

    ``gate`` and ``up`` are the two halves of the checkpoint's fused ``gate_up_proj [E, 2I, h]``
    (rows ``0..I-1`` and ``I..2I-1``); ``down`` is ``down_proj [E, h, I]``."""

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
        missing = [op for op in TEXT_OPS if op not in table]
        if missing:
            raise ValueError(f"op table lacks {missing}")
        unknown = sorted(set(table) - set(OPS))
        if unknown:
            raise ValueError(f"op table has unknown ops {unknown}; the operator interface has {OPS}")
        self._table = table
        self.sources = sources  # op -> "backend.method", for the plan and error messages
        for op, fn in table.items():
            setattr(self, op, fn)

    def has(self, op: str) -> bool:
        """Whether ``op`` is bound (the tower ops are bound only when a plan loads a tower)."""
        return op in self._table

    def __getattr__(self, op: str) -> Any:  # only reached for names not set in __init__
        if op in TOWER_OPS:
            raise AttributeError(f"op {op!r} is not bound in this op table: the plan loaded no vision/audio tower "
                                 "(see model.plan's notes for why)")
        raise AttributeError(f"{type(self).__name__!r} has no attribute {op!r}")

    @classmethod
    def from_backend(cls, backend: Any, fallback: Any = None) -> "Ops":
        """Bind every op to ``backend``; ops it does not implement go to ``fallback`` if given. A tower op
        (:data:`TOWER_OPS`) that neither implements stays unbound; a text op raises."""
        table, sources = {}, {}
        for op in OPS:
            impl = getattr(backend, op, None)
            owner = backend
            if impl is None and fallback is not None:
                impl, owner = getattr(fallback, op, None), fallback
            if impl is None and op in TOWER_OPS:
                continue
            if impl is None:
                raise ValueError(f"backend {backend.name!r} does not implement {op!r} and no fallback was allowed")
            table[op], sources[op] = impl, f"{owner.name}.{op}"
        return cls(table, sources)
