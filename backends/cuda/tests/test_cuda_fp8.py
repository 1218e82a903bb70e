"""The h200-fp8 throughput option: per-token FP8 activations, experts requantized to FP8 at load.

On the CPU: the per-token quantization is the reference's emulation bit for bit, the load-time
requantization follows the ModelOpt rule, the emulation of the GPU's MoE matches the reference's moe,
and the plan states the paths and the memory. On the GPU (``gpu``): the Triton quantize kernel gives
the same bits as the CPU definition, and the FP8 linear and MoE match their emulations.
"""

from __future__ import annotations

import pytest
import torch

import musecore_quant
from musecore.api import plan
from musecore.ops import ExpertWeights, Weight
from musecore.ops import reference as ref
from musecore_quant.metrics import quant_error

from musecore_cuda.fp8 import E4M3_MAX, TOKEN_ACT, emulate_linear_rows, fake_quantize_rows, quantize_rows
from musecore_cuda.kernels.fp8_moe import emulate_fp8_moe


def nmse(expected: torch.Tensor, got: torch.Tensor) -> float:
    e, g = expected.double().cpu(), got.double().cpu()
    return float(((e - g) ** 2).sum() / (e ** 2).sum().clamp_min(1e-300))


def awkward_rows(dtype: torch.dtype, device="cpu") -> torch.Tensor:
    """Rows that exercise the edges: normal, all zero, one huge outlier, tiny values (E4M3 subnormals)."""
    x = torch.randn(6, 256, generator=torch.Generator().manual_seed(1))
    x[1] = 0
    x[2, 7] = 3e4
    x[3] *= 1e-6
    x[4, :128] = 0
    return x.to(dtype).to(device)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_per_token_quantization_is_the_reference_emulation_bit_for_bit(dtype):
    x = awkward_rows(dtype)
    got = fake_quantize_rows(x)
    expected = ref.fake_quantize_activation(x, TOKEN_ACT, None)
    assert torch.equal(got, expected), f"max difference {float((got.float() - expected.float()).abs().max())}"
    q, scale = quantize_rows(x)
    assert scale[1].item() == 1.0, "an all-zero row gets scale 1"
    nonzero = [0, 2, 3, 4, 5]
    assert torch.equal(q[nonzero].float().abs().amax(-1), torch.full((5,), E4M3_MAX)), "each row's max maps to 448"
    # a token's codes do not depend on its batch
    assert torch.equal(quantize_rows(x[2:3])[0], q[2:3])


def test_load_time_requantization_nvfp4_to_fp8_is_the_modelopt_rule_and_adds_little_error():
    w = torch.randn(4, 64, 128, generator=torch.Generator().manual_seed(2)) * 0.05
    nv = musecore_quant.quantize(w, "nvfp4")
    fp8 = musecore_quant.requantize(nv, "fp8")  # what the loader does for the h200-fp8 profile
    values = musecore_quant.dequantize(nv, torch.float32)
    scale = values.abs().amax(dim=(-2, -1)) / 448.0
    codes = (values / scale[:, None, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(fp8.scale, scale) and torch.equal(fp8.data.view(torch.uint8), codes.view(torch.uint8))
    added = quant_error(values, musecore_quant.dequantize(fp8, torch.float32)).sqnr_db
    nvfp4 = quant_error(w, values).sqnr_db
    assert added > nvfp4 + 10, f"FP8 requantization noise {added:.1f} dB is not well below NVFP4's {nvfp4:.1f} dB"


def fp8_layer(experts=8, width=256, inter=256, seed=3):
    g = torch.Generator().manual_seed(seed)
    mats = [torch.randn(experts, inter, width, generator=g) * width ** -0.5,
            torch.randn(experts, inter, width, generator=g) * width ** -0.5,
            torch.randn(experts, width, inter, generator=g) * inter ** -0.5]
    qs = [musecore_quant.requantize(musecore_quant.quantize(m, "nvfp4"), "fp8") for m in mats]
    dense = [musecore_quant.dequantize(q, torch.float32) for q in qs]
    reference = ExpertWeights(gate=dense[0], up=dense[1], down=dense[2], format="fp8", num_experts=experts,
                              act_format=TOKEN_ACT)
    norm = (1.0 + 0.5 * torch.randn(width, generator=g)).to(torch.bfloat16)
    return qs, reference, norm


def route(tokens, experts, topk, seed=4):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, 32, generator=g)
    return ref.router_topk(x, torch.randn(experts, 32, generator=g), torch.zeros(experts), topk, 1.0, 1.0)


def test_emulated_fp8_moe_matches_the_reference_moe():
    """The GPU kernel's arithmetic (integer-exact E4M3 products, scales applied after the sum), emulated in
    fp32, against the reference's fake-quantized moe; tolerance NMSE 1e-5 (fp32 reassociation and a
    rare flipped code of the per-token requantization of h)."""
    qs, reference, norm = fp8_layer()
    weights, ids = route(5, 8, 2)
    z = torch.randn(5, 256).to(torch.bfloat16)
    expected = ref.moe(z, weights, ids, reference, norm, 1e-6)
    got = emulate_fp8_moe(z, weights, ids, *[(q.data, q.scale) for q in qs], norm, 1e-6)
    err = nmse(expected, got)
    assert err < 1e-5, f"emulated FP8 moe vs reference: NMSE {err:.3g} (tolerance 1e-5)"


def test_h200_fp8_plan_states_paths_and_memory_and_816b_fits_8_gpus():
    p = plan("muse-tiny", "h200-fp8")
    experts = [g for g in p.groups if g.group == "experts (quantized layers)"][0]
    assert (experts.target_format, experts.act_format) == ("fp8", TOKEN_ACT)
    assert experts.action == "quantize bf16->fp8"
    kernels = " | ".join(f"{k.what}: {k.choice}" for k in p.kernels)
    assert "Triton FP8 grouped GEMM" in kernels, kernels
    default = plan("muse-tiny", "h200")
    assert [g for g in default.groups if g.group == "experts (quantized layers)"][0].target_format == "bf16", \
        "the FP8 option is off by default: plain h200 keeps the checkpoint's experts"
    big = plan("muse-spark-open-816b-a42b", "h200-fp8", checkpoint_format="nvfp4", tp=8, ep=8)
    assert big.mesh.fits, f"816B with FP8 experts needs {big.mesh.rank_bytes / 2**30:.1f} GiB per H200"
    e = [g for g in big.groups if g.group == "experts (quantized layers)"][0]
    assert e.bytes >= e.parameters, "FP8 experts hold one byte per weight at least"


def test_fp8_moe_kernels_match_emulation_exactly_on_fp16():
    """The grouped GEMM, alignment and finalize of :func:`fp8_moe` (Triton's interpreter without a GPU),
    fp16 activations, against the emulation: equal up to fp32 rounding (NMSE 1e-10; 1e-4 on a GPU). Without a GPU
    ``fp8_moe`` quantizes rows with the CPU definition itself: the interpreter's fp32 -> E4M3 cast does not round to
    nearest (the GPU kernel's bits are checked on the GPU below)."""
    from musecore_cuda import CudaBackend
    from musecore_cuda.kernels import fp8_moe as fm
    device = "cuda" if torch.cuda.is_available() else "cpu"
    qs, _reference, norm = fp8_layer(experts=4, width=128, inter=128)
    prepared = CudaBackend(device).prepare_experts(*qs, act_format=TOKEN_ACT)
    weights, ids = route(5, 4, 2)
    z, norm = torch.randn(5, 128).half(), norm.half()
    got = fm.fp8_moe(z.to(device), weights.to(device), ids.to(device), prepared.gate, prepared.up, prepared.down, 4,
                     norm.to(device), 1e-6).cpu()
    err = nmse(emulate_fp8_moe(z, weights, ids, *[(q.data, q.scale) for q in qs], norm, 1e-6), got)
    # on a GPU the wgmma sums in another order: a last-bit difference can flip an E4M3 code of h (see below)
    tol = 1e-4 if device == "cuda" else 1e-10
    assert err < tol, f"FP8 moe kernels vs emulation on {device}: NMSE {err:.3g} (tolerance {tol})"


# -- on the GPU ---------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_quantize_rows_kernel_is_bit_exact(dtype):
    from musecore_cuda.kernels.fp8_moe import quantize_rows_gpu
    x = torch.cat([awkward_rows(dtype), (torch.randn(300, 256) * 7).to(dtype)])
    q_cpu, s_cpu = quantize_rows(x)
    q, s = quantize_rows_gpu(x.cuda())
    diff = int((q.cpu().view(torch.uint8) != q_cpu.view(torch.uint8)).sum())
    same_scales = torch.equal(s.cpu(), s_cpu)
    assert diff == 0 and same_scales, f"{diff} codes differ; scales equal: {same_scales}"


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 5, 64, 300])
def test_gpu_fp8_linear_per_token_matches_emulation(m):
    from musecore_cuda import CudaBackend
    be = CudaBackend("cuda")
    qt = musecore_quant.quantize(torch.randn(200, 256) * 0.05, "fp8")
    w = be.prepare_weight(qt, "q_proj", act_format=TOKEN_ACT)
    x = torch.randn(m, 256).to(torch.bfloat16)
    got = be.linear(x.cuda(), w).cpu()
    err = nmse(emulate_linear_rows(x, qt.data, qt.scale), got)
    assert got.shape == (m, 200) and err < 1e-5, f"NMSE {err:.3g} vs emulation (tolerance 1e-5: bf16 output)"
    expected = ref.linear(x, Weight(data=musecore_quant.dequantize(qt), format="fp8", out_features=200,
                                    in_features=256, act_format=TOKEN_ACT))
    err = nmse(expected, got)
    assert err < 1e-4, f"NMSE {err:.3g} vs reference (tolerance 1e-4: it rounds x's round trip to bf16)"


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 5, 300])
def test_gpu_fp8_moe_matches_emulation_and_reference(tokens):
    from musecore_cuda import CudaBackend
    be = CudaBackend("cuda")
    qs, reference, norm = fp8_layer()
    prepared = be.prepare_experts(*qs, act_format=TOKEN_ACT)
    weights, ids = route(tokens, 8, 2)
    z = torch.randn(tokens, 256).to(torch.bfloat16)
    got = be.moe(z.cuda(), weights.cuda(), ids.cuda(), prepared, norm.cuda(), 1e-6).cpu()
    # Tolerance: the wgmma sums in another order than fp32 matmul, so an h value within that difference of an
    # E4M3 rounding midpoint takes the neighbouring code (1/16 of it): one such flip costs up to ~2e-5 NMSE
    # here; a wrong scale, expert or row costs ~1. (Without per-wgmma promotion it measured 2.4e-5 .. 6.3e-5.)
    err = nmse(emulate_fp8_moe(z, weights, ids, *[(q.data, q.scale) for q in qs], norm, 1e-6), got)
    assert err < 1e-4, f"T={tokens}: NMSE {err:.3g} vs emulation (tolerance 1e-4)"
    err = nmse(ref.moe(z, weights, ids, reference, norm, 1e-6), got)
    assert err < 2e-4, f"T={tokens}: NMSE {err:.3g} vs reference (tolerance 2e-4)"
