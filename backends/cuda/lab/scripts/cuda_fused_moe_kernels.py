"""The kernels one MoE sublayer launches at batch-1 decode, by name, with the product's fused block and with
``prologue_probe.fused_moe_run`` (the finalize in the unpooler GEMV), on each preset's first MoE layer; and the
inputs of the stand-in's branch (``use_gemv``, the unpooler's K). For when the prologue test's launch count
disagrees with ``cuda_fused_ab.py``'s kernels per step (session 75).

    python backends/cuda/lab/scripts/cuda_fused_moe_kernels.py [--presets muse-tiny,muse-small]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from unittest import mock

import torch
from torch.profiler import ProfilerActivity, profile

from musecore.api import load_random
from musecore.model import MoE
from musecore_cuda import fused
from musecore_cuda.kernels.moe_decode import use_gemv

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # backends/cuda/lab
import prologue_probe  # noqa: E402


def kernel_names(fn) -> list[str]:
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name[:90] for e in prof.events() if e.device_type.name == "CUDA"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--presets", default="muse-tiny,muse-small")
    for preset in parser.parse_args().presets.split(","):
        model = load_random(preset, "h200", checkpoint_format="nvfp4", seed=0)
        i = next(i for i, layer in enumerate(model.layers) if isinstance(layer.mlp, MoE))
        block, H = model.layers[i].mlp, model.config.hidden_size
        experts = block.experts
        x, a = (torch.randn(1, 1, H, device="cuda").to(torch.bfloat16) for _ in range(2))
        print(f"{preset} layer {i}: fused {type(block.fused).__name__}, gate {type(experts.gate).__name__}, "
              f"act_format {experts.act_format}, unpooler {list(block.fused.unpooler.shape)}, use_gemv "
              f"{use_gemv(experts.gate, block.top_k, experts.num_experts, tokens=1, dtype=torch.bfloat16)}")
        with torch.inference_mode():
            model.feedforward_sublayer(i, x, a)
            print("  product:", kernel_names(lambda: model.feedforward_sublayer(i, x, a)))
            with mock.patch.object(fused.FusedMoE, "_run", prologue_probe.fused_moe_run(16, 16)):
                model.feedforward_sublayer(i, x, a)
                print("  fin_16x16:", kernel_names(lambda: model.feedforward_sublayer(i, x, a)))


if __name__ == "__main__":
    main()
