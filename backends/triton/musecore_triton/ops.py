"""The ops a GPU backend runs with the shared Triton kernels unchanged, as ``Backend`` methods.

A vendor backend mixes :class:`TritonOps` in before :class:`musecore.backends.base.Backend`
(``class RocmBackend(TritonOps, Backend)``) and keeps for itself what differs by vendor: the
linears, the MoE and the weight layouts. Its ``supports()`` still decides which of these it claims.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from musecore.ops import Weight
from musecore.ops import reference as ref
from musecore_triton.kernels import attention, elementwise, kv_cache, norms, router


class TritonOps:
    """Embedding, norms, router top-k, elementwise, attention, the static KV-cache write and sampling."""

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
