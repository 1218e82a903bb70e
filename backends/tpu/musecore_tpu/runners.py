"""Where the kernels run: torch custom ops (:mod:`musecore_tpu.torch_tpu_ops`) whose kernels are the Pallas ones,
compiled by Mosaic on a TPU host (torch_tpu's ``jax_op``), or in a Pallas interpreter on the CPU.

:class:`OpsRunner` takes and returns torch tensors with the op contracts of :mod:`musecore.ops` and calls one set of
registered ops, so :class:`musecore_tpu.TpuBackend` and ``torch.compile`` see the same custom ops on both: on the CPU
(every test of this package) the ops' kernels run through DLPack in the interpreter; on a TPU they never have run.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch


class OpsRunner:
    """The backend's ops as calls of registered custom ops: ``ops`` from :func:`musecore_tpu.torch_tpu_ops.register`
    (TPU) or :func:`~musecore_tpu.torch_tpu_ops.register_interpret` (CPU)."""

    def __init__(self, ops: dict[str, Callable[..., Any]], where: str) -> None:
        self.ops, self.where = ops, where

    @classmethod
    def interpret(cls, interpreter: str = "tpu") -> "OpsRunner":
        """The CPU runner: ``interpreter`` ``"tpu"`` (JAX's TPU interpreter) or ``"jax"`` (Pallas' generic one)."""
        from musecore_tpu.torch_tpu_ops import register_interpret
        where = "JAX's TPU interpreter on the CPU" if interpreter == "tpu" else "Pallas' generic interpreter"
        return cls(register_interpret(interpreter), where)

    @classmethod
    def torch_tpu(cls) -> "OpsRunner":
        """The TPU runner (never run: written against torch-tpu 0.2.0's ``jax_op`` without a TPU)."""
        from musecore_tpu.torch_tpu_ops import register
        return cls(register(), "torch_tpu custom ops on the TPU (never run)")

    def resident(self, tensors: dict[str, Optional[torch.Tensor]]) -> dict[str, Optional[torch.Tensor]]:
        return tensors

    def linear(self, x2d, resident, fmt, group):
        if "wt" in resident:
            return self.ops["linear_dense"](x2d, resident["wt"])
        return self.ops["linear_packed"](x2d, resident["codes"], resident["scales"], resident["zeros"],
                                         resident["global_scale"], fmt, group)

    def linear_q8(self, x2d, resident, fmt, act):
        return self.ops["linear_q8"](x2d, resident["q8"], resident["wscale"], fmt, act or "")

    def moe(self, z, weights, ids, gate, up, down, post_norm, fmt, group, eps, act=None):
        ids = ids.to(torch.int32)
        if "q8" in gate:
            return self.ops["moe_q8"](z, weights.float(), ids, gate["q8"], gate["wscale"], up["q8"], up["wscale"],
                                      down["q8"], down["wscale"], post_norm, fmt, eps, act or "")
        if "wt" in gate:
            return self.ops["moe_dense"](z, weights.float(), ids, gate["wt"], up["wt"], down["wt"], post_norm, eps)
        parts = [w[n] for w in (gate, up, down) for n in ("codes", "scales", "zeros", "global_scale")]
        return self.ops["moe_packed"](z, weights.float(), ids, *parts, post_norm, fmt, group, eps)

    def attention(self, q, k, v, q_pos, k_pos, window, scale, k_scale, v_scale):
        return self.ops["attention"](q, k, v, q_pos.to(torch.int32), k_pos.to(torch.int32),
                                     -1 if window is None else window, scale, k_scale, v_scale)

    def rms_norm(self, x, weight, eps, scale_first):
        return self.ops["rms_norm"](x, weight, eps, scale_first)

    def residual_norm(self, residual, out, post_weight, alpha, beta, next_weight, post_eps, eps):
        return self.ops["residual_norm"](residual, out, post_weight, alpha, beta, next_weight, post_eps, eps)
