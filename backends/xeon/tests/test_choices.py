"""The plan's view of the xeon backend: every kernel choice as data, the environment variables it reads, and the
bytes its resident layout keeps. Decided on this host's probe without compiling or measuring; never raises."""

from __future__ import annotations

import pytest

from musecore.backends.base import EnvSetting, KernelChoice, LinearShape
from musecore.devices import get_profile
from musecore_xeon import XeonBackend
from musecore_xeon.kernels import binding, native
from musecore_xeon.kernels.crossover import INT4_CROSSOVER_ENV

# The 816B model's linears (checkpoint_shapes of muse-spark-open-816b-a42b): INT4 experts (fused gate/up [2I, h]
# and down), INT4 attention, pooler/unpooler and lm_head (the xeon profile's quantize_dense), and the first and last
# layers' BF16 experts.
SHAPES_816B = [
    LinearShape("experts gate_up", 8192, 4096, "int4", experts=256, top_k=8),
    LinearShape("experts down", 4096, 4096, "int4", experts=256, top_k=8),
    LinearShape("q_proj", 8192, 8192, "int4"),
    LinearShape("k_proj", 1024, 8192, "int4"),
    LinearShape("pre_expert_proj", 4096, 8192, "int4"),
    LinearShape("post_expert_proj", 8192, 4096, "int4"),
    LinearShape("lm_head", 202048, 8192, "int4"),
    LinearShape("experts gate_up (bf16 layers)", 8192, 4096, "bf16", experts=256, top_k=8),
]


def choices_by_what(backend: XeonBackend, profile: str = "xeon") -> dict[str, KernelChoice]:
    return {c.what: c for c in backend.kernel_choices(SHAPES_816B, get_profile(profile))}


def test_kernel_choices_name_every_path_of_the_816b_model_on_xeon(xeon: XeonBackend) -> None:
    choices = choices_by_what(xeon)
    text = "\n".join(f"{c.what} -> {c.choice} ({c.reason})" for c in choices.values())
    assert all(isinstance(c, KernelChoice) and c.choice and c.choice != "error" for c in choices.values()), text
    assert choices["native kernels: ISA"].choice.removesuffix(" + AVX512_BF16 (the INT4 GEMM on vdpbf16ps)") in (
        "AVX2 + FMA", "AVX-512 VNNI", "AMX-BF16 + AVX-512 VNNI"), text
    assert (" + AVX512_BF16" in choices["native kernels: ISA"].choice) == native.bf16_dot_planned(), text
    assert "this host's probe" in choices["native kernels: ISA"].reason, text
    assert choices["native binding"].choice.startswith(("CPython extension", "ctypes")), text
    assert choices["threads"].choice == "1", text  # the fixture's one thread
    assert "fused native call per layer (musecore_int4_moe)" in choices[
        "moe int4 experts gate_up [256, 8192, 4096], top-8"].choice, text
    assert "musecore_bf16_moe" in choices["moe bf16 experts gate_up (bf16 layers) [256, 8192, 4096], top-8"].choice, text
    for name, (n, k) in {"q_proj": (8192, 8192), "k_proj": (1024, 8192), "lm_head": (202048, 8192),
                         "experts down": (4096, 4096)}.items():
        small = choices[f"linear int4 {name} {n}x{k}, M < 64"]  # the fixture's INT4 crossover
        dense = choices[f"linear int4 {name} {n}x{k}, M >= 64"]
        assert small.choice.startswith("native INT4 GEMV") and small.reason == f"{INT4_CROSSOVER_ENV}=64", text
        assert small.env == INT4_CROSSOVER_ENV, text
        assert "AMX" in dense.choice or "dequantized tiles" in dense.choice or "AVX512_BF16" in dense.choice, text
        if native.bf16_dot_planned() and not native.amx_planned():
            assert dense.choice.startswith("INT4 x BF16 GEMM on AVX512_BF16"), text
    assert any(w.startswith("linear bf16 experts gate_up (bf16 layers)") and c.choice.startswith("native BF16 GEMV")
               for w, c in choices.items()), text


def test_xeon6_plan_on_a_host_without_amx_names_the_amx_gemm_and_says_where_it_is_decided(xeon: XeonBackend) -> None:
    choices = choices_by_what(xeon, "xeon6")
    dense = choices["linear int4 q_proj 8192x8192, M >= 64"]
    assert dense.choice.startswith("INT4 GEMM on AMX"), dense
    if not xeon.cpu.has_amx:
        assert "decided again at load" in choices["native kernels: ISA"].reason, choices["native kernels: ISA"]


def test_measured_crossovers_are_shown_as_measured_at_load(xeon, monkeypatch) -> None:
    monkeypatch.delenv(INT4_CROSSOVER_ENV)
    choices = choices_by_what(xeon)
    small = [c for w, c in choices.items() if w.startswith("linear int4 q_proj 8192x8192, M < ")]
    assert len(small) == 1 and "measured" in small[0].reason, choices


def test_a_bad_override_is_reported_in_the_choice_not_raised(xeon, monkeypatch) -> None:
    monkeypatch.setenv(native.ISA_ENV, "sse9")
    monkeypatch.setenv(INT4_CROSSOVER_ENV, "soon")
    choices = xeon.kernel_choices(SHAPES_816B, get_profile("xeon"))
    errors = [c for c in choices if c.choice == "error"]
    assert any(native.ISA_ENV in c.reason for c in errors), choices
    assert any(INT4_CROSSOVER_ENV in c.reason for c in errors), choices


def test_kernel_choices_take_any_profile_and_unknown_formats(xeon) -> None:
    odd = [LinearShape("w", 100, 96, "nvfp4"), LinearShape("x", 64, 64, "int4", act_format="fp8"),
           LinearShape("y", 64, 64, "int9")]
    choices = xeon.kernel_choices(odd, None)
    assert [c.choice for c in choices[-3:]] == ["not run by xeon"] * 3, choices


def test_binding_choice_follows_its_environment_variable(xeon, monkeypatch) -> None:
    monkeypatch.setenv(binding.BINDING_ENV, "0")
    choice = choices_by_what(xeon)["native binding"]
    assert choice.choice == "ctypes" and binding.BINDING_ENV in choice.reason, choice


def test_the_decode_blocks_choice_says_fused_and_follows_its_switch_and_the_binding(xeon, monkeypatch) -> None:
    chosen = choices_by_what(xeon)
    if chosen["native binding"].choice.startswith("CPython extension"):  # not built: earlier tests may hide the compiler
        assert chosen["decode blocks"].choice.startswith("one C call per attention block"), chosen["decode blocks"]
    else:
        assert chosen["decode blocks"].choice == "separate ops per block", chosen["decode blocks"]
    monkeypatch.setenv("MUSECORE_XEON_FUSED_BLOCKS", "0")
    off = choices_by_what(xeon)["decode blocks"]
    assert off.choice == "separate ops per block" and "MUSECORE_XEON_FUSED_BLOCKS=0" in off.reason, off
    monkeypatch.delenv("MUSECORE_XEON_FUSED_BLOCKS")
    monkeypatch.setenv(binding.BINDING_ENV, "0")
    no_binding = choices_by_what(xeon)["decode blocks"]
    assert no_binding.choice == "separate ops per block" and "CPython extension" in no_binding.reason, no_binding


@pytest.mark.parametrize("name, value", [(INT4_CROSSOVER_ENV, "48"), ("MUSECORE_XEON_ISA", "avx2"),
                                         ("MUSECORE_XEON_BINDING", "0"), ("MUSECORE_NUM_THREADS", "3"),
                                         ("MUSECORE_CACHE", "/somewhere/private")])
def test_env_settings_report_a_variable_when_set(xeon, monkeypatch, name: str, value: str) -> None:
    monkeypatch.setenv(name, value)
    settings = {s.name: s for s in xeon.env_settings()}
    assert all(isinstance(s, EnvSetting) and s.effect and s.default for s in settings.values())
    assert settings[name].value == value, settings[name]


def test_env_settings_list_every_variable_the_backend_reads(xeon, monkeypatch) -> None:
    monkeypatch.delenv("MUSECORE_XEON_ISA", raising=False)
    names = {s.name for s in xeon.env_settings()}
    assert {"MUSECORE_NUM_THREADS", "MUSECORE_XEON_ISA", "MUSECORE_XEON_NATIVE_DEQUANT", "MUSECORE_XEON_BINDING",
            "MUSECORE_XEON_INT4_CROSSOVER", "MUSECORE_XEON_BF16_CROSSOVER", "MUSECORE_XEON_BF16_GEMV_CROSSOVER",
            "MUSECORE_CACHE", "CC", "CXX"} <= names, names
    assert {s.name: s.value for s in xeon.env_settings()}["MUSECORE_XEON_ISA"] is None


def test_resident_bytes_count_the_planar_codes_and_fp16_scale_zero_pairs(xeon, monkeypatch) -> None:
    monkeypatch.delenv(native.NATIVE_ENV, raising=False)
    # per row: K/2 bytes of codes + (K/128) groups x (fp16 scale + fp16 zero); rows padded to 4
    assert xeon.resident_bytes("int4", 4096, 8192) == 4096 * (8192 // 2 + 64 * 4)
    assert xeon.resident_bytes("int4", 4095, 8192) == 4096 * (8192 // 2 + 64 * 4)
    assert xeon.resident_bytes("int4", 8192, 4096, experts=256) == 256 * 8192 * (2048 + 32 * 4)
    assert xeon.resident_bytes("bf16", 4096, 8192) is None and xeon.resident_bytes("bf16", 64, 64, experts=8) is None
    assert xeon.resident_bytes("fp32", 64, 64) == 64 * 64 * 2  # kept in the model dtype (bf16)


def test_resident_bytes_match_a_prepared_weight(xeon) -> None:
    import musecore_quant
    import torch

    w = torch.randn(100, 256, dtype=torch.bfloat16)
    resident = xeon.prepare_weight(musecore_quant.quantize(w, "int4", group_size=128), "attention").data
    assert xeon.resident_bytes("int4", 100, 256) == resident.nbytes + resident.dense_nbytes
