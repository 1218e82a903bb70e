"""Compile every Triton kernel the ROCm backend launches for an AMD target, with no GPU.

Run as a script (``python amd_compile.py gfx950``; Triton's interpreter must be off, which is why
the test runs it in a subprocess): the backend's ops run on small CPU tensors while
``JITFunction.run`` is replaced by a recorder, so each launch is compiled with exactly the
signature, constexprs and launch options its wrapper chose, through ``triton.compile(ASTSource(...),
target=GPUTarget("hip", arch, 64))``, and never executed. The MXFP4 GEMMs are also compiled with the
tiles their launcher picks on a GPU. Prints one JSON list: kernel, variant, mfma instructions used,
VGPRs, AGPRs, spills, scratch and LDS bytes, read from the AMDGCN and the compiled metadata.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import sys

assert os.environ.get("TRITON_INTERPRET") != "1", "compile-only needs Triton's compiler, not its interpreter"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.jit import JITFunction, mangle_type  # noqa: E402

OPTION_KEYS = ("num_warps", "num_stages", "num_ctas", "waves_per_eu", "matrix_instr_nonkdim", "kpack")
RESULTS: list[dict] = []
SEEN: set = set()


def _stat(asm: str, key: str) -> int:
    m = re.search(rf"; {key}: (\d+)", asm)
    return int(m.group(1)) if m else -1


def compile_launch(fn: JITFunction, args: tuple, kwargs: dict, arch: str, variant: str) -> None:
    options = {k: kwargs.pop(k) for k in list(kwargs) if k in OPTION_KEYS}
    bound = inspect.signature(fn.fn).bind(*args, **kwargs)
    bound.apply_defaults()
    signature, constexprs = {}, {}
    for i, (name, value) in enumerate(bound.arguments.items()):
        if i in fn.constexprs or value is None or isinstance(value, str):
            signature[name] = "constexpr"
            constexprs[name] = value
        else:
            signature[name] = mangle_type(value)
    key = (fn.fn.__name__, tuple(sorted((k, str(v)) for k, v in constexprs.items())), tuple(sorted(signature.items())),
           tuple(sorted(options.items())))
    if key in SEEN:
        return
    SEEN.add(key)
    kernel = triton.compile(triton.compiler.ASTSource(fn, signature, constexprs), target=GPUTarget("hip", arch, 64),
                            options=options)
    asm = kernel.asm["amdgcn"]
    RESULTS.append({
        "kernel": fn.fn.__name__, "variant": variant, "arch": arch,
        "constexprs": {k: str(v) for k, v in constexprs.items()}, "options": options,
        "mfma": sorted(set(re.findall(r"v_mfma\w*", asm))),
        "vgprs": _stat(asm, "NumVgprs"), "agprs": _stat(asm, "NumAgprs"), "sgprs": _stat(asm, "NumSgprs"),
        "scratch_bytes": _stat(asm, "ScratchSize"), "lds_bytes": kernel.metadata.shared,
        "occupancy_waves": _stat(asm, "Occupancy"),
        "scratch_stores": len(re.findall(r"scratch_store|buffer_store_dword\w* \S+, off, s\[0:3\]", asm)),
    })


def record(arch: str, variant: list[str]):
    def run(self, *args, grid, warmup, **kwargs):
        compile_launch(self, args, dict(kwargs), arch, variant[0])
    return run


def main(arch: str) -> None:
    import musecore_quant
    from musecore_rocm import RocmBackend
    from musecore_triton.kernels.mx_gemm import (A_DENSE, A_PACKED, A_QUANT, PREQUANTIZE_MIN_M, launch_mx_gemm,
                                                 mxfp4_quantize_activation,
                                                 pick_mx_config)
    from musecore_triton.kernels.mx_moe import mx_experts, mx_moe_forward

    variant = ["?"]
    JITFunction.run = record(arch, variant)
    be = RocmBackend("cpu")
    dt = torch.bfloat16
    H, d, nq, nkv, E, k, h, inter = 256, 64, 4, 2, 8, 2, 256, 256
    gpu = torch.device("cuda")  # only its type is read: the tiles a GPU launch would pick

    # MXFP4 GEMMs: W4A4 (quantize in kernel) and W4A16, the tiles of decode / mid / prefill
    qt = musecore_quant.quantize(torch.randn(512, 512) * 0.05, "mxfp4")
    w, ws = qt.data[None], qt.scale[None]
    for m in (1, 32, 256):  # W4A4 quantizes in the GEMM up to PREQUANTIZE_MIN_M rows, then in its own kernel
        x = torch.randn(m, 512).to(dt)
        out = torch.empty(m, 512, dtype=dt)
        for mode, name in ((A_QUANT, "w4a4"), (A_DENSE, "w4a16")):
            if mode == A_QUANT and m > PREQUANTIZE_MIN_M:
                continue
            variant[0] = f"linear mxfp4 {name} M={m}"
            launch_mx_gemm(x, w, ws, n=512, k=512, out=out, cfg=pick_mx_config(m, gpu), a_mode=mode)
    variant[0] = "linear mxfp4 w4a4 prequantized M=256"
    packed, scales = mxfp4_quantize_activation(torch.randn(256, 512).to(dt))
    launch_mx_gemm(packed, w, ws, n=512, k=512, out=torch.empty(256, 512, dtype=dt), cfg=pick_mx_config(256, gpu),
                   a_mode=A_PACKED, a_scales=scales)
    # MXFP4 MoE (gate+up with SwiGLU and MXFP4 epilogue, packed down), W4A4 and W4A16, + finalize
    stacks = [musecore_quant.quantize(torch.randn(E, o, i) * 0.05, "mxfp4") for o, i in ((inter, h), (inter, h), (h, inter))]
    ex = mx_experts(*stacks, torch.device("cpu"))
    z = torch.randn(6, h).to(dt)
    wts, ids = torch.rand(6, E).topk(k)
    for a4 in (True, False):
        variant[0] = f"moe mxfp4 {'w4a4' if a4 else 'w4a16'}"
        mx_moe_forward(z, wts, ids, ex, torch.ones(h, dtype=dt), 1e-6, quantize_activations=a4)
    # NVFP4 kept (shared W4A16 GEMM) and its MoE
    nv = musecore_quant.quantize(torch.randn(512, 512) * 0.05, "nvfp4")
    wn = be.prepare_weight(nv, "q_proj")
    for m in (1, 256):
        variant[0] = f"linear nvfp4 w4a16 M={m}"
        be.linear(torch.randn(m, 512).to(dt), wn)
    nstacks = [musecore_quant.quantize(torch.randn(E, o, i) * 0.05, "nvfp4") for o, i in ((inter, h), (inter, h), (h, inter))]
    variant[0] = "moe nvfp4 w4a16"
    be.moe(z, wts, ids, be.prepare_experts(*nstacks), torch.ones(h, dtype=dt), 1e-6)
    # the grouped paths' alignment: one Triton program on the GPU (CPU ids here take the PyTorch ops, so called as such)
    from musecore_triton.kernels import moe as triton_moe
    for n, block_m in ((12, 16), (2048, 64)):
        variant[0] = f"moe align n={n} block_m={block_m}"
        triton_moe._align_one_program(torch.randint(0, E, (n,)), E, block_m)
    dense = [torch.randn(E, o, i).to(dt) * 0.05 for o, i in ((inter, h), (inter, h), (h, inter))]
    for t in (1, 64):
        variant[0] = f"moe bf16 T={t}"
        zt = torch.randn(t, h).to(dt)
        wt, it = torch.rand(t, E).topk(k)
        be.moe(zt, wt, it, be.prepare_experts(*dense, dtype=dt), torch.ones(h, dtype=dt), 1e-6)
    # the row ops, router, attention (BF16 and FP8 KV), KV write
    x = torch.randn(2, 3, H).to(dt)
    variant[0] = "norms"
    be.rms_norm(x, torch.ones(H, dtype=dt), 1e-6)
    be.rms_norm(x, torch.ones(H, dtype=dt), 1e-6, scale_first=True)
    alpha, beta = torch.rand(H), torch.rand(H)
    be.residual_norm(x, x.clone(), torch.ones(H, dtype=dt), alpha, beta, torch.ones(H, dtype=dt), 1e-6, 1e-6)
    be.residual_norm(x, x.clone(), None, alpha, beta, torch.ones(H, dtype=dt), 1e-6, 1e-6)
    q, kk = torch.randn(2, 3, nq, d).to(dt), torch.randn(2, 3, nkv, d).to(dt)
    cos, sin = torch.randn(2, 3, d).to(dt), torch.randn(2, 3, d).to(dt)
    be.qk_norm_rope(q, kk, cos, sin, 1e-6, 0.125)
    be.qk_norm_rope(q, kk, None, None, 1e-6, 0.125)
    be.head_norm_gate(q, q.clone(), 1e-6)
    variant[0] = "decode embed"  # the decode step's embedding stage (RocmBackend.fuse_embed)
    from musecore_triton.kernels.embed import decode_embed
    for factor in (1.0, 1.3):  # default rope, and YaRN's attention factor
        decode_embed(torch.tensor([[3], [5]]), torch.tensor([[40], [-1]]), torch.zeros(2, dtype=torch.long),
                     torch.randn(512, H).to(dt), torch.tensor([4, 5, 6]), torch.ones(H).to(dt), 1e-6,
                     torch.ones(d // 2), factor, dt)
    variant[0] = "elementwise"
    be.silu_mul(x, x.clone())
    be.logit_softcap(torch.randn(2, 3, 512).to(dt), 1.0, 30.0)
    variant[0] = "router"
    be.router_topk(torch.randn(3, H).to(dt), torch.randn(E, H), torch.randn(E), k, 1.0, 2.5)  # split-K GEMV
    be.router_topk(torch.randn(20, H).to(dt), torch.randn(E, H), torch.randn(E), k, 1.0, 2.5)  # BLAS + top-k
    for t in (1, 16):  # the 816B router (256 experts, hidden 8192, top-8) at decode
        variant[0] = f"router 816b T={t}"
        be.router_topk(torch.randn(t, 8192).to(dt), torch.randn(256, 8192), torch.randn(256), 8, 1.0, 2.5)
    qp = torch.arange(3)[None].expand(2, 3).contiguous()
    for kv_dtype, scales in ((dt, (None, None)), (torch.float8_e4m3fn, (0.5, 0.25))):
        for window in (None, 8):
            for t in (3, 1):
                variant[0] = f"attention kv {kv_dtype} window {window} T={t}"
                kv = torch.randn(2, 16, nkv, d).to(kv_dtype)
                be.attention(q[:, :t].contiguous(), kv, kv.clone(), qp[:, :t].contiguous(),
                             torch.arange(16)[None].expand(2, 16).contiguous(), window, 0.125, *scales)
    # the shared decode switches turned on (the plain decode compile above has both off; routed on the H200 in session
    # 55: EAGER_FIRST_STEP for CUDA only and the greedy graph's fused position update on, PREFETCH_POSITIONS off):
    # attention's prefetched key positions and eager first step, the greedy graph's fused position update, the Triton
    # argmax
    from musecore_triton.kernels import attention as attention_module, sampling
    defaults = attention_module.PREFETCH_POSITIONS, attention_module.EAGER_FIRST_STEP
    try:
        for prefetch, eager in ((True, False), (False, True), (True, True)):
            attention_module.PREFETCH_POSITIONS, attention_module.EAGER_FIRST_STEP = prefetch, eager
            for window in (None, 8):
                variant[0] = f"attention decode prefetch {prefetch} eager {eager} window {window}"
                kv = torch.randn(2, 16, nkv, d).to(dt)
                be.attention(q[:, :1].contiguous(), kv, kv.clone(), qp[:, :1].contiguous(),
                             torch.arange(16)[None].expand(2, 16).contiguous(), window, 0.125, None, None)
    finally:
        attention_module.PREFETCH_POSITIONS, attention_module.EAGER_FIRST_STEP = defaults
    variant[0] = "sampling"
    sampling.greedy_positions(torch.zeros(2, dtype=torch.long), torch.tensor([True, False]))
    sampling.argmax(torch.randn(2, 5000).to(dt))
    variant[0] = "kv write"
    cache_k = torch.zeros(2, 17, nkv, d, dtype=dt)
    for ring in (False, True):
        be.kv_write(cache_k, cache_k.clone(), torch.full((2, 17), -1), kk, kk.clone(), qp, 16, ring)
    print(json.dumps(RESULTS))


if __name__ == "__main__":
    main(sys.argv[1])
