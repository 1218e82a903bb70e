"""The reference backend: every op from ``musecore.ops.reference``, on the CPU (or any torch device).

It is registered through the same ``musecore.backends`` entry point as the hardware plugins, runs
every format by dequantizing weights once at load to fp32 (exact: every format's values are
representable in fp32), and fake-quantizes activations for W4A4 targets, which is what makes
emulation of another device bit-faithful to that device's numerics.
"""

from __future__ import annotations

from typing import Optional

import torch
from musecore_quant import QTensor

from musecore.backends.base import Backend, Probe, Support, WeightIn, expert_format
from musecore.ops import ExpertWeights, OpSpec, Weight
from musecore.ops import reference as ref


def weight_format_of(weight: WeightIn) -> str:
    if isinstance(weight, torch.Tensor):
        return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(weight.dtype, str(weight.dtype))
    return weight.format


def dense_values(weight: WeightIn, dtype: torch.dtype) -> torch.Tensor:
    """A dense tensor with the weight's exact values: quantized formats dequantize to fp32.

    Always a fresh contiguous allocation: a checkpoint tensor can be a view into its shard's read
    buffer (keeping the whole shard alive) at any byte offset, and CPU GEMMs round differently at
    other alignments, which would make the same weights give other last bits in another sharding."""
    if isinstance(weight, torch.Tensor):
        values = weight.to(dtype).contiguous()
        return values.clone() if values.data_ptr() == weight.data_ptr() else values
    from musecore_quant import dequantize
    return dequantize(weight, torch.float32)


class ReferenceBackend(Backend):
    name = "reference"
    verified_on = ("run on x86-64 CPUs; plain PyTorch with nothing chip-specific (the oracle every backend is checked "
                   "against)")

    def probe(self) -> Probe:
        return Probe(available=True, score=1, devices=["cpu"],
                     reason="plain PyTorch with fp32 math; runs anywhere, slowly")

    def supports(self, op: str, spec: OpSpec) -> Support:
        return Support.native("plain PyTorch reference (fp32 math)")

    def prepare_weight(self, weight: WeightIn, role: str, *, act_format: Optional[str] = None,
                       dtype: torch.dtype = torch.bfloat16) -> Weight:
        data = dense_values(weight, dtype).to(self.device)
        input_scale = getattr(weight, "input_scale", None)
        return Weight(data=data, format=weight_format_of(weight if isinstance(weight, QTensor) else data), out_features=data.shape[-2] if data.dim() > 1 else 1,
                      in_features=data.shape[-1], act_format=act_format, input_scale=input_scale)

    def prepare_experts(self, gate: WeightIn, up: WeightIn, down: WeightIn, *,
                        act_format: Optional[str] = None, dtype: torch.dtype = torch.bfloat16) -> ExpertWeights:
        fmt = expert_format(weight_format_of(w) for w in (gate, up, down))
        values = [dense_values(w, dtype).to(self.device) for w in (gate, up, down)]
        return ExpertWeights(gate=values[0], up=values[1], down=values[2],
                             format=fmt if isinstance(gate, QTensor) else weight_format_of(values[0]),
                             num_experts=values[0].shape[0], act_format=act_format,
                             gate_up_input_scale=getattr(gate, "input_scale", None),
                             down_input_scale=getattr(down, "input_scale", None))

    def resident_bytes(self, weight_format: str, out_features: int, in_features: int, *,
                       experts: int = 0) -> Optional[int]:
        """Quantized weights are kept dequantized to fp32 (exact values); 16-bit ones as they come (None)."""
        from musecore_quant.formats.facts import facts, weight_bytes
        if not facts(weight_format).quantized:
            return None
        return weight_bytes("fp32", out_features * in_features * max(experts, 1))

    embedding = staticmethod(ref.embedding)
    rms_norm = staticmethod(ref.rms_norm)
    residual_norm = staticmethod(ref.residual_norm)
    qk_norm_rope = staticmethod(ref.qk_norm_rope)
    attention = staticmethod(ref.attention)
    head_norm_gate = staticmethod(ref.head_norm_gate)
    linear = staticmethod(ref.linear)
    router_topk = staticmethod(ref.router_topk)
    moe = staticmethod(ref.moe)
    silu_mul = staticmethod(ref.silu_mul)
    logit_softcap = staticmethod(ref.logit_softcap)
    sample = staticmethod(ref.sample)
    layer_norm = staticmethod(ref.layer_norm)
    gelu = staticmethod(ref.gelu)
    varlen_attention = staticmethod(ref.varlen_attention)
    causal_conv1d = staticmethod(ref.causal_conv1d)
    rope = staticmethod(ref.rope)
