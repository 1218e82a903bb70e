"""The plan: per-device conversions, op choices, memory, gaps; loading executes it."""

import json

import pytest
import torch

import musecore
from musecore.api import plan
from musecore.cli import main
from musecore.devices import CATALOG
from musecore.planning import PlanError
from tests.helpers import random_tensors, small_config, write_checkpoint


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    config = small_config(hidden_size=128, moe_hidden_size=128, moe_intermediate_size=128, head_dim=32)
    return write_checkpoint(tmp_path_factory.mktemp("plan") / "bf16", config,
                            random_tensors(config, dtype=torch.bfloat16))


@pytest.mark.parametrize("device", sorted(CATALOG))
def test_plan_json_for_every_catalog_device_on_the_bundled_tiny_model(device, capsys):
    code = main(["plan", "--model", "muse-tiny", "--device", device, "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["device"] == device and out["profile"]["backend"] == CATALOG[device].backend
    assert {o["op"] for o in out["ops"]} >= {"linear", "moe", "attention", "rms_norm"}
    assert code == (1 if out["gaps"] else 0), "exit code must say whether the plan has gaps"
    if device != "cpu" and CATALOG[device].backend not in ("xeon",):
        assert out["gaps"], f"no {device} hardware here: the plan must have a gap"


def test_emulated_plan_has_no_gaps_and_applies_the_device_conversion(bf16_checkpoint):
    p = plan(bf16_checkpoint, "xeon6", emulate=True)
    assert not p.gaps and p.mode == "emulated"
    experts = [g for g in p.groups if g.group == "experts (quantized layers)"]
    assert experts and experts[0].action == "quantize bf16->int4"
    bf16_layers = [g for g in p.groups if g.group == "experts (BF16 layers)"]
    assert bf16_layers[0].target_format == "bf16", "first/last layer experts stay BF16"


def test_816b_preset_on_one_h200_does_not_fit_and_says_how_many_devices():
    p = musecore.plan("muse-spark-open-816b-a42b", "h200", emulate=True, checkpoint_format="nvfp4")
    assert not p.fits and p.devices_needed == 4, (p.memory_bytes / 2**30, p.devices_needed)
    assert "needs 4 devices" in str(p)
    bf16 = plan("muse-spark-open-816b-a42b", "h200", emulate=True)
    assert bf16.devices_needed > 10


def test_missing_hardware_is_a_clear_error_pointing_to_emulate(bf16_checkpoint):
    with pytest.raises(PlanError, match="emulate=True"):
        musecore.load(bf16_checkpoint, device="mi355x")


def test_unknown_device_lists_the_catalog(bf16_checkpoint):
    with pytest.raises(ValueError, match="unknown device 'mi999'.*mi355x"):
        musecore.load(bf16_checkpoint, device="mi999")


def test_emulated_xeon_load_quantizes_experts_to_int4_and_reports_error():
    """On the trained muse-tiny: "a little" is a property of a trained model (a random one flips
    routing choices on any rounding)."""
    ref = musecore.load("muse-tiny", device="cpu")
    emu = musecore.load("muse-tiny", device="xeon6", emulate=True, quantize_dense=False)
    assert emu.layers[1].mlp.experts.format == "int4" and emu.layers[0].mlp.experts.format == "bf16"
    assert emu.lm_head.format == "bf16" and emu.layers[1].self_attn.o_proj.format == "bf16"
    assert emu.conversion_report and all(r.target == "int4" for r in emu.conversion_report)
    assert all(".mlp.experts." in r.name for r in emu.conversion_report)
    assert min(r.sqnr_db for r in emu.conversion_report) > 15, [r.sqnr_db for r in emu.conversion_report][:3]
    ids = torch.tensor([[0, 414, 286, 1290, 17, 9, 300, 41, 12, 2000]])
    a, b = ref.forward(ids), emu.forward(ids)
    assert not torch.equal(a, b), "INT4 experts must change the numbers"
    rel = float((a - b).norm() / a.norm())
    assert rel < 0.2, f"relative logit change from INT4 experts: {rel:.3f}"


def test_quantize_dense_converts_attention_pooler_and_lm_head_like_the_experts(bf16_checkpoint):
    kept = {g.group: g for g in plan(bf16_checkpoint, "xeon6", emulate=True, quantize_dense=False).groups}
    dense = {g.group: g for g in plan(bf16_checkpoint, "xeon6", emulate=True, quantize_dense=True).groups}
    for group in ("attention", "pooler/unpooler", "lm_head"):
        assert kept[group].target_format == "bf16" and dense[group].target_format == "int4", group
        assert dense[group].bytes < kept[group].bytes / 3
    for group in ("embedding", "experts (BF16 layers)"):
        assert dense[group].target_format == kept[group].target_format == "bf16", group
    assert dense["router"].target_format == kept["router"].target_format == "fp32"  # kept fp32, as transformers does
    norms = lambda p: sorted(g.target_format for g in p.groups if g.group == "norms and gates")  # noqa: E731
    assert norms(plan(bf16_checkpoint, "xeon6", emulate=True, quantize_dense=True)) == ["bf16", "fp32"]
    # a device whose rule keeps BF16 (the reference CPU) is unchanged by the option
    cpu = {g.group: g.target_format for g in plan(bf16_checkpoint, "cpu", quantize_dense=True).groups}
    assert set(cpu.values()) == {"bf16", "fp32"} and cpu["router"] == "fp32"


@pytest.mark.parametrize("device", ["xeon", "xeon6"])
def test_cpu_profiles_convert_the_dense_projections_by_default_and_say_so(bf16_checkpoint, device):
    """quantize_dense=None (the default) is the profile's choice: INT4 attention, pooler/unpooler and
    lm_head on the CPU profiles, which the plan's notes state with the way back (False)."""
    the_plan = plan(bf16_checkpoint, device, emulate=True)
    explicit = plan(bf16_checkpoint, device, emulate=True, quantize_dense=True)
    formats = {g.group: g.target_format for g in the_plan.groups}
    assert formats == {g.group: g.target_format for g in explicit.groups}
    assert formats["attention"] == formats["pooler/unpooler"] == formats["lm_head"] == "int4", formats
    assert formats["embedding"] == "bf16" and formats["router"] == "fp32", formats
    assert any("default (quantize_dense=False keeps them" in n for n in the_plan.notes), the_plan.notes
    for gpu in ("h200", "b300", "mi355x"):
        formats = {g.group: g.target_format for g in plan(bf16_checkpoint, gpu, emulate=True).groups}
        assert formats["attention"] == formats["lm_head"] == "bf16", (gpu, formats)


def test_quantize_dense_can_name_the_groups_it_converts(bf16_checkpoint):
    only_head = {g.group: g.target_format for g in plan(bf16_checkpoint, "xeon6", emulate=True,
                                                         quantize_dense=("lm_head",)).groups}
    assert only_head["lm_head"] == "int4"
    assert only_head["attention"] == only_head["pooler/unpooler"] == "bf16"
    two = {g.group: g.target_format for g in plan(bf16_checkpoint, "xeon6", emulate=True,
                                                   quantize_dense="attention, pooler/unpooler").groups}
    assert two["attention"] == two["pooler/unpooler"] == "int4" and two["lm_head"] == "bf16"
    with pytest.raises(ValueError, match="unknown group.*'router'.*choose from"):
        plan(bf16_checkpoint, "xeon6", emulate=True, quantize_dense=("router",))


def test_quantize_dense_load_reports_every_converted_projection(bf16_checkpoint):
    emu = musecore.load(bf16_checkpoint, device="xeon6", emulate=True, quantize_dense=True)
    converted = {r.name for r in emu.conversion_report}
    assert "lm_head.weight" in converted
    assert any(".self_attn.q_proj." in n for n in converted) and any("pre_expert_proj" in n for n in converted)
    assert not any(".mlp.gate." in n or "embed_tokens" in n for n in converted)
    assert emu.lm_head.format == "int4"
    assert min(r.sqnr_db for r in emu.conversion_report) > 15, [r.sqnr_db for r in emu.conversion_report][:3]


def test_plan_cli_quantize_dense_flag(capsys):
    main(["plan", "--model", "muse-tiny", "--device", "xeon", "--emulate", "--quantize-dense", "--json"])
    groups = {g["group"]: g for g in json.loads(capsys.readouterr().out)["groups"]}
    assert groups["attention"]["target_format"] == groups["lm_head"]["target_format"] == "int4"
    assert groups["router"]["target_format"] == "fp32"  # kept fp32, as transformers keeps it
    main(["plan", "--model", "muse-tiny", "--device", "xeon", "--emulate", "--quantize-dense", "lm_head", "--json"])
    groups = {g["group"]: g for g in json.loads(capsys.readouterr().out)["groups"]}
    assert groups["lm_head"]["target_format"] == "int4" and groups["attention"]["target_format"] == "bf16"
    main(["plan", "--model", "muse-tiny", "--device", "xeon", "--emulate", "--no-quantize-dense", "--json"])
    groups = {g["group"]: g for g in json.loads(capsys.readouterr().out)["groups"]}
    assert groups["lm_head"]["target_format"] == groups["attention"]["target_format"] == "bf16"
    main(["plan", "--model", "muse-tiny", "--device", "xeon", "--emulate", "--json"])
    groups = {g["group"]: g for g in json.loads(capsys.readouterr().out)["groups"]}
    assert groups["lm_head"]["target_format"] == groups["attention"]["target_format"] == "int4"
