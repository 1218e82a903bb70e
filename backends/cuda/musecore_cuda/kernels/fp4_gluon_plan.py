"""The launch plan of the Gluon W4A16 GEMM (:mod:`musecore_cuda.kernels.fp4_gemm_gluon`) and whether it can run.

Kept apart from the kernel so that the backend imports, and tells the plan what it would run, on a machine whose
Triton has no Gluon Hopper API (CPU CI, ROCm): the kernel module is imported only after :func:`available` said
yes. :func:`pick_config` is pure arithmetic on (M, N, K, SM count): it never compiles or times anything, so it is
safe inside CUDA-graph capture (the decode graphs of batch 17-32 take this path).

Example::

    cfg = pick_config(64, 8192, 8192, sms=132)   # GluonConfig(block_n=64, block_m=64, split_k=1, stages=4, ...)
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math
import sys
import warnings
from dataclasses import dataclass
from typing import Optional

import torch

UPCASTS = {"int16": 0, "asm": 1, "packed": 2}  # GluonConfig.upcast -> the kernel's UPCAST constexpr
CHUNK_K = 128                 # elements of K per ring stage (fp4_gemm_gluon.CHUNK_K)
SMEM_BYTES = 220 * 1024       # the ring's budget: SM90 gives a block 227 KiB; the rest is barriers and Triton's own
BLOCK_MS = (16, 32, 64, 128, 256)  # tokens per program: wgmma's N


@dataclass(frozen=True)
class GluonConfig:
    block_n: int   # weight rows per program: 64 per consumer warpgroup
    block_m: int   # tokens per program (wgmma's N: a multiple of 8, at most 256)
    split_k: int
    stages: int
    group_m: int = 8
    asm_upcast: bool = False  # session 11's inline-PTX upcast: the same as upcast="asm" (kept for the lab's callers)
    upcast: str = "int16"     # "int16" (element-wise), "asm" (session 11) or "packed" (session 12: the routed one)
    ctas_per_sm: int = 1      # 2: launched at 128 registers per thread so that two CTAs share an SM (session 41)
    fixup: bool = False       # split-K through a workspace summed by the last split of a tile (session 41), not atomics;
                              # False at split_k 1, where there is nothing to sum
    persistent: bool = False  # one program per SM looping over the tiles (session 59; unmeasured): packed, no split-K
    finish: bool = False      # split-K through 16-byte fp32 atomics into a zeroed workspace whose last split of a tile
                              # stores the output in its dtype (session 60): ATOMIC's sums without its cast kernel
    pair: bool = False        # two ring stages per ready/empty mbarrier pair: half the consumer's CTA barriers (session
                              # 60): packed, an even number of stages (4+), an even number of chunks per split
    late: bool = False        # a stage released right before a later chunk's wait (one CTA barrier serves both;
                              # session 60): packed, one tile per program, 3+ stages (6+ paired)
    ahead: int = 1            # chunks between a scale word's load and its use (session 60): 1, or 2 (packed, one tile
                              # per program)
    rezero: bool = False      # finish's last split zeroes the tile's sums and count again, so a kept workspace needs
                              # no memset per launch (kernels/finish_workspace.py; session 62); False without finish

    def __post_init__(self):
        if self.upcast not in UPCASTS:
            raise ValueError(f"upcast must be one of {sorted(UPCASTS)}; got {self.upcast!r}")
        if self.asm_upcast and self.upcast != "asm":
            if self.upcast != "int16":
                raise ValueError(f"asm_upcast=True contradicts upcast={self.upcast!r}")
            object.__setattr__(self, "upcast", "asm")
        object.__setattr__(self, "asm_upcast", self.upcast == "asm")
        object.__setattr__(self, "fixup", self.fixup and self.split_k > 1)
        object.__setattr__(self, "finish", self.finish and self.split_k > 1)
        object.__setattr__(self, "rezero", self.rezero and self.finish)
        if self.fixup and self.finish:
            raise ValueError("split-K sums either by fixup or by finish, not both")
        if self.pair and (self.upcast != "packed" or self.stages % 2 or self.stages < 4 or self.persistent):
            # one pair deadlocks: the consumer waits for the next load before it releases the pair (run 89's hang)
            raise ValueError(f"paired ring stages need the packed upcast, an even number of stages, 4 or more (two "
                             f"pairs), and one tile per program; got upcast={self.upcast!r}, stages={self.stages}, "
                             f"persistent={self.persistent}")
        if self.ahead not in (1, 2) or (self.ahead == 2 and (self.upcast != "packed" or self.persistent)):
            raise ValueError(f"scale words load 1 chunk ahead, or 2 with the packed upcast and one tile per program; "
                             f"got ahead={self.ahead}, upcast={self.upcast!r}, persistent={self.persistent}")
        if self.late and (self.upcast != "packed" or self.persistent or self.stages < (6 if self.pair else 3)):
            raise ValueError(f"late release needs the packed upcast, one tile per program and 3 stages (6 paired) to "
                             f"keep loads ahead; got upcast={self.upcast!r}, persistent={self.persistent}, "
                             f"stages={self.stages}, pair={self.pair}")
        if self.persistent and (self.split_k != 1 or self.upcast != "packed" or self.ctas_per_sm != 1):
            raise ValueError(f"a persistent launch runs the packed upcast without split-K, one CTA per SM; got "
                             f"split_k={self.split_k}, upcast={self.upcast!r}, ctas_per_sm={self.ctas_per_sm}")
        if self.block_n not in (64, 128):
            raise ValueError(f"block_n is one or two consumer warpgroups: 64 or 128; got {self.block_n}")
        if self.block_m % 8 or not 8 <= self.block_m <= 256:
            raise ValueError(f"block_m is wgmma's N: a multiple of 8 in 8-256; got {self.block_m}")
        if self.split_k < 1 or self.stages < 2:
            raise ValueError(f"split_k >= 1 and stages >= 2 expected; got {self.split_k}, {self.stages}")
        if self.ctas_per_sm not in (1, 2) or (self.ctas_per_sm == 2 and (
                self.block_n != 64 or 2 * self.smem_bytes() > SMEM_BYTES)):
            raise ValueError(f"ctas_per_sm is 1, or 2 for block_n 64 with a ring of at most {SMEM_BYTES // 2} bytes; "
                             f"got {self.ctas_per_sm} at block_n {self.block_n}, {self.smem_bytes()} bytes")

    @property
    def num_warps(self) -> int:
        return self.block_n // 16

    def tiles(self, m: int, n: int) -> int:
        """Output tiles of ``m`` tokens x ``n`` weight rows: the launch's programs per split."""
        return math.ceil(m / self.block_m) * math.ceil(n / self.block_n)

    def finish_numel(self, m: int, n: int) -> int:
        """fp32 words of split-K finish's workspace: the ``[m, n]`` sums, then one counter per tile."""
        return m * n + self.tiles(m, n)

    def smem_bytes(self) -> int:
        """Shared memory of the ring: per stage the packed weight bytes and two bf16 activation halves."""
        return self.stages * (self.block_n * 64 + 2 * self.block_m * 64 * 2)

    @property
    def atomic(self) -> bool:
        """Split-K through fp32 atomics into a zeroed fp32 output (the launch's caller allocates it so)."""
        return self.split_k > 1 and not (self.fixup or self.finish)

    @property
    def maxnreg(self) -> Optional[int]:
        """Triton's ``maxnreg`` launch option: None (Triton's 255 per thread: one CTA of 8 warps fills the register
        file) or, for two CTAs per SM, 128 (Triton's warp specialization then gives the consumer warpgroup 232
        and the loader's warpgroup 24-40 through ``setmaxnreg``, within the CTA's 128 x 256)."""
        return None if self.ctas_per_sm == 1 else 65536 // (2 * (self.num_warps + 4) * 32)

    @property
    def launch_options(self) -> dict:
        """Triton's launch / compile options for this config: ``num_warps``, and ``maxnreg`` where it has one."""
        return {"num_warps": self.num_warps, **({"maxnreg": self.maxnreg} if self.maxnreg else {})}

    def label(self) -> str:
        """``block_n,block_m,split_k,stages,upcast[,ctas[,fixup|finish|persistent][,pair][,late][,ahead2]
        [,rezero]]``: the cut syntax of the lab scripts (gluon_ir.py --cuts); ``ctas`` (CTAs per SM) only when it is 2
        or a flag follows."""
        flags = "".join(f",{name}" for name in ("fixup", "finish", "persistent", "pair", "late")
                        if getattr(self, name))
        flags += (",ahead2" if self.ahead == 2 else "") + (",rezero" if self.rezero else "")
        tail = f",{self.ctas_per_sm}" if self.ctas_per_sm != 1 or flags else ""
        return f"{self.block_n},{self.block_m},{self.split_k},{self.stages},{self.upcast}{tail}{flags}"

    @classmethod
    def parse(cls, cut: str) -> "GluonConfig":
        """The inverse of :meth:`label` (an upcast of "0" / "1" means int16 / asm, as session 11's cuts wrote it)."""
        bn, bm, split, stages, *rest = cut.split(",")
        upcast = {"0": "int16", "1": "asm"}.get(rest[0], rest[0]) if rest else "int16"
        return cls(int(bn), int(bm), int(split), int(stages), upcast=upcast,
                   ctas_per_sm=int(rest[1]) if len(rest) > 1 else 1, fixup="fixup" in rest[2:],
                   finish="finish" in rest[2:], persistent="persistent" in rest[2:], pair="pair" in rest[2:],
                   late="late" in rest[2:], ahead=2 if "ahead2" in rest[2:] else 1, rezero="rezero" in rest[2:])


# The cost model behind pick_config, fitted to the H200 sweep of session 40 (backends/cuda/lab/results/
# cuda_gluon_sweep_s40_packed.json, packed upcast, block_n 64, M 16-256; predicted / measured 0.88-1.44 over every
# such cut): one CTA per SM (the consumer holds 255 registers), so a launch takes waves x chunks per CTA x the time of
# one 128-element chunk, which grows with the token tile (0.40 us at 16 tokens, 0.49 at 64, 0.77 at 256: the upcast
# is issue-bound, the wgmmas grow with block_m), plus ~2 us of launch; split-K adds a zeroed fp32 output, relaxed
# atomics and the cast back (1.5 us + 2 us per doubling, + 2.5 us per million atomics).
CHUNK_US, CHUNK_US_PER_TOKEN, LAUNCH_US = 0.38, 0.0015, 2.0
# A one-warpgroup split must win by 10% (at the three points where the fit and the sweep disagreed, split 1 won); a
# split that wide_variant() runs on two warpgroups needs no margin: those launches beat their one-warpgroup split
# wherever routed (runs 89-90), and with the margin the model kept expert_down M = 57-64 on split 1 over two 32-token
# tiles, which the two-warpgroup 64-token tile at split 4 beat 12.24 vs 13.96 us (H100, session 63, run 96). Session
# 63 refit the split penalty to run 95's finish + rezero cuts (H100, block_n 64, M 32-256): chunk time x 0.88, and in
# the model's units 3.3 us + 1.1 per doubling + 3.4 per million atomics against the 1.5 + 2 + 2.5 kept here: no
# smaller for a finish split than for the atomics it was fitted to, so the constants stand (lab NOTES, session 63).
SPLIT_MARGIN = 1.1


def predicted_us(m: int, n: int, k: int, block_m: int, split_k: int, sms: int) -> float:
    """The model's microseconds for a block_n 64 launch (see above); the split penalty included."""
    ctas = math.ceil(n / 64) * math.ceil(m / block_m) * split_k
    t = math.ceil(ctas / sms) * (k // CHUNK_K // split_k) * (CHUNK_US + CHUNK_US_PER_TOKEN * block_m) + LAUNCH_US
    if split_k > 1:
        t += 1.5 + 2.0 * math.log2(split_k) + 2.5e-6 * m * n * split_k
    return t


# Past 256 rows: two consumer warpgroups over 256 tokens, one tile per program (H200, session 59, run 80: the fastest
# cut swept at M = 1024 and 4096 on q_proj, expert_up, expert_down and k_proj at 4096; the persistent grid within
# +-5% of it either way, so not taken; block_n 64 at 256 tokens was 0.65-0.77x BF16 at M = 4096, this one
# 0.82-0.92x). ``musecore_cuda.choices.gluon_large`` decides where it runs (up to M = 2048).
LARGE_M_CONFIG = GluonConfig(128, 256, 1, 3, upcast="packed")
# A 128-row tile's chunk costs this many times a 64-row one's (two consumer warpgroups on one SM): session 40's
# q_proj M = 4096 sweep (0.96 vs 0.57 us at 128 tokens); it makes pick_moe_config pick the measured best tile of
# run 80's MoE probe at 1024 and 8192 tokens.
BN128_CHUNK_FACTOR = 1.69


@functools.lru_cache(maxsize=4096)  # ~35 model evaluations: cached, fp4_linear asks per call
def pick_config(m: int, n: int, k: int, sms: int) -> GluonConfig:
    """The packed-upcast launch for ``m`` tokens against an ``[n, k]`` NVFP4 weight on ``sms`` SMs.

    The model ranks block_n 64 (one consumer warpgroup; a second costs 1.66-1.85x per chunk, run 89); block_m from the
    token tile covering M down to 16, and split-K over the powers of two that divide K's chunks leaving >= 2 per
    split, whichever the model above predicts fastest (a one-warpgroup split only when it wins by
    :data:`SPLIT_MARGIN`); as many ring stages as fit :data:`SMEM_BYTES`, at most 4 (4 and 8 measured alike; 3 at
    block_m 256).
    At the measured points this picks the sweep's best 64-row cut (q_proj, expert_up M=64/256: one token tile;
    expert_down: 32 / 128 tokens for 128 CTAs) and split-K on k_proj, whose 16 weight tiles leave 116 SMs idle.
    Split-K launches sum by ``finish`` (the tile's last split stores the output: no cast kernel): on an H100
    (session 60, run 86) it ran each routed split cut 3-6% faster than the zeroed-fp32-and-cast atomics (k_proj
    M = 16 / 64 / 256: 8.86 -> 8.39, 10.29 -> 9.67, 15.87 -> 14.98 us) and was the fastest cut swept at every
    point where a split won; the model's split penalty, fitted to the atomics, is kept (it only has to rank).
    The tile then takes the consumer-loop variant measured fastest at its token count (:func:`consumer_variant`), or,
    where two consumer warpgroups at twice the split measured faster (:func:`wide_variant`), two 64-row CTAs per SM
    at that split, which measured faster still (:func:`two_cta_variant`); elsewhere up to 32 tokens on large
    weights, two 64-row CTAs per SM at twice the one-warpgroup split (:func:`doubled_two_cta`).
    """
    if m < 1 or n < 1 or k % CHUNK_K:
        raise ValueError(f"pick_config needs M, N >= 1 and K divisible by {CHUNK_K}; got M={m}, N={n}, K={k}")
    if m > BLOCK_MS[-1]:
        return LARGE_M_CONFIG
    chunks = k // CHUNK_K
    cover = next((b for b in BLOCK_MS if b >= m), BLOCK_MS[-1])
    best: Optional[tuple[float, int, int]] = None
    for block_m in (b for b in BLOCK_MS if b <= cover):
        split = 1
        while split == 1 or (chunks % split == 0 and chunks // split >= 2):
            margin = SPLIT_MARGIN if split > 1 and wide_variant(block_m, split, chunks) is None else 1.0
            t = predicted_us(m, n, k, block_m, split, sms) * margin
            if best is None or t < best[0]:
                best = (t, block_m, split)
            split *= 2
    _, block_m, split = best
    wide = wide_variant(block_m, split, chunks)
    if wide:
        return two_cta_variant(wide)
    return doubled_two_cta(m, n, k, block_m, split, sms) or one_warpgroup(block_m, split, chunks)


def one_warpgroup(block_m: int, split_k: int, chunks: int) -> GluonConfig:
    """The block_n 64 launch of ``block_m`` tokens at ``split_k`` over ``chunks`` chunks of K: as many ring stages
    as :func:`ring_stages` fits, split-K summed by ``finish`` into a kept workspace (``rezero``: no memset per
    launch where :mod:`musecore_cuda.kernels.finish_workspace` has one), and its :func:`consumer_variant`."""
    cfg = GluonConfig(64, block_m, split_k, ring_stages(block_m), upcast="packed", finish=True, rezero=True)
    return consumer_variant(cfg, chunks // split_k)


# The consumer-loop variants of session 60 as the H200 sweep of session 61 (run 87, benchmarks/results/h200_issue26/
# NOTES.md) ranked them against the routed cuts: up to 64 tokens, 8 stages paired with late release and the scale
# words two chunks ahead ran 0.7-5.8% faster at all ten points swept (q_proj M = 64 28.55 -> 26.99 us, expert_up
# 15.95 -> 15.23, pooler 18.91 -> 18.35); at 128 tokens late release alone 2.6-6.6% (pooler M = 256 33.94 -> 31.84);
# at 256 tokens (3 stages) late release lost (q_proj 0.89x) and nothing is changed.
PAIRED_STAGES = 8


# Two consumer warpgroups (block_n 128) at twice the split, the same number of CTAs: a 128-row chunk costs 1.66x a
# 64-row one at 16 tokens and 1.85x at 64 (the H200 sweep of run 89, both with the paired variant), so the CTAs finish
# sooner wherever the split's finish is paid already (pooler M = 16 / 64 16.43 -> 14.47, 18.77 -> 17.67 us; expert_down
# M = 16 10.91 -> 10.35) or 64 chunks at 16 tokens outweigh it (q_proj, o_proj M = 16 24.32 -> 22.99, 24.63 -> 23.10),
# and lost everywhere else swept: split 1 over 32 chunks (expert_up, unpooler M = 16: 0.94x), 4 chunks per split
# (k_proj: 0.93-1.00x), split 1 at 64 tokens (q_proj 0.98x) or at 32 (expert_down M = 64 0.92x). Session 63 (an H100,
# run 99; run 100 at the routed code) swept split 1 over 64 chunks at 32 and 64 tokens: on q_proj and o_proj at M 20-56
# two warpgroups at split 2 won 1.03-1.16x (q_proj M = 20 26.55 -> 23.71 us, M = 40 31.07 -> 26.97; o_proj M = 48
# 29.42 -> 27.24) and tied at M = 64 (1.000x both; run 89's H200 0.98x there), so split 1 over 64+ chunks takes them
# at every token tile up to 64; over 32 chunks (unpooler, expert_up) 128 x 32 at split 2 won 1.00-1.07x at M 20-24
# and lost at 32 (0.99x): not taken.
WIDE_MIN_CHUNKS = 8


def wide_variant(block_m: int, split_k: int, chunks: int) -> Optional[GluonConfig]:
    """The two-warpgroup launch that replaces :func:`one_warpgroup`'s (``block_m`` tokens at ``split_k`` over
    ``chunks`` chunks of K) where runs 89 and 99 measured it faster (see :data:`WIDE_MIN_CHUNKS`), else None: up to 64
    tokens, 8+ chunks per split, even (paired stages), and either a split of 2 already or 64+ chunks (the wins
    measured doubled splits of 1 and 2; k_proj's 8 lost)."""
    split = 2 * split_k
    if block_m > 64 or split_k > 2 or chunks % split or chunks // split < WIDE_MIN_CHUNKS or (chunks // split) % 2:
        return None
    if split_k == 1 and chunks < 64:
        return None
    wide = _paired(GluonConfig(128, block_m, split, 2, upcast="packed", finish=True, rezero=True))
    return wide if wide.smem_bytes() <= SMEM_BYTES else None


# Two 64-row CTAs per SM (128 registers, 4 plain stages) in place of the two-warpgroup launch, at its split: twice its
# CTAs, the same warps per SM, each CTA with its own ring and barriers (as the grouped kernel's MOE_TWO_CTA). Measured
# on H100s with `cuda_gluon_sweep.py --cuts`, every cut checked against the fp32 product (NMSE <= 2.8e-6), at every
# token tile where the wide launch routes: session 68 (runs 131, 133) at 64 tokens expert_down 11.23 / 11.26 against
# 12.17 / 12.13 us (1.08x), pooler 16.29 against 17.21 (1.06x), q_proj 26.39 against 28.01 (1.06x); at 48 tokens
# 1.03-1.05x on those three; at 32 tokens (split 4) expert_down 9.65 against 10.18 and pooler 13.71 against 14.45
# (1.05x). Session 69 (run 135) at 16 tokens expert_down 9.00 against 9.51 (1.06x), pooler 13.02 against 13.85 (1.06x),
# q_proj (split 2) 21.85 against 23.13 (1.06x); q_proj at 20 / 32 tokens (block_m 32, split 2) 23.16 / 23.47 against
# 24.14 / 24.80 (1.04 / 1.06x); at 2 and 8 tokens (run 136) the wide launch ran 0.94-0.95x on all three. Other
# splits lost (64 x 64 at twice or half the wide split, 64 x 32 at 48-64 tokens, 64 x 16 at half the wide split on
# expert_down / pooler: 0.3-0.93x), and k_proj / expert_up never take the wide launch (see doubled_two_cta). So the
# wide launch is no longer routed anywhere; wide_variant() still says where two CTAs per SM run.


def two_cta_variant(wide: GluonConfig) -> GluonConfig:
    """Two 64-row CTAs per SM at ``wide``'s token tile and split: measured faster than the two-warpgroup launch
    ``wide`` at every tile where that routes (see above)."""
    return _two_ctas(wide.block_m, wide.split_k)


def _two_ctas(block_m: int, split_k: int) -> GluonConfig:
    """The 64-row launch of ``block_m`` tokens at ``split_k`` at 128 registers, two CTAs per SM: 4 plain stages,
    split-K summed by ``finish`` into the kept workspace (``rezero``)."""
    return GluonConfig(64, block_m, split_k, ring_stages(block_m), upcast="packed", finish=True, rezero=True,
                       ctas_per_sm=2)


# Where the wide launch does not route (k_proj: 4 chunks per doubled split; expert_up / unpooler: split 1 over 32
# chunks), two 64-row CTAs per SM at twice the one-warpgroup split, up to 32 tokens. Session 69 (one H100, run 136,
# `cuda_gluon_sweep.py --cuts`, NMSE checked): k_proj 64 x 16 at split 16 6.87 / 7.00 us against the paired 64 x 16 at
# split 8, 7.26 / 7.19 (M = 2 / 16: 1.06 / 1.03x), 64 x 32 at 32 tokens 7.48 against 7.53 (a tie); expert_up 64 x 16
# at split 2 13.38 / 12.89 against split 1 paired 14.42 / 14.04 (M = 2 / 16: 1.08 / 1.09x), 64 x 32 13.86 against
# 14.65 (M = 32, 1.06x); unpooler 1.07 / 1.09 / 1.06x at the same points. At 64 tokens both lost (0.94-0.96x), as did
# 64 x 16 at 32 tokens and 64 x 64 at 16 (0.57-0.98x). Unmeasured, so left on one warpgroup: weights under k_proj's
# 1024 x 8192 (muse-small's), fewer than 4 chunks per doubled split, and grids of more than two CTAs per SM.
DOUBLED_TWO_CTA_MAX_BLOCK_M = 32
DOUBLED_TWO_CTA_MIN_WEIGHTS = 1024 * 8192
DOUBLED_TWO_CTA_MIN_CHUNKS = 4


def doubled_two_cta(m: int, n: int, k: int, block_m: int, split_k: int, sms: int) -> Optional[GluonConfig]:
    """Two 64-row CTAs per SM at twice the one-warpgroup split ``split_k`` for ``m`` tokens in ``block_m`` tiles
    against an ``[n, k]`` weight, where :data:`DOUBLED_TWO_CTA_MAX_BLOCK_M` and its neighbours say that measured
    faster, else None."""
    split, chunks = 2 * split_k, k // CHUNK_K
    ctas = math.ceil(n / 64) * math.ceil(m / block_m) * split
    if (block_m > DOUBLED_TWO_CTA_MAX_BLOCK_M or n * k < DOUBLED_TWO_CTA_MIN_WEIGHTS or chunks % split
            or chunks // split < DOUBLED_TWO_CTA_MIN_CHUNKS or ctas > 2 * sms):
        return None
    return _two_ctas(block_m, split)


def _paired(cfg: GluonConfig) -> GluonConfig:
    """``cfg`` on :data:`PAIRED_STAGES` stages, paired, released late, the scale words two chunks ahead."""
    return dataclasses.replace(cfg, stages=PAIRED_STAGES, pair=True, late=True, ahead=2)


def consumer_variant(cfg: GluonConfig, chunks_per_split: int) -> GluonConfig:
    """``cfg`` with the consumer-loop variant measured fastest at its token tile (see :data:`PAIRED_STAGES`): paired
    stages need an even number of chunks per split and the 8-stage ring within :data:`SMEM_BYTES`; otherwise, and
    at block_m 128, late release alone when the ring has 3+ stages."""
    paired = _paired(cfg)
    if cfg.block_m <= 64 and chunks_per_split % 2 == 0 and paired.smem_bytes() <= SMEM_BYTES:
        return paired
    if cfg.block_m <= 128 and cfg.stages >= 3:
        return dataclasses.replace(cfg, late=True)
    return cfg


def ring_stages(block_m: int, block_n: int = 64, most: int = 4) -> int:
    """As many ring stages as fit :data:`SMEM_BYTES` at ``block_n`` weight rows and ``block_m`` tokens, at most
    ``most`` (4 by default: 4 and 8 measured alike without pairs; 3 at block_m 256)."""
    return min(most, SMEM_BYTES // (GluonConfig(block_n, block_m, 1, 2, upcast="packed").smem_bytes() // 2))


def expected_tiles(n_assign: int, experts: int, block_m: int) -> float:
    """Token tiles that ``n_assign`` assignments spread evenly over ``experts`` experts fill once each expert's segment
    is padded to a multiple of ``block_m`` (``musecore_triton.kernels.moe.align_assignments``): about half a tile of
    padding per expert, and at least one tile each."""
    active = max(1, min(experts, n_assign))
    return active * max(1.0, n_assign / active / block_m + 0.5)


# Grouped tiles the model ranks first somewhere but measurement does not back, and the assignments from which they are
# left out. 128 x 16 led the model at 129-289 tokens of the 816B layer; on an H100 (session 63, run 96; its row-by-row
# GPU test passed first) it ran 1.04x 128 x 32 at 160 tokens (3451 vs 3594 us) and 0.97x at 256 (3677 vs 3552): a
# wash, so 128 x 32, measured best there against five other tiles in run 91, keeps that range. Up to 128 tokens (1024
# assignments) it is ahead: 1.025-1.058x 128 x 32 at 1-128 tokens in all 13 rows of session 65's runs 110-112 (H100).
MOE_LEFT_OUT_TILES = {(128, 16): 1025}


@functools.lru_cache(maxsize=4096)
def pick_moe_config(n_assign: int, experts: int, rows_out: int, k: int, sms: int) -> GluonConfig:
    """The grouped (MoE) Gluon GEMM's launch for ``n_assign`` token-expert assignments over ``experts`` experts
    against ``[rows_out, k]`` weight rows per expert (gate and up together: ``2 I``): :func:`predicted_us`'s model
    with the token tiles of :func:`expected_tiles` (padding included) instead of ``cdiv(M, block_m)``, over block_n
    64 and 128 (:data:`BN128_CHUNK_FACTOR`), no split-K (a prefill has tiles enough), as many ring stages as fit, at
    most 4. One tile serves both of a layer's GEMMs (they share the alignment), so callers pick it for gate/up. On
    the H200 (run 80, the 816B layer) it picks the measured best of six tiles at 1024 and 8192 tokens: 128 x 64 and
    128 x 256; its times run 0.9-1.4x under the measured ones. From 129 tokens to ~630 it picks 128 x 32: on an H100
    (run 91) the fastest of six tiles swept at 160, 256 and 512 tokens (1.7-2.4x the grouped Triton GEMM, 2.3-2.8x the
    BF16 experts); up to 128 tokens 128 x 16 (session 65). On experts of the 816B layer's size and up to
    :data:`MOE_TWO_CTA_MAX_ASSIGNMENTS` assignments it takes :data:`MOE_TWO_CTA` instead: 64 x 16 at two CTAs per SM
    (session 68). The tiles of :data:`MOE_LEFT_OUT_TILES` are left out from their number of assignments."""
    if n_assign < 1 or experts < 1 or rows_out % 128 or k % CHUNK_K:
        raise ValueError(f"pick_moe_config needs assignments, experts >= 1, rows a multiple of 128 and K of "
                         f"{CHUNK_K}; got {n_assign}, {experts}, {rows_out}, {k}")
    if n_assign <= MOE_TWO_CTA_MAX_ASSIGNMENTS and k * (rows_out // 2) >= MOE_TWO_CTA_MIN_WEIGHTS:
        return MOE_TWO_CTA
    tiles = [(bn, bm) for bn in (64, 128) for bm in BLOCK_MS
             if n_assign < MOE_LEFT_OUT_TILES.get((bn, bm), n_assign + 1)]
    block_n, block_m = min(tiles, key=lambda t: predicted_moe_us(n_assign, experts, rows_out, k, t[1], sms, t[0]))
    return GluonConfig(block_n, block_m, 1, ring_stages(block_m, block_n), upcast="packed")


# The grouped launch at two CTAs per SM (64 weight rows and 16 tokens each, 128 registers, a 4-stage ring of 33 KB per
# CTA: the same warps per SM as one 128-row CTA, each warpgroup with its own ring and barriers), and where it runs. The
# 816B layer (E 256, top-8, h = I = 4096), same process, CUDA graphs (session 68, runs 128-130, one H100), us against
# the launch picked before it (128 x 16 on 8 paired stages up to 16 tokens, 4 plain stages to 128, 128 x 32 beyond):
# 4 / 6 / 7 / 8 / 16 tokens 422.5 / 572.2 / 669.2 / 728.4 / 1277.7 against 448.9 / 601.7 / 705.8 / 765.9 / 1328.4
# (1.04-1.06x); 32 / 64 / 128 2036 / 2693 / 2980 against 2166 / 2831 / 3209 (1.05-1.08x); 256 3411 against 3525 (128 x
# 32, 1.03x); at 512 tokens 4759 against 3830 (0.80x: larger tiles win from there). The consumer variants on top
# (8 paired stages, late release, scales two ahead) moved it -1..+1.5%: not taken. The issue-bound consumer (one
# 168-register CTA per SM, 50% of issue slots busy, run 125) is what a second CTA per SM feeds. Smaller experts
# (muse-small's 768 x 768) are unmeasured with it and keep the model's pick.
MOE_TWO_CTA = GluonConfig(64, 16, 1, 4, upcast="packed", ctas_per_sm=2)
MOE_TWO_CTA_MIN_WEIGHTS = 4096 * 4096
MOE_TWO_CTA_MAX_ASSIGNMENTS = 2048


def predicted_moe_us(n_assign: int, experts: int, rows_out: int, k: int, block_m: int, sms: int,
                     block_n: int = 64) -> float:
    """The model's microseconds for one grouped launch (see :func:`pick_moe_config`)."""
    ctas = math.ceil(expected_tiles(n_assign, experts, block_m)) * (rows_out // block_n)
    chunk = (CHUNK_US + CHUNK_US_PER_TOKEN * block_m) * (BN128_CHUNK_FACTOR if block_n == 128 else 1.0)
    return math.ceil(ctas / sms) * (k // CHUNK_K) * chunk + LAUNCH_US


def unavailable_reason(device: torch.device) -> Optional[str]:
    """Why the Gluon GEMM cannot run on ``device``, or None when it can: SM 9.x (wgmma, TMA; not SM100, whose
    tensor cores the kernel was not written for), a CUDA torch and a Triton with ``triton.experimental.gluon``'s
    Hopper API (Triton 3.6 was used)."""
    if device.type != "cuda" or torch.version.hip is not None:
        return f"the Gluon GEMM runs on NVIDIA GPUs; this is {device.type}" + (" (ROCm torch)" if torch.version.hip
                                                                                else "")
    return _device_reason(device_index(device))


@functools.lru_cache(maxsize=None)
def _device_reason(index: int) -> Optional[str]:
    major, minor = torch.cuda.get_device_capability(index)
    if major != 9:
        return f"the Gluon GEMM is written for SM90 (wgmma, TMA); this GPU is SM{major}{minor}"
    problem = import_problem()
    if problem:  # an SM90 GPU on the slower path: said once, as fp4_gemv_cuda says a failed NVRTC compile
        warnings.warn(f"musecore-cuda: {problem}; NVFP4 linears at M 9-256 take the CUDA C++ GEMM or dequantize + "
                      "cuBLAS instead of the Gluon GEMM", RuntimeWarning, stacklevel=4)
    return problem


# The Triton minor version the Gluon kernels were written, compiled and run with (the GPU machine's). Gluon is
# experimental and its API moves between minors: on Triton 3.9 the module imports but the kernels do not compile
# (``shared_memory_descriptor`` has no ``_reinterpret`` there), so any other version keeps the other paths.
GLUON_TRITON = "3.6"


@functools.lru_cache(maxsize=1)
def import_problem() -> Optional[str]:
    try:
        importlib.import_module("musecore_cuda.kernels.fp4_gemm_gluon")
    except ImportError as exc:  # no Triton, or one without Gluon's Hopper API: the reason goes to the plan
        version = getattr(sys.modules.get("triton"), "__version__", "(not importable)")
        return f"triton {version} has no usable triton.experimental.gluon Hopper API ({exc})"
    version = sys.modules["triton"].__version__
    if not version.startswith(GLUON_TRITON + "."):
        return (f"the Gluon kernels are written for Triton {GLUON_TRITON}'s Gluon API and not tested with triton "
                f"{version} (3.9 does not compile them); install triton=={GLUON_TRITON}.* to use them")
    return None


def available(device: torch.device) -> bool:
    """True when the Gluon GEMM can run on ``device`` (see :func:`unavailable_reason`)."""
    return unavailable_reason(device) is None


@functools.lru_cache(maxsize=None)
def sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def device_index(device: torch.device) -> int:
    """``device``'s CUDA index (the current device for a bare ``cuda``)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def device_sms(device: torch.device) -> int:
    """The SM count of ``device``: what the launches' grids and the cost models size against."""
    return sm_count(device_index(device))
