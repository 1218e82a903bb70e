"""The kernels as torch custom ops on a TPU host, through torch_tpu's JAX bridge. NEVER RUN: no TPU was reachable.

``torch_tpu._internal.pallas.jax_op(name, fn)`` (torch-tpu 0.2.0) wraps a JAX function whose arguments are
annotated (``jax.Array``, ``int``, ``float``, ``bool``, ``str``; non-array ones become static) as a
``torch.library.custom_op``; torch tensors on the ``tpu`` device go in and out without copies. Its default fake
kernel lowers the JAX function with placeholder shapes, which refuses symbolic dimensions, so each op here gets
its own fake (meta) kernel computing only the output shape, and ``torch.compile(backend="tpu")`` can trace a
decode step with a dynamic token count.

Importable without torch_tpu: :func:`register` raises :class:`TorchTpuUnavailable` with the reason.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any, Callable, Optional

import torch

try:  # module-level so jax_op can evaluate the annotations below (it reads fn.__globals__)
    import jax
except ImportError:  # the reason is reported by unavailable_reason()
    jax = None

NAMESPACE = "musecore_tpu"


class TorchTpuUnavailable(RuntimeError):
    pass


def unavailable_reason() -> Optional[str]:
    """Why the custom ops cannot be registered here, or None."""
    if importlib.util.find_spec("torch_tpu") is None:
        return "torch_tpu not installed (pip install 'musecore-tpu[tpu]' on a TPU host)"
    if importlib.util.find_spec("jax") is None:
        return "jax not installed"
    return None


def _fake_linear(x: torch.Tensor, w: torch.Tensor, *_: Any) -> torch.Tensor:
    return x.new_empty((x.shape[0], w.shape[-1]))


def _fake_like_first(x: torch.Tensor, *_: Any) -> torch.Tensor:
    return torch.empty_like(x)


def _fake_pair(residual: torch.Tensor, *_: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(residual), torch.empty_like(residual)


def _fake_moe(z: torch.Tensor, *_: Any) -> torch.Tensor:
    return z.new_empty(z.shape, dtype=torch.float32)


@functools.cache
def register() -> dict[str, Callable[..., Any]]:
    """Register every kernel as ``torch.ops.musecore_tpu.<name>``; returns ``{op: callable}``. Raises
    :class:`TorchTpuUnavailable` when torch_tpu or jax is missing."""
    reason = unavailable_reason()
    if reason is not None:
        raise TorchTpuUnavailable(reason)
    from torch_tpu._internal.pallas import jax_op

    from musecore_tpu.kernels import attention as att
    from musecore_tpu.kernels import matmul as mm
    from musecore_tpu.kernels import moe as me
    from musecore_tpu.kernels import norms as nr

    def linear_dense(x: jax.Array, wt: jax.Array) -> jax.Array:
        return mm.matmul(x, {"wt": wt}, fmt="bf16", out_dtype=x.dtype)

    def linear_packed(x: jax.Array, codes: jax.Array, scales: jax.Array, zeros: Optional[jax.Array],
                      global_scale: Optional[jax.Array], fmt: str, group: int) -> jax.Array:
        w = {"codes": codes, "scales": scales, "zeros": zeros, "global_scale": global_scale}
        return mm.matmul(x, w, fmt=fmt, group=group, out_dtype=x.dtype)

    def attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, k_pos: jax.Array, window: int,
                  scale: float, k_scale: float, v_scale: float) -> jax.Array:
        return att.attention(q, k, v, q_pos, k_pos, window=None if window <= 0 else window, scale=scale,
                             k_scale=k_scale, v_scale=v_scale)

    def rms_norm(x: jax.Array, weight: Optional[jax.Array], eps: float, scale_first: bool) -> jax.Array:
        return nr.rms_norm(x, weight, eps=eps, scale_first=scale_first)

    def residual_norm(residual: jax.Array, out: jax.Array, post_weight: Optional[jax.Array], alpha: jax.Array,
                      beta: jax.Array, next_weight: jax.Array, post_eps: float, eps: float
                      ) -> tuple[jax.Array, jax.Array]:
        return nr.residual_norm(residual, out, post_weight, alpha, beta, next_weight, post_eps=post_eps, eps=eps)

    def moe_dense(z: jax.Array, weights: jax.Array, ids: jax.Array, gate: jax.Array, up: jax.Array,
                  down: jax.Array, post_norm: jax.Array, eps: float) -> jax.Array:
        return me.moe(z, weights, ids, {"wt": gate}, {"wt": up}, {"wt": down}, post_norm, fmt="bf16", eps=eps)

    def moe_packed(z: jax.Array, weights: jax.Array, ids: jax.Array,
                   gate_codes: jax.Array, gate_scales: jax.Array, gate_zeros: Optional[jax.Array],
                   gate_global: Optional[jax.Array], up_codes: jax.Array, up_scales: jax.Array,
                   up_zeros: Optional[jax.Array], up_global: Optional[jax.Array], down_codes: jax.Array,
                   down_scales: jax.Array, down_zeros: Optional[jax.Array], down_global: Optional[jax.Array],
                   post_norm: jax.Array, fmt: str, group: int, eps: float) -> jax.Array:
        pack = lambda c, s, zr, g: {"codes": c, "scales": s, "zeros": zr, "global_scale": g}  # noqa: E731
        return me.moe(z, weights, ids, pack(gate_codes, gate_scales, gate_zeros, gate_global),
                      pack(up_codes, up_scales, up_zeros, up_global),
                      pack(down_codes, down_scales, down_zeros, down_global), post_norm, fmt=fmt, group=group, eps=eps)

    ops = {"linear_dense": (linear_dense, _fake_linear), "linear_packed": (linear_packed, _fake_linear),
           "attention": (attention, _fake_like_first), "rms_norm": (rms_norm, _fake_like_first),
           "residual_norm": (residual_norm, _fake_pair), "moe_dense": (moe_dense, _fake_moe),
           "moe_packed": (moe_packed, _fake_moe)}
    registered = {}
    for name, (fn, fake) in ops.items():
        op = jax_op(f"{NAMESPACE}::{name}", fn)
        op.register_fake(fake)  # shapes only: dynamic token counts trace under torch.compile
        registered[name] = op
    return registered
