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
from musecore_cuda.backend import fp4_linear_path
from musecore_cuda.choices import GLUON_ENV, GLUON_MAX_M, GLUON_MIN_M, fp4_path_for, moe_uses_gemv
from musecore_cuda.kernels import fp4_gluon_plan, moe_prefill, pdl, triton_hooks
from musecore_cuda.kernels.fp4_gluon_plan import SMEM_BYTES, pick_config
from musecore_cuda.kernels.moe_decode import (HANDOFF_ENV, RUNS_FROM_TOKENS, RUNS_MIN_TOKENS, handoff_by_default,
                                              on_runs_by_default)
from musecore_triton.kernels import router
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
def gluon_importable(monkeypatch):
    """The plan as on a machine whose Triton has Gluon's Hopper API (CI's may not)."""
    monkeypatch.delenv(GLUON_ENV, raising=False)
    monkeypatch.setattr(fp4_gluon_plan, "import_problem", lambda: None)


@pytest.fixture
def choices(monkeypatch, gluon_importable):
    monkeypatch.delenv(pdl.ENV, raising=False)
    return CudaBackend().kernel_choices(LINEARS_816B, get_profile("h200"))


def _choice(choices, *words):
    found = [c for c in choices if all(w in c.what for w in words)]
    assert len(found) == 1, f"{words}: {[c.what for c in choices]}"
    return found[0]


def test_fp4_linear_names_each_path_per_m_range(choices):
    gluon = _choice(choices, "q_proj", f"M 1-{GLUON_MAX_M}")  # the 816B shapes from one row (run 137)
    assert "Gluon W4A16 GEMM" in gluon.choice and gluon.env == GLUON_ENV
    # the launch at M=8 on an H200's 132 SMs
    assert "64,16,2,4,packed,2,finish,rezero" in gluon.reason and "two CTAs per SM" in gluon.reason
    k_proj = _choice(choices, "k_proj", f"M 1-{GLUON_MAX_M}")
    assert "64,16,16,4,packed,2,finish,rezero" in k_proj.reason  # narrow N: split-K fills the SMs, two CTAs on each
    large = _choice(choices, "q_proj", f"M {GLUON_MAX_M + 1}-2048")  # 64 weight tiles of 128: 128 tiles at M = 257
    assert "Gluon W4A16 GEMM" in large.choice and "128,256,1,3,packed" in large.reason and "M=2048" in large.reason
    assert "bf16 copy + cuBLAS" in _choice(choices, "q_proj", "M >= 2049").choice  # behind it at 4096 (session 82)
    dequant = _choice(choices, "k_proj", f"M >= {GLUON_MAX_M + 1}")  # 8 weight tiles: never 128 up to M = 2048
    assert "bf16 copy + cuBLAS" in dequant.choice and "16 MiB" in dequant.reason  # the transient copy
    assert "Triton W4A16 GEMM" in _choice(choices, "fp16 activations").choice


def _q_proj_ranges(fmt: str = "nvfp4", profile: str = "h200") -> dict[str, tuple[str, str]]:
    out = CudaBackend().kernel_choices([LinearShape("q_proj", 8192, 8192, fmt)], get_profile(profile))
    return {c.what.split(", bf16, ")[1]: (c.choice, c.reason) for c in out if c.what.startswith("linear q_proj")}


def test_mxfp4_keeps_the_cuda_cpp_gemm_and_dequant_with_the_reason(gluon_importable):
    ranges = _q_proj_ranges("mxfp4")
    assert set(ranges) == {"M 1-15", "M 16-127", "M >= 128"}
    assert "tiled tensor-core GEMM" in ranges["M 16-127"][0] and "NVFP4 only" in ranges["M 16-127"][1]
    assert "NVFP4 only" in ranges["M >= 128"][1]


def test_gluon_switched_off_by_env_restores_todays_ranges_and_says_so(monkeypatch, gluon_importable):
    monkeypatch.setenv(GLUON_ENV, "0")
    ranges = _q_proj_ranges()
    assert set(ranges) == {"M 1-15", "M 16-127", "M >= 128"}
    assert f"{GLUON_ENV}=0" in ranges["M 16-127"][1] and "decided at load" in ranges["M 16-127"][1]  # SM count
    assert {s.name: s for s in CudaBackend().env_settings()}[GLUON_ENV].value == "0"
    monkeypatch.setenv(GLUON_ENV, "no")
    with pytest.raises(ValueError, match=f"{GLUON_ENV} must be 0"):
        _q_proj_ranges()


def test_gluon_unavailable_falls_back_to_todays_rule_and_the_plan_says_why(monkeypatch):
    monkeypatch.delenv(GLUON_ENV, raising=False)
    monkeypatch.setattr(fp4_gluon_plan, "import_problem", lambda: "triton 3.4 has no usable Gluon Hopper API (x)")
    ranges = _q_proj_ranges()
    assert set(ranges) == {"M 1-15", "M 16-127", "M >= 128"}
    assert "triton 3.4 has no usable Gluon" in ranges["M 16-127"][1]
    monkeypatch.setattr(fp4_gluon_plan, "import_problem", lambda: None)
    assert "SM90" in _q_proj_ranges(profile="b200")["M 16-127"][1]  # the kernel is SM90-only


def test_fp4_path_for_takes_gluon_only_for_nvfp4_bf16_in_its_m_range():
    bf16 = torch.bfloat16
    paths = {m: fp4_path_for(m, bf16, weight_format="nvfp4", gluon=True) for m in (8, 9, 16, 17, 100, 256, 257)}
    assert paths == {8: "mma", 9: "gluon", 16: "gluon", 17: "gluon", 100: "gluon", 256: "gluon", 257: "dequant"}
    wide = {m: fp4_path_for(m, bf16, weight_format="nvfp4", gluon=True, weights=1024 * 8192, out_features=1024)
            for m in (1, 2, 8)}
    assert wide == {1: "gluon", 2: "gluon", 8: "gluon"}  # k_proj (8M) and wider: from M=2 (run 93), M=1 (run 137)
    under = {m: fp4_path_for(m, bf16, weight_format="nvfp4", gluon=True, weights=1024 * 8192 - 64, out_features=1024)
             for m in (1, 2)}
    assert under == {1: "mma", 2: "gluon"}
    # muse-small's lm_head quantized (65536 x 1536): large, but K < 4096 is unmeasured at one row
    assert fp4_path_for(1, bf16, weight_format="nvfp4", gluon=True, weights=65536 * 1536, out_features=65536) == "mma"
    assert fp4_path_for(1, bf16, weight_format="nvfp4", gluon=True, weights=1024 * 8192) == "mma"  # K unknown
    small = {m: fp4_path_for(m, bf16, weight_format="nvfp4", gluon=True, weights=192 * 1536) for m in (1, 2, 8)}
    assert small == {1: "mma", 2: "gluon", 8: "gluon"}  # muse-small's smallest linear too (run 96)
    assert fp4_path_for(8, bf16, weight_format="nvfp4", gluon=True, weights=256 * 512) == "mma"  # unmeasured
    assert fp4_path_for(16, bf16, weight_format="nvfp4", gluon=False) == "gemm"
    assert fp4_path_for(64, bf16, weight_format="mxfp4", gluon=True) == "gemm"
    assert fp4_path_for(64, torch.float16, weight_format="nvfp4", gluon=True) == "tiled"
    assert fp4_path_for(64, bf16, weight_format="nvfp4", gluon=False) == "gemm"


def test_fp4_linear_path_without_a_gpu_never_takes_gluon():
    assert fp4_gluon_plan.unavailable_reason(torch.device("cpu")).startswith("the Gluon GEMM runs on NVIDIA GPUs")
    assert fp4_linear_path(64, torch.bfloat16, torch.device("cpu"), 1, weight_format="nvfp4",
                           out_features=1) == "tiled"


def test_sm90_without_gluon_warns_that_the_slower_path_runs(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (9, 0))
    monkeypatch.setattr(fp4_gluon_plan, "import_problem", lambda: "triton 3.4 has no usable Gluon Hopper API (x)")
    with pytest.warns(RuntimeWarning, match="instead of the Gluon GEMM"):
        assert "triton 3.4" in fp4_gluon_plan._device_reason.__wrapped__(0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (10, 0))
    assert "SM100" in fp4_gluon_plan._device_reason.__wrapped__(0)


def test_package_imports_and_plans_without_gluon():
    """CI may have a Triton without ``triton.experimental.gluon``: the backend imports, the kernel module is not
    imported, and the plan keeps today's rule with the import error as its reason."""
    import subprocess
    import sys
    code = """
import sys, importlib.abc
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.startswith("triton.experimental.gluon"):
            raise ImportError(f"blocked {name}")
sys.meta_path.insert(0, Block())
from musecore.backends.base import LinearShape
from musecore.devices import get_profile
from musecore_cuda import CudaBackend
assert "musecore_cuda.kernels.fp4_gemm_gluon" not in sys.modules
out = CudaBackend().kernel_choices([LinearShape("q_proj", 8192, 8192, "nvfp4")], get_profile("h200"))
print([(c.what, c.reason) for c in out if "M 16-127" in c.what])
"""
    env = {k: v for k, v in __import__("os").environ.items() if k != GLUON_ENV}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "no usable triton.experimental.gluon Hopper API" in res.stdout, res.stdout


def test_a_triton_other_than_the_gluon_kernels_one_keeps_the_other_paths_and_says_why(monkeypatch):
    """Gluon's API moves between Triton minors (3.9 imports the module but cannot compile the kernels): only the
    version they were written and run with takes the Gluon paths; the reason names both versions."""
    import triton
    monkeypatch.setattr(fp4_gluon_plan, "importlib", type("I", (), {"import_module": staticmethod(lambda name: None)}))
    for version, ok in (("3.6.0", True), ("3.6.1", True), ("3.9.0", False), ("3.5.1", False), ("3.60.0", False)):
        monkeypatch.setattr(triton, "__version__", version)
        fp4_gluon_plan.import_problem.cache_clear()
        problem = fp4_gluon_plan.import_problem()
        assert (problem is None) == ok, (version, problem)
        assert ok or (f"triton {version}" in problem and "Triton 3.6" in problem), problem
    fp4_gluon_plan.import_problem.cache_clear()


# The sweep's best block_n 64 cut at the points it measured (H200, 132 SMs; tiles from cuda_gluon_sweep_s40_packed.json,
# consumer variants from session 61's run 87, benchmarks/results/h200_issue26/run87_s61_call1_pair_h200)
@pytest.mark.parametrize("m,n,k,cut", [
    (256, 8192, 8192, "64,256,1,3,packed"),                      # 48.88 us (late: 55.12)
    (64, 8192, 4096, "64,64,1,8,packed,1,pair,late,ahead2"),    # expert_up: 15.23 us (15.95)
    (256, 8192, 4096, "64,256,1,3,packed"),                      # 26.80 us
    (32, 4096, 4096, "64,32,4,4,packed,2,finish,rezero"),       # expert_down: 9.65 us (wide: 10.18; H100, run 133)
    (256, 4096, 4096, "64,128,1,4,packed,1,late"),               # 17.93 us (18.58)
    # two consumer warpgroups at twice the split (run 89, benchmarks/results/h200_issue26/run89_s61_call3_*)
    # (H100, session 69, run 135: two 64-row CTAs per SM at the wide launch's split, which beat one warpgroup in run 89)
    (16, 8192, 8192, "64,16,2,4,packed,2,finish,rezero"),  # q_proj: 21.85 us (wide 23.13; one warpgroup, run 89: 24.32)
    (16, 4096, 8192, "64,16,4,4,packed,2,finish,rezero"),  # pooler: 13.02 us (wide 13.85)
    (64, 4096, 8192, "64,64,4,4,packed,2,finish,rezero"),       # pooler: 16.29 us (wide: 17.21; H100, run 133)
    (16, 4096, 4096, "64,16,4,4,packed,2,finish,rezero"),  # expert_down: 9.00 us (wide 9.51; run 135)
    (16, 8192, 4096, "64,16,2,4,packed,2,finish,rezero"),  # expert_up: 12.89 us (split 1 paired: 14.04; run 136)
    (32, 8192, 4096, "64,32,2,4,packed,2,finish,rezero"),  # expert_up: 13.86 us (14.65)
    (64, 8192, 4096, "64,64,1,8,packed,1,pair,late,ahead2"),  # expert_up: 15.32 us (two CTAs at split 2: 16.04)
    # H100 (session 63, run 96, benchmarks/results/h200_issue26/run96_s63_call2_cuts_small_moe_h100): one 64-token
    # tile on two warpgroups at split 4, not two 32-token tiles on one at split 1 (run 87's H200 pick, 13.67 us)
    (64, 4096, 4096, "64,64,4,4,packed,2,finish,rezero"),  # expert_down: 11.23 us (wide 12.17; run 133: two CTAs)
    # (run 99) 64 chunks at split 1 on two warpgroups at split 2, to 64 tokens (the H200's paired one-warpgroup cut at
    # M = 64, run 87: 26.99 us, 1.02x the two-warpgroup one in run 89; on the H100 even, 28.21 both)
    (20, 8192, 8192, "64,32,2,4,packed,2,finish,rezero"),  # q_proj: 23.16 us (wide 24.14, run 135; one: 26.56)
    (48, 8192, 8192, "64,64,2,4,packed,2,finish,rezero"),  # q_proj: 25.43 us (wide 26.54; run 133: two CTAs)
    (64, 8192, 8192, "64,64,2,4,packed,2,finish,rezero"),  # q_proj: 26.39 us (wide 28.01; run 133: two CTAs)
    (16, 1024, 8192, "64,16,16,4,packed,2,finish,rezero"),  # k_proj: 7.00 us (one warpgroup at split 8: 7.19)
    (64, 1024, 8192, "64,64,8,8,packed,1,finish,pair,late,ahead2,rezero"),  # k_proj: 8.46 us (two CTAs: 9.05)
])
def test_pick_config_picks_the_measured_best_cut(m, n, k, cut):
    assert pick_config(m, n, k, 132).label() == cut


@pytest.mark.parametrize("n,k", [(8192, 8192), (1024, 8192), (8192, 4096), (4096, 4096), (320, 1024), (64, 256)])
def test_pick_config_fits_shared_memory_and_divides_k(n, k):
    for m in range(GLUON_MIN_M, GLUON_MAX_M + 1):
        for sms in (78, 114, 132):
            cfg = pick_config(m, n, k, sms)
            chunks = k // 128
            assert cfg.smem_bytes() <= SMEM_BYTES and cfg.stages >= 2, cfg
            assert chunks % cfg.split_k == 0 and (cfg.split_k == 1 or chunks // cfg.split_k >= 2), cfg
            assert not cfg.pair or (chunks // cfg.split_k) % 2 == 0, cfg  # paired stages take chunks two at a time
            assert cfg.block_m >= min(m, 16) and cfg.upcast == "packed", cfg
            assert cfg.block_n == 64 or (cfg.split_k > 1 and cfg.finish and cfg.pair and cfg.block_m <= 64), cfg
            assert cfg.ctas_per_sm == 1 or (cfg.block_n == 64 and cfg.split_k > 1 and cfg.finish), cfg
    assert pick_config(64, 1024, 8192, 132).split_k > 1  # 16 weight tiles on 132 SMs: split-K


def test_consumer_variant_pairs_only_even_chunks_in_the_ring_and_leaves_256_tokens_alone():
    """Run 87's ranking: up to 64 tokens 8 paired stages + late release + scale words two ahead, where the chunks per
    split are even (else late release alone); 128 tokens late release; 256 tokens (3 stages) unchanged."""
    plain = fp4_gluon_plan.GluonConfig(64, 64, 2, 4, upcast="packed", finish=True)
    assert fp4_gluon_plan.consumer_variant(plain, 16).label() == "64,64,2,8,packed,1,finish,pair,late,ahead2"
    assert fp4_gluon_plan.consumer_variant(plain, 15).label() == "64,64,2,4,packed,1,finish,late"
    wide_tile = fp4_gluon_plan.GluonConfig(64, 128, 1, 4, upcast="packed")
    assert fp4_gluon_plan.consumer_variant(wide_tile, 32).label() == "64,128,1,4,packed,1,late"
    full = fp4_gluon_plan.GluonConfig(64, 256, 1, 3, upcast="packed")
    assert fp4_gluon_plan.consumer_variant(full, 32) == full


def test_gluon_config_validates():
    with pytest.raises(ValueError, match="block_n"):
        fp4_gluon_plan.GluonConfig(96, 32, 1, 4)
    with pytest.raises(ValueError, match="upcast must be one of"):
        fp4_gluon_plan.GluonConfig(64, 32, 1, 4, upcast="fp8")
    assert fp4_gluon_plan.GluonConfig(64, 32, 1, 4, asm_upcast=True).upcast == "asm"
    with pytest.raises(ValueError, match="persistent launch runs the packed upcast without split-K"):
        fp4_gluon_plan.GluonConfig(64, 32, 2, 4, upcast="packed", persistent=True)
    # a ring of one pair deadlocks (the consumer waits for the next pair before it releases the one it holds: run 89
    # hung there), so pairs need two
    with pytest.raises(ValueError, match=r"4 or more \(two pairs\)"):
        fp4_gluon_plan.GluonConfig(64, 128, 8, 2, upcast="packed", pair=True)


@pytest.mark.parametrize("cfg", [fp4_gluon_plan.GluonConfig(64, 32, 1, 4),
                                 fp4_gluon_plan.GluonConfig(128, 256, 1, 3, upcast="packed", persistent=True),
                                 fp4_gluon_plan.GluonConfig(64, 64, 4, 4, upcast="packed", fixup=True),
                                 fp4_gluon_plan.GluonConfig(64, 64, 4, 4, upcast="packed", finish=True),
                                 fp4_gluon_plan.GluonConfig(64, 64, 4, 4, upcast="packed", finish=True, pair=True),
                                 fp4_gluon_plan.GluonConfig(64, 64, 4, 6, upcast="packed", pair=True, late=True),
                                 fp4_gluon_plan.GluonConfig(64, 64, 1, 4, upcast="packed", ctas_per_sm=2)])
def test_gluon_config_label_parses_back(cfg):
    assert fp4_gluon_plan.GluonConfig.parse(cfg.label()) == cfg, cfg.label()


def test_gluon_config_two_ctas_per_sm_halves_registers_and_ring():
    """Two CTAs per SM: 128 registers per thread at launch (2 x 256 threads x 128 = the register file), block_n 64
    only, and a ring that fits twice in the shared-memory budget; the label names it, the default does not."""
    two = fp4_gluon_plan.GluonConfig(64, 64, 1, 4, upcast="packed", ctas_per_sm=2)
    assert two.maxnreg == 128 and 2 * 256 * two.maxnreg == 65536
    assert two.label() == "64,64,1,4,packed,2"
    one = fp4_gluon_plan.GluonConfig(64, 64, 1, 4, upcast="packed")
    assert one.maxnreg is None and one.label() == "64,64,1,4,packed"
    assert two.launch_options == {"num_warps": 4, "maxnreg": 128} and one.launch_options == {"num_warps": 4}
    with pytest.raises(ValueError, match="ctas_per_sm"):
        fp4_gluon_plan.GluonConfig(128, 64, 1, 4, upcast="packed", ctas_per_sm=2)
    with pytest.raises(ValueError, match="ctas_per_sm"):
        fp4_gluon_plan.GluonConfig(64, 256, 1, 2, upcast="packed", ctas_per_sm=2)  # 2 x 139 KB of ring
    with pytest.raises(ValueError, match="ctas_per_sm"):
        fp4_gluon_plan.GluonConfig(64, 64, 1, 4, upcast="packed", ctas_per_sm=3)
    fixup = fp4_gluon_plan.GluonConfig(64, 64, 4, 4, upcast="packed", fixup=True)
    assert fixup.label() == "64,64,4,4,packed,1,fixup" and fixup.maxnreg is None and not fixup.atomic
    assert fp4_gluon_plan.GluonConfig(64, 64, 4, 4, upcast="packed").atomic
    assert not fp4_gluon_plan.GluonConfig(64, 64, 1, 4, upcast="packed", fixup=True).fixup  # nothing to sum at split 1
    finish = fp4_gluon_plan.GluonConfig(64, 64, 4, 4, upcast="packed", finish=True)
    assert finish.label() == "64,64,4,4,packed,1,finish" and not finish.atomic and not finish.fixup
    assert not fp4_gluon_plan.GluonConfig(64, 64, 1, 4, upcast="packed", finish=True).finish
    with pytest.raises(ValueError, match="either by fixup or by finish"):
        fp4_gluon_plan.GluonConfig(64, 64, 4, 4, upcast="packed", fixup=True, finish=True)
    with pytest.raises(ValueError, match="paired ring stages need"):
        fp4_gluon_plan.GluonConfig(64, 64, 1, 3, upcast="packed", pair=True)  # an odd number of stages
    with pytest.raises(ValueError, match="paired ring stages need"):
        fp4_gluon_plan.GluonConfig(64, 64, 1, 4, upcast="int16", pair=True)
    with pytest.raises(ValueError, match="late release needs"):
        fp4_gluon_plan.GluonConfig(64, 64, 1, 4, upcast="packed", pair=True, late=True)  # 2 pairs: no loads ahead


def test_moe_names_the_gemv_then_the_grouped_gluon_gemm_from_6_tokens_on_the_816b_experts(choices):
    assert "one program per assignment" in _choice(choices, "experts gate/up", "T <= 5 tokens").reason
    grouped = _choice(choices, "experts down", "T > 5 tokens")
    assert "Gluon grouped W4A16 GEMM" in grouped.choice and "from 6 tokens ahead of the decode GEMVs" in grouped.reason
    assert "tile 64 x 16 at T = 6 at two CTAs per SM up to 256 tokens" in grouped.reason, grouped.reason
    assert not [c for c in choices if "runs of one expert" in c.choice]


def test_moe_gemv_rule_takes_more_than_e_assignments_only_on_runs():
    """Up to E assignments the GEMVs, one program each; beyond, only on runs of one expert (from RUNS_MIN_TOKENS
    tokens, where runs fit in shared memory) up to RUNS_MAX_ASSIGNMENTS."""
    assert moe_uses_gemv(256, 256, 32, 4096, 4096) and moe_uses_gemv(1024, 256, 128, 4096, 4096)
    assert not moe_uses_gemv(1032, 256, 129, 4096, 4096)
    assert not moe_uses_gemv(12, 8, 3, 4096, 4096)  # 3 tokens: no runs, and 12 > E = 8
    assert moe_uses_gemv(16, 8, 4, 4096, 4096)
    assert not moe_uses_gemv(16, 8, 4, 22 * 1024, 22 * 1024)  # K = 22K: not even 2 staged rows fit


def test_moe_gemv_rule_gives_way_to_the_grouped_gluon_gemm_from_6_tokens_on_large_experts_only():
    """Where the grouped Gluon GEMM can run it takes decode batches from DECODE_FROM_TOKENS tokens on the 816B
    experts (session 68, H100, at two CTAs per SM: 1.06-1.07x the GEMVs at 6-7 tokens, 1.14-1.46x at 8-128, 0.98x at
    4), never on muse-small's (h = I = 768: 0.24-0.41x at 1-32 tokens, session 65)."""
    assert moe_prefill.DECODE_FROM_TOKENS == 6
    assert moe_uses_gemv(40, 256, 5, 4096, 4096, gluon=True) and not moe_uses_gemv(48, 256, 6, 4096, 4096, gluon=True)
    assert not moe_uses_gemv(1024, 256, 128, 4096, 4096, gluon=True)
    assert moe_uses_gemv(48, 256, 6, 4096, 4096, gluon=False)
    for t in (4, 6, 16, 32, 128):
        assert moe_uses_gemv(t * 8, 64, t, 768, 768, gluon=True), t


def test_doubled_two_cta_only_where_measured():
    """Two CTAs per SM at twice a one-warpgroup split (run 136): up to 32 tokens, on weights of k_proj's size and more,
    4+ chunks per split, and a grid of at most two CTAs per SM; nowhere else."""
    doubled = fp4_gluon_plan.doubled_two_cta
    cfg = doubled(16, 1024, 8192, 16, 8, 132)
    assert cfg.label() == "64,16,16,4,packed,2,finish,rezero"
    assert doubled(64, 1024, 8192, 64, 8, 132) is None                  # 64 tokens lost (0.94x)
    assert doubled(16, 768, 768, 16, 1, 132) is None                    # muse-small: unmeasured
    assert doubled(16, 1024, 8192, 16, 16, 132) is None                 # 2 chunks per split
    assert doubled(16, 8192, 4096, 16, 1, 100) is None                  # 256 CTAs on 100 SMs: more than two per SM
    assert doubled(16, 8192, 4096, 16, 1, 128).ctas_per_sm == 2


def test_pick_moe_config_takes_two_ctas_per_sm_on_816b_experts_up_to_256_tokens():
    """Session 68 (H100, runs 128-130): on the 816B layer 64 x 16 at two CTAs per SM ran 1.03-1.08x the one-CTA
    picks at 4-256 tokens and 0.80x 128 x 32 at 512, so it takes up to 2048 assignments there. Elsewhere the model's
    pick as in session 65: 128 x 16 up to 1024 assignments, 128 x 32 beyond; muse-small's experts keep it (unmeasured
    at two CTAs)."""
    for t in (1, 6, 8, 16, 64, 256):
        cfg = fp4_gluon_plan.pick_moe_config(t * 8, 256, 8192, 4096, 132)
        assert cfg == fp4_gluon_plan.MOE_TWO_CTA and cfg.label() == "64,16,1,4,packed,2", t
    assert fp4_gluon_plan.pick_moe_config(257 * 8, 256, 8192, 4096, 132).label() == "128,32,1,4,packed"
    for t in (1, 8):
        assert fp4_gluon_plan.pick_moe_config(t * 8, 64, 1536, 768, 132).label() == "128,16,1,4,packed", t
    assert fp4_gluon_plan.pick_moe_config(1025, 64, 1536, 768, 132).label() == "128,32,1,4,packed"


def test_dense_linear_takes_the_gemv_only_on_small_weights(choices):
    assert "Triton dense GEMV" in _choice(choices, "pooler", "M = 1").choice
    assert "cuBLAS" in _choice(choices, "lm_head", "any M").choice


def test_launch_choices_name_pdl_graphs_and_attention(choices):
    assert _choice(choices, "PDL").env == pdl.ENV
    assert f"batch <= {pdl.MAX_BATCH}" in _choice(choices, "PDL").choice
    assert "CUDA graph" in _choice(choices, "decode step").choice
    assert "flash attention" in next(c for c in choices if c.what == "attention").choice


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


def test_fused_sublayers_show_in_choices_and_their_switch_turns_them_off(choices, monkeypatch):
    from musecore_cuda.fused import FUSED_ENV
    assert "fused: 4 launches" in _choice(choices, "MoE sublayer").choice
    assert "fused: 3 launches" in _choice(choices, "attention sublayer").choice
    assert "fused: 1 launch" in _choice(choices, "embedding stage").choice
    monkeypatch.setenv(FUSED_ENV, "0")
    off = CudaBackend().kernel_choices(LINEARS_816B, get_profile("h200"))
    assert _choice(off, "MoE sublayer").choice == "the separate ops (10 launches)"
    assert _choice(off, "attention sublayer").choice == "the separate ops (7 launches)"
    assert _choice(off, "embedding stage").choice == "the separate ops (~18 launches)"
    assert {s.name: s for s in CudaBackend().env_settings()}[FUSED_ENV].value == "0"


def test_the_plan_says_where_the_residual_norms_between_fused_sublayers_run(monkeypatch):
    from musecore_cuda import fused
    for attention, moe in ((False, False), (True, False), (True, True)):
        monkeypatch.setattr(fused, "DEFER_RESIDUAL_NORM", attention)
        monkeypatch.setattr(fused, "DEFER_MOE_NORM", moe)
        row = _choice(CudaBackend().kernel_choices(LINEARS_816B, get_profile("h200")), "residual norms").choice
        assert ("router + pooler launch" in row) == attention and ("q/k/v/gate launch" in row) == moe, row
        assert ("both in the last program" in row) == (not attention and not moe), row


def test_moe_handoff_from_2_tokens_on_large_experts_unless_forced(monkeypatch):
    """The down GEMV's early start: off at batch 1 and on muse-small's 768 x 768 experts, on from 2 tokens on the
    816B layer's; the switch forces it either way at every batch, and says what it takes when it is mistyped."""
    monkeypatch.delenv(HANDOFF_ENV, raising=False)
    assert [handoff_by_default(t, 4096, 4096) for t in (1, 2, 3, 16)] == [False, True, True, True]
    assert not any(handoff_by_default(t, 768, 768) for t in (1, 2, 8))
    be = CudaBackend()
    handoff = _choice(be.kernel_choices(LINEARS_816B, get_profile("h200")), "down GEMV")
    assert "from 2 tokens on experts of 4096 x 4096" in handoff.choice and handoff.env == HANDOFF_ENV
    monkeypatch.setenv(HANDOFF_ENV, "1")
    assert handoff_by_default(1, 768, 768)
    assert "at every batch" in _choice(be.kernel_choices(LINEARS_816B, get_profile("h200")), "down GEMV").choice
    monkeypatch.setenv(HANDOFF_ENV, "0")
    assert not handoff_by_default(16, 4096, 4096)
    assert "completed, at every batch" in _choice(be.kernel_choices(LINEARS_816B, get_profile("h200")),
                                                  "down GEMV").choice
    assert {s.name: s for s in be.env_settings()}[HANDOFF_ENV].value == "0"
    monkeypatch.setenv(HANDOFF_ENV, "yes")
    with pytest.raises(ValueError, match=f"{HANDOFF_ENV} must be 0 .never., 1 .at every batch. or unset"):
        handoff_by_default(2, 4096, 4096)
    with pytest.raises(ValueError, match=f"{HANDOFF_ENV} must be"):
        be.kernel_choices(LINEARS_816B, get_profile("h200"))


def test_per_assignment_cuts_reach_only_experts_whose_warps_do_not_split_k():
    """One program per assignment: the 816B experts' gate/up GEMV fits one wave at one chunk in flight and the down
    GEMV keeps three (on runs too); muse-small's 768-wide experts (never measured with those cuts) keep make_plan's."""
    from musecore_cuda.kernels import moe_decode
    cpu = torch.device("cpu")
    up, down, runs = moe_decode._plans(4096, 4096, torch.bfloat16, cpu, 16, False)
    assert not runs and (up.prefetch, up.min_blocks, down.prefetch) == (1, 4, 3), (up, down)
    up, down, _ = moe_decode._plans(768, 768, torch.bfloat16, cpu, 16, False)
    assert up.k_warps > 1 and down.k_warps > 1 and (up.prefetch, up.min_blocks, down.prefetch) == (2, 0, 2), (up, down)
    up, down, runs = moe_decode._plans(4096, 4096, torch.bfloat16, cpu, 64, True)  # runs: the down cut only
    assert runs and (up.prefetch, up.min_blocks, down.prefetch) == (2, 0, 3) and down.m > 1, (up, down)
    up, down, runs = moe_decode._plans(768, 768, torch.bfloat16, cpu, 128, True)  # muse-small's runs: unmeasured
    assert runs and down.k_warps == 1 and (up.prefetch, down.prefetch) == (2, 2), (up, down)


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


def test_runs_by_default_from_8_tokens_or_past_e_assignments():
    """At 4-7 tokens one program per assignment was measured as fast or faster on the 816B layer (runs from 8);
    past E assignments runs from RUNS_MIN_TOKENS, where one program per assignment would stream experts again."""
    assert not on_runs_by_default(4, 32, 256) and not on_runs_by_default(7, 56, 256)
    assert on_runs_by_default(RUNS_FROM_TOKENS, 64, 256) and on_runs_by_default(RUNS_MIN_TOKENS, 16, 12)
    assert not on_runs_by_default(3, 12, 8)


def test_the_eager_first_attention_step_is_the_cuda_backends_choice(monkeypatch):
    """Run 69 routed it for CUDA only: on gfx950 it costs the windowed one-token program its second wave."""
    from musecore_triton import hooks
    from musecore_triton.kernels import attention

    gpu, cpu = torch.device("cuda"), torch.device("cpu")
    assert triton_hooks.eager_first_step(gpu) and not triton_hooks.eager_first_step(cpu)
    assert not hooks._default_eager_first_step(gpu)  # the portable default (ROCm keeps it): off
    assert hooks.owner() == "cuda" and attention.EAGER_FIRST_STEP is None and attention.eager_first_step(gpu)
    monkeypatch.setattr(attention, "EAGER_FIRST_STEP", False)
    assert not attention.eager_first_step(gpu)
    monkeypatch.setattr(attention, "EAGER_FIRST_STEP", True)
    assert attention.eager_first_step(cpu)


def test_pick_moe_config_picks_run_80s_best_tiles_and_fits_shared_memory():
    """The grouped Gluon GEMM's launch: the measured best of six tiles on the 816B layer at 1024 and 8192 tokens
    (H200, run 80: 128 x 64 in 4.6 ms, 128 x 256 in 15.2 ms), split 1, within the ring's shared memory."""
    assert fp4_gluon_plan.pick_moe_config(1024 * 8, 256, 8192, 4096, 132).label() == "128,64,1,4,packed"
    assert fp4_gluon_plan.pick_moe_config(8192 * 8, 256, 8192, 4096, 132).label() == "128,256,1,3,packed"
    for t in (257, 512):  # run 91 (H100): 128 x 32 the fastest tile swept at 160 / 256 / 512 tokens (until session
        # 68's two CTAs per SM took up to 256: MOE_TWO_CTA_MAX_ASSIGNMENTS)
        assert fp4_gluon_plan.pick_moe_config(t * 8, 256, 8192, 4096, 132).label() == "128,32,1,4,packed", t
    for t in (129, 1024, 8192, 32768):
        cfg = fp4_gluon_plan.pick_moe_config(t * 8, 256, 8192, 4096, 132)
        assert cfg.split_k == 1 and cfg.upcast == "packed" and cfg.smem_bytes() <= SMEM_BYTES
    assert fp4_gluon_plan.expected_tiles(8, 256, 16) == 8  # fewer assignments than experts: one tile each
    assert fp4_gluon_plan.expected_tiles(65536, 256, 128) == 256 * 2.5
    with pytest.raises(ValueError, match="multiple of 128"):
        fp4_gluon_plan.pick_moe_config(64, 8, 192, 4096, 132)


def test_large_m_takes_the_gluon_gemm_where_its_tiles_fill_the_gpu():
    """Past 256 rows up to 2048: two warpgroups over 256 tokens where 128+ output tiles of 128 x 256 fill the GPU
    (runs 80-82: it beat dequantize + cuBLAS on every such shape at M = 512-2048, lost on k_proj's 32 tiles at 1024).
    At 4096 dequantize + cuBLAS led in 36 of 52 comparisons of runs 122-167 (4 of 4 on run 139's H200), K = 8192
    included, which took the Gluon launch to 4096 until session 82."""
    from musecore_cuda.choices import gluon_large, gluon_large_first_m
    assert fp4_gluon_plan.pick_config(1024, 8192, 8192, 132) == fp4_gluon_plan.LARGE_M_CONFIG
    assert gluon_large(257, 8192) and gluon_large(1024, 4096) and not gluon_large(1024, 1024)
    assert not gluon_large(256, 8192)
    assert gluon_large(2048, 8192) and not gluon_large(2049, 8192) and not gluon_large(4096, 8192)
    for weights, n in ((4096 * 8192, 4096), (8192 * 8192, 8192), (8192 * 4096, 8192)):  # K = 8192 and K = 4096 alike
        assert fp4_path_for(2048, torch.bfloat16, gluon=True, weights=weights, out_features=n) == "gluon"
        assert fp4_path_for(4096, torch.bfloat16, gluon=True, weights=weights, out_features=n) == "dequant"
    for n in (4096, 8192, 10240, 2048):
        first = gluon_large_first_m(n)
        assert gluon_large(first, n) and (first == 257 or not gluon_large(first - 1, n)), (n, first)


def test_gluon_moe_is_the_plans_choice_unless_switched_off_or_triton_is_not_3_6(monkeypatch):
    from musecore_cuda.kernels import moe_prefill
    plan = lambda: CudaBackend().kernel_choices(LINEARS_816B, get_profile("h200"))  # noqa: E731
    monkeypatch.delenv(moe_prefill.GLUON_MOE_ENV, raising=False)
    monkeypatch.setattr(fp4_gluon_plan, "import_problem", lambda: None)
    on = _choice(plan(), "experts down", "T > 5 tokens")
    assert "Gluon grouped W4A16 GEMM" in on.choice and "15.2 ms" in on.reason and on.env == moe_prefill.GLUON_MOE_ENV
    monkeypatch.setenv(moe_prefill.GLUON_MOE_ENV, "0")  # the decode GEMVs keep T <= 128, on runs from 8 tokens
    off_plan = plan()
    off = _choice(off_plan, "experts down", "T > 128 tokens")
    assert "Triton grouped W4A16 GEMM" in off.choice and "MUSECORE_CUDA_GLUON_MOE=0" in off.reason
    assert "one program per assignment" in _choice(off_plan, "experts gate/up", "T <= 7 tokens").reason
    assert "runs of one expert" in _choice(off_plan, "experts gate/up", "T 8-128 tokens").choice  # 128 x 8 = 1024
    monkeypatch.delenv(moe_prefill.GLUON_MOE_ENV)
    monkeypatch.setattr(fp4_gluon_plan, "import_problem", lambda: "triton 3.9.0: not 3.6")
    other = _choice(plan(), "experts down", "T > 128 tokens")
    assert "Triton grouped W4A16 GEMM" in other.choice and "triton 3.9.0" in other.reason and not other.env


def test_pdl_early_set_shows_in_choices_with_the_expert_grid_rule(monkeypatch):
    monkeypatch.delenv(pdl.EARLY_ENV, raising=False)
    row = _choice(CudaBackend().kernel_choices(LINEARS_816B, get_profile("h200")), "early launch_dependents")
    assert "expert GEMVs on grids of <= 2 blocks per SM" in row.choice and "attention" in row.choice
    assert row.env == pdl.EARLY_ENV
    monkeypatch.setenv(pdl.EARLY_ENV, "dense_gemv")
    row = _choice(CudaBackend().kernel_choices(LINEARS_816B, get_profile("h200")), "early launch_dependents")
    assert row.choice == "kernels dense_gemv" and f"{pdl.EARLY_ENV}=dense_gemv" in row.reason


def test_the_routers_64_columns_per_program_are_the_cuda_backends_choice(monkeypatch):
    """Session 78 routed 64 hidden columns per one-token router program for CUDA only (the portable kernel's 32 never
    timed on AMD); the lab's ``ONE_LAUNCH_BLOCK_K`` overrides the hook, and the plan names the choice."""
    from musecore_triton import hooks

    gpu, cpu = torch.device("cuda"), torch.device("cpu")
    assert triton_hooks.router_block_k(gpu) == 64 and triton_hooks.router_block_k(cpu) is None
    assert hooks._default_router_block_k(gpu) is None and hooks.owner() == "cuda"
    asked: list = []
    monkeypatch.setattr(hooks, "_router_block_k", lambda device: asked.append(device) or 64)
    x, weight, bias = torch.zeros(1, 200), torch.zeros(12, 200), torch.zeros(12)
    n_e, n_s, part, *_, constexprs = router._one_token_router("router", x, weight, bias, 3)
    assert (n_s, constexprs["BLOCK_K"], part.shape[0]) == (4, 64, 4) and asked == [x.device]
    monkeypatch.setattr(router, "ONE_LAUNCH_BLOCK_K", 32)
    assert router._one_token_router("router", x, weight, bias, 3)[1] == 7 and len(asked) == 1
    row = _choice(CudaBackend().kernel_choices(LINEARS_816B, get_profile("h200")), "one-token router launch")
    assert row.choice.startswith("64;") and "32 elsewhere" in row.choice
