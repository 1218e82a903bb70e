"""Compile the decode kernels that session 43 fused (the CUDA backend's fused sublayers: ``dense_gemv`` with its
row-op epilogues and an fp32 input, the one-launch router alone and beside the pooler, the q/k norms writing the KV
cache, attention with the head norm and gate, and the split keys' merge; since session 48 the decode embed, since
session 50 the q/k/v/gate GEMV running the q/k norms in its heads' last programs, since session 51 that GEMV also
attending per KV-head group, ``qkv_attention``, and greedy sampling's argmax, since session 52 attention prefetching
its next step's key positions and, since session 53, loading its first step's k and v with their positions; since
session 75 the unpooler GEMV with the MoE finalize in its programs, ``moe.finalize_gemv``; since session 76, where
``musecore_cuda`` is installed, the residual-norm GEMV and the router + pooler launch at the CUDA backend's row-op
cuts and attention signalling its dependents early, since session 78 the one-token router launches at its 64 columns
per program, since session 79 the router + pooler and q/k/v/gate launches running the residual norm deferred to them)
for a GPU target with no GPU, with the CUDA backend's hooks where it is installed (the GEMV tails' L2 prefetch,
session 49): ``python decode_compile.py sm90``. Same recorder as ``towers_compile.py`` (every launch compiled with
the signature and constexprs its wrapper chose, never run); prints one JSON list: kernel, constexprs, options, shared
memory bytes."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

assert os.environ.get("TRITON_INTERPRET") != "1", "compile-only needs Triton's compiler, not its interpreter"

import torch  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from towers_compile import RESULTS, recorder  # noqa: E402  (this folder is sys.path[0] when run as a script)


def main(arch: str) -> None:
    JITFunction.run = recorder(GPUTarget("cuda", int(arch[2:]), 32))
    if importlib.util.find_spec("musecore_cuda") is not None:  # the CUDA hooks' PTX too: the tails' L2 prefetch
        import musecore_cuda  # noqa: F401  (installs its hooks)
        from musecore_triton import hooks
        hooks._l2_warm = lambda device: True
    from musecore_triton.kernels import norms, router, sampling
    from musecore_triton.kernels import attention as attention_module
    from musecore_triton.kernels.attention import attention
    from musecore_triton.kernels.dense_gemv import dense_gemv, qkv_attention, qkv_gemv_rope, qkv_gemv_rope_deferred
    from musecore_triton.kernels.embed import decode_embed
    from musecore_triton.kernels.moe import finalize_gemv

    dt, H, h = torch.bfloat16, 1536, 768  # muse-small's widths
    x, w = torch.randn(1, H).to(dt), torch.randn(h, H).to(dt)
    counter = torch.zeros(1, dtype=torch.int32)
    dense_gemv(x, w)
    dense_gemv(x, w, norm=(torch.ones(h).to(dt), 1e-6, counter))
    vec32 = torch.ones(H)
    for post in (None, torch.ones(H).to(dt)):
        dense_gemv(torch.randn(1, h), torch.randn(H, h).to(dt),  # fp32 input (the experts' output), residual norm
                   residual_norm=(x, post, vec32, vec32, torch.ones(H).to(dt), 1e-5, 1e-6, counter))
    o8, wt8 = torch.randn(8, h), torch.softmax(torch.randn(1, 8), -1)  # one token's top-8 expert rows (session 75)
    finalize_gemv(o8, wt8, torch.ones(h).to(dt), 1e-6, torch.randn(H, h).to(dt))
    finalize_gemv(o8, wt8, torch.ones(h).to(dt), 1e-6, torch.randn(H, h).to(dt),
                  residual_norm=(x, torch.ones(H).to(dt), vec32, vec32, torch.ones(H).to(dt), 1e-5, 1e-6, counter))
    router.router_topk_one_launch(x, torch.randn(64, H), torch.zeros(64), 8, 0.18, 1.0, counter)
    router.router_pooler_one_launch(x, torch.randn(64, H), torch.zeros(64), 8, 0.18, 1.0, w, torch.ones(h).to(dt),
                                    1e-6, torch.zeros(2, dtype=torch.int32))
    nq, nkv, d, cap = 24, 3, 64, 256
    y = torch.randn(1, 1, 2 * nq + 2 * nkv, d).to(dt)
    q, k, v, gate = y.split_with_sizes([nq, nkv, nkv, nq], -2)
    cos = sin = torch.randn(1, 1, d)
    ck, cv = (torch.zeros(1, cap + 1, nkv, d).to(dt) for _ in range(2))
    cpos = torch.full((1, cap + 1), -1, dtype=torch.long)
    pos = torch.tensor([[40]])
    for rope, ring in (((cos, sin), True), ((None, None), False)):
        norms.qk_norm_rope(q, k, *rope, 1e-6, 0.5)
        norms.qk_norm_rope_kv_write(q, k, v, *rope, 1e-6, 0.5, ck, cv, cpos, pos, cap, ring)
        qkv_gemv_rope(x, torch.randn(y.numel(), H).to(dt), nq, nkv, *rope, 1e-6, 0.5, ck, cv, cpos, pos, cap, ring,
                      torch.zeros(nq + nkv, dtype=torch.int32))
        qkv_attention(x, torch.randn(y.numel(), H).to(dt), nq, nkv, *rope, 1e-6, 0.5, ck, cv, cpos, pos, cap, ring,
                      torch.zeros(nq + 2 * nkv, dtype=torch.int32), (ck[:, :cap], cv[:, :cap], cpos[:, :cap]),
                      1024 if ring else None, d ** -0.5, 1e-6)
    qn = torch.randn(1, 1, nq, d).to(dt)
    attention(qn, ck[:, :cap], cv[:, :cap], pos, cpos[:, :cap], 1024, d ** -0.5, gate=(gate, 1e-6))
    defaults = attention_module.PREFETCH_POSITIONS, attention_module.EAGER_FIRST_STEP
    for prefetch, eager in ((True, False), (False, True), (True, True)):  # the default compile above: both off
        # the next step's key positions loaded during this one (session 52), the first step's k and v with its
        # positions (session 53)
        attention_module.PREFETCH_POSITIONS, attention_module.EAGER_FIRST_STEP = prefetch, eager
        attention(qn, ck[:, :cap], cv[:, :cap], pos, cpos[:, :cap], 1024, d ** -0.5, gate=(gate, 1e-6))
    attention_module.PREFETCH_POSITIONS, attention_module.EAGER_FIRST_STEP = defaults
    long = 1024  # keys split over programs: the merge kernel, with and without the gate's epilogue
    kl, vl = (torch.zeros(1, long, nkv, d).to(dt) for _ in range(2))
    for g in (None, (gate, 1e-6)):
        attention(qn, kl, vl, pos, torch.full((1, long), -1, dtype=torch.long), None, d ** -0.5, gate=g)
    inv_freq = torch.ones(d // 2)
    for factor in (1.0, 1.3):  # default rope, and YaRN's attention factor
        decode_embed(torch.tensor([[3]]), pos, torch.zeros(1, dtype=torch.long), torch.randn(65536, H).to(dt),
                     torch.tensor([4, 5, 6]), torch.ones(H).to(dt), 1e-6, inv_freq, factor, dt)
    sampling.argmax(torch.randn(1, 65536))  # greedy sampling (session 51)
    sampling.greedy_positions(torch.zeros(1, dtype=torch.long), torch.ones(1, dtype=torch.bool))  # (session 52)
    if importlib.util.find_spec("musecore_cuda") is not None:  # the CUDA backend's launch choices (session 76)
        from musecore_cuda.kernels import triton_hooks  # its hooks answer for CUDA devices only: asked as one here
        hooks._row_op_cut = lambda device, kernel: triton_hooks.row_op_cut(torch.device("cuda"), kernel)
        hooks._router_block_k = lambda device: triton_hooks.router_block_k(torch.device("cuda"))  # (session 78)
        hooks._early_trigger = lambda device, kernel: kernel in ("attention", "decode_embed")
        dense_gemv(torch.randn(1, h), torch.randn(H, h).to(dt),  # the residual-norm GEMV at its wider cut
                   residual_norm=(x, None, vec32, vec32, torch.ones(H).to(dt), 1e-5, 1e-6, counter))
        router.router_pooler_one_launch(x, torch.randn(64, H), torch.zeros(64), 8, 0.18, 1.0, w,
                                        torch.ones(h).to(dt), 1e-6, torch.zeros(2, dtype=torch.int32))
        router.router_topk_one_launch(x, torch.randn(64, H), torch.zeros(64), 8, 0.18, 1.0, counter)  # 64 columns
        router.router_pooler_deferred((x, x, None, vec32, vec32, torch.ones(H).to(dt), 1e-5, 1e-6),  # (session 79)
                                      torch.randn(64, H), torch.zeros(64), 8, 0.18, 1.0, w, torch.ones(h).to(dt),
                                      1e-6, torch.zeros(2, dtype=torch.int32))
        qkv_gemv_rope_deferred((x, x, torch.ones(H).to(dt), vec32, vec32, torch.ones(H).to(dt), 1e-5, 1e-6),
                               torch.randn(y.numel(), H).to(dt), nq, nkv, cos, sin, 1e-6, 0.5, ck, cv, cpos, pos, cap,
                               True, torch.zeros(nq + nkv, dtype=torch.int32))  # at the qkv_deferred cut
        attention(qn, ck[:, :cap], cv[:, :cap], pos, cpos[:, :cap], 1024, d ** -0.5, gate=(gate, 1e-6))  # EARLY
        decode_embed(torch.tensor([[3]]), pos, torch.zeros(1, dtype=torch.long), torch.randn(65536, H).to(dt),
                     torch.tensor([4, 5, 6]), torch.ones(H).to(dt), 1e-6, inv_freq, 1.0, dt)  # EARLY (lab mode only)
    print(json.dumps(RESULTS))


if __name__ == "__main__":
    main(sys.argv[1])
