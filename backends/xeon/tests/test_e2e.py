"""The whole muse-tiny graph on the xeon backend against the same device emulated by the reference.

``musecore.load(..., device="xeon", emulate=True)`` applies the same conversions (experts to INT4
g128 at load) and runs reference kernels, so only kernel arithmetic differs: BF16 activations and
outputs of the INT4 kernel, BF16 scales, fused norms. Per-op errors (<= 1e-4 NMSE each) compound over 6 layers, hence the
looser whole-model bound.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import musecore
from musecore.config import MuseConfig
from musecore.model import init_weights
from musecore.testing import nmse
from safetensors.torch import save_file

LOGITS_NMSE_BOUND = 1e-2


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = MuseConfig.from_name("muse-tiny")
    folder = tmp_path_factory.mktemp("xeon-e2e")
    config.save_pretrained(folder)
    save_file(init_weights(config, seed=0, std=0.15, dtype=torch.bfloat16), str(folder / "model.safetensors"))
    return folder


def test_muse_tiny_logits_match_the_emulated_xeon_device(xeon, tiny_checkpoint: Path) -> None:
    native = musecore.load(str(tiny_checkpoint), device="xeon", progress=False)
    emulated = musecore.load(str(tiny_checkpoint), device="xeon", emulate=True, progress=False)
    assert native.plan.backend == "xeon"
    ids = torch.randint(0, native.config.vocab_size, (2, 12))
    got, want = native.forward(ids), emulated.forward(ids)
    err = nmse(want.float(), got.float())
    top1 = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    print(f"muse-tiny logits NMSE {err:.3e} (bound {LOGITS_NMSE_BOUND:.0e}), top-1 agreement {top1:.3f}")
    assert torch.isfinite(got).all()
    assert err <= LOGITS_NMSE_BOUND


def test_quantize_dense_logits_match_the_emulated_xeon_device(xeon, tiny_checkpoint: Path) -> None:
    """Attention, pooler/unpooler and lm_head in INT4 too (``quantize_dense``): the native kernels
    against the reference kernels on the same converted weights, under the same bound."""
    native = musecore.load(str(tiny_checkpoint), device="xeon", progress=False, quantize_dense=True)
    emulated = musecore.load(str(tiny_checkpoint), device="xeon", emulate=True, progress=False, quantize_dense=True)
    assert native.lm_head.format == "int4" and native.layers[0].self_attn.in_proj.weight.format == "int4"
    ids = torch.randint(0, native.config.vocab_size, (2, 12))
    got, want = native.forward(ids), emulated.forward(ids)
    err = nmse(want.float(), got.float())
    print(f"muse-tiny quantize_dense logits NMSE {err:.3e} (bound {LOGITS_NMSE_BOUND:.0e})")
    assert torch.isfinite(got).all()
    assert err <= LOGITS_NMSE_BOUND
