"""FP4 kernels in CUDA C++ (NVRTC through ``torch.cuda._compile_kernel``): decode (M <= 16) and dequantize.

The kernels read the resident FP4 bytes of :mod:`musecore_triton.layouts` (no second copy) as int32
words; nibble ``n`` of word ``q`` of a 128-element chunk is element ``(n % 2) * 64 + 4q + n / 2``.

* ``fp4_gemv_mma`` (bf16 activations, M <= 16, the default): ``mma.m16n8k16`` with the weights as
  operand A, upcast in registers (shift/LOP3 into bf16x2 pairs holding ``code * 2**-126`` exactly,
  then ``mul.bf16x2`` by ``scale * 2**(126 - fold)``, also exact; e4m3 scales decoded by the
  hardware ``cvt.rn.f16x2.e4m3x2``) and the activations as operand B, staged once per block in
  shared memory in the same pair order (one 16-byte load per word; token rows padded apart so the
  8 rows a load instruction reads fall in different banks). Up to 16 tokens share each upcast (two
  mma n8 groups). A block's 4 warps may split its K range, and the blocks of a thread-block cluster
  split it further; partial sums meet in shared memory and, across the cluster, through distributed
  shared memory, so the output is written once in its own dtype (SwiGLU after the reduction). Each
  thread keeps ``prefetch`` chunks in flight in a ring of registers (the first ones issued before
  the activations are staged) and accumulates into 4 independent mma chains.
* ``fp4_gemv`` (bf16 or fp16, M <= 2; fp16 activations use it): fp32 FMA. Each lane reads 16
  bytes of each of ``R`` rows per step (next step's loads issued first); activations are staged as
  fp32 times 2**64; the upcast gives the fp32 bits of ``code * 2**-126``; sums per group, one FMA
  per group with ``scale * 2**(62 - fold)``; split-K through fp32 atomics.

Numerics: products are exact (2-bit code times a 16-bit activation) and sums are fp32, as in the
Triton GEMM; no ``--use_fast_math``, so the subnormal ``0.5 * 2**-126`` is kept (tested for every
code at every nibble position). The per-tensor ``out_scale`` (NVFP4 global scale times
``2**fold``) is applied to the sums.

Why not Triton: a Triton GEMV with the same upcast moved the activations and decoded weights
between register layouts through shared memory inside the K loop and streamed far below HBM
bandwidth (measurements and the profile: ``backends/cuda/lab/NOTES.md``). Sources: ``csrc/pdl.cuh``
and ``csrc/fp4_gemv.cu``.

* ``fp4_dequant``: the weight as bf16 times its per-tensor scale (each element rounded once), for
  large M, where cuBLAS's BF16 GEMM on it beats the W4A16 GEMM (``fp4_dequant_linear``).

Availability: needs ``torch.cuda._compile_kernel`` (PyTorch >= 2.8) and NVRTC. When either is
missing or compilation fails, :func:`available` is False with the reason in :data:`UNAVAILABLE`
and the backend uses the Triton GEMM (announced once as a RuntimeWarning).
"""

from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass, replace
from typing import Optional

import torch

from musecore_cuda.kernels import pdl, sources
from musecore_triton import hooks
from musecore_triton.kernels.fp4_gemm import CHUNK_K, WFMT_NVFP4

SOURCE = sources.read("pdl.cuh", "fp4_gemv.cu")

FMA_WARPS, MMA_WARPS = 8, 4
FMA_MAX_M = 2  # fp32 FMA kernel (bf16 or fp16 activations); its FMA count grows with M
MAX_M = 16     # tensor-core kernel (bf16 activations): one or two mma n8 token groups
SMEM_LIMIT = 48 * 1024  # staged activations per block without the opt-in
MAX_CLUSTER = 8  # portable thread-block cluster size: the MMA kernel's largest split-K
MMA_TARGET_WARPS = 2048  # ~16 warps per SM of an H200 streaming at once: enough loads in flight
MMA_MIN_CHUNKS = 4       # fewest 128-element chunks a warp streams (its prologue must pay off)
UNAVAILABLE: list[str] = []
_DTYPE_CODE = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}


@dataclass(frozen=True)
class GemvPlan:
    """Which decode kernel runs a weight at ``m`` rows, and how it is cut into blocks.

    MMA kernel: a block is 4 warps = ``4 / k_warps`` row groups x ``k_warps`` slices of the block's
    K range; a warp owns ``tile`` 16-row output tiles and keeps ``prefetch`` chunks in flight;
    ``split_k`` blocks of a cluster share a row block. FMA kernel: ``tile`` rows per warp, 8 warps.
    """

    kind: str            # "mma" (tensor cores, bf16) or "fma" (fp32 FMA, bf16/fp16)
    m: int
    tile: int            # FMA: rows per warp; MMA: 16-row tiles per warp
    split_k: int = 1
    k_warps: int = 1     # MMA: warps of a block splitting its K range
    prefetch: int = 2    # MMA: chunks each thread keeps in flight
    lean: Optional[bool] = None  # MMA: the kernel's lean path (None: lean_path's measured rule; sweeps force it)
    min_blocks: int = 0  # MMA: blocks per SM the kernel's registers must allow (__launch_bounds__: 4 -> 128, 8 -> 64)

    @property
    def token_groups(self) -> int:  # MMA: groups of 8 activation rows (mma n8 each)
        return -(-self.m // 8)

    @property
    def rows_per_block(self) -> int:
        if self.kind == "mma":
            return MMA_WARPS // self.k_warps * 16 * self.tile
        return FMA_WARPS * self.tile

    def grid(self, n: int, programs: int = 1) -> tuple[int, int, int]:
        """The launch grid for ``n`` output rows: row blocks x the cluster's split x ``programs`` (experts' grid z)."""
        return -(-n // self.rows_per_block), self.split_k, programs

    @property
    def atomic(self) -> bool:
        """Split-K through fp32 atomics into a zeroed fp32 output (FMA kernel); the MMA kernel reduces
        its splits inside the block and the thread-block cluster and writes the final dtype."""
        return self.kind == "fma" and self.split_k > 1

    def smem(self, k: int, swiglu: bool = False) -> int:
        if self.kind == "mma":  # bf16 pairs, then the partial sums of every warp
            tiles = self.tile * (2 if swiglu else 1) * self.token_groups
            reduce = tiles * 4 * MMA_WARPS * 32 * 4 if self.k_warps > 1 or self.split_k > 1 else 0
            return self.m * ((k // self.split_k) * 2 + 64) + reduce
        return self.m * (k // self.split_k) * 4


RUN_CAP = 8  # most assignments of one expert a runs program computes (one mma n8 token group)


def run_plan(plan: GemvPlan, k: int, swiglu: bool = False) -> Optional[GemvPlan]:
    """``plan`` (made for M = 1 per assignment) as a runs plan (``launch(perm=...)``): up to :data:`RUN_CAP`
    assignments of one expert per program, as many as its staged activations fit in shared memory beside the
    same cut; None when fewer than 2 fit (runs would save nothing)."""
    if plan.kind != "mma" or plan.m != 1:
        raise ValueError(f"runs extend an M=1 MMA plan; got {plan}")
    cap = max((c for c in range(2, RUN_CAP + 1) if replace(plan, m=c).smem(k, swiglu) < SMEM_LIMIT), default=None)
    return replace(plan, m=cap) if cap else None


def kind_for(m: int, dtype: torch.dtype) -> Optional[str]:
    if dtype == torch.bfloat16 and m <= MAX_M:
        return "mma"
    if dtype in (torch.bfloat16, torch.float16) and m <= FMA_MAX_M:
        return "fma"
    return None


def make_plan(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, *, allow_split: bool = True,
              kind: Optional[str] = None, programs: int = 1, swiglu: bool = False) -> GemvPlan:
    """Tile and split-K for ``m`` activation rows against an ``[n, k]`` weight (``kind`` forces a kernel).

    ``programs`` is the number of independent launches along z (expert assignments). The MMA plan
    splits K until about ``MMA_TARGET_WARPS`` warps stream at once, keeping at least
    ``MMA_MIN_CHUNKS`` chunks per warp. At M = 1 it splits across the warps of a block first (no
    cluster barrier); at M > 1 across the cluster first, because every block stages its K range of
    all M activation rows, and a block of fewer rows (warps splitting K) pays more staging per
    weight byte (measured on the H200; backends/cuda/lab/NOTES.md).
    """
    kind = kind or kind_for(m, dtype)
    if kind is None:
        raise ValueError(f"no CUDA decode kernel for M={m} with {dtype} activations (see kind_for)")
    chunks = k // CHUNK_K
    if kind == "mma":
        plan = GemvPlan(kind, m, 1)
        while allow_split or plan.smem(k, swiglu) >= SMEM_LIMIT:
            warps = math.prod(plan.grid(n, programs)) * MMA_WARPS
            per_warp = chunks // (plan.split_k * plan.k_warps)
            target = MMA_TARGET_WARPS * (2 if m > 1 else 1)  # M > 1: more work per weight byte
            if warps >= target and plan.smem(k, swiglu) < SMEM_LIMIT:
                break
            deep = per_warp >= 2 * MMA_MIN_CHUNKS
            # At M = 1 the warps of a block may split even a short K down to one chunk each (a
            # shared-memory reduction, no cluster barrier): short experts (4 chunks) ran the decode MoE
            # faster with 1-2 chunks per warp.
            cuts = [replace(plan, k_warps=plan.k_warps * 2)] if plan.k_warps < MMA_WARPS and (
                deep or (m == 1 and per_warp >= 2)) else []
            if plan.split_k < MAX_CLUSTER and deep:
                cuts.insert(0 if m > 1 else len(cuts), replace(plan, split_k=plan.split_k * 2))
            cuts = [c for c in cuts if chunks % (c.split_k * c.k_warps) == 0]
            if not cuts:
                break
            plan = cuts[0]
        plan = replace(plan, prefetch=min(plan.prefetch, chunks // (plan.split_k * plan.k_warps)))
    else:
        plan = GemvPlan(kind, m, 8 if m == 1 else 4)
        blocks, split = math.prod(plan.grid(n, programs)), 1
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        while split < 16 and chunks % (split * 2) == 0 and chunks // (split * 2) >= 4 and (
                (allow_split and blocks * split < 2 * sms) or plan.smem(k) >= SMEM_LIMIT):
            split *= 2
            plan = replace(plan, split_k=split)
    if plan.smem(k, swiglu) >= SMEM_LIMIT:
        raise ValueError(f"the CUDA decode kernel cannot stage {m} x {k} activations in shared memory")
    return plan


def lean_path(plan: GemvPlan, experts: bool, runs: bool = False) -> bool:
    """Whether the MMA kernel runs ``plan`` on its lean path (``plan.lean`` when set): fewer instructions per chunk,
    more registers (``gemv_mma_body`` in ``csrc/fp4_gemv.cu``). Measured on the H200 against the plain path, same
    process, bit-equal (lab NOTES, session 56, runs 77 and 79): the M = 1 linear cuts (warps of a block splitting K)
    1.02-1.08x faster; the split-8 linear cut of M = 2..16 0.88-0.97x (80 -> 92-95 registers: 5 blocks per SM instead
    of 6 on a multi-wave grid); the 816B MoE decode's expert GEMVs 1.06-1.08x at batch 1-4 (one program per
    assignment) and 0.96-0.97x at batch 8-16 (runs of one expert). So: lean for linears whose warps split K, and for
    expert GEMVs not on runs."""
    if plan.lean is not None:
        return plan.lean
    return not runs if experts else plan.k_warps > 1


def kernel_name(kind: str, tile: int, m: int, wfmt: int, experts: bool, swiglu: bool, split: int = 1,
                k_warps: int = 1, prefetch: int = 2, early: bool = False, lean: bool = False,
                min_blocks: int = 0) -> str:
    """The template instantiation of ``csrc/fp4_gemv.cu`` that runs a plan (NVRTC's name expression)."""
    flags = f"{wfmt}, {str(experts).lower()}, {str(swiglu).lower()}"
    return (f"fp4_gemv_mma<{tile}, {k_warps}, {prefetch}, {-(-m // 8)}, {flags}, {split}, {str(early).lower()}, "
            f"{str(lean).lower()}, {min_blocks}>"
            if kind == "mma" else f"fp4_gemv<{tile}, {m}, {FMA_WARPS}, {flags}, {str(early).lower()}>")


def plan_kernel_name(plan: GemvPlan, wfmt: int, experts: bool = False, swiglu: bool = False,
                     early: bool = False, runs: bool = False) -> str:
    """:func:`kernel_name` of ``plan``, as :func:`launch` picks it (``runs``: launched with ``perm``)."""
    mma = plan.kind == "mma"
    return kernel_name(plan.kind, plan.tile, plan.m, wfmt, experts, swiglu, plan.split_k if mma else 1,
                       plan.k_warps if mma else 1, plan.prefetch if mma else 2, early,
                       mma and lean_path(plan, experts, runs), plan.min_blocks if mma else 0)


@functools.lru_cache(maxsize=None)
def _kernel(name: str):
    return torch.cuda._compile_kernel(SOURCE, name)


def available(device: torch.device) -> bool:
    """True when the CUDA C++ decode kernels compile here (checked once per process, reason kept)."""
    return device.type == "cuda" and _probe()


@functools.lru_cache(maxsize=1)
def _probe() -> bool:
    if not hasattr(torch.cuda, "_compile_kernel"):
        reason = f"torch {torch.__version__} has no torch.cuda._compile_kernel (NVRTC; PyTorch >= 2.8)"
    else:
        try:
            _kernel(kernel_name("mma", 1, 1, WFMT_NVFP4, False, False))
            _kernel(kernel_name("fma", 8, 1, WFMT_NVFP4, False, False))
            return True
        except Exception as exc:  # NVRTC missing or a compile error: say why, use the Triton GEMM
            reason = f"compiling the CUDA C++ decode kernels with NVRTC failed ({type(exc).__name__}: {str(exc)[:300]})"
    UNAVAILABLE.append(reason)
    warnings.warn(f"musecore-cuda: {reason}; decode linears use the slower Triton tensor-core GEMM",
                  RuntimeWarning, stacklevel=3)
    return False


# An expert GEMV signals its dependents at its top (under PDL, when ``fp4_gemv_mma_experts`` is in the early set)
# only on a grid of at most this many blocks per SM: muse-small's (192 blocks of 128 threads on 132 SMs) then runs its
# decode graph 671.4 -> 659.5 us per replay, while the 816B MoE layer's batch-1 launches (512 blocks, one full wave)
# lost 102.4 -> 105.5 us with it (session 77, runs 152-153, H100: lab NOTES).
EXPERTS_EARLY_BLOCKS_PER_SM = 2


def signals_early(device: torch.device, plan: GemvPlan, grid: tuple[int, int, int], *, experts: bool) -> bool:
    """Whether a launch of ``plan`` on ``grid`` signals ``launch_dependents`` at its top (``pdl.early``; an expert
    launch only on a grid of at most :data:`EXPERTS_EARLY_BLOCKS_PER_SM` blocks per SM)."""
    if not pdl.early(device, f"fp4_gemv_{plan.kind}{'_experts' if experts else ''}"):
        return False
    return not experts or grid[0] * grid[1] * grid[2] <= EXPERTS_EARLY_BLOCKS_PER_SM * hooks.num_sms(device)


def launch(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, out_scale: torch.Tensor, *,
           wfmt: int, fold_log2: int, n: int, k: int, out: torch.Tensor, plan: GemvPlan,
           ids: Optional[torch.Tensor] = None, a_div: int = 1, packed2: Optional[torch.Tensor] = None,
           scales2: Optional[torch.Tensor] = None, out_scale2: Optional[torch.Tensor] = None,
           perm: Optional[torch.Tensor] = None, handoff: Optional[tuple["Handoff", int]] = None) -> torch.Tensor:
    """``out (+)= x @ W^T`` for ``x [M, K]`` (``plan.m == M``), or one row per assignment when ``ids``
    (int64 ``[A]``) is given (expert ``ids[a]``, activation row ``a // a_div``, output row ``a``).

    With ``perm`` (MMA kernel, expert mode): ``ids`` sorted by expert and ``perm[p]`` the assignment at sorted
    position ``p`` (``moe_decode.sort_by_expert``); the assignments of one expert are computed together, up to
    ``plan.m`` per program (:func:`run_plan`), so the expert's weights stream once per run chunk instead of once per
    assignment.
    Each token's sums are the same as without ``perm`` (mma columns are independent): the same bits.

    ``handoff`` (MMA kernel, expert mode): this launch's side of a :class:`Handoff` between two expert GEMVs of the
    same programs (``Handoff.produce`` or ``.consume``; the producer's output is the consumer's ``x``)."""
    m = x.shape[0] if ids is None else (plan.m if perm is not None else 1)
    if m != plan.m:
        raise ValueError(f"plan for M={plan.m} used with M={m}")
    if perm is not None and (ids is None or plan.kind != "mma" or perm.shape != ids.shape
                             or perm.dtype != torch.int64):
        raise ValueError("perm (runs of one expert) needs the MMA kernel, sorted int64 ids and an int64 perm of "
                         "the same shape")
    if kind_for(m, x.dtype) is None or (plan.kind == "mma" and x.dtype != torch.bfloat16) or x.stride(-1) != 1:
        raise ValueError(f"the {plan.kind} decode kernel cannot take M={m} contiguous={x.stride(-1) == 1} {x.dtype}")
    if plan.atomic and (ids is not None or packed2 is not None or out.dtype != torch.float32):
        raise ValueError("FMA split-K accumulates with fp32 atomics: linear only, into a zeroed fp32 output")
    if k % CHUNK_K or (k // CHUNK_K) % (plan.split_k * plan.k_warps):
        raise ValueError(f"the {plan.kind} decode kernel splits K = {k} into {plan.split_k * plan.k_warps} parts of "
                         f"whole {CHUNK_K}-element chunks; {plan} does not divide it")
    if n * (k // 8) >= 1 << 32:  # (the lean kernel's row offsets are 32-bit word counts within one weight)
        raise ValueError(f"the CUDA decode kernel addresses one weight's words with 32 bits; [{n}, {k}] is too large: "
                         "split the layer")
    if ids is not None and ids.dtype != torch.int64:
        ids = ids.to(torch.int64)
    smem = plan.smem(k, swiglu=packed2 is not None)
    if smem >= SMEM_LIMIT:
        raise ValueError(f"{smem} bytes of staged activations exceed {SMEM_LIMIT}; raise split_k")
    words = packed.view(torch.int32)
    w2 = packed2.view(torch.int32) if packed2 is not None else words
    mma = plan.kind == "mma"
    if handoff is not None and (not mma or ids is None or handoff[0].programs != ids.numel()):
        raise ValueError(f"a hand-off joins two MMA expert launches of {handoff[0].programs} programs; got a "
                         f"{plan.kind} launch of {None if ids is None else ids.numel()}")
    producer = handoff is not None and handoff[1] == PRODUCER
    grid = plan.grid(n, 1 if ids is None else ids.numel())
    kern = _kernel(plan_kernel_name(plan, wfmt, ids is not None, packed2 is not None,
                                    producer or signals_early(x.device, plan, grid, experts=ids is not None),
                                    runs=perm is not None))
    head = [x, x.stride(0)] + ([] if plan.kind == "mma" else [_DTYPE_CODE[x.dtype]])
    ids_arg = ids if ids is not None else out_scale  # (a placeholder pointer, never read without EXPERTS)
    ids_args = [ids_arg, ids_arg if perm is None else perm, int(perm is not None)] if mma else [ids_arg]
    tail = ([] if not mma else [None, 0, 0] if handoff is None else
            [handoff[0].counters, handoff[1], handoff[0].need])
    pdl.launch(kern, grid=grid,
               block=((MMA_WARPS if plan.kind == "mma" else FMA_WARPS) * 32, 1, 1), shared_mem=smem, device=x.device,
               name=f"fp4_gemv_{plan.kind}{'_experts' if ids is not None else ''}",
               dependent=handoff is not None and not producer,
               args=[*head, *ids_args, a_div,
                     words, scales, w2, scales2 if scales2 is not None else scales,
                     words.stride(0), words.stride(1), scales.stride(0), scales.stride(1),
                     out_scale, out_scale2 if out_scale2 is not None else out_scale, fold_log2,
                     out, out.stride(0), _DTYPE_CODE[out.dtype], m, n, k, plan.split_k, *tail])
    return out


PRODUCER, CONSUMER = 1, 2
HANDOFF_SLOTS = 1024  # most programs (assignments) a hand-off takes: two int32 counters each in its own 128-byte line
HANDOFF_STRIDE = 32  # int32s from one program's counters to the next (csrc/fp4_gemv.cu)
_COUNTERS: dict[torch.device, torch.Tensor] = {}


class Handoff:
    """The producer/consumer hand-off between two expert GEMV launches of the same ``programs`` (the decode MoE's
    gate/up+SwiGLU, then down, whose input is the first one's output): the consumer is launched with the PDL
    attribute and its blocks may start in the producer's last wave; each waits for the producer's warps of its own
    program (assignment or run chunk) instead of the whole launch (``handoff_wait`` / ``handoff_publish`` in
    ``csrc/fp4_gemv.cu``). The counters (two per program) are one zeroed buffer per device, reset by the consumer:
    the two launches must follow each other on one stream, as in a model's forward.

    Example::

        h = Handoff(up_plan, n=inter, programs=ids.numel(), device=z.device)
        launch(z, gate..., plan=up_plan, ids=ids, handoff=h.produce)
        launch(hidden, down..., plan=down_plan, ids=ids, handoff=h.consume)
    """

    def __init__(self, producer: GemvPlan, n: int, programs: int, device: torch.device) -> None:
        if producer.kind != "mma" or not 0 < programs <= HANDOFF_SLOTS:
            raise ValueError(f"a hand-off takes an MMA producer of 1..{HANDOFF_SLOTS} programs; got {producer.kind} "
                             f"with {programs}")
        self.producer, self.programs = producer, programs
        self.need = self.producer_warps(producer, n)
        if not self.possible(programs, device):
            raise RuntimeError("the hand-off's counters are made on a CUDA device, on an eager call (not in a graph "
                               "capture)")
        counters = _COUNTERS.get(device)
        if counters is None:
            counters = _COUNTERS[device] = torch.zeros(HANDOFF_STRIDE * HANDOFF_SLOTS, dtype=torch.int32,
                                                       device=device)
        self.counters = counters

    @staticmethod
    def producer_warps(plan: GemvPlan, n: int) -> int:
        """The warps of one program (grid z) of an MMA launch of ``n`` output rows: row blocks x the cluster's split
        x 4 warps. Each publishes its end once, so the consumer waits for this many."""
        return math.prod(plan.grid(n)) * MMA_WARPS

    @staticmethod
    def possible(programs: int, device: torch.device) -> bool:
        """Whether a hand-off can join launches of ``programs`` here: few enough programs, and the device's counters
        made already or makeable now (not inside a CUDA graph capture, which would record their zeroing)."""
        return device.type == "cuda" and 0 < programs <= HANDOFF_SLOTS and (
            device in _COUNTERS or not torch.cuda.is_current_stream_capturing())

    @property
    def produce(self) -> tuple["Handoff", int]:
        return self, PRODUCER

    @property
    def consume(self) -> tuple["Handoff", int]:
        return self, CONSUMER


@functools.lru_cache(maxsize=None)
def _dequant_kernel(wfmt: int):
    return torch.cuda._compile_kernel(SOURCE, f"fp4_dequant<{wfmt}>")


def dequantize(packed: torch.Tensor, scales: torch.Tensor, out_scale: torch.Tensor, *, wfmt: int, fold_log2: int,
               n: int, k: int, out: torch.Tensor) -> torch.Tensor:
    """``out [n, k]`` bf16 = the resident FP4 weight (one expert: ``packed [n, k/2]``) times ``out_scale``,
    each element rounded once to bf16 (for large M, where a BF16 GEMM on the result beats W4A16)."""
    if out.dtype != torch.bfloat16 or out.shape != (n, k) or out.stride(-1) != 1 or out.stride(0) % 4:
        raise ValueError(f"dequantize writes a bf16 [{n}, {k}] row-major tensor with 8-byte aligned rows; got "
                         f"{out.dtype} {tuple(out.shape)} strides {out.stride()}")
    if k % CHUNK_K:
        raise ValueError(f"dequantize takes K in whole {CHUNK_K}-element chunks; got K={k}")
    words = packed.view(torch.int32)
    total = n * (k // 8)  # one thread per int32 word (a 16-byte quad per thread measured slower: lab NOTES s41)
    pdl.launch(_dequant_kernel(wfmt), grid=(-(-total // 256), 1, 1), block=(256, 1, 1), device=out.device,
               name="fp4_dequant",
               args=[words, scales, words.stride(0), scales.stride(0), out_scale, fold_log2, out, out.stride(0), n, k])
    return out

