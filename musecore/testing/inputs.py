"""Deterministic inputs for each conformance case, and the call of the op on a given backend.

``build(case, dtype)`` makes every tensor on the CPU from a generator seeded by the case id and
returns a :class:`BuiltCase` whose ``run(backend)`` moves the inputs to the backend's device, has
that backend prepare the weights (``prepare_weight`` / ``prepare_experts``, from the very same
``QTensor``) and calls its op. Running it on the backend under test and on the reference backend
therefore differs only in kernel arithmetic, never in inputs or quantized weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from musecore_quant.formats.facts import producer_options

from musecore.kv_cache import FP8_MAX
from musecore.ops import reference as ref
from musecore.rope import RotaryTable
from musecore.testing.cases import ConformanceCase, preset



@dataclass
class BuiltCase:
    """A case's inputs, ready to run on any backend: ``run(backend)`` returns the op's output."""

    case: ConformanceCase
    dtype: torch.dtype
    run: Callable[[Any], Any]


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if hasattr(value, "to") and hasattr(value, "format"):  # QTensor
        return value.to(device)
    return value


class _Rand:
    def __init__(self, seed: int) -> None:
        self.gen = torch.Generator().manual_seed(seed)

    def normal(self, *shape: int, std: float = 1.0) -> torch.Tensor:
        return torch.randn(shape, generator=self.gen) * std

    def norm_weight(self, n: int) -> torch.Tensor:
        return 1.0 + 0.2 * self.normal(n)  # not ones: a missing weight must show

    def weight(self, *shape: int) -> torch.Tensor:
        """``[..., out, in]`` with std ``in^-0.5`` and a few outlier rows and blocks, as trained weights have."""
        w = self.normal(*shape, std=shape[-1] ** -0.5)
        rows = torch.randint(0, shape[-2], (max(1, shape[-2] // 64),), generator=self.gen)
        w[..., rows, :16] *= 8.0  # one large block per outlier row: stresses per-block scales
        w[..., rows, 16:32] *= 0.01  # and a nearly empty one beside it
        return w

    def activation(self, *shape: int) -> torch.Tensor:
        x = self.normal(*shape)
        channels = torch.randint(0, shape[-1], (max(1, shape[-1] // 128),), generator=self.gen)
        x[..., channels] *= 6.0  # activation outlier channels
        return x


def checkpoint_weight(w: torch.Tensor, fmt: str) -> Any:
    """``w`` as a checkpoint of format ``fmt`` holds it: a bf16 tensor or a QTensor."""
    if fmt in ("bf16", "fp16", "fp32"):
        return w.to({"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[fmt])
    from musecore_quant import quantize
    return quantize(w.float(), fmt, **producer_options(fmt))  # as the loader quantizes (the format's producer)


def static_input_scale(act_format: Optional[str], amax: torch.Tensor) -> Optional[torch.Tensor]:
    """The static activation scale a calibrating producer stores (NVFP4 amax/(6*448), FP8 amax/448);
    ``None`` for dynamic formats (MXFP4) and 16-bit activations."""
    if act_format == "nvfp4":
        from musecore_quant.formats.nvfp4 import nvfp4_input_scale
        return nvfp4_input_scale(amax.float())
    if act_format == "fp8":
        return (amax.float() / FP8_MAX).to(torch.float32)
    return None


def _with_input_scale(qt: Any, scale: Optional[torch.Tensor]) -> Any:
    if scale is None or isinstance(qt, torch.Tensor):
        return qt
    from dataclasses import replace
    return replace(qt, input_scale=scale)


def build(case: ConformanceCase, dtype: torch.dtype = torch.bfloat16) -> BuiltCase:
    """The inputs of ``case`` in activation dtype ``dtype`` (weights keep their checkpoint format)."""
    builder = _BUILDERS[case.op]
    return BuiltCase(case, dtype, builder(case, dtype, _Rand(case.seed)))


def _build_linear(case: ConformanceCase, dtype: torch.dtype, rnd: _Rand) -> Callable:
    k, n, t = case.dim("in"), case.dim("out"), case.dim("tokens")
    x = rnd.activation(1, t, k).to(dtype)
    w = checkpoint_weight(rnd.weight(n, k), case.weight_format)
    w = _with_input_scale(w, static_input_scale(case.act_format, x.float().abs().amax()))

    def run(backend: Any) -> Any:
        prepared = backend.prepare_weight(_to(w, backend.device), case.variant, act_format=case.act_format, dtype=dtype)
        return backend.linear(x.to(backend.device), prepared)
    return run


def _build_moe(case: ConformanceCase, dtype: torch.dtype, rnd: _Rand) -> Callable:
    t, E, k = case.dim("tokens"), case.dim("experts"), case.dim("top_k")
    h, inter = case.dim("moe_hidden"), case.dim("intermediate")
    config = preset(case.size)
    z = ref.rms_norm(rnd.activation(t, h), None, config.rms_norm_eps).to(dtype)  # the model feeds normed inputs
    ids = torch.topk(rnd.normal(t, E), k, dim=-1).indices  # k distinct experts per token
    weights = torch.softmax(rnd.normal(t, k), dim=-1)  # [t,k] fp32, positive, as the router gives
    gate, up, down = rnd.weight(E, inter, h), rnd.weight(E, inter, h), rnd.weight(E, h, inter)
    post_norm = rnd.norm_weight(h).to(dtype)  # 1 + w: one weight shared by the experts
    stacks = [checkpoint_weight(w, case.weight_format) for w in (gate, up, down)]
    if case.act_format in ("nvfp4", "fp8"):  # static per-expert scales, calibrated on these tokens
        zf = z.float()
        act = torch.stack([torch.nn.functional.silu(zf @ gate[e].T) * (zf @ up[e].T) for e in range(E)])  # [E,t,I]
        gate_up_scale = static_input_scale(case.act_format, zf.abs().amax().expand(E).clone())
        down_scale = static_input_scale(case.act_format, act.abs().flatten(1).amax(1))
        stacks = [_with_input_scale(stacks[0], gate_up_scale), _with_input_scale(stacks[1], gate_up_scale),
                  _with_input_scale(stacks[2], down_scale)]

    def run(backend: Any) -> Any:
        dev = backend.device
        experts = backend.prepare_experts(*[_to(s, dev) for s in stacks], act_format=case.act_format, dtype=dtype)
        return backend.moe(z.to(dev), weights.to(dev), ids.to(dev), experts, post_norm.to(dev), config.post_norm_eps)
    return run


def _positions(case: ConformanceCase) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q_pos [B,T], cached slot positions [B,C], new key positions [B,T]); -1 = padding / empty."""
    B, T, C = case.dim("batch"), case.dim("tokens"), case.dim("cached")
    cache, window = case.option("cache", "none"), case.option("window")
    if cache == "none":
        pad = case.option("left_pad", (0,) * B)
        q_pos = torch.stack([torch.cat([torch.full((p,), -1), torch.arange(T - p)]) for p in pad])
        return q_pos, torch.empty(B, 0, dtype=torch.long), q_pos
    slots = torch.full((B, C), -1, dtype=torch.long)
    starts = case.option("next_position")
    for b, start in enumerate(starts):
        held = range(max(0, start - C), start) if cache == "ring" else range(min(start, C))
        for pos in held:
            slots[b, pos % C if cache == "ring" else pos] = pos
    q_pos = torch.stack([torch.arange(s, s + T) for s in starts])
    assert window is None or cache != "ring" or C == window
    return q_pos, slots, q_pos


def _build_attention(case: ConformanceCase, dtype: torch.dtype, rnd: _Rand) -> Callable:
    B, T, C = case.dim("batch"), case.dim("tokens"), case.dim("cached")
    nq, nkv, d = case.dim("q_heads"), case.dim("kv_heads"), case.dim("head_dim")
    q_pos, slot_pos, new_pos = _positions(case)
    k_pos = torch.cat([slot_pos, new_pos], 1)  # what KVLayerCache.view_with hands attention
    S = C + T
    q = rnd.normal(B, T, nq, d).to(dtype)
    k, v = rnd.normal(B, S, nkv, d), rnd.normal(B, S, nkv, d)
    k_scale, v_scale = case.option("k_scale"), case.option("v_scale")
    if case.kv_format == "fp8":
        k = (k / k_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        v = (v / v_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    else:
        k, v = k.to(dtype), v.to(dtype)
    window, scale = case.option("window"), d ** -0.5

    def run(backend: Any) -> Any:
        dev = backend.device
        return backend.attention(q.to(dev), k.to(dev), v.to(dev), q_pos.to(dev), k_pos.to(dev), window, scale,
                                 k_scale, v_scale)
    return run


def _build_rms_norm(case: ConformanceCase, dtype: torch.dtype, rnd: _Rand) -> Callable:
    B, T, n = case.dim("batch"), case.dim("tokens"), case.dim("width")
    x = (3.0 * rnd.activation(B, T, n) + 0.5).to(dtype)
    w = rnd.norm_weight(n).to(dtype) if case.option("weight") else None
    eps, scale_first = preset(case.size).rms_norm_eps, case.option("scale_first", False)

    def run(backend: Any) -> Any:
        dev = backend.device
        return backend.rms_norm(x.to(dev), None if w is None else w.to(dev), eps, scale_first=scale_first)
    return run


def _build_residual_norm(case: ConformanceCase, dtype: torch.dtype, rnd: _Rand) -> Callable:
    B, T, n = case.dim("batch"), case.dim("tokens"), case.dim("width")
    config = preset(case.size)
    residual, out = (4.0 * rnd.activation(B, T, n)).to(dtype), rnd.activation(B, T, n).to(dtype)
    post = rnd.norm_weight(n).to(dtype) if case.option("post_weight") else None
    nxt = rnd.norm_weight(n).to(dtype)
    alpha, beta = ref.residual_gate_coefficients(0.3 * rnd.normal(n), config.residual_gate_temperature)

    def run(backend: Any) -> Any:
        dev = backend.device
        return backend.residual_norm(residual.to(dev), out.to(dev), None if post is None else post.to(dev),
                                     alpha.to(dev), beta.to(dev), nxt.to(dev), config.post_norm_eps,
                                     config.rms_norm_eps)
    return run


def _build_qk_norm_rope(case: ConformanceCase, dtype: torch.dtype, rnd: _Rand) -> Callable:
    B, T, nq, nkv, d = (case.dim(n) for n in ("batch", "tokens", "q_heads", "kv_heads", "head_dim"))
    config = preset(case.size)
    q, k = rnd.activation(B, T, nq, d).to(dtype), rnd.activation(B, T, nkv, d).to(dtype)
    positions = case.option("start", 0) + torch.arange(T)[None].expand(B, T).clone()
    positions[0, 0] = -1  # a padding slot: the table gives position 0
    cos = sin = None
    if case.option("rope"):
        cos, sin = RotaryTable(d, config.rope_parameters, config.max_position_embeddings)(positions)  # fp32

    def run(backend: Any) -> Any:
        dev = backend.device
        move = lambda t: None if t is None else t.to(dev)  # noqa: E731
        return backend.qk_norm_rope(q.to(dev), k.to(dev), move(cos), move(sin), config.rms_norm_eps,
                                    config.qk_scale_factor)
    return run


def _build_head_norm_gate(case: ConformanceCase, dtype: torch.dtype, rnd: _Rand) -> Callable:
    B, T, nq, d = (case.dim(n) for n in ("batch", "tokens", "q_heads", "head_dim"))
    o, gate = rnd.activation(B, T, nq, d).to(dtype), (2.0 * rnd.normal(B, T, nq, d)).to(dtype)
    eps = preset(case.size).rms_norm_eps
    return lambda backend: backend.head_norm_gate(o.to(backend.device), gate.to(backend.device), eps)


def _build_embedding(case: ConformanceCase, dtype: torch.dtype, rnd: _Rand) -> Callable:
    B, T, V, H = (case.dim(n) for n in ("batch", "tokens", "vocab", "width"))
    table = rnd.normal(V, H, std=0.02).to(torch.bfloat16)
    ids = torch.randint(0, V, (B, T), generator=rnd.gen)
    ids[0, 0], ids[-1, -1] = 0, V - 1  # both ends of the table

    def run(backend: Any) -> Any:
        prepared = backend.prepare_weight(table.to(backend.device), "embedding", dtype=dtype)
        return backend.embedding(ids.to(backend.device), prepared)
    return run


def _build_router_topk(case: ConformanceCase, dtype: torch.dtype, rnd: _Rand) -> Callable:
    T, H, E, k = case.dim("tokens"), case.dim("width"), case.dim("experts"), case.dim("top_k")
    config = preset(case.size)
    # x in {-1, 0, 1} and W on a 1/64 grid: every product and partial sum is exact in fp32, so the
    # scores do not depend on the summation order and the top-k is the same on every backend.
    x = torch.randint(-1, 2, (T, H), generator=rnd.gen).to(dtype)
    weight = torch.randint(-32, 33, (E, H), generator=rnd.gen).float() / 64
    tiebreak = torch.randperm(E, generator=rnd.gen).float() / (E * 4096)  # exact ties broken the same way
    bias = tiebreak + (0.05 * rnd.normal(E) if case.option("bias") else 0.0)
    scaling = case.option("scaling", 1.0)
    return lambda backend: backend.router_topk(x.to(backend.device), weight.to(backend.device),
                                               bias.to(backend.device), k, config.output_multiplier, scaling)


def _build_silu_mul(case: ConformanceCase, dtype: torch.dtype, rnd: _Rand) -> Callable:
    T, n = case.dim("tokens"), case.dim("width")
    gate, up = (2.0 * rnd.activation(T, n)).to(dtype), rnd.activation(T, n).to(dtype)
    return lambda backend: backend.silu_mul(gate.to(backend.device), up.to(backend.device))


def _build_logit_softcap(case: ConformanceCase, dtype: torch.dtype, rnd: _Rand) -> Callable:
    B, T, V = case.dim("batch"), case.dim("tokens"), case.dim("vocab")
    config = preset(case.size)
    logits = (30.0 * rnd.normal(B, T, V)).to(dtype)  # beyond the cap, so tanh saturates somewhere
    return lambda backend: backend.logit_softcap(logits.to(backend.device), config.output_multiplier,
                                                 config.final_logit_softcapping)


def _build_sample(case: ConformanceCase, dtype: torch.dtype, rnd: _Rand) -> Callable:
    B, V = case.dim("batch"), case.dim("vocab")
    logits = 3.0 * rnd.normal(B, V)  # fp32: the model's logits are fp32 whatever its dtype
    opts = dict(case.options)

    def run(backend: Any) -> Any:
        gen = torch.Generator(device=backend.device).manual_seed(case.seed)
        return backend.sample(logits.to(backend.device), opts["temperature"], opts["top_k"], opts["top_p"], gen)
    return run


def _build_layer_norm(case: ConformanceCase, dtype: torch.dtype, rnd: _Rand) -> Callable:
    T, n = case.dim("tokens"), case.dim("width")
    x = (3.0 * rnd.activation(T, n) + 0.5).to(dtype)  # an offset the mean must remove
    weight = bias = None
    if case.option("affine"):
        weight, bias = rnd.norm_weight(n).to(dtype), (0.1 * rnd.normal(n)).to(dtype)
    eps = case.option("eps")

    def run(backend: Any) -> Any:
        move = lambda t: None if t is None else t.to(backend.device)  # noqa: E731
        return backend.layer_norm(x.to(backend.device), move(weight), move(bias), eps)
    return run


def _build_gelu(case: ConformanceCase, dtype: torch.dtype, rnd: _Rand) -> Callable:
    x = (2.0 * rnd.activation(case.dim("tokens"), case.dim("width"))).to(dtype)
    approximate = case.option("approximate")
    return lambda backend: backend.gelu(x.to(backend.device), approximate)


def _build_varlen_attention(case: ConformanceCase, dtype: torch.dtype, rnd: _Rand) -> Callable:
    N, nh, d = case.dim("tokens"), case.dim("heads"), case.dim("head_dim")
    q, k, v = (rnd.normal(N, nh, d).to(dtype) for _ in range(3))
    lengths = torch.tensor((0,) + tuple(case.option("segments")))
    cu_seqlens = lengths.cumsum(0).to(torch.int32)  # [S+1], from 0 to N

    def run(backend: Any) -> Any:
        dev = backend.device
        return backend.varlen_attention(q.to(dev), k.to(dev), v.to(dev), cu_seqlens.to(dev), d ** -0.5)
    return run


def _build_causal_conv1d(case: ConformanceCase, dtype: torch.dtype, rnd: _Rand) -> Callable:
    B, C, T, K = (case.dim(n) for n in ("batch", "channels", "time", "kernel"))
    if case.option("layout") == "btc":  # the audio tower's [B,T,C] activations, seen as [B,C,T] (a strided view)
        x = rnd.activation(B, T, C).to(dtype).transpose(1, 2)
    else:
        x = rnd.activation(B, C, T).to(dtype)
    weight = rnd.normal(C, 1, K, std=K ** -0.5).to(dtype)
    bias = (0.1 * rnd.normal(C)).to(dtype) if case.option("bias", True) else None
    state = rnd.activation(B, C, K - 1).to(dtype) if case.option("state") else None  # a previous chunk's tail

    def run(backend: Any) -> Any:
        move = lambda t: None if t is None else t.to(backend.device)  # noqa: E731
        return backend.causal_conv1d(x.to(backend.device), move(weight), move(bias), move(state))
    return run


def _build_rope(case: ConformanceCase, dtype: torch.dtype, rnd: _Rand) -> Callable:
    N, nh, d = case.dim("tokens"), case.dim("heads"), case.dim("head_dim")
    x = rnd.activation(N, nh, d).to(dtype)
    # The vision tower's axial table: (h, w) patch positions (+1), d/4 frequencies each, [h | w] twice.
    spatial = d // 2
    inv_freq = 1.0 / (case.option("theta") ** (torch.arange(0, spatial, 2).float() / spatial))
    positions = torch.randint(1, 33, (N, 2), generator=rnd.gen).float()
    freqs = (positions[..., None] * inv_freq).flatten(1)  # [N, d/2]: h frequencies then w frequencies
    angles = torch.cat([freqs, freqs], dim=-1)  # [N, d]
    cos, sin = angles.cos(), angles.sin()
    if case.option("table") == "activation":  # the table in the model dtype, as the vision tower builds it
        cos, sin = cos.to(dtype), sin.to(dtype)

    def run(backend: Any) -> Any:
        dev = backend.device
        return backend.rope(x.to(dev), cos.to(dev), sin.to(dev))
    return run


_BUILDERS: dict[str, Callable[[ConformanceCase, torch.dtype, _Rand], Callable]] = {
    "linear": _build_linear, "moe": _build_moe, "attention": _build_attention, "rms_norm": _build_rms_norm,
    "residual_norm": _build_residual_norm, "qk_norm_rope": _build_qk_norm_rope,
    "head_norm_gate": _build_head_norm_gate, "embedding": _build_embedding, "router_topk": _build_router_topk,
    "silu_mul": _build_silu_mul, "logit_softcap": _build_logit_softcap, "sample": _build_sample,
    "layer_norm": _build_layer_norm, "gelu": _build_gelu, "varlen_attention": _build_varlen_attention,
    "causal_conv1d": _build_causal_conv1d, "rope": _build_rope,
}
