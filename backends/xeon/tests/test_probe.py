"""Probe, support matrix, threads and plugin registration of the xeon backend."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from musecore.backends.base import Tier
from musecore.ops import OpSpec
from musecore_xeon import XeonBackend
from musecore_xeon.backend import probe_cpu
from musecore_xeon.cpu import configure_threads, read_cpu_info


def fake_cpuinfo(tmp_path: Path, flags: str, vendor: str = "GenuineIntel") -> Path:
    path = tmp_path / "cpuinfo"
    path.write_text(f"processor\t: 0\nvendor_id\t: {vendor}\nmodel name\t: Test CPU\nflags\t\t: {flags}\n\n")
    return path


def test_probe_on_this_machine_serves_xeon6_only_with_amx(xeon: XeonBackend) -> None:
    probe = xeon.probe()
    info = read_cpu_info()
    print(probe.reason, probe.details)
    assert probe.available, probe.reason
    assert "xeon" in probe.devices and "cpu-x86" in probe.devices
    if info.has("amx_bf16"):
        assert "xeon6" in probe.devices
    else:
        assert "xeon6" not in probe.devices
        assert "no AMX (amx_bf16 absent)" in probe.reason and "device='xeon'" in probe.reason
    assert probe.details["torch_cpu_capability"] == str(torch.backends.cpu.get_cpu_capability())


def test_probe_with_amx_serves_xeon6(tmp_path: Path) -> None:
    info = read_cpu_info(str(fake_cpuinfo(tmp_path, "fpu avx2 avx512f avx512_bf16 amx_tile amx_bf16 amx_int8")))
    probe = probe_cpu(info)
    assert probe.available and probe.devices[0] == "xeon6"
    assert probe.score > probe_cpu(read_cpu_info(str(fake_cpuinfo(tmp_path, "avx2 avx512f")))).score


def test_every_cpu_tier_scores_below_an_accelerator() -> None:
    """``device="auto"`` on a GPU host with a Xeon 6 is the GPU: the best CPU tier scores below the lowest
    accelerator backend (CUDA or ROCm on a chip where none of its kernels has run: 50)."""
    from musecore_xeon.backend import ACCELERATOR_MIN_SCORE, PROBE_SCORES
    assert max(PROBE_SCORES.values()) < ACCELERATOR_MIN_SCORE, PROBE_SCORES


def test_probe_reports_the_int4_dense_path_that_the_build_will_take(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """AMX-BF16 with AVX-512 BF16 and VNNI: the INT4 GEMM on AMX above the crossover; AVX-512 BF16 without AMX (or AMX
    capped to avx512_vnni by MUSECORE_XEON_ISA): the AVX512_BF16 GEMM; capped to avx2 or without those flags:
    dequantized tiles."""
    amx = read_cpu_info(str(fake_cpuinfo(tmp_path, "fpu avx2 fma f16c avx512f avx512bw avx512vl avx512_vnni "
                                                   "avx512_bf16 amx_tile amx_bf16 amx_int8")))
    monkeypatch.delenv("MUSECORE_XEON_ISA", raising=False)
    assert probe_cpu(amx).details["int4_dense_path"] == "amx"
    assert probe_cpu(read_cpu_info(str(fake_cpuinfo(tmp_path, "avx2 fma avx512f avx512_vnni")))
                     ).details["int4_dense_path"] == "dequantized tiles"
    zen = read_cpu_info(str(fake_cpuinfo(tmp_path, "avx2 fma f16c avx512f avx512bw avx512vl avx512_vnni avx512_bf16")))
    assert probe_cpu(zen).details["int4_dense_path"] == "avx512_bf16 gemm"
    monkeypatch.setenv("MUSECORE_XEON_ISA", "avx512_vnni")
    assert probe_cpu(amx).details["int4_dense_path"] == "avx512_bf16 gemm"
    monkeypatch.setenv("MUSECORE_XEON_ISA", "avx2")
    assert probe_cpu(amx).details["int4_dense_path"] == "dequantized tiles"


def test_probe_without_avx2_is_unavailable_with_reason(tmp_path: Path) -> None:
    probe = probe_cpu(read_cpu_info(str(fake_cpuinfo(tmp_path, "fpu sse4_2 avx"))))
    assert not probe.available and probe.devices == [] and "AVX2" in probe.reason


def test_probe_never_raises_on_unreadable_cpuinfo(tmp_path: Path) -> None:
    probe = probe_cpu(read_cpu_info(str(tmp_path / "missing")))
    assert not probe.available and "cannot read" in probe.reason


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_fp4_weights_are_refused_with_the_conversion_to_apply(xeon: XeonBackend, fmt: str) -> None:
    for op in ("linear", "moe"):
        support = xeon.supports(op, OpSpec(op, weight_format=fmt))
        assert support.tier is Tier.NO and not support.ok
        assert support.reason == "convert to INT4 at load (the plan does this for xeon devices)"


@pytest.mark.parametrize("act", ["nvfp4", "mxfp4", "fp8"])
def test_activation_quantization_is_refused(xeon: XeonBackend, act: str) -> None:
    support = xeon.supports("linear", OpSpec("linear", weight_format="int4", act_format=act))
    assert support.tier is Tier.NO and "weight-only" in support.reason


@pytest.mark.parametrize("fmt", ["int4", "bf16", "fp32"])
def test_int4_and_dense_weights_are_native(xeon: XeonBackend, fmt: str) -> None:
    for op in ("linear", "moe"):
        assert xeon.supports(op, OpSpec(op, weight_format=fmt)).tier is Tier.NATIVE


def test_num_threads_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    before = torch.get_num_threads()
    try:
        monkeypatch.setenv("MUSECORE_NUM_THREADS", "1")
        assert XeonBackend().num_threads == 1 and torch.get_num_threads() == 1
        monkeypatch.setenv("MUSECORE_NUM_THREADS", "many")
        with pytest.raises(ValueError, match="MUSECORE_NUM_THREADS"):
            configure_threads()
    finally:
        torch.set_num_threads(before)


def test_plugin_is_registered_under_the_entry_point() -> None:
    from musecore.backends.registry import discover
    record = discover()["xeon"]
    assert record.error is None, record.error
    assert record.backend_class is XeonBackend
