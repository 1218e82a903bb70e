"""Every Pallas kernel compiled ahead of time for a real TPU target, without a TPU: libtpu's compiler (Mosaic and
XLA) behind ``jax.experimental.topologies.get_topology_desc`` builds the executables for a v6e chip and for one
TensorCore of a v7 chip on the 816B model's shapes. This checks what interpret mode cannot (Mosaic's layout rules,
VMEM allocation, supported vector ops); it does not run anything, so it says nothing about numbers or speed.

Needs libtpu (``pip install libtpu``, or torch-tpu which pulls it); skips with the reason otherwise. Measured
here with jax 0.10.2 + libtpu 0.0.52 (in a ``--target`` directory): every case compiles.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Any, Callable

import pytest

pytestmark = [pytest.mark.usefixtures("jax_available"), pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                 reason="libtpu not installed: ahead-of-time TPU compilation needs its compiler "
                                        "(pip install libtpu, or torch-tpu which pulls it)")]

TOPOLOGIES = {"tpu-v6e": "v6e:1x1", "tpu-v7": "tpu7x:1x1x1"}
H, h, I, E, K_TOP, Q_HEADS, KV_HEADS, D = 8192, 4096, 4096, 256, 8, 128, 16, 64  # the 816B preset


@functools.cache
def device(chip: str) -> Any:
    # libtpu looks for a TPU VM's metadata unless told not to; these only describe the (absent) host.
    for name, value in (("TPU_SKIP_MDS_QUERY", "1"), ("TPU_WORKER_HOSTNAMES", "localhost")):
        os.environ.setdefault(name, value)
    from jax.experimental import topologies
    return topologies.get_topology_desc(platform="tpu", topology_name=TOPOLOGIES[chip]).devices[0]


def cases() -> dict[str, Callable[[Callable], tuple[Callable, tuple]]]:
    """name -> (spec maker -> (function, abstract arguments))."""
    import jax.numpy as jnp
    from musecore_tpu.kernels import tiling
    from musecore_tpu.kernels.attention import attention
    from musecore_tpu.kernels.matmul import matmul
    from musecore_tpu.kernels.moe import moe
    from musecore_tpu.kernels.norms import residual_norm, rms_norm

    def weight(S, fmt, lead, K, N):
        if fmt == "bf16":
            return {"wt": S(lead + (K, N), jnp.bfloat16)}
        g = tiling.GROUP[fmt]
        return {"codes": S(lead + (K // 2, N), jnp.uint8),
                "scales": S(lead + (K // g, N), jnp.float32 if fmt == "int4" else jnp.uint8),
                "zeros": S(lead + (K // g, N), jnp.float32) if fmt == "int4" else None,
                "global_scale": S(lead, jnp.float32) if fmt == "nvfp4" else None}

    out: dict[str, Any] = {}
    for fmt in ("bf16", "int4", "mxfp4", "nvfp4"):
        g = tiling.GROUP.get(fmt, 0)
        for M in (16, 256):
            for name, (K, N) in (("q_proj", (H, H)), ("expert", (h, I))):
                out[f"matmul-{fmt}-{name}-M{M}"] = lambda S, fmt=fmt, g=g, M=M, K=K, N=N: (
                    functools.partial(matmul, fmt=fmt, group=g), (S((M, K), jnp.bfloat16), weight(S, fmt, (), K, N)))
        for T in (1, 64):
            out[f"moe-{fmt}-T{T}"] = lambda S, fmt=fmt, g=g, T=T: (
                functools.partial(moe, fmt=fmt, group=g, eps=1e-8),
                (S((T, h), jnp.bfloat16), S((T, K_TOP), jnp.float32), S((T, K_TOP), jnp.int32),
                 weight(S, fmt, (E,), h, I), weight(S, fmt, (E,), h, I), weight(S, fmt, (E,), I, h),
                 S((h,), jnp.bfloat16)))
    for T, keys, window, kv in ((1, 2048, 2048, "bf16"), (1, 32768, None, "fp8"), (512, 512, None, "bf16")):
        kv_dtype = jnp.float8_e4m3fn if kv == "fp8" else jnp.bfloat16
        out[f"attention-T{T}-S{keys}-kv{kv}"] = lambda S, T=T, keys=keys, window=window, kv_dtype=kv_dtype: (
            functools.partial(attention, window=window, scale=D ** -0.5),
            (S((1, T, Q_HEADS, D), jnp.bfloat16), S((1, keys, KV_HEADS, D), kv_dtype),
             S((1, keys, KV_HEADS, D), kv_dtype), S((1, T), jnp.int32), S((1, keys), jnp.int32)))
    for T in (1, 64):  # FP8 W8A16 experts: E4M3 codes and a per-expert scale
        fp8 = lambda S, K, N: {"q8": S((E, K, N), jnp.float8_e4m3fn), "wscale": S((E, 1, 1), jnp.float32)}  # noqa: E731
        for act in (None, "fp8-token"):  # W8A16, and W8A8 with per-token E4M3 activations (tpu-v7-fp8)
            out[f"moe-fp8{'-' + act if act else ''}-T{T}"] = lambda S, T=T, fp8=fp8, act=act: (
                functools.partial(moe, fmt="fp8", eps=1e-8, act=act),
                (S((T, h), jnp.bfloat16), S((T, K_TOP), jnp.float32), S((T, K_TOP), jnp.int32), fp8(S, h, I),
                 fp8(S, h, I), fp8(S, I, h), S((h,), jnp.bfloat16)))
    for T in (1, 64):  # INT8 experts: codes and one f32 scale per output channel
        int8 = lambda S, K, N: {"q8": S((E, K, N), jnp.int8), "wscale": S((E, 1, N), jnp.float32)}  # noqa: E731
        for act in (None, "int8-token"):  # W8A16, and W8A8 with per-token INT8 activations (tpu-v6e-int8)
            out[f"moe-int8{'-' + act if act else ''}-T{T}"] = lambda S, T=T, int8=int8, act=act: (
                functools.partial(moe, fmt="int8", eps=1e-8, act=act),
                (S((T, h), jnp.bfloat16), S((T, K_TOP), jnp.float32), S((T, K_TOP), jnp.int32), int8(S, h, I),
                 int8(S, h, I), int8(S, I, h), S((h,), jnp.bfloat16)))
    from musecore_tpu.kernels.quantized import matmul_q8
    for fmt, act in Q8_PATHS:
        for M in (16, 256):
            q8 = jnp.int8 if fmt == "int8" else jnp.float8_e4m3fn
            out[f"q8-{fmt}-{act or 'a16'}-M{M}"] = lambda S, fmt=fmt, act=act, M=M, q8=q8: (
                functools.partial(matmul_q8, fmt=fmt, act=act),
                (S((M, H), jnp.bfloat16), {"q8": S((H, H), q8),
                                           "wscale": S((1, H) if fmt == "int8" else (1, 1), jnp.float32)}))
    out["rms_norm-scale_first"] = lambda S: (functools.partial(rms_norm, eps=1e-5, scale_first=True),
                                             (S((16, H), jnp.bfloat16), S((H,), jnp.bfloat16)))
    out["residual_norm"] = lambda S: (functools.partial(residual_norm, post_eps=1e-8, eps=1e-5),
                                      (S((16, H), jnp.bfloat16), S((16, H), jnp.bfloat16), S((H,), jnp.bfloat16),
                                       S((H,), jnp.float32), S((H,), jnp.float32), S((H,), jnp.bfloat16)))
    return out


Q8_PATHS = (("int8", None), ("int8", "int8-token"), ("fp8", None), ("fp8", "fp8-token"))
CASE_NAMES = [f"q8-{fmt}-{act or 'a16'}-M{M}" for fmt, act in Q8_PATHS for M in (16, 256)] + [
    "moe-fp8-T1", "moe-fp8-T64", "moe-fp8-fp8-token-T1", "moe-fp8-fp8-token-T64",
    "moe-int8-T1", "moe-int8-T64", "moe-int8-int8-token-T1", "moe-int8-int8-token-T64"] + [
    "matmul-" + f"{fmt}-{name}-M{M}" for fmt in ("bf16", "int4", "mxfp4", "nvfp4") for M in (16, 256)
              for name in ("q_proj", "expert")] + [f"moe-{fmt}-T{T}" for fmt in ("bf16", "int4", "mxfp4", "nvfp4")
                                                    for T in (1, 64)] + \
    ["attention-T1-S2048-kvbf16", "attention-T1-S32768-kvfp8", "attention-T512-S512-kvbf16", "rms_norm-scale_first",
     "residual_norm"]


@pytest.mark.parametrize("chip", list(TOPOLOGIES))
@pytest.mark.parametrize("case", CASE_NAMES)
def test_kernel_compiles_for_the_tpu_ahead_of_time(chip: str, case: str) -> None:
    import jax
    sharding = jax.sharding.SingleDeviceSharding(device(chip))
    S = functools.partial(jax.ShapeDtypeStruct, sharding=sharding)
    fn, args = cases()[case](S)
    compiled = jax.jit(fn).lower(*args).compile()
    stats = compiled.memory_analysis()
    print(f"{chip} {case}: compiled, code {stats.generated_code_size_in_bytes / 2**20:.1f} MiB, "
          f"temp {stats.temp_size_in_bytes / 2**20:.1f} MiB")
