"""The kernels one MoE sublayer launches at batch-1 decode, by name, on each MoE layer of a preset whose experts
differ in format from the layer before (muse-tiny / muse-small: the first, BF16; the second, NVFP4; the last, BF16):
the product's fused block, and the same with the finalize its own launch (``fused.FINALIZE_IN_UNPOOLER`` off). For
when a launch count disagrees with ``cuda_fused_ab.py``'s kernels per step (session 75).

    python backends/cuda/lab/scripts/cuda_fused_moe_kernels.py [--presets muse-tiny,muse-small]
"""

from __future__ import annotations

import argparse
from unittest import mock

import torch
from torch.profiler import ProfilerActivity, profile

from musecore.api import load_random
from musecore.model import MoE
from musecore_cuda import fused


def kernel_names(fn) -> list[str]:
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name[:60] for e in prof.events() if e.device_type.name == "CUDA"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--presets", default="muse-tiny,muse-small")
    for preset in parser.parse_args().presets.split(","):
        model = load_random(preset, "h200", checkpoint_format="nvfp4", seed=0)
        H, before = model.config.hidden_size, None
        for i, layer in enumerate(model.layers):
            if not isinstance(layer.mlp, MoE) or layer.mlp.experts.format == before:
                continue
            block, before = layer.mlp, layer.mlp.experts.format
            x, a = (torch.randn(1, 1, H, device="cuda").to(torch.bfloat16) for _ in range(2))
            print(f"{preset} layer {i}: {block.experts.format} experts, unpooler {list(block.fused.unpooler.shape)}")
            with torch.inference_mode():
                for name, on in (("product", True), ("fin_apart", False)):
                    with mock.patch.object(fused, "FINALIZE_IN_UNPOOLER", on):
                        model.feedforward_sublayer(i, x, a)
                        print(f"  {name}:", kernel_names(lambda: model.feedforward_sublayer(i, x, a)))


if __name__ == "__main__":
    main()
