"""The int8 format end to end in the core: the reference's ``int8-token`` activation rule (bit for bit against the
formula written out here), the ``tpu-v6e-int8`` device rules and plan, an emulated load, and the catalog's
promise that every format a device lists or converts to has a codec."""

from __future__ import annotations

import torch

import musecore
from musecore.devices import CATALOG
from musecore.ops import ExpertWeights, Weight
from musecore.ops import reference as ref


def int8_token_by_hand(x: torch.Tensor) -> torch.Tensor:
    """Per row: s = amax|x| / 127 in fp32 (1.0 for a zero row); round half to even of x / s, clamp +-127; times s."""
    xf = x.float()
    s = xf.abs().amax(-1, keepdim=True) / torch.tensor(127.0)
    s = torch.where(s == 0, torch.tensor(1.0), s)
    return torch.round(xf / s).clamp(-127.0, 127.0) * s


def test_int8_token_activations_equal_the_formula_bit_for_bit() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 6, 320, generator=gen) * torch.logspace(-3, 3, 6).view(1, 6, 1)
    x[0, 2] = 0.0                       # a zero token: scale 1.0, codes 0
    x[1, 3, :4] = torch.tensor([127.0, 0.5, 1.5, -2.5]) / 127 * 8  # exact ties after scaling are rare; a few here
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        got = ref.fake_quantize_activation(xd, "int8-token", None)
        assert got.dtype == torch.float32, "x-hat stays fp32: the kernel scales exact int32 sums in f32"
        assert torch.equal(got, int8_token_by_hand(xd)), dtype
    # a token's codes never depend on the other tokens of its batch
    assert torch.equal(ref.fake_quantize_activation(x[:1, :3], "int8-token", None),
                       ref.fake_quantize_activation(x, "int8-token", None)[:1, :3])
    # ties go to even: the row [127, 0.5, 1.5, -2.5] has scale 1.0, so its codes are 127, 0, 2, -2
    row = torch.tensor([[127.0, 0.5, 1.5, -2.5, 2.5]])
    assert ref.fake_quantize_activation(row, "int8-token", None).tolist() == [[127.0, 0.0, 2.0, -2.0, 2.0]]


def test_reference_linear_and_experts_use_int8_token_codes_times_the_int8_weights() -> None:
    import musecore_quant
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(5, 64, generator=gen).to(torch.bfloat16)
    qt = musecore_quant.quantize(torch.randn(32, 64, generator=gen), "int8")
    w_hat = musecore_quant.dequantize(qt)
    got = ref.linear(x, Weight(w_hat, "int8", 32, 64, act_format="int8-token"))
    assert torch.equal(got, (int8_token_by_hand(x) @ w_hat.T).to(torch.bfloat16))
    E, inter = 3, 16
    stacks = [musecore_quant.dequantize(musecore_quant.quantize(torch.randn(s, generator=gen), "int8"))
              for s in ((E, inter, 64), (E, inter, 64), (E, 64, inter))]
    experts = ExpertWeights(gate=stacks[0], up=stacks[1], down=stacks[2], format="int8", num_experts=E,
                            act_format="int8-token")
    z = x.float()
    zq = int8_token_by_hand(z)
    h = torch.nn.functional.silu(zq @ stacks[0][1].T) * (zq @ stacks[1][1].T)
    assert torch.equal(ref.expert_forward(z, experts, 1), int8_token_by_hand(h) @ stacks[2][1].T)


def test_every_catalog_format_has_a_codec() -> None:
    """A device may list or convert to a weight format only if musecore_quant can produce it (or it is 16/32-bit):
    a format without a codec would be a plan that cannot load."""
    from musecore_quant import FORMATS
    dense = ("bf16", "fp16", "fp32")
    for name, profile in CATALOG.items():
        targets = {c.target for c in profile.conversions.values()}
        for fmt in set(profile.weight_formats) | targets:
            assert fmt in FORMATS or fmt in dense, f"{name} names {fmt!r}, which has no musecore_quant codec"


def test_tpu_v6e_int8_is_an_option_and_its_816b_plan_needs_one_byte_per_expert_weight() -> None:
    """tpu-v6e keeps an NVFP4 checkpoint's experts 4-bit (W4A16); tpu-v6e-int8 converts BF16, FP8, NVFP4 and MXFP4
    experts to INT8 with int8-token activations (INT4 stays W4A16): the 816B model's weights ~808 GiB, 29 v6e
    chips of 32 GiB, against ~493 GiB (18 chips) for NVFP4 W4A16."""
    profile = CATALOG["tpu-v6e-int8"]
    assert (profile.backend, profile.arch, profile.memory_gib) == ("tpu", "v6e", 32)
    for fmt in ("bf16", "fp8", "nvfp4", "mxfp4"):
        conv = profile.conversion(fmt)
        assert (conv.target, conv.act_format) == ("int8", "int8-token"), (fmt, conv)
    assert (profile.conversion("int4").target, profile.conversion("int4").act_format) == ("int4", None)
    assert all(c.target != "int8" for c in CATALOG["tpu-v6e"].conversions.values()), "off by default"
    name = "muse-spark-open-816b-a42b"
    default, int8 = (musecore.plan(name, d, checkpoint_format="nvfp4") for d in ("tpu-v6e", "tpu-v6e-int8"))
    experts = [g for g in int8.groups if g.group == "experts (quantized layers)"][0]
    assert (experts.target_format, experts.act_format, experts.action) == ("int8", "int8-token",
                                                                            "requantize nvfp4->int8")
    assert 1.0 <= experts.bytes / experts.parameters < 1.01, experts.bytes / experts.parameters
    gib = int8.memory_bytes / 2**30
    print(f"816B weights: tpu-v6e {default.memory_bytes / 2**30:.0f} GiB ({default.devices_needed} chips), "
          f"tpu-v6e-int8 {gib:.0f} GiB ({int8.devices_needed} chips)")
    assert 780 <= gib <= 830 and int8.devices_needed == 29, (gib, int8.devices_needed)


def test_emulated_tpu_v6e_int8_load_converts_the_experts_and_runs_int8_token() -> None:
    emu = musecore.load("muse-tiny", device="tpu-v6e-int8", emulate=True, progress=False, towers=False)
    experts = emu.layers[1].mlp.experts
    assert (experts.format, experts.act_format) == ("int8", "int8-token")
    assert emu.layers[0].mlp.experts.format == "bf16", "the first and last layers keep BF16 experts"
    assert emu.conversion_report and all(r.target == "int8" for r in emu.conversion_report)
    assert min(r.sqnr_db for r in emu.conversion_report) > 35, [r.sqnr_db for r in emu.conversion_report][:3]
