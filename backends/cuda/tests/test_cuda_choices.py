"""The CUDA backend's kernel choices as the plan shows them, its environment overrides, the bytes it keeps
resident and its benchmark entry point: all answered on a machine without a GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import musecore_quant
from musecore.backends.base import LinearShape
from musecore.devices import get_profile

from musecore_cuda import CudaBackend
from musecore_cuda.kernels import pdl
from musecore_triton.layouts import prepare_fp4

# The 816B preset's shapes (H 8192, h = I = 4096, 256 experts, top-8): FP4 linears as an all-NVFP4
# checkpoint would have them, the routed experts, and BF16 projections below and above the GEMV limit.
LINEARS_816B = [
    LinearShape("q_proj", 8192, 8192, "nvfp4"),
    LinearShape("k_proj", 1024, 8192, "nvfp4"),
    LinearShape("experts gate/up", 8192, 4096, "nvfp4", experts=256, top_k=8),
    LinearShape("experts down", 4096, 4096, "nvfp4", experts=256, top_k=8),
    LinearShape("pooler", 4096, 8192, "bf16"),
    LinearShape("lm_head", 202048, 8192, "bf16"),
]


@pytest.fixture
def choices(monkeypatch):
    monkeypatch.delenv(pdl.ENV, raising=False)
    return CudaBackend().kernel_choices(LINEARS_816B, get_profile("h200"))


def _choice(choices, *words):
    found = [c for c in choices if all(w in c.what for w in words)]
    assert len(found) == 1, f"{words}: {[c.what for c in choices]}"
    return found[0]


def test_fp4_linear_names_each_path_per_m_range(choices):
    assert "tensor-core GEMV" in _choice(choices, "q_proj", "M 1-15").choice
    assert "tiled tensor-core GEMM" in _choice(choices, "q_proj", "M 16-127").choice
    dequant = _choice(choices, "q_proj", "M >= 128")
    assert "bf16 copy + cuBLAS" in dequant.choice and "128 MiB" in dequant.reason  # the transient copy
    assert "decided at load" in _choice(choices, "k_proj", "M 16-127").reason  # needs the GPU's SM count
    assert "Triton W4A16 GEMM" in _choice(choices, "fp16 activations").choice


def test_moe_names_the_gemv_up_to_e_assignments_and_the_grouped_gemm_beyond(choices):
    assert "CUDA C++ expert GEMVs" in _choice(choices, "experts gate/up", "T <= 32 tokens").choice  # 32 x 8 = 256
    assert "Triton grouped W4A16 GEMM" in _choice(choices, "experts down", "T > 32 tokens").choice


def test_dense_linear_takes_the_gemv_only_on_small_weights(choices):
    assert "Triton dense GEMV" in _choice(choices, "pooler", "M = 1").choice
    assert "cuBLAS" in _choice(choices, "lm_head", "any M").choice


def test_launch_choices_name_pdl_graphs_and_attention(choices):
    assert _choice(choices, "PDL").env == pdl.ENV
    assert f"batch <= {pdl.MAX_BATCH}" in _choice(choices, "PDL").choice
    assert "CUDA graph" in _choice(choices, "decode step").choice
    assert "flash attention" in _choice(choices, "attention").choice


def test_pdl_override_shows_in_choices_and_env_settings(monkeypatch):
    monkeypatch.setenv(pdl.ENV, "0")
    be = CudaBackend()
    pdl_choice = _choice(be.kernel_choices(LINEARS_816B, get_profile("h200")), "PDL")
    assert pdl_choice.choice == "off" and f"{pdl.ENV}=0" in pdl_choice.reason
    settings = {s.name: s for s in be.env_settings()}
    assert settings[pdl.ENV].value == "0"
    monkeypatch.delenv(pdl.ENV)
    assert {s.name: s for s in be.env_settings()}[pdl.ENV].value is None
    assert pdl.EARLY_ENV in settings


def test_blackwell_profile_says_the_kernels_are_unverified_there():
    choices = CudaBackend().kernel_choices(LINEARS_816B[:1], get_profile("b200"))
    assert "SM90 only" in _choice(choices, "kernels on").reason


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("experts", [0, 3])
def test_resident_bytes_are_what_prepare_keeps(fmt, experts):
    shape = (experts, 64, 256) if experts else (64, 256)
    resident = prepare_fp4(musecore_quant.quantize(torch.randn(*shape) * 0.05, fmt), torch.device("cpu"))
    assert CudaBackend().resident_bytes(fmt, 64, 256, experts=experts) == resident.nbytes
    assert CudaBackend().resident_bytes("bf16", 64, 256) is None  # kept as the checkpoint's tensor


def test_benchmarks_come_through_the_entry_point_not_the_backend():
    from musecore.commands.bench import benchmark_cases

    cases = benchmark_cases("cuda")
    assert {"linear", "moe", "attention", "e2e"} <= set(cases)
    assert not hasattr(CudaBackend, "benchmarks")
    backend_source = (Path(__file__).parents[1] / "musecore_cuda" / "backend.py").read_text()
    assert "musecore_cuda.bench" not in backend_source  # no backend.py <-> bench.py circle
