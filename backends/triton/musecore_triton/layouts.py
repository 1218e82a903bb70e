"""Resident weight layouts of the CUDA backend, built once at load by ``prepare_weight``.

A checkpoint's FP4 weight (``QTensor``, canonical layout: byte ``i`` of a row holds elements
``2i`` and ``2i+1``) becomes a :class:`Fp4Resident`:

* ``packed`` uint8 ``[E, N, K/2]``: within each 128-element chunk of K, byte ``j`` holds element
  ``j`` in the low nibble and element ``j + 64`` in the high nibble. The kernel then multiplies
  the low nibbles by one contiguous half of the activation tile and the high nibbles by the
  other, with no even/odd gather; the weight stays 4.5 (NVFP4) / 4.25 (MXFP4) bits per value.
* ``scales`` uint8 ``[E, N, K/group]``: the block-scale bytes as stored (e4m3 or e8m0). They are
  decoded per group in registers; widening them to fp16 here would cost 1 more bit per weight.
* ``out_scale`` fp32 ``[E]``: everything that is constant per tensor (the NVFP4 global scale and
  the power-of-two fold ``2**fold_log2`` that keeps the 16-bit per-group multiplier in range),
  applied once to the fp32 accumulator.

Dense weights stay plain tensors ``[E, N, K]`` in the activation dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
import torch

from musecore_triton.kernels.fp4_gemm import CHUNK_K, NVFP4_FOLD_LOG2, WFMT_MXFP4, WFMT_NVFP4

FP4_GROUP = {"nvfp4": 16, "mxfp4": 32}


@dataclass
class Fp4Resident:
    """An FP4 weight (or a stack of expert weights) in the kernel's resident layout."""

    format: str
    packed: torch.Tensor     # uint8 [E, N, K/2], chunk-halves nibble order
    scales: torch.Tensor     # uint8 [E, N, K/group]
    out_scale: torch.Tensor  # fp32 [E]
    fold_log2: int
    group: int
    out_features: int
    in_features: int

    @property
    def wfmt(self) -> int:
        return WFMT_NVFP4 if self.format == "nvfp4" else WFMT_MXFP4

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales, self.out_scale))


def repack_chunk_halves(canonical: torch.Tensor) -> torch.Tensor:
    """Canonical packed FP4 ``[..., N, K/2]`` -> chunk-halves order (see the module docstring)."""
    *lead, n, half_k = canonical.shape
    k = half_k * 2
    codes = torch.stack((canonical & 0xF, canonical >> 4), dim=-1).reshape(*lead, n, k)  # [..., N, K]
    chunks = codes.reshape(*lead, n, k // CHUNK_K, 2, CHUNK_K // 2)
    packed = chunks[..., 0, :] | (chunks[..., 1, :] << 4)
    return packed.reshape(*lead, n, half_k).contiguous()


def prepare_fp4(qt, device: torch.device) -> Fp4Resident:
    """A ``QTensor`` (nvfp4/mxfp4, ``[out, in]`` or stacked ``[E, out, in]``) -> :class:`Fp4Resident`."""
    if qt.format not in FP4_GROUP:
        raise ValueError(f"prepare_fp4 takes nvfp4 or mxfp4 QTensors; got {qt.format!r}")
    if qt.group_size != FP4_GROUP[qt.format]:
        raise ValueError(f"{qt.format} needs group_size {FP4_GROUP[qt.format]}; got {qt.group_size}")
    n, k = qt.shape[-2], qt.shape[-1]
    if k % CHUNK_K:
        raise ValueError(f"the CUDA FP4 kernels need in_features divisible by {CHUNK_K}; got {k}. "
                         "Exclude this layer from quantization or pad it.")
    stacked = len(qt.shape) == 3
    data = qt.data if stacked else qt.data[None]
    scale = qt.scale if stacked else qt.scale[None]
    e = data.shape[0]
    packed = repack_chunk_halves(data.to(device))
    scales = scale.to(device).view(torch.uint8).contiguous()
    if qt.format == "nvfp4":
        fold_log2 = NVFP4_FOLD_LOG2
        global_scale = qt.global_scale if qt.global_scale is not None else torch.ones(())
        out_scale = global_scale.to(device, torch.float32).reshape(-1).expand(e) * 2.0 ** fold_log2
    else:
        # Fold the largest block exponent out so every per-group multiplier is <= 2**EB.
        fold_log2 = int(scales.max().item()) - 127
        out_scale = torch.full((e,), 2.0 ** fold_log2, dtype=torch.float32, device=device)
    return Fp4Resident(format=qt.format, packed=packed, scales=scales, out_scale=out_scale.contiguous(),
                       fold_log2=fold_log2, group=qt.group_size, out_features=n, in_features=k)



def share_fold(*stacks: Fp4Resident) -> None:
    """Give resident weights that one kernel launch reads together (gate and up) one ``fold_log2``.

    The GEMM and GEMV take a single fold per launch. NVFP4 folds are a constant; an MXFP4 fold is
    the tensor's largest block exponent, so gate and up may differ: both take the larger one (the
    smaller tensor's multipliers only get smaller, and stay exact above 2**-126).
    """
    fold = max(s.fold_log2 for s in stacks)
    for s in stacks:
        if s.fold_log2 != fold:
            if s.format != "mxfp4":
                raise ValueError(f"{s.format} weights have a fixed fold; got {s.fold_log2} and {fold}")
            s.out_scale = s.out_scale * 2.0 ** (fold - s.fold_log2)
            s.fold_log2 = fold
