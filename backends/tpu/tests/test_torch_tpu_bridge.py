"""The torch_tpu side, where torch_tpu is installed (its own tox env: it autoloads on every ``import torch``):
the probe's answer without a chip, and the registration of every kernel as ``torch.ops.musecore_tpu.*`` through
``torch_tpu._internal.pallas.jax_op`` with shape-only fake kernels that trace on the meta device. Running the ops
needs a TPU and has never been done."""

from __future__ import annotations

import importlib.util

import pytest
import torch


pytestmark = [pytest.mark.usefixtures("jax_available"), pytest.mark.skipif(importlib.util.find_spec("torch_tpu") is None,
                                            reason="torch_tpu not installed (the tpu-bridge tox env installs it)")]


def test_probe_with_torch_tpu_but_no_chip_says_no_tpu_device() -> None:
    from musecore_tpu import TpuBackend
    if torch.accelerator.current_accelerator() is not None:
        pytest.skip("a TPU is here: the probe's positive answer is checked by hand on a TPU host")
    assert TpuBackend().probe().reason.startswith("no TPU device (")


def test_every_kernel_registers_as_a_torch_custom_op_with_meta_shapes() -> None:
    from musecore_tpu.torch_tpu_ops import register
    ops = register()
    assert sorted(ops) == ["attention", "linear_dense", "linear_packed", "linear_q8", "moe_dense", "moe_packed", "moe_q8",
                           "residual_norm", "rms_norm"]
    meta = dict(device="meta", dtype=torch.bfloat16)
    x, wt = torch.empty(3, 256, **meta), torch.empty(256, 128, **meta)
    assert torch.ops.musecore_tpu.linear_dense(x, wt).shape == (3, 128)
    q, k = torch.empty(1, 4, 8, 64, **meta), torch.empty(1, 6, 2, 64, **meta)
    pos = torch.empty(1, 4, device="meta", dtype=torch.int32)
    kpos = torch.empty(1, 6, device="meta", dtype=torch.int32)
    assert torch.ops.musecore_tpu.attention(q, k, k, pos, kpos, -1, 0.125, 1.0, 1.0).shape == q.shape
    res, normed = torch.ops.musecore_tpu.residual_norm(x, x, None, torch.empty(256, device="meta"),
                                                       torch.empty(256, device="meta"), x[0], 1e-8, 1e-5)
    assert res.shape == normed.shape == x.shape
