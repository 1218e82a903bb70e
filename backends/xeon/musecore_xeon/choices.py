"""The kernel choices of the xeon backend as data (``musecore plan`` shows them), the environment variables it
reads, and the bytes its resident layouts keep.

Every choice here is the one the load would make, found without compiling or measuring anything: what depends on
the CPU is read from this host's probe and says so; crossovers measured at load are shown as measured when this
process already measured them, otherwise as "measured at load" with the range; an environment override in force
is named. Nothing here raises: a setting that would make the load fail is reported as that error.

Example::

    from musecore.backends.base import LinearShape
    from musecore.devices import get_profile
    shapes = [LinearShape("experts gate/up", 4096, 8192, "int4", experts=256, top_k=8)]
    for c in XeonBackend().kernel_choices(shapes, get_profile("xeon")):
        print(c.what, "->", c.choice, "|", c.reason)
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from musecore import compile_cache
from musecore.backends.base import EnvSetting, KernelChoice, LinearShape
from musecore_quant.formats.facts import block_size
from musecore_xeon import ops as xops
from musecore_xeon.cpu import NUM_THREADS_ENV, CpuInfo
from musecore_xeon.fused import FUSED_ENV, disabled as fused_disabled
from musecore_xeon.kernels import binding, crossover, native
from musecore_xeon.kernels.crossover import (BF16_CROSSOVER_ENV, BF16_GEMV_CROSSOVER_ENV, CALIBRATION_MS,
                                             INT4_CROSSOVER_ENV, PROXY_MAX_ROWS)
from musecore_xeon.kernels.dense import BF16_GEMV_CALIBRATION_MS
from musecore_xeon.kernels.int4 import INT4_GEMM_ENV, INT4_PROXY_MAX_ROWS, PACK_ROWS, planar_chunk
from musecore_xeon.kernels.moe import INT4_FUSED_MIN_TOKENS

DENSE_FORMATS = ("bf16", "fp16", "fp32")
ISA_NAMES = {"amx": "AMX-BF16 + AVX-512 VNNI", "avx512_vnni": "AVX-512 VNNI", "avx2": "AVX2 + FMA",
             "portable": "portable C (no SIMD flags)"}


def env_settings() -> list[EnvSetting]:
    """Every environment variable the xeon backend reads, its value now (None: unset), default and effect."""
    def setting(name: str, default: str, effect: str) -> EnvSetting:
        return EnvSetting(name, os.environ.get(name), default, effect)

    return [
        setting(NUM_THREADS_ENV, "the cores free at load (usable cores minus the 1-minute load average)",
                "threads of PyTorch and of the native kernels (one OpenMP pool); a number, or 'all'"),
        setting(native.ISA_ENV, "the best the CPU has",
                f"caps the ISA the native kernels are built for: one of {', '.join(native.ISA_LEVELS)}"),
        setting(native.NATIVE_ENV, "on",
                "0: do not build or use the C kernels (PyTorch's int4pack kernel, PyTorch-op dequantization, "
                "F.linear for BF16: same results, slower)"),
        setting(binding.BINDING_ENV, "on",
                "0: call the native kernels through ctypes instead of the CPython extension (same results, "
                "a few us more per call)"),
        setting(FUSED_ENV, "on",
                "0: at decode run each attention and MoE block as its separate ops instead of one extension call "
                "per block (same results, more Python per token)"),
        setting(INT4_CROSSOVER_ENV, "measured at load",
                "integer M: INT4 rows M >= it take the dense path (AMX GEMM or dequantized tiles); none: never"),
        setting(INT4_GEMM_ENV, "measured at load (hosts with AMX and AVX512_BF16)",
                "amx or bf16dot: the INT4 dense path on a host that has both GEMMs, without measuring"),
        setting(BF16_CROSSOVER_ENV, "measured at load",
                "integer M: BF16 rows M >= it take fp32 SGEMM on upcast tiles (CPUs without native BF16); none: never"),
        setting(BF16_GEMV_CROSSOVER_ENV, "measured at load",
                "integer M: BF16 rows M < it take the native BF16 GEMV (1: never; none: every M)"),
        setting(compile_cache.ENV, "$XDG_CACHE_HOME/musecore or ~/.cache/musecore",
                "root of the per-user cache the compiled kernels are kept in (<root>/xeon, mode 0700)"),
        setting("CC", "cc, else gcc", "the C compiler of the native kernels"),
        setting("CXX", "c++, else g++", "the C++ compiler of the CPython extension"),
    ]


def resident_bytes(weight_format: str, out_features: int, in_features: int, *, experts: int = 0) -> Optional[int]:
    """Bytes the xeon layout keeps for one weight (``experts`` > 0: a stacked ``[experts, out, in]``); None where
    that equals the checkpoint format's bytes.

    INT4 (group size of the format's facts, 128): nibble-planar codes (half a byte per weight) and per group and row
    an fp16 scale and an fp16 zero (4 bytes, where the checkpoint has a 2-byte scale), rows padded to a multiple of
    4; with the native kernels off (``MUSECORE_XEON_NATIVE_DEQUANT=0``) PyTorch's int4pack layout (rows padded to
    64, bf16 scale and zero) and the planar copy of the dense path. Dense weights keep their bytes (fp16 becomes
    bf16; an fp32 checkpoint weight is counted as bf16, the model dtype).
    """
    count = max(experts, 1)
    if weight_format == "int4":
        group = block_size("int4") or 128
        rows = out_features + -out_features % native.ROWS
        planar = rows * in_features // 2 + rows * (in_features // group) * 4
        if native.disabled():
            rows64 = out_features + -out_features % PACK_ROWS
            return count * (rows64 * in_features // 2 + rows64 * (in_features // group) * 4 + planar)
        return count * planar
    if weight_format == "fp32":
        return count * out_features * in_features * 2
    return None


class Choices:
    """The choices for one host (``cpu``) and device profile; one method per decision."""

    def __init__(self, cpu: CpuInfo, profile: Any, threads: int) -> None:
        self.cpu, self.profile, self.threads = cpu, profile, threads
        self.profile_name = getattr(profile, "name", None) or "?"
        self.host = f"this host's probe: {cpu.model_name}, {cpu.logical_cores} logical cores, ISA tier {cpu.isa_tier}"
        # a xeon6 has AMX, hence a native BF16 dot product, whatever host the plan is made on
        self.bf16_dot = cpu.native_bf16_dot or self.profile_name == "xeon6"
        self.bf16_source = self.host if cpu.native_bf16_dot or not self.bf16_dot else "the xeon6 profile (AMX)"

    # -- the process-wide choices ------------------------------------------------------------------------------
    def isa(self) -> KernelChoice:
        cap = native.isa_cap()
        flags = native.compile_flags(cap, info=self.cpu)
        level = ("amx" if "-mamx-bf16" in flags else "avx512_vnni" if "-mavx512vnni" in flags
                 else "avx2" if "-mavx2" in flags else "portable")
        reason = f"decided on {self.host}"
        if cap != native.ISA_LEVELS[0]:
            reason += f"; capped by {native.ISA_ENV}={os.environ.get(native.ISA_ENV)}"
        if level in ("amx", "avx512_vnni") and native.bf16_dot_planned(self.cpu):
            names = f"{ISA_NAMES[level]} + AVX512_BF16 (the INT4 GEMM on vdpbf16ps)"
        else:
            names = ISA_NAMES[level]
        reason += f"; torch CPU capability {self.cpu.torch_capability}"
        if self.profile_name == "xeon6" and level != "amx" and cap == native.ISA_LEVELS[0]:
            reason += ("; a xeon6 has AMX-BF16, so on the target the build adds AMX (decided again at load, on the "
                       "target's probe)")
        return KernelChoice("native kernels: ISA", names, reason, native.ISA_ENV)

    def native_kernels(self) -> KernelChoice:
        what = "native kernels (csrc/kernels.c)"
        if native.disabled():
            return KernelChoice(what, "off: PyTorch int4pack, PyTorch-op dequantization, F.linear",
                                f"{native.NATIVE_ENV}={os.environ.get(native.NATIVE_ENV)}", native.NATIVE_ENV)
        if native.load.cache_info().currsize:  # already loaded in this process: its outcome
            if native.load() is None:
                return KernelChoice(what, "off: PyTorch int4pack, PyTorch-op dequantization, F.linear",
                                    "; ".join(native.UNAVAILABLE) or "unavailable", native.NATIVE_ENV)
        cc = native.compiler()
        if cc is None:
            return KernelChoice(what, "off: PyTorch int4pack, PyTorch-op dequantization, F.linear",
                                "no C compiler (cc/gcc) on this host: announced by a RuntimeWarning at load",
                                native.NATIVE_ENV)
        omp = "OpenMP on PyTorch's libgomp" if native.torch_libgomp() is not None else "one thread (no libgomp in torch)"
        return KernelChoice(what, f"C, compiled at first use with {cc}, {omp}",
                            f"kept in the per-user compile cache ({compile_cache.root() / 'xeon'}), keyed by "
                            "sources, compiler and flags", native.NATIVE_ENV)

    def binding(self) -> KernelChoice:
        what = "native binding"
        ctypes_choice = "ctypes"
        if native.disabled():
            return KernelChoice(what, "none", "the native kernels are off", native.NATIVE_ENV)
        if binding.disabled():
            return KernelChoice(what, ctypes_choice, f"{binding.BINDING_ENV}={os.environ.get(binding.BINDING_ENV)}",
                                binding.BINDING_ENV)
        if binding.load.cache_info().currsize and binding.UNAVAILABLE:
            return KernelChoice(what, ctypes_choice, binding.UNAVAILABLE[-1], binding.BINDING_ENV)
        if binding.cxx_compiler() is None:
            return KernelChoice(what, ctypes_choice, "no C++ compiler (c++/g++): announced by a RuntimeWarning at load",
                                binding.BINDING_ENV)
        if not (Path(sysconfig.get_paths()["include"]) / "Python.h").exists():
            return KernelChoice(what, ctypes_choice, "no Python.h: announced by a RuntimeWarning at load",
                                binding.BINDING_ENV)
        return KernelChoice(what, "CPython extension (csrc/binding.cpp, METH_FASTCALL)",
                            "built at first use with PyTorch's headers; the GEMVs, norms, router and decode "
                            "attention called without ctypes", binding.BINDING_ENV)

    def decode_blocks(self) -> KernelChoice:
        what = "decode blocks"
        separate = "separate ops per block"
        if fused_disabled():
            return KernelChoice(what, separate, f"{FUSED_ENV}={os.environ.get(FUSED_ENV)}", FUSED_ENV)
        binding_choice = self.binding()
        if not binding_choice.choice.startswith("CPython extension"):
            return KernelChoice(what, separate, f"needs the CPython extension ({binding_choice.reason})", FUSED_ENV)
        return KernelChoice(what, "one C call per attention block and per MoE block (musecore_xeon.fused)",
                            "one token of one sequence through a bf16 KV cache (attention), up to "
                            f"{xops.NATIVE_ATTENTION_MAX_QUERIES} tokens (MoE): the separate ops' kernels and bits "
                            "without Python between them; other inputs take the separate ops", FUSED_ENV)

    def thread_count(self) -> KernelChoice:
        raw = os.environ.get(NUM_THREADS_ENV)
        reason = (f"{NUM_THREADS_ENV}={raw}" if raw else
                  f"the cores free at load (usable minus the 1-minute load average; musecore.threads) on {self.host}")
        return KernelChoice("threads", str(self.threads), reason, NUM_THREADS_ENV)

    def attention(self) -> KernelChoice:
        dtype = "bf16" if self.bf16_dot else "fp32"
        return KernelChoice("attention", f"decode (T <= {xops.NATIVE_ATTENTION_MAX_QUERIES}): one C loop, fp32 "
                                         f"softmax; prefill: SDPA in {dtype} with the reference mask",
                            f"SDPA compute dtype from {self.bf16_source} (fp32 without native BF16: exact and faster)")

    # -- per linear shape --------------------------------------------------------------------------------------
    def int4_dense_path(self) -> str:
        bf16dot = ("INT4 x BF16 GEMM on AVX512_BF16 (codes decoded into L1 bf16 panels, vdpbf16ps, scales on fp32 per "
                   "group)")
        if self.profile_name == "xeon6" or (self.cpu.native_bf16_dot and native.amx_planned(self.cpu)):
            return ("INT4 GEMM on AMX (weight panels dequantized into AMX tiles, tdpbf16ps), or the " + bf16dot +
                    " where it measures faster at load (M = 64 and 256 on a proxy; MUSECORE_XEON_INT4_GEMM forces one)")
        if native.bf16_dot_planned(self.cpu) and not native.disabled():
            return bf16dot
        tiles = "BF16 GEMM (oneDNN)" if self.bf16_dot else "fp32 SGEMM"
        return f"{tiles} on dequantized tiles"

    def int4_crossover(self, shape: LinearShape) -> tuple[Optional[int], str]:
        """The INT4 crossover M and where it comes from."""
        proxy_rows = min(shape.out_features + -shape.out_features % PACK_ROWS, INT4_PROXY_MAX_ROWS)
        try:
            bf16dot_only = native.bf16_dot_planned(self.cpu) and not native.amx_planned(self.cpu) \
                and self.profile_name != "xeon6"
        except ValueError:  # a bad MUSECORE_XEON_ISA: the ISA row reports it; this row reports its own setting
            bf16dot_only = False
        rule = "the dense path taken when faster" if bf16dot_only else "the dense path taken when at most 20% slower"
        return self.crossover_of(INT4_CROSSOVER_ENV, "int4-native", shape.in_features, proxy_rows, CALIBRATION_MS,
                                 rule)

    def crossover_of(self, env: str, kind: str, in_features: int, proxy_rows: int, ms: Sequence[int],
                     rule: str) -> tuple[Optional[int], str]:
        is_set, value = crossover.env_crossover(env)
        if is_set:
            return value, f"{env}={os.environ[env]}"
        for cal in crossover.calibrations():
            if (cal.kind, cal.in_features, cal.proxy_out_features, cal.threads) == (kind, in_features, proxy_rows,
                                                                                  self.threads):
                return cal.crossover, f"measured in this process ({proxy_rows}-row proxy, {self.threads} threads)"
        return None, (f"measured at load on this host, M = {min(ms)}..{max(ms)} on a {proxy_rows}-row proxy with "
                      f"{self.threads} threads ({rule})")

    def int4_linear(self, shape: LinearShape) -> list[KernelChoice]:
        n, k = shape.out_features, shape.in_features
        label = f"linear int4 {shape.name} {n}x{k}"
        group = block_size("int4") or 128
        if native.disabled() or native.compiler() is None:
            return [KernelChoice(label, "PyTorch _weight_int4pack_mm_for_cpu at every M",
                                 "the native kernels are off (see 'native kernels')", native.NATIVE_ENV)]
        if k % planar_chunk(group):
            return [KernelChoice(label, "PyTorch _weight_int4pack_mm_for_cpu at every M",
                                 f"K={k} is not a multiple of {planar_chunk(group)} (the planar chunk)")]
        value, source = self.int4_crossover(shape)
        small = "native INT4 GEMV / skinny GEMM (nibble-planar codes, int16 activations)"
        if value is None and "measured at load" not in source:
            return [KernelChoice(label, f"{small} at every M", source, INT4_CROSSOVER_ENV)]
        bound = "crossover" if value is None else str(value)
        return [KernelChoice(f"{label}, M < {bound}", small, source, INT4_CROSSOVER_ENV),
                KernelChoice(f"{label}, M >= {bound}", self.int4_dense_path(), f"decided on {self.host}"
                             + ("; the xeon6 profile has AMX" if self.profile_name == "xeon6" else ""),
                             INT4_CROSSOVER_ENV)]

    def dense_linear(self, shape: LinearShape) -> list[KernelChoice]:
        n, k = shape.out_features, shape.in_features
        label = f"linear {shape.weight_format} {shape.name} {n}x{k}"
        if shape.weight_format == "fp32":
            return [KernelChoice(label, "F.linear in the model dtype", "kept in the model dtype (bf16 by default)")]
        proxy = min(n, PROXY_MAX_ROWS)
        choices = []
        if not self.bf16_dot:
            tiles, tiles_source = self.crossover_of(BF16_CROSSOVER_ENV, "bf16", k, proxy, CALIBRATION_MS,
                                                    "F.linear in BF16 against fp32 SGEMM on upcast tiles")
        else:
            tiles, tiles_source = None, f"native BF16 matmul on {self.bf16_source}: F.linear at every larger M"
        if native.disabled() or native.compiler() is None:
            gemv, gemv_source = 1, "the native kernels are off (see 'native kernels')"
        else:
            gemv, gemv_source = self.crossover_of(BF16_GEMV_CROSSOVER_ENV, "bf16-gemv", k, proxy,
                                                  BF16_GEMV_CALIBRATION_MS, "the GEMV must be 10% faster")
        gemv_bound = "gemv crossover" if gemv is None else str(gemv)
        if gemv != 1:
            choices.append(KernelChoice(f"{label}, M < {gemv_bound}", "native BF16 GEMV (C, fp32 accumulation)",
                                        gemv_source, BF16_GEMV_CROSSOVER_ENV))
        if self.bf16_dot:
            choices.append(KernelChoice(f"{label}, M >= {gemv_bound}" if gemv != 1 else label, "F.linear in BF16",
                                        tiles_source))
        else:
            tiles_bound = "tiles crossover" if tiles is None else str(tiles)
            low = f"{gemv_bound} <= M < {tiles_bound}" if gemv != 1 else f"M < {tiles_bound}"
            choices.append(KernelChoice(f"{label}, {low}", "F.linear in BF16", tiles_source, BF16_CROSSOVER_ENV))
            choices.append(KernelChoice(f"{label}, M >= {tiles_bound}", "fp32 SGEMM on BF16 tiles upcast one at a time",
                                        f"no native BF16 matmul on {self.host}", BF16_CROSSOVER_ENV))
        return choices

    def moe(self, shape: LinearShape) -> KernelChoice:
        fmt = shape.weight_format
        what = f"moe {fmt} {shape.name} [{shape.experts}, {shape.out_features}, {shape.in_features}], top-{shape.top_k}"
        if native.disabled() or native.compiler() is None:
            return KernelChoice(what, "per routed expert linear calls, PyTorch norm and sum",
                                "the native kernels are off (see 'native kernels')", native.NATIVE_ENV)
        if fmt == "int4":
            value, source = self.int4_crossover(shape)
            limit = (f"fewer than max(crossover, {INT4_FUSED_MIN_TOKENS})" if value is None
                     else f"fewer than {max(value, INT4_FUSED_MIN_TOKENS)}")
            return KernelChoice(what, f"one fused native call per layer (musecore_int4_moe) while every routed expert "
                                      f"has {limit} tokens; per-expert INT4 linear calls above",
                                f"INT4 crossover (the smaller of the layer's gate/up and down): {source}; at least "
                                f"{INT4_FUSED_MIN_TOKENS} tokens, since leaving the fused call costs two calls per "
                                "routed expert", INT4_CROSSOVER_ENV)
        gemv, source = self.crossover_of(BF16_GEMV_CROSSOVER_ENV, "bf16-gemv", shape.in_features,
                                         min(shape.out_features, PROXY_MAX_ROWS), BF16_GEMV_CALIBRATION_MS,
                                         "the GEMV must be 10% faster")
        limit = "the BF16 GEMV crossover" if gemv is None else str(gemv)
        return KernelChoice(what, f"one fused native call per layer (musecore_bf16_moe) while every routed expert has "
                                  f"fewer than {limit} tokens; per-expert linear calls above",
                            f"BF16 experts in the model dtype; GEMV crossover (the smaller of the layer's gate/up and "
                            f"down): {source}", BF16_GEMV_CROSSOVER_ENV)

    def for_shape(self, shape: LinearShape) -> list[KernelChoice]:
        fmt = shape.weight_format
        if shape.act_format is not None:
            return [KernelChoice(f"linear {fmt} {shape.name}", "not run by xeon",
                                 f"{shape.act_format} activations: xeon is weight-only")]
        if fmt in ("nvfp4", "mxfp4", "fp8"):
            return [KernelChoice(f"linear {fmt} {shape.name}", "not run by xeon",
                                 "convert at load (the plan turns these into INT4 or BF16 on xeon devices)")]
        if fmt not in ("int4", *DENSE_FORMATS):
            return [KernelChoice(f"linear {fmt} {shape.name}", "not run by xeon", f"unknown format {fmt!r}")]
        if shape.experts > 0:
            per_expert = self.int4_linear(shape) if fmt == "int4" else self.dense_linear(shape)
            return [self.moe(shape), *per_expert]
        return self.int4_linear(shape) if fmt == "int4" else self.dense_linear(shape)


def guarded(what: str, make: Callable[[], Any]) -> list[KernelChoice]:
    """``make()`` as a list of choices, or the error it raised as the choice's reason (kernel_choices never
    raises; the same error would stop the load, so it is shown, not hidden)."""
    try:
        made = make()
    except Exception as err:  # reported in the plan: the load would raise the same
        return [KernelChoice(what, "error", f"{type(err).__name__}: {err}")]
    return made if isinstance(made, list) else [made]


def kernel_choices(linears: Sequence[LinearShape], profile: Any, cpu: CpuInfo, threads: int) -> list[KernelChoice]:
    """Every kernel decision for these linears on ``profile`` (a DeviceProfile), decided on ``cpu`` (this host)."""
    c = Choices(cpu, profile, threads)
    out: list[KernelChoice] = []
    for what, make in (("native kernels: ISA", c.isa), ("native kernels", c.native_kernels),
                       ("native binding", c.binding), ("decode blocks", c.decode_blocks), ("threads", c.thread_count),
                       ("attention", c.attention)):
        out += guarded(what, make)
    seen = set()
    for shape in linears:
        key = (shape.weight_format, shape.act_format, shape.out_features, shape.in_features, shape.experts,
               shape.top_k, shape.name)
        if key in seen:
            continue
        seen.add(key)
        out += guarded(f"linear {shape.weight_format} {shape.name}", lambda: c.for_shape(shape))
    return out

