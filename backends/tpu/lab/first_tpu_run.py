"""The first thing to run on a TPU host: every Pallas kernel compiled by Mosaic for the local chip (jax only, no
torch_tpu), against its plain-jnp reference, on the 816B model's shapes at decode and prefill sizes.

    python backends/tpu/lab/first_tpu_run.py            # on a TPU host: Mosaic lowering, NMSE, time per call
    python backends/tpu/lab/first_tpu_run.py --interpret --small   # anywhere: the same script in TPU interpret mode

Prints one line per kernel: ok / FAILED (the lowering error's first line) / NMSE / microseconds. Nothing here has
run on a TPU yet; what fails first is most likely a lane relayout (the scale broadcast in decode.py, the
query-group reshape in attention.py, head_dim 64 < 128 lanes) - see the package README.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from musecore_tpu.kernels import tiling  # noqa: E402
from musecore_tpu.kernels.attention import attention, attention_reference  # noqa: E402
from musecore_tpu.kernels.matmul import matmul, matmul_reference  # noqa: E402
from musecore_tpu.kernels.moe import moe, moe_reference  # noqa: E402
from musecore_tpu.kernels.quantized import matmul_q8, matmul_q8_reference  # noqa: E402


def nmse(want, got) -> float:
    want, got = np.asarray(want, np.float64), np.asarray(got, np.float64)
    return float(((got - want) ** 2).sum() / max((want ** 2).sum(), 1e-300))


def random_packed(rng, fmt: str, lead: tuple[int, ...], K: int, N: int) -> dict:
    """Random resident 4-bit weights (codes and plausible scales) straight in the kernel layout."""
    g = tiling.GROUP[fmt]
    codes = jnp.asarray(rng.integers(0, 256, lead + (K // 2, N)), jnp.uint8)
    if fmt == "int4":
        scales = jnp.asarray(rng.uniform(1e-3, 2e-3, lead + (K // g, N)), jnp.float32)
    elif fmt == "mxfp4":
        scales = jnp.asarray(rng.integers(118, 122, lead + (K // g, N)), jnp.uint8)
    else:
        scales = jnp.asarray(rng.integers(0x30, 0x48, lead + (K // g, N)), jnp.uint8)
    gs = jnp.full(lead, 1e-3, jnp.float32) if fmt == "nvfp4" else None
    return {"codes": codes, "scales": scales, "zeros": None, "global_scale": gs}


def timed(fn, *args, **kw):
    out = jax.block_until_ready(fn(*args, **kw))
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args, **kw))
    return out, (time.perf_counter() - start) * 1e6


def report(name: str, run) -> None:
    try:
        err, us = run()
        print(f"ok      {name:48s} NMSE {err:.2e}  {us:10.1f} us")
    except Exception as exc:  # the point of this script is to list every failure, not stop at the first
        print(f"FAILED  {name:48s} {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--interpret", action="store_true", help="TPU interpret mode (no TPU needed)")
    parser.add_argument("--small", action="store_true", help="muse-small-like shapes (for --interpret)")
    args = parser.parse_args()
    print(f"jax {jax.__version__}, devices {jax.devices()}, interpret={args.interpret}")
    rng = np.random.default_rng(0)
    H, h, inter, E, k = (1536, 512, 512, 8, 4) if args.small else (8192, 4096, 4096, 32, 8)
    for fmt in ("bf16", "int4", "mxfp4", "nvfp4"):
        for M in (1, 256):
            K, N = h, inter
            w = ({"wt": jnp.asarray(rng.standard_normal((K, N)) * K ** -0.5, jnp.bfloat16)} if fmt == "bf16"
                 else random_packed(rng, fmt, (), K, N))
            x = jnp.asarray(rng.standard_normal((M, K)), jnp.bfloat16)
            g = tiling.GROUP.get(fmt, 0)

            def run_matmul(x=x, w=w, fmt=fmt, g=g):
                got, us = timed(matmul, x, w, fmt=fmt, group=g, out_dtype=jnp.float32, interpret=args.interpret)
                return nmse(matmul_reference(x, w, fmt=fmt, group=g, out_dtype=jnp.float32), got), us
            report(f"matmul {fmt} M={M} {K}x{N}", run_matmul)
        for T in (1, 64):
            stack = lambda K, N: ({"wt": jnp.asarray(rng.standard_normal((E, K, N)) * K ** -0.5, jnp.bfloat16)}  # noqa: E731
                                  if fmt == "bf16" else random_packed(rng, fmt, (E,), K, N))
            gate, up, down = stack(h, inter), stack(h, inter), stack(inter, h)
            z = jnp.asarray(rng.standard_normal((T, h)), jnp.bfloat16)
            ids = jnp.asarray(np.stack([rng.permutation(E)[:k] for _ in range(T)]), jnp.int32)
            wts = jnp.full((T, k), 1.0 / k, jnp.float32)
            post = jnp.ones((h,), jnp.bfloat16)
            g = tiling.GROUP.get(fmt, 0)

            def run_moe(z=z, wts=wts, ids=ids, gate=gate, up=up, down=down, fmt=fmt, g=g):
                got, us = timed(moe, z, wts, ids, gate, up, down, post, fmt=fmt, group=g, eps=1e-8,
                                interpret=args.interpret)
                return nmse(moe_reference(z, wts, ids, gate, up, down, post, fmt=fmt, group=g, eps=1e-8), got), us
            report(f"moe {fmt} T={T} E={E} top-{k}", run_moe)
    for fmt, act in (("int8", None), ("int8", "int8-token"), ("fp8", None), ("fp8", "fp8-token")):
        for M in (16, 256):  # the 8-bit MXU paths: what the chip's int8 / fp8 rate buys against the bf16 matmul
            K, N = h, inter
            q8 = (jnp.asarray(rng.integers(-127, 128, (K, N)), jnp.int8) if fmt == "int8" else
                  jnp.asarray(rng.standard_normal((K, N)) * 16, jnp.float32).astype(jnp.float8_e4m3fn))
            w8 = {"q8": q8, "wscale": jnp.full((1, N) if fmt == "int8" else (1, 1), 1e-3, jnp.float32)}
            x = jnp.asarray(rng.standard_normal((M, K)), jnp.bfloat16)

            def run_q8(x=x, w8=w8, fmt=fmt, act=act):
                got, us = timed(matmul_q8, x, w8, fmt=fmt, act=act, out_dtype=jnp.float32, interpret=args.interpret)
                return nmse(matmul_q8_reference(x, w8, fmt=fmt, act=act, out_dtype=jnp.float32), got), us
            report(f"matmul_q8 {fmt} act={act} M={M} {K}x{N}", run_q8)
    for fmt, act in (("int8", None), ("int8", "int8-token"), ("fp8", None), ("fp8", "fp8-token")):
        for T in (1, 64):  # 8-bit experts: INT8 per-channel scales (tpu-v6e-int8), FP8 per-expert (tpu-v7-fp8)
            def stack8(K, N, fmt=fmt):
                q8 = (jnp.asarray(rng.integers(-127, 128, (E, K, N)), jnp.int8) if fmt == "int8" else
                      jnp.asarray(rng.standard_normal((E, K, N)) * 16, jnp.float32).astype(jnp.float8_e4m3fn))
                scale_shape = (E, 1, N) if fmt == "int8" else (E, 1, 1)
                return {"q8": q8, "wscale": jnp.asarray(rng.uniform(0.5, 2.0, scale_shape) * 1e-3 * K ** -0.5,
                                                        jnp.float32)}
            gate, up, down = stack8(h, inter), stack8(h, inter), stack8(inter, h)
            z = jnp.asarray(rng.standard_normal((T, h)), jnp.bfloat16)
            ids = jnp.asarray(np.stack([rng.permutation(E)[:k] for _ in range(T)]), jnp.int32)
            wts = jnp.full((T, k), 1.0 / k, jnp.float32)
            post = jnp.ones((h,), jnp.bfloat16)

            def run_moe8(z=z, wts=wts, ids=ids, gate=gate, up=up, down=down, fmt=fmt, act=act):
                got, us = timed(moe, z, wts, ids, gate, up, down, post, fmt=fmt, eps=1e-8, act=act,
                                interpret=args.interpret)
                return nmse(moe_reference(z, wts, ids, gate, up, down, post, fmt=fmt, eps=1e-8, act=act), got), us
            report(f"moe {fmt} act={act} T={T} E={E} top-{k}", run_moe8)
    nq, nkv, d = (16, 2, 64) if args.small else (128, 16, 64)
    for T, S, window in ((1, 2048, 2048), (1, 8192, None), (256, 256, None)):
        q = jnp.asarray(rng.standard_normal((1, T, nq, d)), jnp.bfloat16)
        kk = jnp.asarray(rng.standard_normal((1, S, nkv, d)), jnp.bfloat16)
        qp = jnp.arange(S - T, S, dtype=jnp.int32)[None]
        kp = jnp.arange(S, dtype=jnp.int32)[None]

        def run_attention(q=q, kk=kk, qp=qp, kp=kp, window=window):
            got, us = timed(attention, q, kk, kk, qp, kp, window=window, scale=d ** -0.5, interpret=args.interpret)
            return nmse(attention_reference(q, kk, kk, qp, kp, window=window, scale=d ** -0.5), got), us
        report(f"attention T={T} S={S} window={window}", run_attention)


if __name__ == "__main__":
    main()
