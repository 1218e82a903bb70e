"""``RocmBackend``: musecore's AMD plugin (MI350X/MI355X gfx950, MI300X gfx942).

What runs, per architecture (``supports`` answers from this, never optimistically):

* MXFP4 weights: Triton ``tl.dot_scaled`` (:mod:`musecore_triton.kernels.mx_gemm`, ``mx_moe``) on
  the checkpoint's canonical bytes. gfx950: W4A4, the activations quantized to MXFP4 per 1x32
  inside the GEMM with the emulated target's rule, scaled MFMA. gfx942: W4A16 (``dot_scaled``
  upcasts e2m1 to bf16 MFMA); W4A4 numerics there are emulated by the same upcast.
* NVFP4 weights kept as NVFP4 (the catalog requantizes them to MXFP4 for these devices): W4A16
  through the shared FP4 upcast GEMM of :mod:`musecore_triton.kernels.fp4_gemm`.
* BF16/FP16 weights: ``torch.nn.functional.linear`` (hipBLASLt); BF16 experts: the shared grouped GEMM.
* FP8 weights: W8A8 per tensor through ``torch._scaled_mm``, e4m3fnuz on gfx942 with the scales
  doubled at load (:mod:`musecore_rocm.fp8`).
* Norms, RoPE, attention (BF16/FP8 KV), router (split-K GEMV at decode) and top-k, finalize, KV writes: the
  shared Triton kernels. Decode steps are captured as HIP graphs (the shared :mod:`musecore_triton.graphs`).
* Optional: AMD aiter's ``gemm_a4w4`` / ``fused_moe`` for the MXFP4 W4A4 ops (gfx950), its a16w4 ``fused_moe``
  for MXFP4 experts with BF16 activations (gfx942/gfx950) and ``unified_attention`` at decode on static caches,
  when asked for (``MUSECORE_ROCM_AITER=1``; :mod:`musecore_rocm.aiter_adapter`, never run against the real aiter).

No kernel here has ever run on AMD hardware (none was reachable while it was written): every
native answer is therefore ``emulated`` with the reason "not yet run on <arch> hardware", the
convention the CUDA backend uses for SM100, until a run on the device (``pytest -m rocm``)
moves the arch into :data:`VERIFIED_ARCHES`. In Triton's CPU interpreter
(``RocmBackend("cpu")`` with ``TRITON_INTERPRET=1``) the same kernels run for correctness.
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Sequence, Union

import torch
import torch.nn.functional as F

from musecore.backends.base import (Backend, EnvSetting, KernelChoice, LinearShape, Probe, Support, WeightIn,
                                    expert_format)
from musecore.ops import ExpertWeights, OpSpec, Weight
from musecore_rocm import choices
from musecore_rocm.aiter_adapter import (AiterApi, AiterExperts, AiterLinear, aiter_a16w4_fits, aiter_a16w4_selected,
                                         aiter_attention, aiter_attention_selected, aiter_fits, aiter_linear,
                                         aiter_moe, aiter_moe_a16w4, aiter_selected, attention_declines, load_aiter,
                                         prepare_aiter_experts, prepare_aiter_experts_a16w4, prepare_aiter_linear)
from musecore_rocm.arch import ARCHES, DEVICE_ARCH, find_rocm_device
from musecore_rocm.fp8 import Fp8Resident, fp8_linear, prepare_fp8
from musecore_triton.graphs import (graph_unavailable, make_graphed_decode_step, make_graphed_greedy_step,
                                    make_graphed_prefill_step)
from musecore_triton.kernels import interpreted
from musecore_triton.kernels.embed import model_decode_embed
from musecore_triton.kernels.fp4_gemm import w4a16_linear
from musecore_triton.kernels.moe import moe_forward
from musecore_triton.kernels.mx_gemm import BLOCK_K, MX_BLOCK, mxfp4_linear
from musecore_triton.kernels.mx_moe import MxExperts, mx_experts, mx_moe_forward
from musecore_triton.layouts import Fp4Resident, prepare_fp4, share_fold
from musecore_triton.ops import (ACT_DTYPES, DENSE_FORMATS, TritonOps, dense_experts, dense_weight, format_of,
                                 shared_kernel_limit)
from musecore_triton.towers import TOWER_REASONS

VERIFIED_ARCHES: tuple[str, ...] = ()  # archs the kernels have run and been checked on: none yet


def verified_on(verified: Sequence[str] = VERIFIED_ARCHES) -> str:
    """``RocmBackend.verified_on`` (what ``musecore doctor`` says on any host), from ``verified``."""
    def named(names: list[str]) -> str:
        return ", ".join(f"{a} ({' / '.join(d.upper() for d in ARCHES[a].devices)})" for a in names)
    never = [a for a in ARCHES if a not in verified]
    untried = f"{named(never)} (compiled here for the arch without a device; numerics in Triton's CPU interpreter)"
    if not verified:
        return "never run on AMD hardware: " + untried
    return f"run and checked on {named(list(verified))}" + (f"; never run on {untried}" if never else "")


log = logging.getLogger("musecore.rocm")


class MxWeight:
    """A canonical MXFP4 weight on the device: packed ``[1, N, K/2]`` and E8M0 ``[1, N, K/32]`` uint8."""

    def __init__(self, packed: torch.Tensor, scales: torch.Tensor) -> None:
        self.packed, self.scales = packed, scales
        self.out_features, self.in_features = packed.shape[1], packed.shape[2] * 2

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + self.scales.numel()


class RocmBackend(TritonOps, Backend):
    """AMD Instinct GPUs through Triton (``dot_scaled`` MXFP4) and hipBLASLt.

    Example::

        be = RocmBackend("cuda")          # torch's device type on ROCm builds is "cuda"
        w = be.prepare_weight(musecore_quant.quantize(w_bf16, "mxfp4"), "q_proj", act_format="mxfp4")
        y = be.linear(x_bf16, w)          # W4A4 on gfx950
    """

    name = "rocm"
    verified_on = verified_on()

    def __init__(self, device: Optional[Union[str, torch.device]] = None, *, arch: Optional[str] = None) -> None:
        super().__init__(device if device is not None else "cuda")
        if arch is not None and arch not in ARCHES:
            raise ValueError(f"unknown AMD arch {arch!r}; this backend targets {sorted(ARCHES)}")
        self._arch_override = arch  # the arch the interpreter stands in for (tests); default: the probe's

    # --- discovery -------------------------------------------------------------------------
    def probe(self) -> Probe:
        index = self.device.index if self.device.type == "cuda" and self.device.index is not None else 0
        found = find_rocm_device(index)
        details = {"arch": found.arch, **found.details}
        if not found.available:
            return Probe(False, reason=found.reason, details=details)
        verified = found.arch in VERIFIED_ARCHES
        reason = found.reason if verified else f"{found.reason}; no kernel of this backend has run on {found.arch} yet"
        details["verified_archs"] = list(VERIFIED_ARCHES)
        return Probe(True, score=100 if verified else 50, devices=list(ARCHES[found.arch].devices), reason=reason,
                     details=details)

    @property
    def interpreted(self) -> bool:
        """Kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1 on a "cpu" backend): for tests."""
        return interpreted(self.device)

    def arch(self) -> Optional[str]:
        """The gfx arch the kernels run for: the probe's, or in the interpreter the one it stands in for."""
        if self.interpreted:
            return self._arch_override or "gfx950"
        probe = self.probe()
        return probe.details.get("arch") if probe.available else None

    def supports(self, op: str, spec: OpSpec) -> Support:
        if self.interpreted:
            arch = DEVICE_ARCH.get(spec.device, self.arch())
            answer = self._supports_on(arch, op, spec)
            if answer.ok:
                return Support.emulated(f"Triton interpreter on the CPU standing in for {arch} (correctness only): "
                                        f"{answer.reason}")
            return answer
        arch = self.arch()
        if arch is None:
            probe_reason = self.probe().reason
            target = DEVICE_ARCH.get(spec.device)
            if target is None:
                return Support.no(probe_reason)
            would = self._supports_on(target, op, spec)
            return Support.no(f"{probe_reason}; on {spec.device} ({target}) it would be {would.tier.value}: {would.reason}")
        return self._supports_on(arch, op, spec)

    def _supports_on(self, arch: str, op: str, spec: OpSpec) -> Support:
        answer = self._capability(arch, op, spec)
        if answer.ok and answer.tier.value == "native" and arch not in VERIFIED_ARCHES:
            return Support.emulated(f"{answer.reason}; not yet run on {arch} hardware")
        return answer

    def _capability(self, arch: str, op: str, spec: OpSpec) -> Support:
        if op in ("linear", "moe"):
            return self._supports_matmul(arch, op, spec)
        limit = shared_kernel_limit(op, spec)
        if limit:
            return Support.no(limit)
        if op in ("embedding", "sample"):
            return Support.native("PyTorch ops on the GPU")
        if op == "router_topk":
            return Support.native("fp32 product (shared Triton split-K GEMV up to 16 tokens, hipBLASLt beyond), then "
                                  "the shared Triton top-k kernel")
        if op in TOWER_REASONS:  # the vision/audio towers' ops: the shared kernels of musecore_triton.towers
            return Support.native(TOWER_REASONS[op])
        return Support.native("shared Triton kernel (musecore_triton), fp32 math")

    def _supports_matmul(self, arch: str, op: str, spec: OpSpec) -> Support:
        fmt, act, caps = spec.weight_format, spec.act_format, ARCHES[arch]
        dims = dict(spec.shape)
        if fmt == "fp8":
            if op != "linear" or act != "fp8":
                return Support.no("FP8 weights run as W8A8 linear only (FP8 activations, torch._scaled_mm); "
                                  f"got {op} with {act or '16-bit'} activations")
            if self.interpreted:
                return Support.no("FP8 W8A8 runs through hipBLASLt (torch._scaled_mm) on the GPU only; the "
                                  "e4m3fn -> e4m3fnuz load conversion is unit-tested")
            return Support.native(f"W8A8 per tensor, {caps.fp8_dtype} through hipBLASLt (torch._scaled_mm)"
                                  + ("; e4m3fn bytes kept, scales doubled at load" if caps.fp8_dtype == "e4m3fnuz" else ""))
        if spec.dtype not in ACT_DTYPES and fmt not in DENSE_FORMATS:
            return Support.no(f"the FP4 kernels take bf16/fp16 activations; got {spec.dtype}")
        if fmt == "mxfp4":
            k, n = dims.get("in", dims.get("moe_hidden")), dims.get("out", dims.get("intermediate"))
            if (k is not None and k % BLOCK_K) or (n is not None and n % MX_BLOCK):
                return Support.no(f"the dot_scaled MXFP4 kernels need in_features % {BLOCK_K} == 0 and out_features % "
                                  f"{MX_BLOCK} == 0; got {n}x{k}")
            what = "GEMM" if op == "linear" else "grouped MoE GEMMs + shared finalize"
            if act == "mxfp4":
                if caps.mxfp4_w4a4:
                    return Support.native(f"W4A4: Triton dot_scaled(e2m1, e2m1) {what}, activations quantized to MXFP4 "
                                          "per 1x32 in the kernel (the emulated plan's rule), scaled MFMA")
                return Support.emulated(f"W4A4 numerics on {arch} (no FP4 matrix cores): dot_scaled upcasts both "
                                        f"operands to bf16 MFMA; {what}")
            if act is None:
                return Support.native(f"W4A16: Triton dot_scaled(bf16/fp16, e2m1) {what}"
                                      + ("" if caps.mxfp4_w4a4 else " (e2m1 upcast: gfx942 has no FP4 matrix cores)"))
        if fmt == "nvfp4" and act is None:
            return Support.native("NVFP4 kept as W4A16: the shared Triton FP4 upcast "
                                  + ("GEMM" if op == "linear" else "grouped MoE"))
        if act is not None:
            return Support.no(f"{fmt} weights with {act} activations are not implemented on AMD (MXFP4 W4A4, FP8 W8A8 "
                              "are; the catalog requantizes NVFP4 to MXFP4 for these devices)")
        if fmt in DENSE_FORMATS:
            return Support.native("hipBLASLt (torch.nn.functional.linear)" if op == "linear"
                                  else "the shared Triton grouped GEMM")
        return Support.no(f"{fmt} weights are not implemented in the ROCm backend (mxfp4, nvfp4 W4A16, fp8 W8A8, "
                          "bf16, fp16 are)")

    # --- weights ---------------------------------------------------------------------------
    def aiter_api(self) -> Optional[AiterApi]:
        """AMD aiter's kernels for the MXFP4 W4A4 ops when selected (``MUSECORE_ROCM_AITER=1``, importable, gfx950;
        :func:`musecore_rocm.aiter_adapter.aiter_selected`), else None: the Triton kernels run."""
        return load_aiter() if aiter_selected(self.arch())[0] else None

    def prepare_weight(self, weight: WeightIn, role: str, *, act_format: Optional[str] = None,
                       dtype: torch.dtype = torch.bfloat16) -> Weight:
        fmt = format_of(weight)
        if fmt == "fp8" and act_format == "fp8":
            arch = self.arch()
            resident = prepare_fp8(weight, self.device, fnuz=arch is not None and ARCHES[arch].fp8_dtype == "e4m3fnuz")
            return Weight(data=resident, format="fp8", out_features=resident.out_features,
                          in_features=resident.in_features, act_format="fp8",
                          input_scale=getattr(weight, "input_scale", None))
        if fmt == "mxfp4" and act_format == "mxfp4" and aiter_fits(*weight.shape):
            api = self.aiter_api()
            if api is not None:
                resident = prepare_aiter_linear(weight.data.to(self.device).view(torch.uint8),
                                                weight.scale.to(self.device).view(torch.uint8), api)
                return Weight(data=resident, format=fmt, out_features=resident.out_features,
                              in_features=resident.in_features, act_format=act_format)
        if fmt == "mxfp4" and act_format in (None, "mxfp4"):
            resident = MxWeight(weight.data.to(self.device)[None].contiguous(),
                                weight.scale.to(self.device).view(torch.uint8)[None].contiguous())
            return Weight(data=resident, format=fmt, out_features=resident.out_features,
                          in_features=resident.in_features, act_format=act_format)
        if act_format is not None:
            raise NotImplementedError(f"{role}: {fmt} weights with {act_format} activations are not supported by the "
                                      "ROCm backend; see supports()")
        if fmt == "nvfp4":
            resident = prepare_fp4(weight, self.device)
            return Weight(data=resident, format=fmt, out_features=resident.out_features,
                          in_features=resident.in_features)
        if fmt in DENSE_FORMATS:
            return dense_weight(weight, self.device, dtype)
        raise NotImplementedError(f"{role}: {fmt} weights are not implemented in the ROCm backend")

    def prepare_experts(self, gate: WeightIn, up: WeightIn, down: WeightIn, *,
                        act_format: Optional[str] = None, dtype: torch.dtype = torch.bfloat16) -> ExpertWeights:
        fmt = expert_format(format_of(w) for w in (gate, up, down))
        if fmt == "mxfp4" and act_format in (None, "mxfp4"):
            stacks = mx_experts(gate, up, down, self.device)
            api = self.aiter_api() if act_format == "mxfp4" else None
            if api is not None and aiter_fits(*gate.shape[1:]) and aiter_fits(*down.shape[1:]):
                ours = prepare_aiter_experts(stacks, api)
                return ExpertWeights(gate=ours, up=None, down=None, format=fmt, num_experts=ours.num_experts,
                                     act_format=act_format)
            inter, hidden = gate.shape[1], gate.shape[2]
            if act_format is None and aiter_a16w4_fits(hidden, inter) and aiter_a16w4_selected(self.arch())[0]:
                ours = prepare_aiter_experts_a16w4(stacks, load_aiter())
                return ExpertWeights(gate=ours, up=None, down=None, format=fmt, num_experts=ours.num_experts)
            return ExpertWeights(gate=stacks, up=None, down=None, format=fmt, num_experts=stacks.num_experts,
                                 act_format=act_format)
        if act_format is not None:
            raise NotImplementedError(f"experts: {fmt} with {act_format} activations is not supported (see supports())")
        if fmt == "nvfp4":
            fp4 = [prepare_fp4(w, self.device) for w in (gate, up, down)]
            share_fold(fp4[0], fp4[1])  # gate and up run in one launch with one fold
            return ExpertWeights(gate=fp4[0], up=fp4[1], down=fp4[2], format=fmt, num_experts=fp4[0].packed.shape[0])
        if fmt in DENSE_FORMATS:
            return dense_experts(gate, up, down, self.device, dtype)
        raise NotImplementedError(f"experts: {fmt} weights are not implemented in the ROCm backend")

    def kernel_choices(self, linears: Sequence[LinearShape], profile: Any) -> list[KernelChoice]:
        return choices.kernel_choices(linears, profile)

    def env_settings(self) -> list[EnvSetting]:
        return choices.env_settings()

    def resident_bytes(self, weight_format: str, out_features: int, in_features: int, *,
                       experts: int = 0) -> Optional[int]:
        return choices.resident_bytes(weight_format, out_features, in_features, experts=experts)

    # --- decode ----------------------------------------------------------------------------
    @property
    def wants_static_cache(self) -> bool:  # type: ignore[override]
        """Static, sync-free KV caches on a GPU, where decode steps are captured as HIP graphs."""
        return graph_unavailable(self.device) is None

    def make_decode_step(self, model, cache):
        """One decode step replayed from a captured HIP graph (the shared :mod:`musecore_triton.graphs`);
        None where graphs are unavailable (the CPU interpreter, no GPU): the core then calls ``forward``."""
        if graph_unavailable(self.device) is not None:
            return None
        return make_graphed_decode_step(model, cache)

    def make_greedy_decode_step(self, model, cache):
        """A greedy decode step (its argmax in the graph) replayed from a captured HIP graph; None where graphs are
        unavailable."""
        if graph_unavailable(self.device) is not None:
            return None
        return make_graphed_greedy_step(model, cache)

    def make_prefill_step(self, model, cache, tokens):
        """A prefill of ``tokens`` positions replayed from a captured HIP graph; None where graphs are unavailable."""
        if graph_unavailable(self.device) is not None:
            return None
        return make_graphed_prefill_step(model, cache, tokens)

    def fuse_embed(self, model):
        """The decode step's embedding stage in one launch (the shared
        :func:`musecore_triton.kernels.embed.model_decode_embed`, as on CUDA), or None when the model's weights do not
        fit it (off a GPU: the ops run). Compiled for gfx950/gfx942 here; never run on AMD hardware."""
        embed, why = model_decode_embed(model)
        if embed is None:
            log.debug("embed not fused: %s", why)
        return embed

    # --- ops -------------------------------------------------------------------------------
    def linear(self, x: torch.Tensor, w: Weight) -> torch.Tensor:
        if isinstance(w.data, Fp8Resident):
            return fp8_linear(x, w.data, w.input_scale)
        if isinstance(w.data, AiterLinear):
            return aiter_linear(x, w.data)
        if isinstance(w.data, MxWeight):
            return mxfp4_linear(x, w.data.packed, w.data.scales, quantize_activations=w.act_format == "mxfp4")
        if w.act_format is not None:
            raise NotImplementedError(f"linear: activation format {w.act_format!r} is not supported (see supports())")
        if isinstance(w.data, Fp4Resident):
            return w4a16_linear(x, w.data)  # NVFP4 kept: the shared W4A16 upcast GEMM
        if w.data.dtype != x.dtype:
            raise TypeError(f"linear: weight prepared as {w.data.dtype} but x is {x.dtype}; prepare it with "
                            f"dtype={x.dtype} (converting per call would be a hidden slow path)")
        return F.linear(x, w.data)

    def moe(self, z: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: ExpertWeights,
            post_norm: torch.Tensor, post_eps: float) -> torch.Tensor:
        if isinstance(experts.gate, AiterExperts):
            if experts.gate.a16w4:
                return aiter_moe_a16w4(z, weights, ids, experts.gate, post_norm, post_eps, self.arch())
            return aiter_moe(z, weights, ids, experts.gate, post_norm, post_eps)
        if isinstance(experts.gate, MxExperts):
            return mx_moe_forward(z, weights, ids, experts.gate, post_norm, post_eps,
                                  quantize_activations=experts.act_format == "mxfp4")
        if experts.act_format is not None:
            raise NotImplementedError(f"moe: activation format {experts.act_format!r} is not supported")
        if experts.format in DENSE_FORMATS and experts.gate.dtype != z.dtype:
            raise TypeError(f"moe: dense experts are {experts.gate.dtype} but z is {z.dtype}; prepare them with "
                            f"dtype={z.dtype}")
        return moe_forward(z, weights, ids, experts.gate, experts.up, experts.down, experts.num_experts,
                           post_norm, post_eps)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                  window: Optional[int], scale: float, k_scale: Optional[float] = None,
                  v_scale: Optional[float] = None) -> torch.Tensor:
        """Decode on a static cache through aiter's ``unified_attention`` when selected and exact
        (:func:`musecore_rocm.aiter_adapter.attention_declines`); otherwise the shared Triton flash attention."""
        api = self._aiter_attention_api()
        if api is not None and q.shape[1] == 1:
            cache_k, cache_v = _static_buffer(k), _static_buffer(v)
            if cache_k is not None and cache_v is not None and attention_declines(
                    self._aiter_attention_arch, cache_k, k.shape[1], 1, window,
                    k.dtype == torch.float8_e4m3fn) is None:
                return aiter_attention(q, cache_k, cache_v, q_pos, k.shape[1], window, scale, api, k_scale, v_scale)
        return super().attention(q, k, v, q_pos, k_pos, window, scale, k_scale, v_scale)

    def _aiter_attention_api(self) -> Optional[AiterApi]:
        """aiter when its unified_attention is selected here; decided once per backend (the probe is not free)."""
        if not hasattr(self, "_aiter_attention"):
            self._aiter_attention_arch = self.arch()
            self._aiter_attention = (load_aiter() if aiter_attention_selected(self._aiter_attention_arch)[0]
                                     else None)
        return self._aiter_attention

    # embedding, norms, router, elementwise, kv_write, sample: musecore_triton.ops.TritonOps


def _static_buffer(view: torch.Tensor) -> Optional[torch.Tensor]:
    """The ``[B, C+1, nkv, d]`` buffer behind a static cache's ``stored()`` view ``[B, C, nkv, d]`` (C slots and the
    trash slot per row), or None when ``view`` is not laid out like one (a ``[cache, new]`` concatenation)."""
    B, C, nkv, d = view.shape
    slot = nkv * d
    if view.stride(3) != 1 or view.stride(2) != d or view.stride(1) != slot or view.stride(0) != (C + 1) * slot:
        return None
    return view.as_strided((B, C + 1, nkv, d), view.stride(), view.storage_offset())

