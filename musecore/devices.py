"""The device catalog: every named target, its backend, memory and native number formats.

A profile says, for each checkpoint format, what loading does to the quantized weight groups
(the routed experts of layers 1..L-2, MODEL.md section 2): keep them, requantize them to the
device's own 4-bit format, quantize BF16 to it, or dequantize; and which activation format the
device's matmuls use for them (``None`` = 16-bit activations, i.e. weight-only). A profile may
also convert the BF16 attention, pooler/unpooler and lm_head projections by default
(``quantize_dense``: all of them on the CPU profiles, where decode speed is the bytes read per
token).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional

from musecore.names import ATTENTION, LM_HEAD, POOLER

CHECKPOINT_FORMATS = ("bf16", "fp8", "nvfp4", "mxfp4", "int4")


@dataclass(frozen=True)
class Conversion:
    """What loading does to the quantized weight group of one checkpoint format."""

    target: str                 # format the weights have in memory
    act_format: Optional[str]   # activation format of their matmuls (None = 16-bit)
    note: str = ""

    def action(self, source: str) -> str:
        if source == self.target:
            return "keep"
        if self.target == "bf16":
            return f"dequantize {source}->bf16"
        if source == "bf16":
            return f"quantize bf16->{self.target}"
        return f"requantize {source}->{self.target}"


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    vendor: str
    backend: str
    arch: str
    memory_gib: float
    weight_formats: tuple[str, ...]       # formats its kernels run natively
    activation_formats: tuple[str, ...]   # low-precision activation formats it computes in
    conversions: dict[str, Conversion] = field(default_factory=dict)
    description: str = ""
    # The dense projection groups (names.DENSE_QUANTIZABLE) that loading also converts with the BF16
    # rule: ``quantize_dense``'s default on this device. The CPU profiles take all three (attention,
    # pooler/unpooler, lm_head): CPU decode is bound by the bytes read per token, and the routed
    # experts alone are too small a share of them (byte-ideal speed-up over BF16: muse-small 1.32x,
    # the 816B model 1.79x; with the dense projections 3.30x and 3.54x).
    quantize_dense: tuple[str, ...] = ()

    def conversion(self, checkpoint_format: str) -> Conversion:
        if checkpoint_format not in self.conversions:
            raise ValueError(f"device {self.name!r} has no rule for {checkpoint_format!r} checkpoints; "
                             f"it takes {sorted(self.conversions)}")
        return self.conversions[checkpoint_format]

    def to_dict(self) -> dict:
        data = asdict(self)
        data["conversions"] = {fmt: {"action": c.action(fmt), **asdict(c)} for fmt, c in self.conversions.items()}
        return data


def _rules(**rules: tuple[str, Optional[str]] | tuple[str, Optional[str], str]) -> dict[str, Conversion]:
    return {fmt: Conversion(*rule) for fmt, rule in rules.items()}


_BLACKWELL = _rules(bf16=("bf16", None), fp8=("fp8", "fp8"), nvfp4=("nvfp4", "nvfp4", "W4A4 on FP4 tensor cores"),
                    mxfp4=("mxfp4", "mxfp4", "W4A4 on FP4 tensor cores"),
                    int4=("bf16", None, "no INT4 kernels: dequantized to BF16"))
_HOPPER = _rules(bf16=("bf16", None), fp8=("fp8", "fp8"), nvfp4=("nvfp4", None, "W4A16: FP4 upcast in registers"),
                 mxfp4=("mxfp4", None, "W4A16: FP4 upcast in registers"),
                 int4=("bf16", None, "no INT4 kernels: dequantized to BF16"))
# The throughput option on Hopper (devices "h200-fp8", "h100-fp8"; off unless asked for): the routed experts (and,
# with quantize_dense, the dense projections) are requantized to FP8 E4M3 at load (per-expert scale, the ModelOpt
# rule) and run W8A8 on FP8 tensor cores with dynamic per-token activation scales ("fp8-token"). Faster from
# prefill-sized batches up (FP8 tensor cores at ~2x BF16's rate; W4A16 GEMMs are slower than BF16 there), slower at
# decode (8 bits per weight read instead of 4.5), and ~1.8x the memory of NVFP4 for the experts.
_FP8_TOKEN = "W8A8, per-token activations"
_HOPPER_FP8 = _rules(bf16=("fp8", "fp8-token", f"quantized to FP8 E4M3 at load (per-tensor scale); {_FP8_TOKEN}"),
                     fp8=("fp8", "fp8", "W8A8 with the checkpoint's per-tensor activation scales"),
                     nvfp4=("fp8", "fp8-token", f"requantized to FP8 E4M3 at load (per-tensor scale); {_FP8_TOKEN}"),
                     mxfp4=("fp8", "fp8-token", f"requantized to FP8 E4M3 at load (per-tensor scale); {_FP8_TOKEN}"),
                     int4=("bf16", None, "no INT4 kernels: dequantized to BF16"))
_GFX950 = _rules(bf16=("bf16", None), fp8=("fp8", "fp8"),
                 nvfp4=("mxfp4", "mxfp4", "NVFP4 requantized to MXFP4 at load (least-error E8M0 scales; Quark's EVEN "
                                          "with MUSECORE_REQUANTIZATION=producer); W4A4"),
                 mxfp4=("mxfp4", "mxfp4", "W4A4 on MXFP4 matrix cores"),
                 int4=("bf16", None, "no INT4 kernels: dequantized to BF16"))
_GFX942 = _rules(bf16=("bf16", None), fp8=("fp8", "fp8"),
                 nvfp4=("mxfp4", None, "no FP4 matrix cores: requantized to MXFP4, W4A16"),
                 mxfp4=("mxfp4", None, "no FP4 matrix cores: W4A16"),
                 int4=("bf16", None, "no INT4 kernels: dequantized to BF16"))
_XEON = _rules(bf16=("int4", None, "quantized to INT4 g128 (RTN) at load"),
               fp8=("int4", None, "experts requantized to INT4 g128 at load"),
               nvfp4=("int4", None, "experts requantized to INT4 g128 at load"),
               mxfp4=("int4", None, "experts requantized to INT4 g128 at load"),
               int4=("int4", None, "INT4 weight-only"))
_CPU_DENSE = (ATTENTION, POOLER, LM_HEAD)
# TPU (musecore-tpu; Pallas kernels verified in JAX's TPU interpret mode, never run on a TPU): 4-bit checkpoints
# stay 4-bit, W4A16 (codes and block scales kept packed in HBM, decoded in VMEM); FP8 checkpoints stay FP8, W8A16.
# v6e's int8 MXU only with the tpu-v6e-int8 option, v7's FP8 MXU only with the tpu-v7-fp8 option below.
_TPU = _rules(bf16=("bf16", None), fp8=("fp8", None, "W8A16: E4M3 codes and per-tensor scales kept, decoded in VMEM"),
              nvfp4=("nvfp4", None, "W4A16: E2M1 codes and E4M3 scales kept packed, decoded in VMEM"),
              mxfp4=("mxfp4", None, "W4A16: E2M1 codes and E8M0 scales kept packed, decoded in VMEM"),
              int4=("int4", None, "W4A16: INT4 codes kept packed (f32 group scales), decoded in VMEM"))
_TPU_FORMATS = ("bf16", "fp8", "int4", "mxfp4", "nvfp4")
# The v7 throughput option (device "tpu-v7-fp8"; off unless asked for), like h200-fp8: experts (and FP8 checkpoints'
# linears) FP8 E4M3 with per-tensor / per-expert scales, W8A8 with per-token E4M3 activations on v7's FP8 MXU
# (2x its BF16 rate); 1 byte per weight, ~1.8x NVFP4's. Verified in JAX's TPU interpreter only.
_TPU_W8A8 = "W8A8 on v7's FP8 MXU, per-token E4M3 activations"
_TPU7_FP8 = _rules(bf16=("fp8", "fp8-token", f"quantized to FP8 E4M3 at load (per-tensor scale); {_TPU_W8A8}"),
                   fp8=("fp8", "fp8-token", f"E4M3 codes and per-tensor scales kept; {_TPU_W8A8}"),
                   nvfp4=("fp8", "fp8-token", f"requantized to FP8 E4M3 at load (per-tensor scale); {_TPU_W8A8}"),
                   mxfp4=("fp8", "fp8-token", f"requantized to FP8 E4M3 at load (per-tensor scale); {_TPU_W8A8}"),
                   int4=("int4", None, "W4A16: INT4 codes kept packed (f32 group scales), decoded in VMEM"))
# The v6e throughput option (device "tpu-v6e-int8"; off unless asked for), the same plan with v6e's int8 MXU (2x its
# BF16 rate; v6e has no FP8 rate): experts (and an FP8/NVFP4/MXFP4 checkpoint's linears) INT8 with one fp32 scale per
# output channel (musecore_quant's int8 codec, a load-time target), W8A8 with per-token INT8 activations and exact
# int32 sums; 1 byte per weight, ~1.8x NVFP4's. INT4 stays W4A16. Verified in JAX's TPU interpreter only.
_TPU_INT8_W8A8 = "W8A8 on v6e's int8 MXU (2x its BF16 rate; no FP8 rate), per-token INT8 activations"
_TPU_TO_INT8 = f"to INT8 at load (fp32 scale per output channel); {_TPU_INT8_W8A8}"
_TPU6E_INT8 = _rules(bf16=("int8", "int8-token", f"quantized {_TPU_TO_INT8}"),
                     fp8=("int8", "int8-token", f"requantized {_TPU_TO_INT8}"),
                     nvfp4=("int8", "int8-token", f"requantized {_TPU_TO_INT8}"),
                     mxfp4=("int8", "int8-token", f"requantized {_TPU_TO_INT8}"),
                     int4=("int4", None, "W4A16: INT4 codes kept packed (f32 group scales), decoded in VMEM"))
_REFERENCE = _rules(**{fmt: (fmt, None, "reference kernels: exact values, fp32 math") for fmt in CHECKPOINT_FORMATS})


def _profile(name, vendor, backend, arch, memory, weights, acts, conversions, description, quantize_dense=()):
    return DeviceProfile(name, vendor, backend, arch, memory, weights, acts, conversions, description, quantize_dense)


CATALOG: dict[str, DeviceProfile] = {p.name: p for p in [
    _profile("b300", "nvidia", "cuda", "sm100", 288, ("bf16", "fp8", "nvfp4", "mxfp4"), ("fp8", "nvfp4", "mxfp4"), _BLACKWELL, "NVIDIA B300 (Blackwell Ultra)"),
    _profile("gb300", "nvidia", "cuda", "sm100", 288, ("bf16", "fp8", "nvfp4", "mxfp4"), ("fp8", "nvfp4", "mxfp4"), _BLACKWELL, "NVIDIA GB300 (Grace Blackwell Ultra)"),
    _profile("b200", "nvidia", "cuda", "sm100", 192, ("bf16", "fp8", "nvfp4", "mxfp4"), ("fp8", "nvfp4", "mxfp4"), _BLACKWELL, "NVIDIA B200 (Blackwell)"),
    _profile("gb200", "nvidia", "cuda", "sm100", 192, ("bf16", "fp8", "nvfp4", "mxfp4"), ("fp8", "nvfp4", "mxfp4"), _BLACKWELL, "NVIDIA GB200 (Grace Blackwell)"),
    _profile("h200", "nvidia", "cuda", "sm90", 141, ("bf16", "fp8", "nvfp4", "mxfp4"), ("fp8",), _HOPPER, "NVIDIA H200 (Hopper)"),
    _profile("h100", "nvidia", "cuda", "sm90", 80, ("bf16", "fp8", "nvfp4", "mxfp4"), ("fp8",), _HOPPER, "NVIDIA H100 (Hopper)"),
    _profile("h200-fp8", "nvidia", "cuda", "sm90", 141, ("bf16", "fp8", "nvfp4", "mxfp4"), ("fp8", "fp8-token"), _HOPPER_FP8,
             "NVIDIA H200, throughput option: 4-bit and BF16 experts requantized to FP8 at load, W8A8 per token"),
    _profile("h100-fp8", "nvidia", "cuda", "sm90", 80, ("bf16", "fp8", "nvfp4", "mxfp4"), ("fp8", "fp8-token"), _HOPPER_FP8,
             "NVIDIA H100, throughput option: 4-bit and BF16 experts requantized to FP8 at load, W8A8 per token"),
    _profile("mi355x", "amd", "rocm", "gfx950", 288, ("bf16", "fp8", "mxfp4"), ("fp8", "mxfp4"), _GFX950, "AMD Instinct MI355X (CDNA4)"),
    _profile("mi350x", "amd", "rocm", "gfx950", 288, ("bf16", "fp8", "mxfp4"), ("fp8", "mxfp4"), _GFX950, "AMD Instinct MI350X (CDNA4)"),
    _profile("mi300x", "amd", "rocm", "gfx942", 192, ("bf16", "fp8", "mxfp4"), ("fp8",), _GFX942, "AMD Instinct MI300X (CDNA3)"),
    _profile("xeon6", "intel", "xeon", "x86-64 amx", 512, ("bf16", "int4"), (), _XEON, "Intel Xeon 6 with AMX (host memory)",
             quantize_dense=_CPU_DENSE),
    _profile("xeon", "intel", "xeon", "x86-64 avx512/avx2", 256, ("bf16", "int4"), (), _XEON, "x86-64 CPU without AMX (host memory)",
             quantize_dense=_CPU_DENSE),
    _profile("tpu-v6e", "google", "tpu", "v6e", 32, _TPU_FORMATS, (), _TPU,
             "Google TPU v6e (Trillium): 32 GiB HBM at 1.64 TB/s, 128 MiB VMEM"),
    _profile("tpu-v6e-int8", "google", "tpu", "v6e", 32, _TPU_FORMATS + ("int8",), ("int8-token",), _TPU6E_INT8,
             "Google TPU v6e, throughput option: BF16, FP8 and 4-bit experts converted to INT8 at load, "
             "W8A8 per token"),
    _profile("tpu-v7", "google", "tpu", "v7", 192, _TPU_FORMATS, (), _TPU,
             "Google TPU v7 (Ironwood): 192 GiB HBM at 7.4 TB/s per chip (two TensorCores), 64 MiB VMEM each"),
    _profile("tpu-v7-fp8", "google", "tpu", "v7", 192, _TPU_FORMATS, ("fp8-token",), _TPU7_FP8,
             "Google TPU v7, throughput option: BF16 and 4-bit experts converted to FP8 at load, W8A8 per token"),
    _profile("cpu", "any", "reference", "any", 0, CHECKPOINT_FORMATS, ("fp8", "nvfp4", "mxfp4"), _REFERENCE, "reference kernels on the local CPU (host memory)"),
]}


def get_profile(name: str) -> DeviceProfile:
    if name not in CATALOG:
        raise ValueError(f"unknown device {name!r}; choose one of {sorted(CATALOG)}, 'auto', or a torch device "
                         "string such as 'cuda:0' (run `musecore devices` for the catalog)")
    return CATALOG[name]
