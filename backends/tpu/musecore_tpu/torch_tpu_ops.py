"""The kernels as torch custom ops: on a TPU host through torch_tpu's JAX bridge (NEVER RUN: no TPU was reachable),
and on a CPU through the same op definitions with the kernels in a Pallas interpreter (every CPU test runs them).

``torch_tpu._internal.pallas.jax_op(name, fn)`` (torch-tpu 0.2.0) wraps a JAX function whose arguments are
annotated (``jax.Array``, ``int``, ``float``, ``bool``, ``str``; non-array ones become static) as a
``torch.library.custom_op``; torch tensors on the ``tpu`` device go in and out without copies. Its default fake
kernel lowers the JAX function with placeholder shapes, which refuses symbolic dimensions, so each op here gets
its own fake (meta) kernel computing only the output shape, and ``torch.compile(backend="tpu")`` can trace a
decode step with a dynamic token count.

On a CPU, :func:`register_interpret` registers the same seven JAX functions, the same schemas (derived from the
same annotations) and the same fakes under ``musecore_tpu_interpret_<mode>::*``; their real kernel hands the
torch tensors to JAX through DLPack (:mod:`musecore_tpu.bridge`). So the backend's glue, the op signatures and the
fakes that ``torch.compile`` traces with are exercised here exactly as a TPU host would use them; only the
``jax_op`` call itself and the device differ.

Importable without torch_tpu: :func:`register` raises :class:`TorchTpuUnavailable` with the reason.
"""

from __future__ import annotations

import functools
import importlib.util
import typing
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


def _jax_functions(interpret: Any) -> dict[str, tuple[Callable[..., Any], Callable[..., Any]]]:
    """``{op: (annotated JAX function, fake kernel)}``; ``interpret`` is the kernels' ``interpret=`` (False on a TPU)."""
    from musecore_tpu.kernels import attention as att
    from musecore_tpu.kernels import matmul as mm
    from musecore_tpu.kernels import moe as me
    from musecore_tpu.kernels import norms as nr
    from musecore_tpu.kernels import quantized as qz

    def linear_dense(x: jax.Array, wt: jax.Array) -> jax.Array:
        return mm.matmul(x, {"wt": wt}, fmt="bf16", out_dtype=x.dtype, interpret=interpret)

    def linear_packed(x: jax.Array, codes: jax.Array, scales: jax.Array, zeros: Optional[jax.Array],
                      global_scale: Optional[jax.Array], fmt: str, group: int) -> jax.Array:
        w = {"codes": codes, "scales": scales, "zeros": zeros, "global_scale": global_scale}
        return mm.matmul(x, w, fmt=fmt, group=group, out_dtype=x.dtype, interpret=interpret)

    def linear_q8(x: jax.Array, q8: jax.Array, wscale: jax.Array, fmt: str, act: str) -> jax.Array:
        return qz.matmul_q8(x, {"q8": q8, "wscale": wscale}, fmt=fmt, act=act or None, out_dtype=x.dtype,
                            interpret=interpret)

    def attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, k_pos: jax.Array, window: int,
                  scale: float, k_scale: float, v_scale: float) -> jax.Array:
        return att.attention(q, k, v, q_pos, k_pos, window=None if window <= 0 else window, scale=scale,
                             k_scale=k_scale, v_scale=v_scale, interpret=interpret)

    def rms_norm(x: jax.Array, weight: Optional[jax.Array], eps: float, scale_first: bool) -> jax.Array:
        return nr.rms_norm(x, weight, eps=eps, scale_first=scale_first, interpret=interpret)

    def residual_norm(residual: jax.Array, out: jax.Array, post_weight: Optional[jax.Array], alpha: jax.Array,
                      beta: jax.Array, next_weight: jax.Array, post_eps: float, eps: float
                      ) -> tuple[jax.Array, jax.Array]:
        return nr.residual_norm(residual, out, post_weight, alpha, beta, next_weight, post_eps=post_eps, eps=eps,
                                interpret=interpret)

    def moe_dense(z: jax.Array, weights: jax.Array, ids: jax.Array, gate: jax.Array, up: jax.Array,
                  down: jax.Array, post_norm: jax.Array, eps: float) -> jax.Array:
        return me.moe(z, weights, ids, {"wt": gate}, {"wt": up}, {"wt": down}, post_norm, fmt="bf16", eps=eps,
                      interpret=interpret)

    def moe_q8(z: jax.Array, weights: jax.Array, ids: jax.Array, gate_q8: jax.Array, gate_scale: jax.Array,
               up_q8: jax.Array, up_scale: jax.Array, down_q8: jax.Array, down_scale: jax.Array,
               post_norm: jax.Array, fmt: str, eps: float, act: str) -> jax.Array:
        pack = lambda q, sc: {"q8": q, "wscale": sc}  # noqa: E731
        return me.moe(z, weights, ids, pack(gate_q8, gate_scale), pack(up_q8, up_scale), pack(down_q8, down_scale),
                      post_norm, fmt=fmt, eps=eps, act=act or None, interpret=interpret)

    def moe_packed(z: jax.Array, weights: jax.Array, ids: jax.Array,
                   gate_codes: jax.Array, gate_scales: jax.Array, gate_zeros: Optional[jax.Array],
                   gate_global: Optional[jax.Array], up_codes: jax.Array, up_scales: jax.Array,
                   up_zeros: Optional[jax.Array], up_global: Optional[jax.Array], down_codes: jax.Array,
                   down_scales: jax.Array, down_zeros: Optional[jax.Array], down_global: Optional[jax.Array],
                   post_norm: jax.Array, fmt: str, group: int, eps: float) -> jax.Array:
        pack = lambda c, s, zr, g: {"codes": c, "scales": s, "zeros": zr, "global_scale": g}  # noqa: E731
        return me.moe(z, weights, ids, pack(gate_codes, gate_scales, gate_zeros, gate_global),
                      pack(up_codes, up_scales, up_zeros, up_global),
                      pack(down_codes, down_scales, down_zeros, down_global), post_norm, fmt=fmt, group=group, eps=eps,
                      interpret=interpret)

    return {"linear_dense": (linear_dense, _fake_linear), "linear_packed": (linear_packed, _fake_linear),
            "linear_q8": (linear_q8, _fake_linear),
            "attention": (attention, _fake_like_first), "rms_norm": (rms_norm, _fake_like_first),
            "residual_norm": (residual_norm, _fake_pair), "moe_dense": (moe_dense, _fake_moe), "moe_q8": (moe_q8, _fake_moe),
            "moe_packed": (moe_packed, _fake_moe)}


def _register_all(namespace: str, jax_op: Callable[[str, Callable[..., Any]], Any], interpret: Any
                  ) -> dict[str, Callable[..., Any]]:
    registered = {}
    for name, (fn, fake) in _jax_functions(interpret).items():
        op = jax_op(f"{namespace}::{name}", fn)
        op.register_fake(fake)  # shapes only: dynamic token counts trace under torch.compile
        registered[name] = op
    return registered


@functools.cache
def register() -> dict[str, Callable[..., Any]]:
    """Register every kernel as ``torch.ops.musecore_tpu.<name>`` through torch_tpu's ``jax_op``; returns
    ``{op: callable}``. Raises :class:`TorchTpuUnavailable` when torch_tpu or jax is missing."""
    reason = unavailable_reason()
    if reason is not None:
        raise TorchTpuUnavailable(reason)
    from torch_tpu._internal.pallas import jax_op
    return _register_all(NAMESPACE, jax_op, False)


_SCHEMA_TYPES = {int: "int", float: "float", bool: "bool", str: "str"}


def _schema_type(hint: Any) -> str:
    """A torch schema type of one annotation: ``jax.Array`` -> Tensor, ``Optional[jax.Array]`` -> Tensor?."""
    args = typing.get_args(hint)
    if type(None) in args:
        (inner,) = [a for a in args if a is not type(None)]
        return _schema_type(inner) + "?"
    if typing.get_origin(hint) is tuple:
        return "(" + ", ".join(_schema_type(a) for a in args) + ")"
    if hint is jax.Array:
        return "Tensor"
    return _SCHEMA_TYPES[hint]


def schema_of(fn: Callable[..., Any]) -> str:
    """``(Tensor x, Tensor? w, float eps) -> Tensor`` from a JAX function's annotations (what ``jax_op`` reads)."""
    hints = typing.get_type_hints(fn)
    ret = hints.pop("return")
    return "(" + ", ".join(f"{_schema_type(h)} {n}" for n, h in hints.items()) + ") -> " + _schema_type(ret)


def interpret_jax_op(name: str, fn: Callable[..., Any]) -> Any:
    """``jax_op``'s CPU counterpart: a ``torch.library.custom_op`` whose kernel runs ``fn`` on DLPack views of the
    CPU tensors and hands the JAX results back as torch tensors."""
    from musecore_tpu.bridge import to_jax, to_torch

    def impl(*args: Any) -> Any:
        out = fn(*(to_jax(a) if isinstance(a, torch.Tensor) else a for a in args))
        # copies: DLPack views of JAX-owned results must not outlive JAX's buffers inside compiled graphs
        return tuple(to_torch(o).clone() for o in out) if isinstance(out, tuple) else to_torch(out).clone()

    return torch.library.custom_op(name, impl, mutates_args=(), schema=schema_of(fn))


@functools.cache
def register_interpret(interpret: str = "tpu") -> dict[str, Callable[..., Any]]:
    """The same ops as :func:`register`, on the CPU, with the kernels in a Pallas interpreter (``"tpu"``: JAX's TPU
    interpreter; ``"jax"``: Pallas' generic one), as ``torch.ops.musecore_tpu_interpret_<interpret>.<name>``."""
    if interpret not in ("tpu", "jax"):
        raise ValueError(f"interpret must be 'tpu' or 'jax'; got {interpret!r}")
    if jax is None:
        raise TorchTpuUnavailable("jax not installed")
    return _register_all(f"{NAMESPACE}_interpret_{interpret}", interpret_jax_op, interpret)
