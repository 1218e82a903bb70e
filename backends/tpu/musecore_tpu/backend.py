"""``TpuBackend``: Muse Spark Open on Cloud TPU (v6e, v7) with Pallas kernels; on a CPU, the same kernels in JAX's
TPU interpreter.

What runs: BF16 and W4A16 linears (INT4 g128, MXFP4, NVFP4 codes kept packed in HBM and decoded in VMEM), the
routed experts as grouped matmuls over only the routed rows with the MoE finalize, sliding-window GQA attention
over the KV cache, and the two norm ops as Pallas kernels (:mod:`musecore_tpu.kernels`); the remaining ops
(embedding, q/k norm + RoPE, head norm gate, router, SwiGLU of dense layers, softcap, sampling) are PyTorch ops,
which torch_tpu lowers on a TPU host. FP8 checkpoint weights (per-tensor) stay FP8: W8A16 in linears and experts,
``fp8-token`` W8A8 in linears (:mod:`musecore_tpu.kernels.quantized`) and experts (the ``tpu-v7-fp8`` device). INT8
weights (per channel, converted at load by the ``tpu-v6e-int8`` device) run ``int8-token`` W8A8 (int32 sums on v6e's
int8 MXU) or W8A16 in the same kernels. Every kernel is a registered torch custom
op (:mod:`musecore_tpu.torch_tpu_ops`), so a decode step compiles into one graph (:meth:`TpuBackend.make_decode_step`).
On a CPU (``TpuBackend("cpu")``) every kernel runs in a Pallas interpreter, which is how all of this is tested;
NO KERNEL HAS RUN ON A TPU YET.

Example::

    backend = TpuBackend("cpu")                     # interpret mode: TPU semantics, CPU speed
    w = backend.prepare_weight(musecore_quant.quantize(w_bf16, "mxfp4"), "q_proj")
    y = backend.linear(x_bf16, w)
"""

from __future__ import annotations

import importlib.util
import os
import types
from typing import Any, Callable, Optional, Sequence, Union

import torch

from musecore.backends.base import (Backend, EnvSetting, KernelChoice, LinearShape, Probe, Support, WeightIn,
                                    expert_format)
from musecore.backends.reference import weight_format_of
from musecore.ops import ExpertWeights, OpSpec, Weight
from musecore.ops import reference as ref
from musecore_quant.qtensor import QTensor

from musecore_tpu import layouts
from musecore_tpu.chips import CHIPS, chip_for_device_kind
from musecore_tpu.kernels import tiling

INTERPRETER_ENV = "MUSECORE_TPU_INTERPRETER"
DENSE = ("bf16", "fp16", "fp32")
PACKED = layouts.PACKED_FORMATS
Q8 = layouts.Q8_FORMATS
NEVER_RUN = "never run on a TPU"
UNTESTED = " (musecore-tpu's kernels are tested in JAX's TPU interpreter on CPU; none has run on a TPU yet)"
TORCH_OPS = ("embedding", "qk_norm_rope", "head_norm_gate", "router_topk", "silu_mul", "logit_softcap", "sample")
KERNEL_OPS = ("linear", "moe", "attention", "rms_norm", "residual_norm")
# The towers' ops (musecore.ops.TOWER_OPS) that run as the reference's PyTorch ops, like TORCH_OPS above.
TOWER_TORCH_OPS = ("layer_norm", "gelu", "causal_conv1d", "rope")
NO_VARLEN = ("no Pallas kernel for packed bidirectional (varlen) attention yet; the reference's per-segment loop reads "
             "cu_seqlens on the host and would compile one XLA graph per segment length, so it is not claimed: a plan "
             "for a TPU loads the vision tower only with allow_reference=True (the reference's loop)")
NO_ACT_QUANT = ("the TPU backend runs 16-bit activations (W4A16 / BF16); {fmt} activation quantization has no TPU "
                "kernel here: load with act_format=None")
NO_FP8 = ("FP8 experts run W8A16 (act_format=None) or W8A8 with per-token FP8 activations ('fp8-token'); "
          "{act!r} activations have no grouped kernel here")
FP8_MOE_NOTE = ("W8A8 FP8 (E4M3 codes and per-expert scales kept; z per token and h per row to E4M3, "
                "FP8 x FP8 on v7's FP8 MXU, f32 accumulation)")
FP8_LINEAR = ("Pallas 8-bit matmul: FP8 E4M3 weights (per-tensor scale) kept, {act}")
FP8_ACTS = {None: "W8A16: the E4M3 values are exact in bf16, one bf16 MXU pass",
            "fp8-token": "W8A8: activations to E4M3 per token, FP8 x FP8 on v7's FP8 MXU (f32 accumulation)"}
NO_FP8_ACT = ("{act} activations with FP8 weights: the TPU's W8A8 path is 'fp8-token' (dynamic per-token scales); "
              "static per-tensor FP8 activations have no kernel here")
NO_FP8_ON_V6E = "tpu-v6e's MXU has no FP8 rate (fp8 runs at its bf16 rate): load FP8 weights W8A16 (act_format=None)"
INT8_MOE_NOTE = ("W8A8 INT8 (codes and per-channel f32 scales kept; z per token and h per row to INT8, "
                 "int8 x int8 on v6e's int8 MXU, exact int32 sums)")
INT8_LINEAR = "Pallas 8-bit matmul: INT8 weights (one f32 scale per output channel) kept, {act}"
INT8_ACTS = {None: "W8A16: the INT8 values are exact in bf16, one bf16 MXU pass",
             "int8-token": "W8A8: activations to INT8 per token, int8 x int8 on v6e's int8 MXU (exact int32 sums)"}
NO_INT8_ACT = ("{act} activations with INT8 weights: the TPU's INT8 paths are W8A16 (act_format=None) and "
               "'int8-token' W8A8 (dynamic per-token scales)")
NO_INT8_ON_V7 = ("tpu-v7's MXU has no int8 rate (Ironwood multiplies bf16 and fp8): load INT8 weights W8A16 "
                 "(act_format=None), or use tpu-v7-fp8 for W8A8")
Q8_ACTS = {"fp8": FP8_ACTS, "int8": INT8_ACTS}
W8A8_CHIP = {"fp8-token": "tpu-v7", "int8-token": "tpu-v6e"}  # the chip whose MXU has that 8-bit rate
KERNEL_REASONS = {
    "linear": "Pallas tiled matmul: {fmt} (one bf16 MXU pass where both operands are bf16 values, else HIGHEST)",
    "moe": "Pallas grouped expert matmuls over the routed rows only ({fmt} experts): gate/up + SwiGLU, down + "
           "round + shared post-expert norm (scale first) + routing weight; fp32 sum by XLA scatter-add",
    "attention": "Pallas flash attention: one KV head and its query group per step, positions decide visibility "
                 "(causal, sliding window, empty -1 slots; linear or ring cache), f32 online softmax{fp8}",
    "rms_norm": "Pallas row-tile kernel, f32 math (weightless / weighted / scale first)",
    "residual_norm": "Pallas row-tile kernel: post norm, f32 gated residual, next pre-norm in one pass",
}
FORMAT_NOTES = {"bf16": "BF16 weights, K-major", "fp16": "FP16 weights as BF16-tiled K-major",
                "fp32": "FP32 weights, K-major", "int4": "W4A16 INT4 (codes and f32 group scales, decoded in VMEM)",
                "mxfp4": "W4A16 MXFP4 (E2M1 codes and E8M0 bytes, decoded in VMEM)",
                "fp8": "W8A16 FP8 (E4M3 codes and the per-tensor scale, decoded in VMEM)",
                "int8": "W8A16 INT8 (codes and per-channel f32 scales, decoded in VMEM)",
                "nvfp4": "W4A16 NVFP4 (E2M1 codes, E4M3 bytes and the global scale, decoded in VMEM)"}


def chip_of(device: Optional[str]) -> Any:
    """The chip of a catalog TPU device (``tpu-v7-fp8`` is a tpu-v7, ``tpu-v6e-int8`` a tpu-v6e, with another plan),
    or None."""
    name = device or ""
    return CHIPS.get(name) or CHIPS.get(name.removesuffix("-fp8").removesuffix("-int8"))


def jax_missing() -> Optional[str]:
    if importlib.util.find_spec("jax") is None:
        return "jax not installed (pip install 'musecore-tpu[jax]'; jax 0.12 needs Python >= 3.12, 0.10.2 runs on 3.11)"
    return None


THROUGHPUT_OPTIONS = {"tpu-v7": ["tpu-v7-fp8"], "tpu-v6e": ["tpu-v6e-int8"]}  # 8-bit W8A8 plans, asked for by name


def probe_tpu() -> Probe:
    """Available only with torch_tpu importable and a TPU device present; the chip kind picks the catalog device."""
    details: dict[str, Any] = {"kernels": "Pallas (JAX); " + NEVER_RUN + ", tested in JAX's TPU interpreter on CPU",
                               "jax": _version("jax"), "torch_tpu": _version("torch_tpu")}
    if importlib.util.find_spec("torch_tpu") is None:
        return Probe(False, 0, [], "torch_tpu not installed" + UNTESTED, details)
    try:
        import torch_tpu  # noqa: F401  (torch autoloads it anyway when installed)
        # torch.tpu.device_count is internal to torch_tpu 0.2.0 (it raises); the accelerator API is the public one
        accelerator = torch.accelerator.current_accelerator()
        count = int(torch.accelerator.device_count()) if accelerator is not None and accelerator.type == "tpu" else 0
    except Exception as err:  # probe() never raises: the cause is the reason
        return Probe(False, 0, [], f"torch_tpu failed to start: {type(err).__name__}: {err}", details)
    if count == 0:
        return Probe(False, 0, [], "no TPU device" + UNTESTED, details)
    try:
        from torch_tpu._internal.device import _device_ops_backend
        kind = str(_device_ops_backend._get_local_device_attributes().get("device_kind", ""))
    except Exception as err:
        return Probe(False, 0, [], f"{count} TPU device(s), but their kind is unreadable: {type(err).__name__}: {err}",
                     details)
    details.update(device_kind=kind, devices=count)
    chip = chip_for_device_kind(kind)
    if chip is None:
        return Probe(False, 0, [], f"{count} x {kind!r}: not a catalog TPU ({', '.join(CHIPS)})", details)
    devices = [chip.name] + THROUGHPUT_OPTIONS.get(chip.name, [])  # listed after the chip: `auto` never picks them
    return Probe(True, 70, devices, f"{count} x {kind} ({chip.name}); kernels {NEVER_RUN} before this host",
                 details)


def _version(module: str) -> Optional[str]:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(module.replace("_", "-"))
    except PackageNotFoundError:
        return None


class TpuBackend(Backend):
    """Pallas kernels on a TPU through torch_tpu, or in JAX's TPU interpreter on a CPU."""

    name = "tpu"
    verified_on = (f"{NEVER_RUN} ({', '.join(CHIPS)}): the Pallas kernels checked in JAX's TPU interpreter on CPU "
                   "and compiled ahead of time for v6e and v7 by libtpu (where installed), the decode step compiled by "
                   "torch.compile's aot_eager on CPU")

    def __init__(self, device: Optional[Union[str, torch.device]] = None, *,
                 interpret: Optional[Union[bool, str]] = None) -> None:
        """``interpret``: None (interpret on a CPU, compile on a TPU), True or ``"tpu"`` (JAX's TPU interpreter),
        ``"jax"`` (Pallas' generic interpreter: faster, no TPU memory model), False (compile; needs a TPU)."""
        try:
            super().__init__(device)
        except RuntimeError as err:
            raise ValueError(f"TPU device {device!r} is unknown to torch: torch_tpu registers it (pip install "
                             f"'musecore-tpu[tpu]' on a TPU host); use TpuBackend('cpu') for interpret mode ({err})") from None
        if interpret is None:
            interpret = self.device.type == "cpu"
        if not interpret and self.device.type == "cpu":
            raise ValueError("the TPU kernels run on a CPU only in interpret mode; pass interpret=True or a tpu device")
        if interpret and self.device.type != "cpu":
            raise ValueError(f"interpret mode runs on the CPU (tensors move through DLPack); got device {self.device}")
        if interpret is True:
            interpret = os.environ.get(INTERPRETER_ENV) or "tpu"
        if interpret not in (False, "tpu", "jax"):
            raise ValueError(f"interpret must be None, True, False, 'tpu' or 'jax' (${INTERPRETER_ENV} too); "
                             f"got {interpret!r}")
        self.interpret: Union[bool, str] = interpret
        self._runner: Any = None
        self.compiled_steps = 0  # decode steps compiled by this instance (make_decode_step)

    @property
    def runner(self) -> Any:
        """Made on first use, so constructing the backend (the plan does) touches neither jax nor torch_tpu."""
        if self._runner is None:
            from musecore_tpu.runners import OpsRunner
            missing = jax_missing()
            if missing:
                raise RuntimeError(f"the TPU backend's kernels need jax: {missing}")
            self._runner = OpsRunner.interpret(self.interpret) if self.interpret else OpsRunner.torch_tpu()
        return self._runner

    # -- discovery ----------------------------------------------------------------------------------------------
    def probe(self) -> Probe:
        try:
            return probe_tpu()
        except Exception as err:  # never raises
            return Probe(False, 0, [], f"tpu probe failed: {type(err).__name__}: {err}")

    def supports(self, op: str, spec: OpSpec) -> Support:
        """Reasons describe the TPU path when the plan asks about a TPU device (``spec.device``), else what runs on
        this backend instance (the interpreter on a CPU)."""
        on_tpu = chip_of(spec.device) is not None or not self.interpret
        where = ("on the TPU through torch_tpu (" + NEVER_RUN + ")" if on_tpu else
                 {"tpu": "in JAX's TPU interpreter on this CPU", "jax": "in Pallas' generic interpreter on this CPU"}
                 [self.interpret])
        if op == "varlen_attention":
            return Support.no(NO_VARLEN)
        if op in TORCH_OPS or op in TOWER_TORCH_OPS:
            return Support.native(f"PyTorch ops (the reference's), lowered by torch_tpu ({NEVER_RUN})" if on_tpu
                                  else "PyTorch ops (the reference's) on this CPU")
        missing = jax_missing()
        if missing:
            return Support.no(missing)
        if op in ("linear", "moe"):
            fmt = spec.weight_format
            if fmt in Q8:
                return self._supports_q8(op, fmt, spec, where)
            if spec.act_format is not None:
                return Support.no(NO_ACT_QUANT.format(fmt=spec.act_format))
            if fmt not in DENSE + PACKED:
                return Support.no(f"{fmt} weights: the TPU kernels take {DENSE + PACKED}")
            return Support.native(KERNEL_REASONS[op].format(fmt=FORMAT_NOTES[fmt]) + f"; runs {where}")
        if op == "attention":
            if spec.kv_format not in ("bf16", "fp16", "fp32", "fp8"):
                return Support.no(f"KV format {spec.kv_format!r}: the TPU attention kernel reads bf16, fp32 or fp8")
            fp8 = "; FP8 KV dequantized per tensor in VMEM" if spec.kv_format == "fp8" else ""
            return Support.native(KERNEL_REASONS[op].format(fp8=fp8) + f"; runs {where}")
        return Support.native(KERNEL_REASONS[op] + f"; runs {where}")

    @staticmethod
    def _supports_q8(op: str, fmt: str, spec: OpSpec, where: str) -> Support:
        """8-bit weights: W8A16 anywhere; W8A8 (``fp8-token`` / ``int8-token``) only on the chip with that MXU rate
        (a plan for another chip is refused; on this CPU's interpreter both run)."""
        act, acts = spec.act_format, Q8_ACTS[fmt]
        if act not in acts:
            return Support.no((NO_FP8 if op == "moe" else NO_FP8_ACT).format(act=act) if fmt == "fp8"
                              else NO_INT8_ACT.format(act=act))
        chip = chip_of(spec.device)
        if act is not None and chip is not None and chip.name != W8A8_CHIP[act]:
            return Support.no(NO_FP8_ON_V6E if fmt == "fp8" else NO_INT8_ON_V7)
        if op == "moe":
            note = FORMAT_NOTES[fmt] if act is None else FP8_MOE_NOTE if fmt == "fp8" else INT8_MOE_NOTE
            return Support.native(KERNEL_REASONS[op].format(fmt=note) + f"; runs {where}")
        return Support.native((FP8_LINEAR if fmt == "fp8" else INT8_LINEAR).format(act=acts[act]) + f"; runs {where}")

    # -- weights --------------------------------------------------------------------------------------------------
    def _resident(self, weight: WeightIn, dtype: torch.dtype) -> tuple[str, dict[str, Any], int]:
        """(format, resident tensors on this backend's device, group)."""
        if isinstance(weight, torch.Tensor):
            if weight.dtype not in (torch.bfloat16, torch.float16, torch.float32):
                raise ValueError(f"TPU dense weights must be bf16, fp16 or fp32; got {weight.dtype}")
            return weight_format_of(weight), layouts.prepare_dense(weight, dtype), 0
        if weight.format in Q8:
            raise ValueError(f"TPU {weight.format} weights: a linear's {weight.format} QTensor or all three expert "
                             "stacks in that format (gate, up and down must share one format); this one is neither")
        return weight.format, layouts.prepare_packed(weight), weight.group_size

    def prepare_weight(self, weight: WeightIn, role: str, *, act_format: Optional[str] = None,
                       dtype: torch.dtype = torch.bfloat16) -> Weight:
        """Dense -> ``W^T [K, N]`` in ``dtype``; 4-bit QTensor -> K-major half-split codes + block scales
        (:mod:`musecore_tpu.layouts`). ``Weight.extra["tpu"]`` holds what the kernel reads."""
        out_features, in_features = (weight.shape[-2], weight.shape[-1])
        if isinstance(weight, QTensor) and weight.format in Q8:  # the 8-bit MXU path: FP8 / INT8 kept
            if act_format not in Q8_ACTS[weight.format]:
                raise ValueError((NO_FP8_ACT if weight.format == "fp8" else NO_INT8_ACT).format(act=act_format))
            resident = {k: v.to(self.device) for k, v in layouts.prepare_q8(weight).items()}
            return Weight(data=resident, format=weight.format, out_features=out_features, in_features=in_features,
                          act_format=act_format, extra={"tpu": self.runner.resident(resident), "q8": act_format,
                                                        "role": role})
        if act_format is not None:
            raise ValueError(NO_ACT_QUANT.format(fmt=act_format))
        if role == "embedding":  # a row lookup (torch op): keep rows
            table = weight if isinstance(weight, torch.Tensor) else None
            if table is None:
                raise ValueError(f"the embedding table must be dense; got a {weight.format} QTensor")
            return Weight(data=table.to(dtype).contiguous(), format=weight_format_of(table),
                          out_features=out_features, in_features=in_features)
        fmt, resident, group = self._resident(weight, dtype)
        resident = {k: (None if v is None else v.to(self.device)) for k, v in resident.items()}
        return Weight(data=resident, format=fmt, out_features=out_features, in_features=in_features,
                      extra={"tpu": self.runner.resident(resident), "group": group, "role": role})

    def prepare_experts(self, gate: WeightIn, up: WeightIn, down: WeightIn, *, act_format: Optional[str] = None,
                        dtype: torch.dtype = torch.bfloat16) -> ExpertWeights:
        fmt = gate.format if isinstance(gate, QTensor) else None
        if fmt in Q8 and all(isinstance(w, QTensor) and w.format == fmt for w in (up, down)):  # 8-bit kept
            if act_format not in Q8_ACTS[fmt]:
                raise ValueError(NO_FP8.format(act=act_format) if fmt == "fp8" else NO_INT8_ACT.format(act=act_format))
            resident = [{k: v.to(self.device) for k, v in layouts.prepare_q8(w).items()} for w in (gate, up, down)]
            return ExpertWeights(gate=resident[0], up=resident[1], down=resident[2], format=fmt,
                                 num_experts=gate.shape[0], act_format=act_format,
                                 extra={"tpu": [self.runner.resident(r) for r in resident], "group": 0})
        if act_format is not None:
            raise ValueError(NO_ACT_QUANT.format(fmt=act_format))
        prepared = [self._resident(w, dtype) for w in (gate, up, down)]
        fmt = expert_format(p[0] for p in prepared)
        groups = {p[2] for p in prepared}
        if len(groups) != 1:
            raise ValueError(f"gate, up and down must share one group size; got {sorted(groups)}")
        if fmt in DENSE:
            fmt = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(dtype, fmt)
        resident = [{k: (None if v is None else v.to(self.device)) for k, v in p[1].items()} for p in prepared]
        E = gate.shape[0]
        return ExpertWeights(gate=resident[0], up=resident[1], down=resident[2], format=fmt, num_experts=E,
                             extra={"tpu": [self.runner.resident(r) for r in resident], "group": groups.pop()})

    def resident_bytes(self, weight_format: str, out_features: int, in_features: int, *,
                       experts: int = 0) -> Optional[int]:
        """INT4 keeps f32 group scales (fp16 is no TPU vector type): 4.25 bits per weight instead of 4.125; INT8 its
        f32 scale per output channel beside the byte per weight."""
        if weight_format not in ("int4", "int8"):
            return None
        return layouts.resident_bytes(weight_format, out_features, in_features, experts)

    # -- ops ------------------------------------------------------------------------------------------------------
    def linear(self, x: torch.Tensor, w: Weight) -> torch.Tensor:
        resident = w.extra.get("tpu")
        if resident is None:
            raise TypeError("tpu linear got a Weight that TpuBackend.prepare_weight did not make; prepare it with "
                            "this backend")
        lead = x.shape[:-1]
        if "q8" in w.extra:
            y = self.runner.linear_q8(x.reshape(-1, x.shape[-1]).contiguous(), resident, w.format, w.extra["q8"])
            return y.reshape(*lead, y.shape[-1])
        y = self.runner.linear(x.reshape(-1, x.shape[-1]).contiguous(), resident, w.format, w.extra["group"])
        return y.reshape(*lead, y.shape[-1])

    def moe(self, z: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: ExpertWeights,
            post_norm: torch.Tensor, post_eps: float) -> torch.Tensor:
        resident = experts.extra.get("tpu")
        if resident is None:
            raise TypeError("tpu moe got ExpertWeights that TpuBackend.prepare_experts did not make")
        return self.runner.moe(z.contiguous(), weights, ids, *resident, post_norm, experts.format,
                               experts.extra["group"], post_eps, experts.act_format)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                  window: Optional[int], scale: float, k_scale: Optional[float] = None,
                  v_scale: Optional[float] = None) -> torch.Tensor:
        if q.shape[2] % k.shape[2]:
            raise ValueError(f"attention: {q.shape[2]} query heads are not a multiple of {k.shape[2]} kv heads")
        return self.runner.attention(q, k, v, q_pos, k_pos, window, scale,
                                     1.0 if k_scale is None else float(k_scale), 1.0 if v_scale is None else float(v_scale))

    def rms_norm(self, x: torch.Tensor, weight: Optional[torch.Tensor], eps: float,
                 scale_first: bool = False) -> torch.Tensor:
        if scale_first and weight is None:
            raise ValueError("rms_norm: scale_first=True needs a weight")
        return self.runner.rms_norm(x, weight, eps, scale_first)

    def residual_norm(self, residual: torch.Tensor, out: torch.Tensor, post_weight: Optional[torch.Tensor],
                      alpha: torch.Tensor, beta: torch.Tensor, next_weight: torch.Tensor, post_eps: float,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        return self.runner.residual_norm(residual, out, post_weight, alpha, beta, next_weight, post_eps, eps)

    embedding = staticmethod(ref.embedding)
    qk_norm_rope = staticmethod(ref.qk_norm_rope)
    head_norm_gate = staticmethod(ref.head_norm_gate)
    router_topk = staticmethod(ref.router_topk)
    silu_mul = staticmethod(ref.silu_mul)
    logit_softcap = staticmethod(ref.logit_softcap)
    sample = staticmethod(ref.sample)
    layer_norm = staticmethod(ref.layer_norm)  # the towers' element-wise and conv ops: PyTorch, as TOWER_TORCH_OPS says
    gelu = staticmethod(ref.gelu)
    causal_conv1d = staticmethod(ref.causal_conv1d)
    rope = staticmethod(ref.rope)

    # -- decode: one compiled step per batch bucket -----------------------------------------------------------------
    wants_static_cache = True  # fixed-shape KV caches (capacity + a trash slot): what a compiled step needs

    def make_decode_step(self, model: Any, cache: Any) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """``model.forward`` for one token per row through the static ``cache``, as ONE graph compiled by
        ``torch.compile(fullgraph=True, dynamic=False)`` with :meth:`compile_backend`: TorchTPU's ``tpu`` compiler
        on a TPU host (never run), ``aot_eager`` on the CPU (dynamo + AOTAutograd over the same custom ops and
        fakes, the kernels in the interpreter). A graph break or a host sync in the step is an error, not a
        slow path. The core keeps one static cache and its step per (batch, capacity, KV format), so a batch
        size compiles once; :meth:`batch_bucket` is the batch the core should size that cache for."""
        def step(ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            return model.forward(ids, positions=positions, cache=cache)
        # A fresh code object per step: dynamo keeps compiled graphs per code object and, with fullgraph=True, fails
        # hard past its recompile limit (8), which one shared `step` would reach after 8 caches (batch sizes).
        step = types.FunctionType(step.__code__.replace(), step.__globals__, step.__name__, step.__defaults__,
                                  step.__closure__)
        self.compiled_steps += 1
        return torch.compile(step, backend=self.compile_backend(), fullgraph=True, dynamic=False)

    BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

    def batch_bucket(self, batch: int) -> int:
        """The decode batch a step is compiled for: the smallest bucket holding ``batch`` (then multiples of the
        largest), so a server whose batch varies compiles a handful of steps, not one per batch size."""
        if batch < 1:
            raise ValueError(f"batch must be >= 1; got {batch}")
        for bucket in self.BATCH_BUCKETS:
            if batch <= bucket:
                return bucket
        top = self.BATCH_BUCKETS[-1]
        return -(-batch // top) * top

    def compile_backend(self) -> str:
        return "aot_eager" if self.interpret else "tpu"

    # -- what the plan and doctor show ------------------------------------------------------------------------------
    def kernel_choices(self, linears: Sequence[LinearShape], profile: Any) -> list[KernelChoice]:
        chip = chip_of(getattr(profile, "name", ""))
        vmem = chip.vmem_bytes if chip else min(c.vmem_bytes for c in CHIPS.values())
        out = []
        for lin in linears:
            fmt, act = lin.weight_format, lin.act_format if lin.weight_format in Q8 else None
            if fmt not in DENSE + PACKED + Q8:
                continue
            for label, M in (("decode M<=16", 16), ("prefill M=256", 256)):
                if lin.experts:  # "experts gate/up" [E, 2I, h] or "experts down" [E, h, I]: the grouped kernels
                    down = "down" in lin.name
                    hidden, inter = (lin.out_features, lin.in_features) if down else (lin.in_features,
                                                                                     lin.out_features // 2)
                    cfg = tiling.moe_configs(fmt, M, lin.top_k, lin.experts, hidden, inter, act=act)[1 if down else 0]
                    kernel = ("grouped down + finalize, full h rows" if down else "grouped gate/up + SwiGLU")
                elif fmt in Q8:
                    cfg = tiling.q8_config(fmt, act, M, lin.in_features, lin.out_features)
                    kernel = "8-bit MXU matmul"
                else:
                    cfg = tiling.matmul_config(fmt, M, lin.in_features, lin.out_features)
                    kernel = "tiled matmul"
                what = f"{lin.name} {fmt} {lin.out_features}x{lin.in_features}" + (
                    f" x{lin.experts} experts, top-{lin.top_k}" if lin.experts else "") + f", {label}"
                tiles = "x".join(str(s) for s in cfg.blocks[0].shape)
                note = Q8_ACTS[fmt][act] if act else FORMAT_NOTES[fmt]
                out.append(KernelChoice(what, f"Pallas {kernel}, {note}; row x K tile {tiles}, grid "
                                              f"{cfg.grid}",
                                        f"VMEM {cfg.vmem_bytes / 2**20:.1f} of {vmem / 2**20:.0f} MiB; {NEVER_RUN}"))
        return out

    def env_settings(self) -> list[EnvSetting]:
        return [EnvSetting(INTERPRETER_ENV, os.environ.get(INTERPRETER_ENV), "tpu",
                           "on a CPU, which interpreter runs the Pallas kernels: 'tpu' (JAX's TPU interpreter, TPU "
                           "memory model) or 'jax' (Pallas' generic one, ~3x faster end to end)")]

    def benchmarks(self) -> dict[str, Any]:
        from musecore_tpu.bench import benchmarks
        return benchmarks(self)
