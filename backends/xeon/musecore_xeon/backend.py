"""``XeonBackend``: Muse Spark Open on x86-64 CPUs with INT4 weight-only experts.

INT4 linear layers run a small C GEMV compiled at first use (AVX2/FMA; PyTorch's
``_weight_int4pack_mm_for_cpu`` without a compiler) up to a crossover M measured on this machine and
a tiled dense GEMM above it; everything else is PyTorch's own (intel-extension-for-pytorch is
end-of-life) (:mod:`musecore_xeon.kernels.int4`); BF16 weights stay BF16
(:mod:`musecore_xeon.kernels.dense`); the MoE groups tokens per expert
(:mod:`musecore_xeon.kernels.moe`). FP4 checkpoints are not run here: the plan converts their
experts to INT4 at load for xeon devices.

Example::

    backend = XeonBackend(num_threads=4)
    print(backend.probe().reason)
    w = backend.prepare_weight(musecore_quant.quantize(w_bf16, "int4", group_size=128), "expert")
    y = backend.linear(x_bf16, w)
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Union

import torch

from musecore.backends.base import (Backend, EnvSetting, KernelChoice, LinearShape, Probe, Support, WeightIn,
                                    expert_format)
from musecore.backends.reference import weight_format_of
from musecore.ops import ExpertWeights, OpSpec, Weight
from musecore_quant.qtensor import QTensor
from musecore_xeon import choices
from musecore_xeon import ops as xops
from musecore_xeon import towers
from musecore_xeon.cpu import CpuInfo, configure_threads, read_cpu_info
from musecore_xeon.fused import fuse_block
from musecore_xeon.kernels import native
from musecore_xeon.kernels.dense import DenseLinear, dense_compute_dtype, prepare_dense
from musecore_xeon.kernels.int4 import Int4Linear, int4_crossover, pack_int4, prepare_int4
from musecore_xeon.kernels.moe import XeonExperts, moe_forward

DENSE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
CONVERT_FP4 = "convert to INT4 at load (the plan does this for xeon devices)"
NO_ACT_QUANT = ("xeon runs weight-only quantization (W4A16 INT4): {fmt} activations need FP4/FP8 "
                "tensor hardware; load with act_format=None")
NORM_PATH = (f"one C call through the CPython extension at decode sizes (<= {xops.NATIVE_NORM_MAX_ELEMENTS} elements, "
             "contiguous bf16/fp32), PyTorch ops with the same math otherwise")
OP_REASONS = {
    "rms_norm": f"fp32 math, weightless / scale-after / scale-first (product rounded to x's dtype): {NORM_PATH}",
    "residual_norm": f"post norm (weightless or scale-first) + fp32 gated residual alpha*res + beta*h + next norm: "
                     f"{NORM_PATH}",
    "qk_norm_rope": f"weightless per-head norms, q scale, RoPE or NoPE: {NORM_PATH}",
    "head_norm_gate": f"weightless per-head norm times element-wise sigmoid gate: {NORM_PATH}",
    "router_topk": f"decode (<= {xops.NATIVE_ATTENTION_MAX_QUERIES} tokens): one C call (fp32 logits as SIMD dot "
                   "products, within the op's tolerance; sigmoid, top-k of scores + bias, renormalisation); otherwise "
                   "fp32 logits by PyTorch's matmul (the reference's) and the selection in C at decode sizes",
    "silu_mul": "the reference's PyTorch ops (fp32 math)",
    "logit_softcap": "one C call with the reference's bits (PyTorch's own tanh kernel, MKL VML, per L1-sized chunk, "
                     "threaded) where that kernel is found; the reference's PyTorch ops otherwise",
    "embedding": "the reference's PyTorch lookup",
    "sample": "the reference's PyTorch sampler (same random stream)",
    **towers.TOWER_REASONS,  # the vision and audio towers' ops (musecore_xeon.towers)
}
MOE_REASON = ("{fmt} experts: one fused native call per layer at decode sizes (gate/up and down GEMV row blocks, "
              "SwiGLU, the shared post-expert norm scale first, routing weight, fp32 sum), per routed expert "
              "linear calls and PyTorch ops for the norm and sum above the measured crossover")
# Below every accelerator backend's (CUDA and ROCm 50 unverified, 100 verified; TPU 70): on a GPU host with a Xeon 6,
# device="auto" is the GPU (an AMX host picked xeon6 over an MI355X at 60 > 50 until session 50).
PROBE_SCORES = {"amx": 45, "avx512_bf16": 40, "avx512": 30, "avx2": 20}
ACCELERATOR_MIN_SCORE = 50


def probe_cpu(info: CpuInfo) -> Probe:
    """What this CPU serves: ``xeon6`` needs AMX; ``xeon`` and ``cpu-x86`` need x86-64 with AVX2."""
    details: dict[str, Any] = {"vendor": info.vendor, "model": info.model_name, "arch": info.arch,
                               "logical_cores": info.logical_cores, "isa_tier": info.isa_tier,
                               "torch_cpu_capability": info.torch_capability,
                               "flags": sorted(f for f in ("amx_bf16", "amx_int8", "avx512_bf16", "avx512f",
                                                           "avx512_vnni", "avx2") if info.has(f)),
                               "threads": torch.get_num_threads(),
                               "int4_dense_path": ("amx" if native.amx_planned(info) else "avx512_bf16 gemm"
                                                   if native.bf16_dot_planned(info) else "dequantized tiles")}
    if info.error is not None:
        return Probe(False, 0, [], f"cannot read CPU features: {info.error}", details)
    if not info.is_x86_64:
        return Probe(False, 0, [], f"not an x86-64 CPU (machine {info.arch!r}); the xeon backend needs x86-64 "
                                   "with AVX2", details)
    if not info.has("avx2"):
        return Probe(False, 0, [], f"no AVX2 on {info.summary()}; the xeon backend needs AVX2 or newer", details)
    devices = (["xeon6"] if info.has_amx else []) + ["xeon", "cpu-x86"]
    if info.has_amx:
        note = "AMX present (amx_bf16): serves xeon6"
    else:
        note = "no AMX (amx_bf16 absent): xeon6 needs AMX; use device='xeon' or emulate=True"
    return Probe(True, PROBE_SCORES[info.isa_tier], devices, f"{info.summary()}; {note}", details)


class XeonBackend(Backend):
    """INT4 weight-only and BF16 inference on x86-64 CPUs with PyTorch's CPU kernels."""

    name = "xeon"
    verified_on = ("run and checked on x86-64 hosts of each ISA tier the probe names: Intel Xeon with AMX, Intel Xeon "
                   "with AVX512_BF16 and no AMX exposed (Emerald Rapids class), AMD EPYC Zen 5 (AVX512_BF16), AMD EPYC "
                   "with AVX2 only; the speed of one tier says nothing of another (backends/xeon/README.md)")

    def __init__(self, device: Optional[Union[str, torch.device]] = None, *,
                 num_threads: Optional[int] = None) -> None:
        super().__init__(device)
        if self.device.type != "cpu":
            raise ValueError(f"the xeon backend runs on the CPU; got device {self.device}")
        self.num_threads = configure_threads(num_threads)
        self.cpu = read_cpu_info()
        self.dense_dtype = dense_compute_dtype(self.cpu.native_bf16_dot)

    # -- discovery -------------------------------------------------------------------------------
    def probe(self) -> Probe:
        try:
            return probe_cpu(read_cpu_info())
        except Exception as exc:  # probe() must never raise; the cause is returned, not hidden
            return Probe(False, 0, [], f"xeon probe failed: {type(exc).__name__}: {exc}")

    def supports(self, op: str, spec: OpSpec) -> Support:
        if spec.act_format is not None:
            return Support.no(NO_ACT_QUANT.format(fmt=spec.act_format))
        if op in ("linear", "moe"):
            fmt = spec.weight_format
            if fmt in ("nvfp4", "mxfp4"):
                return Support.no(CONVERT_FP4)
            if fmt not in ("int4", "bf16", "fp16", "fp32"):  # fp8, int8: prepare_weight refuses them
                return Support.no(f"{fmt.upper()} weights: convert to INT4 or BF16 at load")
            if op == "moe":
                return Support.native(MOE_REASON.format(fmt=fmt.upper() if fmt == "int4" else fmt))
            if fmt == "int4":
                dense = ("the INT4 GEMM on AMX (weight panels dequantized into AMX tiles)" if native.amx_planned(self.cpu)
                         else "SGEMM on dequantized tiles")
                return Support.native("INT4 weight-only: native GEMV (nibble-planar codes; "
                                      "_weight_int4pack_mm_for_cpu without a C compiler) below the measured "
                                      f"crossover M, {dense} above it")
            return Support.native(f"{fmt} weights via PyTorch matmul ({self.dense_dtype} tiles at large M)")
        if op == "attention":
            if spec.kv_format not in ("bf16", "fp16", "fp32", "fp8"):
                return Support.no(f"KV format {spec.kv_format!r} unknown to xeon (bf16, fp32 or fp8)")
            return Support.native(f"decode (T <= 8): one C loop, fp32 softmax; prefill: scaled_dot_product_attention in "
                                  f"{self.dense_dtype} with the reference visibility mask"
                                  + ("; FP8 KV dequantized per tensor first" if spec.kv_format == "fp8" else ""))
        return Support.native(OP_REASONS[op])

    # -- what the plan shows ------------------------------------------------------------------------
    def kernel_choices(self, linears: Sequence[LinearShape], profile: Any) -> list[KernelChoice]:
        """The ISA, native kernels, binding, threads, attention path, and per linear shape the path for each M range
        with its crossover (:mod:`musecore_xeon.choices`); decided on this host's probe, never raises."""
        return choices.kernel_choices(linears, profile, self.cpu, self.num_threads)

    def env_settings(self) -> list[EnvSetting]:
        return choices.env_settings()

    def resident_bytes(self, weight_format: str, out_features: int, in_features: int, *,
                       experts: int = 0) -> Optional[int]:
        return choices.resident_bytes(weight_format, out_features, in_features, experts=experts)

    # -- weights -----------------------------------------------------------------------------------
    def _check_format(self, weight: WeightIn, act_format: Optional[str]) -> str:
        if act_format is not None:
            raise ValueError(NO_ACT_QUANT.format(fmt=act_format))
        if isinstance(weight, torch.Tensor):
            if weight.dtype not in DENSE_DTYPES:
                raise ValueError(f"xeon dense weights must be bf16, fp16 or fp32; got {weight.dtype}")
            return weight_format_of(weight)
        if weight.format in ("nvfp4", "mxfp4"):
            raise ValueError(f"xeon cannot run {weight.format} weights: {CONVERT_FP4}")
        if weight.format != "int4":
            raise ValueError(f"xeon cannot run {weight.format} weights: convert to INT4 or BF16 at load")
        return "int4"

    def prepare_weight(self, weight: WeightIn, role: str, *, act_format: Optional[str] = None,
                       dtype: torch.dtype = torch.bfloat16) -> Weight:
        """INT4 QTensor -> packed for the CPU kernel; dense -> ``dtype`` (bf16 or fp32).

        ``Weight.data`` is the resident payload (a dense tensor, or :class:`Int4Linear`);
        ``Weight.extra["linear"]`` is the callable that ``linear`` runs.
        """
        fmt = self._check_format(weight, act_format)
        if fmt == "int4":
            resident: Union[Int4Linear, DenseLinear] = prepare_int4(weight, self.dense_dtype)
            data: Any = resident
        else:
            resident = prepare_dense(weight, dtype, self.cpu.native_bf16_dot, calibrate=role != "embedding")
            data = resident.weight
            fmt = weight_format_of(data)  # the dtype it runs in, which the plan keys dense linears by (a bf16
            # checkpoint loaded with dtype=float32 runs fp32), as the reference backend and prepare_experts say
        return Weight(data=data, format=fmt, out_features=resident.out_features, in_features=resident.in_features,
                      extra={"linear": resident, "role": role})

    def prepare_experts(self, gate: WeightIn, up: WeightIn, down: WeightIn, *,
                        act_format: Optional[str] = None, dtype: torch.dtype = torch.bfloat16) -> ExpertWeights:
        """Stacked ``[E, out, in]`` experts -> per-expert resident weights with gate and up fused.

        The returned ``ExpertWeights.gate`` holds the fused ``[gate; up]`` per expert (``up`` is None)
        and ``extra["xeon"]`` the :class:`XeonExperts` that ``moe`` runs.
        """
        fmt = expert_format(self._check_format(w, act_format) for w in (gate, up, down))
        shape = lambda w: tuple(w.shape)  # noqa: E731  (QTensor.shape is the logical shape too)
        (E, inter, hidden), down_shape = shape(gate), shape(down)
        if shape(up) != (E, inter, hidden) or down_shape != (E, hidden, inter):
            raise ValueError(f"expert shapes gate {shape(gate)}, up {shape(up)}, down {down_shape}: expected "
                             f"[E, I, h], [E, I, h], [E, h, I]")
        if fmt == "int4":
            gate_up, downs = self._prepare_int4_experts(gate, up, down)
        else:  # dense experts run in the model dtype, which is the format the plan keyed them by
            gate_up = [prepare_dense(torch.cat((gate[e], up[e])), dtype, self.cpu.native_bf16_dot) for e in range(E)]
            downs = [prepare_dense(down[e], dtype, self.cpu.native_bf16_dot) for e in range(E)]
            fmt = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(dtype, fmt)
        experts = XeonExperts(gate_up, downs, inter, hidden)
        return ExpertWeights(gate=gate_up, up=None, down=downs, format=fmt, num_experts=E,
                             extra={"xeon": experts})

    def _prepare_int4_experts(self, gate: QTensor, up: QTensor, down: QTensor
                              ) -> tuple[list[Int4Linear], list[Int4Linear]]:
        E = gate.shape[0]
        g = gate.group_size
        if up.group_size != g:
            raise ValueError(f"gate and up must share a group size to be fused; got {g} and {up.group_size}")
        with_zero = lambda qt, e: (qt.zero[e] if qt.zero is not None  # noqa: E731
                                   else torch.full_like(qt.scale[e], 8, dtype=torch.uint8))
        fused_zero = gate.zero is not None or up.zero is not None
        gate_up, downs = [], []
        for e in range(E):
            zero = torch.cat((with_zero(gate, e), with_zero(up, e))) if fused_zero else None
            gate_up.append(pack_int4(torch.cat((gate.data[e], up.data[e])), torch.cat((gate.scale[e], up.scale[e])),
                                     zero, g, self.dense_dtype))
            downs.append(pack_int4(down.data[e], down.scale[e], None if down.zero is None else down.zero[e],
                                   down.group_size, self.dense_dtype))
        for resident in (gate_up, downs):  # one measurement per shape class, shared by every expert
            first = resident[0]
            calibration = int4_crossover(first.in_features, first.out_features, first.group_size, self.dense_dtype,
                                         first.kernel)
            for lin in resident:
                lin.set_crossover(calibration.crossover, calibration)
        return gate_up, downs

    # -- ops -----------------------------------------------------------------------------------------
    def linear(self, x: torch.Tensor, w: Weight) -> torch.Tensor:
        resident = w.extra.get("linear")
        if resident is None:
            raise TypeError("xeon linear got a Weight that XeonBackend.prepare_weight did not make "
                            f"(format {w.format!r}, no extra['linear']); prepare it with this backend")
        return resident(x)

    def fuse_block(self, block: Any) -> Optional[Callable[..., Optional[torch.Tensor]]]:
        """A layer's attention or MoE block at decode in one extension call (:func:`musecore_xeon.fused.fuse_block`)."""
        return fuse_block(block)

    def moe(self, z: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: ExpertWeights,
            post_norm: torch.Tensor, post_eps: float) -> torch.Tensor:
        """Routed SwiGLU experts, each output rounded to z's dtype, the shared post-expert norm (scale first), the
        routing weight, an fp32 sum -> fp32 ``[T, h]`` (:func:`musecore_xeon.kernels.moe.moe_forward`)."""
        resident = experts.extra.get("xeon")
        if resident is None:
            raise TypeError("xeon moe got ExpertWeights that XeonBackend.prepare_experts did not make; "
                            "prepare them with this backend")
        return moe_forward(z, weights, ids, resident, post_norm, post_eps)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                  window: Optional[int], scale: float, k_scale: Optional[float] = None,
                  v_scale: Optional[float] = None) -> torch.Tensor:
        """SDPA in this CPU's dense compute dtype (fp32 without native BF16), see :func:`xops.attention`."""
        return xops.attention(q, k, v, q_pos, k_pos, window, scale, k_scale, v_scale, compute_dtype=self.dense_dtype)

    def varlen_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                         scale: float) -> torch.Tensor:
        """Packed bidirectional attention of the vision tower, SDPA in this CPU's dense compute dtype
        (:func:`musecore_xeon.towers.varlen_attention`)."""
        return towers.varlen_attention(q, k, v, cu_seqlens, scale, compute_dtype=self.dense_dtype)

    layer_norm = staticmethod(towers.layer_norm)
    gelu = staticmethod(towers.gelu)
    causal_conv1d = staticmethod(towers.causal_conv1d)
    rope = staticmethod(towers.rope)
    embedding = staticmethod(xops.embedding)
    rms_norm = staticmethod(xops.rms_norm)
    residual_norm = staticmethod(xops.residual_norm)
    qk_norm_rope = staticmethod(xops.qk_norm_rope)
    head_norm_gate = staticmethod(xops.head_norm_gate)
    router_topk = staticmethod(xops.router_topk)
    silu_mul = staticmethod(xops.silu_mul)
    logit_softcap = staticmethod(xops.logit_softcap)
    kv_write_row = staticmethod(xops.kv_write_row)  # a KV cache's decode writes (musecore.kv_cache.RowWriter)
    sample = staticmethod(xops.sample)
