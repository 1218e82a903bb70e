"""Compile the towers' Triton kernels for a GPU target with no GPU: ``python towers_compile.py sm90`` (or a
gfx arch). Triton's interpreter must be off, so the test runs this in a subprocess. The ops run on small CPU
tensors with ``JITFunction.run`` replaced by a recorder, so every launch is compiled with exactly the
signature, constexprs and options its wrapper chose (the 816B tower's head dim 96 included) and never
executed. Prints one JSON list: kernel, constexprs, options, shared memory bytes."""

from __future__ import annotations

import inspect
import json
import os
import sys

assert os.environ.get("TRITON_INTERPRET") != "1", "compile-only needs Triton's compiler, not its interpreter"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.jit import JITFunction, mangle_type  # noqa: E402

OPTION_KEYS = ("num_warps", "num_stages", "num_ctas")
RESULTS: list[dict] = []


def recorder(target: GPUTarget):
    def run(self, *args, grid, warmup, **kwargs):
        options = {k: kwargs.pop(k) for k in list(kwargs) if k in OPTION_KEYS}
        bound = inspect.signature(self.fn).bind(*args, **kwargs)
        bound.apply_defaults()
        signature, constexprs = {}, {}
        for i, (name, value) in enumerate(bound.arguments.items()):
            if i in self.constexprs or value is None or isinstance(value, str):
                signature[name], constexprs[name] = "constexpr", value
            else:
                signature[name] = mangle_type(value)
        kernel = triton.compile(triton.compiler.ASTSource(self, signature, constexprs), target=target, options=options)
        RESULTS.append({"kernel": self.fn.__name__, "constexprs": {k: str(v) for k, v in constexprs.items()},
                        "options": options, "shared_bytes": kernel.metadata.shared})
    return run


def main(arch: str) -> None:
    target = GPUTarget("cuda", int(arch[2:]), 32) if arch.startswith("sm") else GPUTarget("hip", arch, 64)
    JITFunction.run = recorder(target)
    from musecore_triton.kernels.causal_conv import causal_conv1d
    from musecore_triton.kernels.rope import rope
    from musecore_triton.kernels.varlen_attention import varlen_attention

    dt = torch.bfloat16
    cu = torch.tensor([0, 40, 100], dtype=torch.int32)
    for d in (64, 96):  # muse-small's vision head dim; the 816B tower's (padded to 128)
        q = torch.randn(100, 2, d).to(dt)
        varlen_attention(q, q, q, cu, d ** -0.5)
    x = torch.randn(2, 37, 64).to(dt).transpose(1, 2)  # the audio tower's [B,T,C] view
    causal_conv1d(x, torch.randn(64, 1, 7).to(dt), torch.randn(64).to(dt), torch.randn(2, 64, 6).to(dt))
    causal_conv1d(x, torch.randn(64, 1, 7).to(dt), None, None)
    rope(torch.randn(10, 16, 96).to(dt), torch.randn(10, 96).to(dt), torch.randn(10, 96).to(dt))
    print(json.dumps(RESULTS))


if __name__ == "__main__":
    main(sys.argv[1])
