"""Where the kernels run: JAX's TPU interpreter on the CPU (tests, CI), or torch_tpu custom ops on a TPU host.

Both take and return torch tensors with the op contracts of :mod:`musecore.ops`, so
:class:`musecore_tpu.TpuBackend` does not know which one it drives. :class:`InterpretRunner` has run (every test
of this package); :class:`TorchTpuRunner` has not: no TPU was reachable when it was written.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from musecore_tpu.bridge import to_jax, to_torch, tree_to_jax


class InterpretRunner:
    """torch CPU tensors -> DLPack -> the Pallas kernels in interpret mode -> torch. ``interpreter``: ``"tpu"``
    (JAX's TPU interpreter, the default) or ``"jax"`` (Pallas' generic one, faster; see
    :func:`musecore_tpu.kernels.matmul.interpret_mode`)."""

    def __init__(self, interpreter: str = "tpu") -> None:
        if interpreter not in ("tpu", "jax"):
            raise ValueError(f"interpreter must be 'tpu' or 'jax'; got {interpreter!r}")
        self.interpret = interpreter
        self.where = "JAX's TPU interpreter on the CPU" if interpreter == "tpu" else "Pallas' generic interpreter"

    def resident(self, tensors: dict[str, Optional[torch.Tensor]]) -> dict[str, Any]:
        return tree_to_jax(tensors)

    def linear(self, x2d: torch.Tensor, resident: dict, fmt: str, group: int) -> torch.Tensor:
        from musecore_tpu.kernels.matmul import matmul
        return to_torch(matmul(to_jax(x2d), resident, fmt=fmt, group=group, out_dtype=to_jax(x2d).dtype,
                               interpret=self.interpret))

    def moe(self, z: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate: dict, up: dict, down: dict,
            post_norm: torch.Tensor, fmt: str, group: int, eps: float) -> torch.Tensor:
        from musecore_tpu.kernels.moe import moe
        return to_torch(moe(to_jax(z), to_jax(weights.float()), to_jax(ids), gate, up, down, to_jax(post_norm),
                            fmt=fmt, group=group, eps=float(eps), interpret=self.interpret))

    def attention(self, q, k, v, q_pos, k_pos, window, scale, k_scale, v_scale) -> torch.Tensor:
        from musecore_tpu.kernels.attention import attention
        return to_torch(attention(to_jax(q), to_jax(k), to_jax(v), to_jax(q_pos), to_jax(k_pos), window=window,
                                  scale=float(scale), k_scale=float(k_scale), v_scale=float(v_scale),
                                  interpret=self.interpret))

    def rms_norm(self, x, weight, eps, scale_first) -> torch.Tensor:
        from musecore_tpu.kernels.norms import rms_norm
        return to_torch(rms_norm(to_jax(x), to_jax(weight), eps=float(eps), scale_first=scale_first, interpret=self.interpret))

    def residual_norm(self, residual, out, post_weight, alpha, beta, next_weight, post_eps, eps):
        from musecore_tpu.kernels.norms import residual_norm
        new_res, normed = residual_norm(to_jax(residual), to_jax(out), to_jax(post_weight), to_jax(alpha),
                                        to_jax(beta), to_jax(next_weight), post_eps=float(post_eps), eps=float(eps),
                                        interpret=self.interpret)
        return to_torch(new_res), to_torch(normed)


class TorchTpuRunner:
    """torch tensors on the ``tpu`` device -> ``torch.ops.musecore_tpu.*`` (:mod:`musecore_tpu.torch_tpu_ops`).
    Never run: written against torch-tpu 0.2.0's ``jax_op`` without a TPU."""

    interpret = False
    where = "torch_tpu custom ops on the TPU (never run)"

    def __init__(self) -> None:
        from musecore_tpu.torch_tpu_ops import register
        self.ops = register()

    def resident(self, tensors: dict[str, Optional[torch.Tensor]]) -> dict[str, Any]:
        return tensors

    def linear(self, x2d, resident, fmt, group):
        if "wt" in resident:
            return self.ops["linear_dense"](x2d, resident["wt"])
        return self.ops["linear_packed"](x2d, resident["codes"], resident["scales"], resident["zeros"],
                                         resident["global_scale"], fmt, group)

    def moe(self, z, weights, ids, gate, up, down, post_norm, fmt, group, eps):
        ids = ids.to(torch.int32)
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
