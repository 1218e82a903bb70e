"""Every block shape the kernels choose for the presets' shapes obeys the TPU tiling rules, and every kernel
configuration fits the smaller VMEM of the two chips (v7: 64 MiB per TensorCore; v6e has 128 MiB), per
:mod:`musecore_tpu.kernels.tiling`. Interpret mode checks neither, so this is the only guard before a TPU
compiles them. Pure Python: no jax needed."""

from __future__ import annotations

import pytest

from musecore.testing import projection_shapes
from musecore.testing.cases import preset
from musecore_tpu.chips import CHIPS, smallest_vmem
from musecore_tpu.kernels import tiling

FORMATS = ("bf16", "int4", "mxfp4", "nvfp4")
TOKENS = (1, 16, 256, 4096)


def configs(size: str) -> list[tiling.KernelConfig]:
    c = preset(size)
    out = []
    for role, (k, n) in projection_shapes(size).items():
        for fmt in FORMATS:
            out += [tiling.matmul_config(fmt, m, k, n) for m in TOKENS]
        for fmt, act in (("int8", None), ("int8", "int8-token"), ("fp8", None), ("fp8", "fp8-token")):
            out += [tiling.q8_config(fmt, act, m, k, n) for m in TOKENS]
    for fmt, act in [(f, None) for f in FORMATS + ("fp8", "int8")] + [("fp8", "fp8-token"), ("int8", "int8-token")]:
        for t in TOKENS:
            out += tiling.moe_configs(fmt, t, c.num_experts_per_tok, c.num_experts, c.moe_hidden_size,
                                      c.moe_intermediate_size, act=act)
    for t, keys in ((1, c.sliding_window), (1, 32768), (512, 512), (4096, 4096)):
        for kv in ("bf16", "fp8"):
            out.append(tiling.attention_config(1, t, keys, c.num_attention_heads, c.num_key_value_heads, c.head_dim, kv))
    out += [tiling.norm_config(t, c.hidden_size) for t in TOKENS]
    return out


@pytest.mark.parametrize("size", ["tiny", "small", "816b"])
def test_every_kernel_config_fits_the_smallest_vmem(size: str) -> None:
    budget = smallest_vmem()
    worst = max(configs(size), key=lambda cfg: cfg.vmem_bytes)
    print(f"{size}: largest VMEM footprint {worst.vmem_bytes / 2**20:.1f} MiB ({worst.kernel}, grid {worst.grid}) "
          f"of {budget / 2**20:.0f} MiB (v7; v6e {CHIPS['tpu-v6e'].vmem_bytes / 2**20:.0f} MiB)")
    assert worst.vmem_bytes <= budget


@pytest.mark.parametrize("size", ["tiny", "small", "816b"])
def test_block_shapes_obey_the_sublane_and_lane_tiling(size: str) -> None:
    problems = sorted({f"{cfg.kernel}: {v}" for cfg in configs(size) for v in cfg.violations()})
    assert not problems, "\n".join(problems)


def test_the_rules_themselves() -> None:
    assert tiling.Block("x", (8, 128), (64, 256), "f32").violation() is None
    assert tiling.Block("x", (8, 128), (64, 256), "bf16").violation() is not None  # bf16 packs 16 rows
    assert tiling.Block("x", (32, 256), (64, 512), "u8").violation() is None
    assert tiling.Block("x", (16, 64), (16, 64), "bf16").violation() is None      # equal to the array: allowed
    assert tiling.Block("x", (16, 64), (16, 128), "bf16").violation() is not None
    assert tiling.Block("x", (16, 128), (64, 128), "i8").violation() is not None   # int8 packs 32 rows


def test_int8_token_moe_blocks_are_int8_rows_with_int32_accumulators() -> None:
    """The W8A8 INT8 grouped kernels: 32-row tiles of int8 codes, per-row f32 scales, the experts' per-channel f32
    scales as ``[1, tn]`` blocks, int32 accumulators; the 816B shapes fit v7's 64 MiB (they run on v6e's 128)."""
    c = preset("816b")
    gate_up, down = tiling.moe_configs("int8", 4096, c.num_experts_per_tok, c.num_experts, c.moe_hidden_size,
                                       c.moe_intermediate_size, act="int8-token")
    blocks = {b.name: b for b in gate_up.blocks}
    assert blocks["x rows int8"].dtype == "i8" and blocks["x rows int8"].shape[0] % 32 == 0
    assert blocks["acc gate"].dtype == "i32" and blocks["w scale gate"].shape[0] == 1
    assert {b.name: b for b in down.blocks}["acc"].dtype == "i32"
    for cfg in (gate_up, down):
        assert not cfg.violations() and cfg.vmem_bytes <= smallest_vmem(), (cfg.kernel, cfg.vmem_bytes)
