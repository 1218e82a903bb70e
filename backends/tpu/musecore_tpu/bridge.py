"""Moving tensors between torch and jax on the CPU (the interpret path): DLPack, no copies where it can.

On a CPU the backend's ops take torch tensors, hand them to the JAX kernels through DLPack, run the Pallas
kernels in the TPU interpreter and hand the results back. DLPack needs compact strides (views are made
contiguous first); float8 travels as its bytes and is bitcast back (DLPack's float8 type codes are recent, bytes
work with every torch/jax pair); jax runs without 64-bit types by default, so int64 positions and ids become int32.
On a TPU host none of this runs: tensors stay on the ``tpu`` device and the ops are torch custom ops
(:mod:`musecore_tpu.torch_tpu_ops`).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

FP8 = (torch.float8_e4m3fn,)


def to_jax(t: Optional[torch.Tensor]) -> Any:
    """A torch CPU tensor as a jax array (shared memory when contiguous)."""
    if t is None:
        return None
    import jax
    import jax.numpy as jnp
    if t.device.type != "cpu":
        raise ValueError(f"the interpret path runs on the CPU; got a tensor on {t.device}")
    if t.dtype in FP8:
        return jax.lax.bitcast_convert_type(jnp.from_dlpack(t.contiguous().view(torch.uint8)), jnp.float8_e4m3fn)
    if t.dtype == torch.int64:
        t = t.to(torch.int32)
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    return jnp.from_dlpack(t.contiguous())


def to_torch(a: Any) -> torch.Tensor:
    """A jax CPU array as a torch tensor (shared memory)."""
    return torch.from_dlpack(a)


def tree_to_jax(resident: dict[str, Optional[torch.Tensor]]) -> dict[str, Any]:
    return {name: to_jax(t) for name, t in resident.items()}
