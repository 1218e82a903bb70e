"""Discovery without a TPU: the package imports without jax or torch_tpu, the probe says why it is unavailable,
``supports`` gives a reason for every no, the chip kinds map to the catalog devices, the torch_tpu bridge
refuses with its reason, and the benchmark cases skip with theirs. None of this needs jax."""

from __future__ import annotations

import importlib.util
import tomllib
from pathlib import Path

import pytest
import torch

from musecore.backends.base import LinearShape
from musecore.devices import get_profile
from musecore.ops import OPS, OpSpec

PACKAGE = Path(__file__).resolve().parents[1]
HAS_TORCH_TPU = importlib.util.find_spec("torch_tpu") is not None


def test_package_declares_its_entry_points() -> None:
    meta = tomllib.loads((PACKAGE / "pyproject.toml").read_text())
    assert meta["project"]["name"] == "musecore-tpu"
    assert meta["project"]["entry-points"]["musecore.backends"] == {"tpu": "musecore_tpu:TpuBackend"}
    assert meta["project"]["entry-points"]["musecore.benchmarks"] == {"tpu": "musecore_tpu.bench:benchmarks"}
    from musecore_tpu import TpuBackend
    from musecore_tpu.bench import benchmarks
    assert TpuBackend.name == "tpu" and TpuBackend.api_version[0] == 1 and callable(benchmarks)


@pytest.mark.skipif(HAS_TORCH_TPU, reason="torch_tpu is installed here")
def test_probe_without_torch_tpu_says_so() -> None:
    from musecore_tpu import TpuBackend
    probe = TpuBackend().probe()
    assert not probe.available and probe.devices == []
    assert probe.reason.startswith("torch_tpu not installed (") and "none has run on a TPU" in probe.reason
    assert "never run on a TPU" in probe.details["kernels"]


def test_doctor_line_says_no_tpu_chip_has_run_it() -> None:
    from musecore_tpu import TpuBackend
    from musecore_tpu.chips import CHIPS
    line = TpuBackend.verified_on
    assert line.startswith("never run on a TPU") and all(chip in line for chip in CHIPS), line


def test_probe_without_a_tpu_device_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch_tpu importable but no chip: 'no TPU device' (simulated: torch_tpu is not installed here)."""
    import sys
    import types
    from musecore_tpu import backend as backend_module
    monkeypatch.setattr(backend_module.importlib.util, "find_spec",
                        lambda name, *a: object() if name == "torch_tpu" else importlib.util.find_spec(name, *a))
    monkeypatch.setitem(sys.modules, "torch_tpu", types.ModuleType("torch_tpu"))
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: None)
    probe = backend_module.probe_tpu()
    assert not probe.available and probe.reason.startswith("no TPU device (")


@pytest.mark.parametrize("kind,device", [("TPU v6e", "tpu-v6e"), ("TPU v6 lite", "tpu-v6e"), ("TPU7x", "tpu-v7"),
                                         ("TPU7", "tpu-v7"), ("TPU v5 lite", None)])
def test_chip_generation_maps_to_the_catalog_device(kind: str, device) -> None:
    from musecore_tpu.chips import chip_for_device_kind
    chip = chip_for_device_kind(kind)
    assert (chip.name if chip else None) == device
    if chip is not None:
        assert get_profile(chip.name).backend == "tpu"


def test_chip_facts_equal_jax_s_own_table() -> None:
    pltpu = pytest.importorskip("jax.experimental.pallas.tpu", reason="jax not installed")
    from musecore_tpu.chips import CHIPS
    for name, version in (("tpu-v6e", pltpu.ChipVersion.TPU_V6E), ("tpu-v7", pltpu.ChipVersion.TPU_7X)):
        info = pltpu.get_tpu_info_for_chip(version, 1)  # per TensorCore
        chip = CHIPS[name]
        assert chip.vmem_bytes == info.vmem_capacity_bytes
        assert chip.hbm_bytes == info.hbm_capacity_bytes * chip.tensorcores
        assert chip.hbm_bytes_per_s == pytest.approx(info.mem_bw_bytes_per_second * chip.tensorcores, rel=1e-3)


def test_supports_answers_every_op_with_a_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    from musecore_tpu import TpuBackend
    from musecore_tpu import backend as backend_module
    monkeypatch.setattr(backend_module, "jax_missing", lambda: None)  # the answers with jax present, wherever this runs
    backend = TpuBackend("cpu")
    for op in OPS:
        answer = backend.supports(op, OpSpec(op, device="tpu-v6e"))
        assert answer.reason, op
    for fmt in ("bf16", "int4", "mxfp4", "nvfp4"):
        assert backend.supports("linear", OpSpec("linear", weight_format=fmt)).ok
        assert backend.supports("moe", OpSpec("moe", weight_format=fmt)).ok
    assert backend.supports("linear", OpSpec("linear", weight_format="fp8")).ok  # W8A16
    assert backend.supports("linear", OpSpec("linear", weight_format="fp8", act_format="fp8-token", device="tpu-v7")).ok
    v6e = backend.supports("linear", OpSpec("linear", weight_format="fp8", act_format="fp8-token", device="tpu-v6e"))
    assert not v6e.ok and "no FP8 rate" in v6e.reason
    static = backend.supports("linear", OpSpec("linear", weight_format="fp8", act_format="fp8"))
    assert not static.ok and "fp8-token" in static.reason
    assert backend.supports("moe", OpSpec("moe", weight_format="fp8")).ok  # W8A16 experts
    assert backend.supports("moe", OpSpec("moe", weight_format="fp8", act_format="fp8-token", device="tpu-v7-fp8")).ok
    v6e = backend.supports("moe", OpSpec("moe", weight_format="fp8", act_format="fp8-token", device="tpu-v6e"))
    assert not v6e.ok and "no FP8 rate" in v6e.reason
    static = backend.supports("moe", OpSpec("moe", weight_format="fp8", act_format="fp8"))
    assert not static.ok and "'fp8' activations have no grouped kernel" in static.reason, static.reason
    w4a4 = backend.supports("moe", OpSpec("moe", weight_format="mxfp4", act_format="mxfp4"))
    assert not w4a4.ok and "16-bit activations" in w4a4.reason


def test_supports_int8_w8a16_anywhere_and_int8_token_only_on_v6e(monkeypatch: pytest.MonkeyPatch) -> None:
    from musecore_tpu import TpuBackend
    from musecore_tpu import backend as backend_module
    monkeypatch.setattr(backend_module, "jax_missing", lambda: None)
    backend = TpuBackend("cpu")
    for op in ("linear", "moe"):
        assert backend.supports(op, OpSpec(op, weight_format="int8")).ok  # W8A16
        w8a8 = backend.supports(op, OpSpec(op, weight_format="int8", act_format="int8-token", device="tpu-v6e-int8"))
        assert w8a8.ok and "int8 MXU" in w8a8.reason and "int32" in w8a8.reason, w8a8.reason
        v7 = backend.supports(op, OpSpec(op, weight_format="int8", act_format="int8-token", device="tpu-v7"))
        assert not v7.ok and "no int8 rate" in v7.reason
        fp8_acts = backend.supports(op, OpSpec(op, weight_format="int8", act_format="fp8-token"))
        assert not fp8_acts.ok and "'int8-token'" in fp8_acts.reason
        fp8_on_v6e = backend.supports(op, OpSpec(op, weight_format="fp8", act_format="fp8-token",
                                                 device="tpu-v6e-int8"))
        assert not fp8_on_v6e.ok and "no FP8 rate" in fp8_on_v6e.reason


@pytest.mark.parametrize("kind,devices", [("TPU v6 lite", ["tpu-v6e", "tpu-v6e-int8"]),
                                          ("TPU7x", ["tpu-v7", "tpu-v7-fp8"])])
def test_probe_lists_the_8bit_option_after_the_chip_s_own_device(monkeypatch: pytest.MonkeyPatch, kind: str,
                                                                 devices: list) -> None:
    """On a chip (simulated: torch_tpu's modules faked), the probe lists the chip's device first, so ``auto`` picks
    it, and the 8-bit W8A8 option after it (asked for by name)."""
    import sys
    import types
    from musecore_tpu import backend as backend_module
    monkeypatch.setattr(backend_module.importlib.util, "find_spec",
                        lambda name, *a: object() if name == "torch_tpu" else importlib.util.find_spec(name, *a))
    ops_backend = types.SimpleNamespace(_get_local_device_attributes=lambda: {"device_kind": kind})
    device_module = types.ModuleType("torch_tpu._internal.device")
    device_module._device_ops_backend = ops_backend
    for name, module in (("torch_tpu", types.ModuleType("torch_tpu")),
                         ("torch_tpu._internal", types.ModuleType("torch_tpu._internal")),
                         ("torch_tpu._internal.device", device_module)):
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: types.SimpleNamespace(type="tpu"))
    monkeypatch.setattr(torch.accelerator, "device_count", lambda *a, **k: 1)
    probe = backend_module.probe_tpu()
    assert probe.available and probe.devices == devices, (probe.reason, probe.devices)
    assert all(get_profile(d).backend == "tpu" for d in devices)


def test_kernel_ops_say_no_with_the_reason_when_jax_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    from musecore_tpu import TpuBackend
    from musecore_tpu import backend as backend_module
    monkeypatch.setattr(backend_module, "jax_missing", lambda: "jax not installed (test)")
    backend = TpuBackend("cpu")
    assert backend.supports("linear", OpSpec("linear")).reason == "jax not installed (test)"
    assert backend.supports("embedding", OpSpec("embedding")).ok  # a torch op


def test_constructing_the_backend_touches_neither_jax_nor_torch_tpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from musecore_tpu import TpuBackend
    monkeypatch.delenv("MUSECORE_TPU_INTERPRETER", raising=False)
    backend = TpuBackend()
    assert backend.interpret == "tpu" and backend._runner is None


def test_the_interpreter_is_chosen_by_argument_or_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from musecore_tpu import TpuBackend
    assert TpuBackend("cpu", interpret="jax").interpret == "jax"
    monkeypatch.setenv("MUSECORE_TPU_INTERPRETER", "jax")
    assert TpuBackend("cpu").interpret == "jax"
    monkeypatch.setenv("MUSECORE_TPU_INTERPRETER", "fast")
    with pytest.raises(ValueError, match="'tpu' or 'jax'"):
        TpuBackend("cpu")
    with pytest.raises(ValueError, match="only in interpret mode"):
        TpuBackend("cpu", interpret=False)


def test_a_tpu_device_string_without_torch_tpu_is_a_clear_error() -> None:
    from musecore_tpu import TpuBackend
    if HAS_TORCH_TPU:
        pytest.skip("torch_tpu is installed here")
    with pytest.raises(ValueError, match="torch_tpu registers it"):
        TpuBackend("tpu")


def test_torch_tpu_bridge_imports_and_refuses_with_its_reason() -> None:
    if HAS_TORCH_TPU:
        pytest.skip("torch_tpu is installed here: the registration itself is for a TPU host")
    from musecore_tpu import torch_tpu_ops
    assert torch_tpu_ops.unavailable_reason().startswith("torch_tpu not installed")
    with pytest.raises(torch_tpu_ops.TorchTpuUnavailable, match="torch_tpu not installed"):
        torch_tpu_ops.register()


def test_kernel_choices_show_tiles_and_vmem_per_linear() -> None:
    from musecore_tpu import TpuBackend
    linears = [LinearShape("q_proj", 8192, 8192, "bf16"), LinearShape("experts down", 4096, 4096, "int4",
                                                                       experts=256, top_k=8)]
    choices = TpuBackend().kernel_choices(linears, get_profile("tpu-v7"))
    assert len(choices) == 4
    assert all("never run on a TPU" in c.reason and "of 64 MiB" in c.reason for c in choices)
    assert TpuBackend().env_settings()[0].name == "MUSECORE_TPU_INTERPRETER"
    int8 = [LinearShape("q_proj", 8192, 8192, "int8", "int8-token"),
            LinearShape("experts gate/up", 8192, 4096, "int8", "int8-token", experts=256, top_k=8)]
    choices = TpuBackend().kernel_choices(int8, get_profile("tpu-v6e-int8"))
    assert len(choices) == 4 and all("int8 MXU" in c.choice and "of 128 MiB" in c.reason for c in choices), choices


def test_reasons_describe_the_tpu_path_when_the_plan_asks_about_a_tpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from musecore_tpu import TpuBackend
    from musecore_tpu import backend as backend_module
    monkeypatch.setattr(backend_module, "jax_missing", lambda: None)
    backend = TpuBackend()  # what the plan constructs: a CPU instance, interpret mode
    planned = backend.supports("linear", OpSpec("linear", weight_format="nvfp4", device="tpu-v7")).reason
    here = backend.supports("linear", OpSpec("linear", weight_format="nvfp4")).reason
    assert "torch_tpu (never run on a TPU)" in planned and "interpreter on this CPU" not in planned
    assert "JAX's TPU interpreter on this CPU" in here


@pytest.mark.skipif(HAS_TORCH_TPU, reason="torch_tpu is installed here")
def test_benchmark_cases_skip_with_the_reason_without_a_tpu() -> None:
    from musecore_tpu.bench import Skip, benchmarks
    cases = benchmarks()
    assert cases
    for run in cases.values():
        with pytest.raises(Skip, match="no TPU here: torch_tpu not installed"):
            run()


def test_int4_and_int8_resident_bytes_count_the_f32_scales() -> None:
    from musecore_tpu import TpuBackend
    backend = TpuBackend()
    assert backend.resident_bytes("int4", 4096, 4096) == 4096 * 4096 // 2 + 4096 * 32 * 4
    assert backend.resident_bytes("int8", 1024, 4096, experts=8) == 8 * (1024 * 4096 + 1024 * 4)
    assert backend.resident_bytes("mxfp4", 4096, 4096) is None
