"""The ops a GPU backend runs with the shared Triton kernels unchanged, as ``Backend`` methods.

A vendor backend mixes :class:`TritonOps` in before :class:`musecore.backends.base.Backend`
(``class RocmBackend(TritonOps, Backend)``) and keeps for itself what differs by vendor: the
linears, the MoE and the weight layouts. Its ``supports()`` still decides which of these it claims.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from musecore.ops import ExpertWeights, OpSpec, Weight
from musecore.ops import reference as ref
from musecore_triton import towers
from musecore_triton.kernels import attention, elementwise, kv_cache, norms, router

DENSE_FORMATS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DTYPE_FORMAT = {dtype: name for name, dtype in DENSE_FORMATS.items()}
ACT_DTYPES = (torch.bfloat16, torch.float16)
HEAD_OPS = ("attention", "qk_norm_rope", "head_norm_gate")  # one program holds one power-of-two head row
KV_FORMATS = ("bf16", "fp16", "fp8")


def format_of(weight) -> str:
    """A checkpoint weight's format: a dense tensor's by its dtype, a ``QTensor``'s own."""
    if isinstance(weight, torch.Tensor):
        if weight.dtype in DTYPE_FORMAT:
            return DTYPE_FORMAT[weight.dtype]
        raise TypeError(f"dense weights must be bf16, fp16 or fp32; got {weight.dtype}")
    return weight.format


def dense_weight(weight: torch.Tensor, device: torch.device, dtype: torch.dtype) -> Weight:
    """A dense linear weight kept in the model dtype on ``device``, and labelled so (the plan keys linears by it)."""
    data = weight.to(device=device, dtype=dtype).contiguous()
    return Weight(data=data, format=DTYPE_FORMAT[dtype], out_features=data.shape[0] if data.dim() > 1 else 1,
                  in_features=data.shape[-1])


def dense_experts(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, device: torch.device,
                  dtype: torch.dtype) -> ExpertWeights:
    """Dense expert stacks ``[E, ., .]`` in the model dtype on ``device``, labelled like :func:`dense_weight`."""
    stacks = [w.to(device=device, dtype=dtype).contiguous() for w in (gate, up, down)]
    return ExpertWeights(gate=stacks[0], up=stacks[1], down=stacks[2], format=DTYPE_FORMAT[dtype],
                         num_experts=stacks[0].shape[0])


def shared_kernel_limit(op: str, spec: OpSpec) -> Optional[str]:
    """Why the shared Triton kernel of ``op`` cannot run ``spec`` (KV format, head dim), or None."""
    if op == "attention" and spec.kv_format not in KV_FORMATS:
        return f"KV cache format {spec.kv_format!r} is not implemented ({', '.join(KV_FORMATS)} are)"
    if op in towers.TOWER_REASONS:
        return towers.tower_kernel_limit(op, dict(spec.shape))
    head_dim = dict(spec.shape).get("head_dim")
    if op in HEAD_OPS and head_dim is not None and (head_dim & (head_dim - 1) or head_dim < 16):
        return f"the shared {op} Triton kernel needs a power-of-two head dim >= 16; got {head_dim}"
    return None


class TritonOps:
    """Embedding, norms, router top-k, elementwise, attention, the static KV-cache write and sampling, and the
    towers' ops (:mod:`musecore_triton.towers`; ``TOWER_REASONS`` says what each is, for ``supports()``)."""

    @staticmethod
    def embedding(ids: torch.Tensor, table: Weight) -> torch.Tensor:
        return F.embedding(ids, table.data)

    rms_norm = staticmethod(norms.rms_norm)
    residual_norm = staticmethod(norms.residual_norm)
    qk_norm_rope = staticmethod(norms.qk_norm_rope)
    head_norm_gate = staticmethod(norms.head_norm_gate)
    router_topk = staticmethod(router.router_topk)
    silu_mul = staticmethod(elementwise.silu_mul)
    logit_softcap = staticmethod(elementwise.logit_softcap)
    attention = staticmethod(attention.attention)
    kv_write = staticmethod(kv_cache.kv_write)  # static KV cache writes (musecore.kv_cache.write_static)
    sample = staticmethod(ref.sample)
    layer_norm = staticmethod(towers.layer_norm)
    gelu = staticmethod(towers.gelu)
    varlen_attention = staticmethod(towers.varlen_attention)
    causal_conv1d = staticmethod(towers.causal_conv1d)
    rope = staticmethod(towers.rope)
