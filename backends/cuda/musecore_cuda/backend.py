"""``CudaBackend``: musecore's NVIDIA plugin (Hopper W4A16 FP4, grouped MoE, flash attention).

What is native here, and why (``supports`` answers from this table, never optimistically):

* NVFP4 / MXFP4 weights with 16-bit activations (W4A16): FP4 is upcast in registers and fed to
  bf16/fp16 tensor cores. Decode (M < 16 bf16, NVFP4 below 8-9 rows where
  the Gluon GEMM runs; M <= 2 fp16) and mid-size M (bf16) run CUDA C++
  kernels compiled with NVRTC (:mod:`musecore_cuda.kernels.fp4_gemv_cuda`, ``fp4_gemm_cuda``; sources in
  ``csrc/``), NVFP4 at M 9-256 the Gluon GEMM (:mod:`musecore_cuda.kernels.fp4_gemm_gluon`) where Triton's
  Gluon runs, large M a bf16 copy of the weight made per call and cuBLAS, fp16 beyond decode the
  portable Triton GEMM of :mod:`musecore_triton` (thresholds measured: :mod:`musecore_cuda.choices`,
  which also tells the plan every choice). Run and measured on SM90
  (H200); on SM100 the same kernels would run but have not been, so they are reported as emulated.
* W4A4 (FP4 activations): needs FP4 tensor cores. SM90 has none, and no SM100 kernel exists
  here, so it is ``no``: a caller wanting those numerics should use the reference backend's
  emulation, not a silent slow path here.
* BF16/FP16/FP32 weights: cuBLAS through ``torch.nn.functional.linear``, except one token on a small
  16-bit weight, which takes a Triton GEMV (``kernels.dense_gemv``: measured faster there).
* FP8 (per-tensor, ModelOpt layout) weights: W8A8 through ``torch._scaled_mm``; with per-token
  activations (``fp8-token``, the ``h200-fp8`` profile: experts and linears requantized to FP8 at load)
  linears take its row-wise scales and routed experts a Triton FP8 grouped GEMM (:mod:`musecore_cuda.fp8`).
  INT4 and block-scaled FP8: not implemented (``no``).
* The row ops (norms, residual gate, q/k norms + RoPE, head gate, MoE finalize, silu_mul, logit_softcap)
  and the router's top-k are Triton kernels in fp32 that round exactly where the reference rounds
  (:mod:`musecore_triton.kernels`); the router's fp32 product is cuBLAS.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.nn.functional as F

from musecore.backends.base import (Backend, EnvSetting, KernelChoice, LinearShape, Probe, Support, WeightIn,
                                    expert_format)
from musecore.ops import ExpertWeights, OpSpec, Weight
from musecore_cuda import choices
from musecore_cuda.choices import DEQUANT_MIN_M, GEMM_MIN_M  # noqa: F401  (the crossovers, re-exported)
from musecore_cuda.fp8 import TOKEN_ACT, Fp8Resident, fp8_linear, fp8_linear_rows, prepare_fp8
from musecore_cuda.kernels import fp4_gemm_cuda, fp4_gemv_cuda, fp4_gluon_plan, moe_prefill
from musecore_cuda.kernels.fp8_moe import fp8_moe
from musecore_cuda.kernels.moe_decode import moe_decode_rows, use_gemv
from musecore_triton.kernels import interpreted, sampling
from musecore_triton.kernels.dense_gemv import dense_gemv, use_dense_gemv
from musecore_triton.kernels.fp4_gemm import launch_gemm, pick_config
from musecore_triton.kernels.moe import finalize, moe_decode_dense_rows, moe_forward, uses_dense_decode
from musecore_triton.layouts import Fp4Resident, prepare_fp4, share_fold
from musecore_triton.ops import (ACT_DTYPES, DENSE_FORMATS, TritonOps, dense_experts, dense_weight, format_of,
                                 shared_kernel_limit)
from musecore_triton.towers import TOWER_REASONS

FP4_FORMATS = ("nvfp4", "mxfp4")
SM_DEVICES = {9: ["h200", "h100", "h200-fp8", "h100-fp8"], 10: ["b200", "gb200", "b300", "gb300"]}
VERIFIED_SM = (9,)  # the kernels have been run and checked on these SM majors
# the chips of each verified SM major they ran on: the H200 (sessions 40-61), H100s (sessions 62-69, runs 90-138 of
# benchmarks/results/h200_issue26: the GPU tests by suite and the benchmarks)
RAN_ON = {9: ("H200", "H100")}
# Kernels written and compiled for SM90 without a GPU: doctor names them until a device has run their tests
NEVER_RAN: tuple[str, ...] = ()


def verified_on(verified: Sequence[int] = VERIFIED_SM) -> str:
    """``CudaBackend.verified_on`` (what ``musecore doctor`` says on any host), from ``verified`` and ``RAN_ON``."""
    def chips(sm: int) -> list[str]:
        return [d.upper() for d in SM_DEVICES[sm] if not d.endswith("-fp8")]  # -fp8: plans, not chips
    ran = []
    for sm in verified:
        others = [c for c in chips(sm) if c not in RAN_ON[sm]]
        ran.append(f"the {' / '.join(RAN_ON[sm])} (SM{sm}0"
                   + (f"; the same code paths never run on the {' / '.join(others)})" if others else ")"))
    never = [f"SM{sm}0 ({' / '.join(chips(sm))})" for sm in SM_DEVICES if sm not in verified]
    return ("run and checked on " + "; ".join(ran)
            + (f"; never run on {', '.join(never)}: its kernels are reported 'emulated'" if never else "")
            + (f"; never run on any GPU yet: {', '.join(NEVER_RAN)}" if NEVER_RAN else ""))

def fp4_linear(x: torch.Tensor, w: Fp4Resident) -> torch.Tensor:
    """``x @ W.T`` for an FP4 resident weight through the kernel ``fp4_linear_path`` picks for its M."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, w.in_features)
    if x2.stride(-1) != 1 or (x2.shape[0] > 1 and x2.stride(0) != w.in_features):
        x2 = x2.contiguous()
    if x2.shape[0] == 0:
        return x.new_empty(*lead, w.out_features)
    path = fp4_linear_path(x2.shape[0], x.dtype, x.device, w.out_features * w.in_features, weight_format=w.format,
                           out_features=w.out_features)
    if path == "gluon":
        y = fp4_gluon_linear(x2, w)
    elif path in ("mma", "fma"):
        y = fp4_decode_linear(x2, w, path)
    elif path == "dequant":
        y = fp4_dequant_linear(x2, w)
    elif path == "gemm":
        y = fp4_gemm_linear(x2, w)
    else:
        y = fp4_tiled_linear(x2, w)
    return y.reshape(*lead, w.out_features)


def fp4_linear_path(m: int, dtype: torch.dtype, device: torch.device, weights: int, *, weight_format: str,
                    out_features: int) -> str:
    """Which kernel ``fp4_linear`` runs for ``m`` rows against a ``weight_format`` ("nvfp4" / "mxfp4") weight of
    ``weights`` elements (``out_features`` rows): :func:`musecore_cuda.choices.fp4_path_for`'s answer ("gluon" only
    where the Gluon GEMM runs and is not switched off), or "tiled" (the Triton W4A16 GEMM) for any other answer when
    NVRTC is missing."""
    gluon = choices.gluon_enabled() and fp4_gluon_plan.available(device)
    path = choices.fp4_path_for(m, dtype, weight_format=weight_format, gluon=gluon, weights=weights,
                                out_features=out_features)
    if path != "gluon" and not fp4_gemv_cuda.available(device):
        return "tiled"
    return path


def fp4_dequant_linear(x2: torch.Tensor, w: Fp4Resident) -> torch.Tensor:
    """2-D ``x2 @ W.T`` for large M: W dequantized to a transient bf16 copy, then cuBLAS.

    At M >= ``DEQUANT_MIN_M`` the GEMM is compute-bound and cuBLAS's BF16 tensor-core kernel beats
    the Triton W4A16 GEMM by more than the dequantization costs (one read of the FP4 bytes, one
    write of 2 bytes per weight); vLLM's AWQ path makes the same switch at 256 tokens.
    """
    n, k = w.out_features, w.in_features
    dense = torch.empty(n, k, dtype=torch.bfloat16, device=x2.device)
    fp4_gemv_cuda.dequantize(w.packed[0], w.scales[0], w.out_scale, wfmt=w.wfmt, fold_log2=w.fold_log2, n=n, k=k,
                             out=dense)
    return F.linear(x2, dense)


def fp4_gluon_linear(x2: torch.Tensor, w: Fp4Resident,
                     cfg: Optional["fp4_gluon_plan.GluonConfig"] = None) -> torch.Tensor:
    """2-D ``x2 @ W.T`` (bf16, NVFP4) through the Gluon W4A16 GEMM, with ``cfg`` or
    :func:`~musecore_cuda.kernels.fp4_gluon_plan.pick_config`'s launch (arithmetic only: safe in graph capture)."""
    from musecore_cuda.kernels import fp4_gemm_gluon  # needs Gluon: imported once fp4_linear_path said "gluon"
    m, n, k = x2.shape[0], w.out_features, w.in_features
    if cfg is None:
        cfg = fp4_gluon_plan.pick_config(m, n, k, fp4_gluon_plan.device_sms(x2.device))
    x2 = x2.contiguous()
    if x2.data_ptr() % 16:  # TMA reads from a 16-byte aligned base (a row slice of a larger tensor may not be)
        x2 = x2.clone()
    out = (torch.zeros(m, n, dtype=torch.float32, device=x2.device) if cfg.atomic
           else torch.empty(m, n, dtype=x2.dtype, device=x2.device))
    fp4_gemm_gluon.launch(x2, w.packed, w.scales, w.out_scale, wfmt=w.wfmt, group=w.group, fold_log2=w.fold_log2,
                          n=n, k=k, out=out, cfg=cfg)
    return out.to(x2.dtype)


def fp4_gemm_linear(x2: torch.Tensor, w: Fp4Resident) -> torch.Tensor:
    """2-D ``x2 @ W.T`` (bf16) through the CUDA C++ tiled tensor-core GEMM."""
    out = torch.empty(x2.shape[0], w.out_features, dtype=x2.dtype, device=x2.device)
    return fp4_gemm_cuda.launch(x2, w.packed[0], w.scales[0], w.out_scale, wfmt=w.wfmt, fold_log2=w.fold_log2,
                                n=w.out_features, k=w.in_features, out=out)


def fp4_decode_linear(x2: torch.Tensor, w: Fp4Resident, kind: str) -> torch.Tensor:
    """2-D ``x2 @ W.T`` through one of the CUDA C++ decode kernels (``kind``: "mma" or "fma")."""
    m, n, k = x2.shape[0], w.out_features, w.in_features
    plan = fp4_gemv_cuda.make_plan(m, n, k, x2.dtype, x2.device, kind=kind)
    out = (torch.zeros(m, n, dtype=torch.float32, device=x2.device) if plan.atomic
           else torch.empty(m, n, dtype=x2.dtype, device=x2.device))
    fp4_gemv_cuda.launch(x2, w.packed, w.scales, w.out_scale, wfmt=w.wfmt, fold_log2=w.fold_log2, n=n, k=k,
                         out=out, plan=plan)
    return out.to(x2.dtype)


def fp4_tiled_linear(x2: torch.Tensor, w: Fp4Resident) -> torch.Tensor:
    """2-D ``x2 @ W.T`` through the Triton tensor-core GEMM (any M)."""
    m, n, k = x2.shape[0], w.out_features, w.in_features
    cfg = pick_config(m, n, k, None, x2.device, allow_split=True)
    out = (torch.zeros(m, n, dtype=torch.float32, device=x2.device) if cfg.split_k > 1
           else torch.empty(m, n, dtype=x2.dtype, device=x2.device))
    launch_gemm(x2, w.packed, w.scales, w.out_scale, wfmt=w.wfmt, group=w.group, fold_log2=w.fold_log2,
                n=n, k=k, out=out, cfg=cfg)
    return out.to(x2.dtype)


# Greedy sampling through musecore_triton.kernels.sampling.argmax instead of torch.argmax (the same index): muse-small
# greedy generate 720.6 -> 707.0 us per token on the H200 (session 52, run 62: cuda_fused_ab.py, A/B mode
# torch_argmax is the old path); False puts torch.argmax back.
TRITON_ARGMAX = True


class CudaBackend(TritonOps, Backend):
    """NVIDIA GPUs through Triton and cuBLAS.

    Example::

        be = CudaBackend("cuda")
        w = be.prepare_weight(musecore_quant.quantize(w_bf16, "nvfp4"), "q_proj")
        y = be.linear(x_bf16, w)
    """

    name = "cuda"
    verified_on = verified_on()
    wants_static_cache = True  # decode steps are captured as CUDA graphs (musecore_cuda.graphs)

    def __init__(self, device: Optional[Union[str, torch.device]] = None) -> None:
        super().__init__(device if device is not None else "cuda")

    def sample(self, logits: torch.Tensor, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
               generator: Optional[torch.Generator] = None) -> torch.Tensor:
        """With :data:`TRITON_ARGMAX`, greedy (temperature 0) through the Triton argmax
        (``musecore_triton.kernels.sampling``: two short launches; PyTorch's argmax is one ~16 us reduction at a
        65536-entry vocabulary on the H200), the same index as ``torch.argmax``; otherwise the reference's
        sampling."""
        if temperature <= 0.0 and self._triton_argmax(logits):
            return sampling.argmax(logits)
        return TritonOps.sample(logits, temperature, top_k, top_p, generator)

    def _triton_argmax(self, logits: torch.Tensor) -> bool:
        return TRITON_ARGMAX and (logits.is_cuda or self.interpreted) and sampling.takes(logits)

    def argmax_into(self, logits: torch.Tensor, tokens: torch.Tensor) -> bool:
        """Greedy tokens written into ``tokens`` (the greedy graph's static buffer) by the Triton argmax, where
        :meth:`sample` would take that path (True), else nothing (False: the caller samples and copies)."""
        if not self._triton_argmax(logits):
            return False
        sampling.argmax(logits, out=tokens)
        return True

    # --- discovery -------------------------------------------------------------------------
    def probe(self) -> Probe:
        try:
            if torch.version.hip is not None:
                return Probe(False, reason=f"no CUDA device: this torch is a ROCm build (hip {torch.version.hip})")
            if not torch.cuda.is_available():
                return Probe(False, reason="no CUDA device: torch.cuda.is_available() is False")
            index = self.device.index if self.device.type == "cuda" and self.device.index is not None else 0
            major, minor = torch.cuda.get_device_capability(index)
            name = torch.cuda.get_device_name(index)
        except Exception as exc:  # probe never raises: the failure becomes the reason
            return Probe(False, reason=f"no CUDA device: probing failed with {type(exc).__name__}: {exc}")
        devices = SM_DEVICES.get(major, [])
        if not devices:
            return Probe(False, reason=f"{name} is SM{major}{minor}; this backend targets SM90 and SM100",
                         details={"sm": (major, minor), "name": name})
        return Probe(True, score=100 if major in VERIFIED_SM else 50, devices=devices,
                     reason=f"{name} (SM{major}{minor})", details={"sm": (major, minor), "name": name})

    def _sm_major(self) -> Optional[int]:
        probe = self.probe()
        return probe.details["sm"][0] if probe.available else None

    @property
    def interpreted(self) -> bool:
        """Kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1 on a "cpu" backend): for tests."""
        return interpreted(self.device)

    def supports(self, op: str, spec: OpSpec) -> Support:
        if self.interpreted:  # the SM90 code paths, run by the interpreter: correct but never fast
            answer = self._supports_on(9, op, spec)
            if answer.ok:
                return Support.emulated(f"Triton interpreter on the CPU (correctness only): {answer.reason}")
            return answer
        sm = self._sm_major()
        if sm is None:
            return Support.no(self.probe().reason)
        return self._supports_on(sm, op, spec)

    def _supports_on(self, sm: int, op: str, spec: OpSpec) -> Support:
        unverified = f"Triton kernel not yet run on SM{sm}0 hardware" if sm not in VERIFIED_SM else ""
        if op in ("linear", "moe"):
            return self._supports_matmul(op, spec, sm, unverified)
        limit = shared_kernel_limit(op, spec)
        if limit:
            return Support.no(limit)
        if op == "embedding":
            return Support.native("PyTorch CUDA ops")
        if op == "sample":
            return Support.native("greedy: a Triton argmax (two launches); at a temperature: PyTorch CUDA ops"
                                  if TRITON_ARGMAX else "PyTorch CUDA ops")
        if op == "router_topk":
            how = "fp32 cuBLAS product, then a Triton top-k kernel"
        elif op in ("silu_mul", "logit_softcap"):
            how = "Triton element-wise kernel, fp32 math"
        elif op in TOWER_REASONS:  # the vision/audio towers' ops (musecore_triton.towers)
            how = TOWER_REASONS[op]
        else:
            how = "Triton kernel"
        if unverified:
            return Support.emulated(f"{how}; {unverified}")
        return Support.native(how)

    def _supports_matmul(self, op: str, spec: OpSpec, sm: int, unverified: str) -> Support:
        fmt, act = spec.weight_format, spec.act_format
        if fmt == "fp8" and act == TOKEN_ACT:
            if sm < 9:
                return Support.no(f"FP8 tensor cores need SM89+; this is SM{sm}0")
            how = ("W8A8, per-token activations: cuBLASLt row-wise scaled FP8 GEMM (torch._scaled_mm)" if op == "linear"
                   else "W8A8, per-token activations: Triton FP8 grouped GEMM (wgmma), fp32 SwiGLU")
            return Support.emulated(f"{how}; {unverified}") if unverified else Support.native(how)
        if fmt == "fp8":
            if op != "linear" or act != "fp8":
                return Support.no("FP8 weights run as W8A8 linear only (FP8 activations, torch._scaled_mm); "
                                  f"got {op} with {act or '16-bit'} activations")
            if sm < 9:
                return Support.no(f"FP8 tensor cores need SM89+; this is SM{sm}0")
            return Support.emulated(unverified) if unverified else Support.native(
                "W8A8: per-tensor FP8 weights and activations through cuBLASLt (torch._scaled_mm)")
        if act in FP4_FORMATS:
            return Support.no(f"W4A4 ({act} activations) needs FP4 tensor cores: SM90 has none and no SM100 "
                              "FP4 kernel is implemented here; use the reference backend's emulation")
        if act is not None:
            return Support.no(f"{act} activation quantization is not implemented in the CUDA backend")
        if fmt in DENSE_FORMATS:
            how = "cuBLAS" if op == "linear" else "Triton grouped GEMM"
            return Support.emulated(unverified) if unverified else Support.native(how)
        if fmt in FP4_FORMATS:
            if spec.dtype not in ACT_DTYPES:
                return Support.no(f"W4A16 kernels take bf16/fp16 activations; got {spec.dtype}")
            if unverified:
                return Support.emulated(f"{fmt} as W4A16 (FP4 upcast in registers); {unverified}; "
                                        "native FP4 tensor-core kernels are not implemented")
            return Support.native(f"{fmt} as W4A16: FP4 upcast in registers, bf16 tensor cores (SM90 has no FP4 MMA)")
        return Support.no(f"{fmt} weights are not implemented in the CUDA backend (nvfp4, mxfp4, bf16, fp16 are)")

    # --- weights ---------------------------------------------------------------------------
    def prepare_weight(self, weight: WeightIn, role: str, *, act_format: Optional[str] = None,
                       dtype: torch.dtype = torch.bfloat16) -> Weight:
        fmt = format_of(weight)
        if fmt == "fp8" and act_format in ("fp8", TOKEN_ACT):
            resident = prepare_fp8(weight, self.device, per_token=act_format == TOKEN_ACT)
            return Weight(data=resident, format="fp8", out_features=resident.out_features,
                          in_features=resident.in_features, act_format=act_format,
                          input_scale=getattr(weight, "input_scale", None))
        if act_format is not None:
            raise NotImplementedError(f"{role}: activation format {act_format!r} is not supported by the CUDA "
                                      "backend (W4A4 needs FP4 tensor cores); see supports()")
        if fmt in FP4_FORMATS:
            resident = prepare_fp4(weight, self.device)
            return Weight(data=resident, format=fmt, out_features=resident.out_features,
                          in_features=resident.in_features)
        if fmt in DENSE_FORMATS:
            return dense_weight(weight, self.device, dtype)
        raise NotImplementedError(f"{role}: {fmt} weights are not implemented in the CUDA backend")

    def prepare_experts(self, gate: WeightIn, up: WeightIn, down: WeightIn, *,
                        act_format: Optional[str] = None, dtype: torch.dtype = torch.bfloat16) -> ExpertWeights:
        fmt = expert_format(format_of(w) for w in (gate, up, down))
        if fmt == "fp8" and act_format == TOKEN_ACT:
            stacks = [prepare_fp8(w, self.device, per_token=True) for w in (gate, up, down)]
            return ExpertWeights(gate=stacks[0], up=stacks[1], down=stacks[2], format=fmt,
                                 num_experts=stacks[0].experts, act_format=act_format)
        if act_format is not None:
            raise NotImplementedError(f"experts: activation format {act_format!r} is not supported (see supports())")
        if fmt in FP4_FORMATS:
            stacks = [prepare_fp4(w, self.device) for w in (gate, up, down)]
            share_fold(stacks[0], stacks[1])  # gate and up run in one launch with one fold
            return ExpertWeights(gate=stacks[0], up=stacks[1], down=stacks[2], format=fmt,
                                 num_experts=stacks[0].packed.shape[0])
        if fmt in DENSE_FORMATS:
            return dense_experts(gate, up, down, self.device, dtype)
        raise NotImplementedError(f"experts: {fmt} weights are not implemented in the CUDA backend")

    def kernel_choices(self, linears: Sequence[LinearShape], profile: Any) -> list[KernelChoice]:
        return choices.kernel_choices(linears, profile)

    def env_settings(self) -> list[EnvSetting]:
        return choices.env_settings()

    def resident_bytes(self, weight_format: str, out_features: int, in_features: int, *,
                       experts: int = 0) -> Optional[int]:
        return choices.resident_bytes(weight_format, out_features, in_features, experts=experts)

    def fuse_block(self, block: Any) -> Optional[Callable[..., Optional[torch.Tensor]]]:
        """A layer's MoE or attention block at one-token decode in fewer launches (:mod:`musecore_cuda.fused`)."""
        from musecore_cuda.fused import fuse_block
        return fuse_block(self, block)

    def fuse_embed(self, model):
        """The decode step's embedding stage in one launch (:func:`musecore_cuda.fused.fuse_embed`)."""
        from musecore_cuda.fused import fuse_embed
        return fuse_embed(model)

    def make_decode_step(self, model, cache):
        """One decode step of ``model`` through ``cache``, replayed from a captured CUDA graph."""
        from musecore_cuda.graphs import make_graphed_decode_step
        return make_graphed_decode_step(model, cache)

    def make_greedy_decode_step(self, model, cache):
        """A greedy decode step (position update, step and argmax) replayed from one captured CUDA graph."""
        from musecore_cuda.graphs import make_graphed_greedy_step
        return make_graphed_greedy_step(model, cache, argmax_into=self.argmax_into)

    def make_prefill_step(self, model, cache, tokens):
        """A prefill of ``tokens`` positions into ``cache``'s rows, replayed from a captured CUDA graph."""
        from musecore_triton.graphs import make_graphed_prefill_step
        return make_graphed_prefill_step(model, cache, tokens)

    # --- ops -------------------------------------------------------------------------------
    def linear(self, x: torch.Tensor, w: Weight) -> torch.Tensor:
        if isinstance(w.data, Fp8Resident):
            if w.act_format == TOKEN_ACT:
                return fp8_linear_rows(x, w.data)
            return fp8_linear(x, w.data, w.input_scale)
        if w.act_format is not None:
            raise NotImplementedError(f"linear: activation format {w.act_format!r} is not supported (see supports())")
        if isinstance(w.data, Fp4Resident):
            return fp4_linear(x, w.data)
        if w.data.dtype != x.dtype:
            raise TypeError(f"linear: weight prepared as {w.data.dtype} but x is {x.dtype}; prepare it with "
                            f"dtype={x.dtype} (converting per call would be a hidden slow path)")
        x2 = x.reshape(-1, x.shape[-1])
        if use_dense_gemv(x2, w.data):  # one token, small weight: cuBLAS's M=1 tiles are launch-bound here
            return dense_gemv(x2, w.data).view(*x.shape[:-1], w.data.shape[0])
        return F.linear(x, w.data)

    def moe(self, z: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: ExpertWeights,
            post_norm: torch.Tensor, post_eps: float) -> torch.Tensor:
        if experts.act_format == TOKEN_ACT:
            return fp8_moe(z, weights, ids, experts.gate, experts.up, experts.down, experts.num_experts,
                           post_norm, post_eps)
        if experts.act_format is not None:
            raise NotImplementedError(f"moe: activation format {experts.act_format!r} is not supported")
        if experts.format in DENSE_FORMATS and experts.gate.dtype != z.dtype:
            raise TypeError(f"moe: dense experts are {experts.gate.dtype} but z is {z.dtype}; prepare them with "
                            f"dtype={z.dtype}")
        gluon = bool(z.shape[0]) and moe_prefill.unavailable_reason(z, experts.gate, experts.up, experts.down) is None
        rows = self.moe_rows(z, ids, experts, gluon)
        if rows is not None:  # decode: one GEMV per assignment, then the finalize
            return finalize(rows, ids.reshape(-1), ids, weights, post_norm, post_eps, sorted_rows=False,
                            act_dtype=z.dtype)
        if gluon:
            return moe_prefill.moe_forward_gluon(z, weights, ids, experts.gate, experts.up, experts.down,
                                                 experts.num_experts, post_norm, post_eps)
        return moe_forward(z, weights, ids, experts.gate, experts.up, experts.down, experts.num_experts,
                           post_norm, post_eps)

    def moe_rows(self, z: torch.Tensor, ids: torch.Tensor, experts: ExpertWeights,
                 gluon: Optional[bool] = None) -> Optional[torch.Tensor]:
        """:meth:`moe`'s expert rows before its finalize, where it runs one GEMV per token-expert assignment (decode:
        FP4 experts on the CUDA C++ GEMVs, ``moe_decode``; 16-bit experts on ``expert_gemv``): fp32 ``[T * k, h]``,
        row ``a`` assignment ``a`` of ``ids``. None where :meth:`moe` takes a grouped GEMM or another path.
        ``gluon``: whether the grouped Gluon GEMM can run these experts (worked out when not given).
        ``FusedMoE`` runs the finalize of these rows in the unpooler GEMV (``moe.finalize_gemv``)."""
        if experts.act_format is not None or not z.shape[0]:
            return None
        if isinstance(experts.gate, Fp4Resident):
            if gluon is None:
                gluon = moe_prefill.unavailable_reason(z, experts.gate, experts.up, experts.down) is None
            if use_gemv(experts.gate, ids.numel(), experts.num_experts, tokens=ids.shape[0], dtype=z.dtype,
                        gluon=gluon):  # the CUDA C++ GEMVs
                return moe_decode_rows(z, ids, experts.gate, experts.up, experts.down)[0]
            return None
        if experts.format in DENSE_FORMATS and experts.gate.dtype == z.dtype \
                and uses_dense_decode(ids.numel(), experts.num_experts):  # the first and last layers' 16-bit experts
            return moe_decode_dense_rows(z, ids, experts.gate, experts.up, experts.down)
        return None

    # embedding, norms, router, elementwise, attention, kv_write, sample: musecore_triton.ops.TritonOps
