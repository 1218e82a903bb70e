"""A Hopper W4A16 GEMM for NVFP4 resident weights in Gluon (swap-AB, register-A ``wgmma``, TMA ring, warp
specialization): ``fp4_linear``'s path "gluon" for bf16 activations at M 9-256 and past 256 rows where its 128 x 256
tiles fill the GPU (:mod:`musecore_cuda.choices`), launched with
:func:`musecore_cuda.kernels.fp4_gluon_plan.pick_config`'s packed-upcast config; and its grouped (MoE) variant on the
same mainloop, :func:`fp4_gluon_moe_kernel` (:mod:`musecore_cuda.kernels.moe_prefill`). This module needs Triton
3.6's Gluon Hopper API and is imported only when ``fp4_gluon_plan.available`` says so. The linear kernel is
launched with programmatic dependent launch where :func:`musecore_cuda.kernels.pdl.enabled` says so (name
``fp4_gluon``; it waits before it loads anything), otherwise it is ordered like any PyTorch kernel; the grouped and
persistent kernels never take PDL.

Sessions 6 and 10 ended on the same advice: Triton's ``tl.dot`` cannot express the Machete-class design
(a producer warp streaming packed weights and activations through a ring of stages with mbarriers,
consumer warpgroups that upcast the weight straight into ``wgmma``'s register operand A). Gluon
(``triton.experimental.gluon``, Triton 3.6) exposes each of those pieces, so this kernel is that design:

``C^T[N, M] = W[N, K] @ X[M, K]^T``, one output tile ``[BLOCK_N weight rows, BLOCK_M tokens]`` per program:

* a 1-warp loader partition issues, per 128-element chunk of K, one TMA copy of the packed weight
  bytes ``[BLOCK_N, 64]`` (byte ``j`` holds elements ``j`` and ``j + 64``: the resident chunk-halves
  order of ``musecore_triton.layouts``) and two of the activations ``[BLOCK_M, 64]`` (elements
  0-63 and 64-127 of the chunk) into stage ``i % STAGES`` of a shared ring, completing on the
  stage's ``ready`` mbarrier;
* the default partition (one warpgroup per 64 weight rows) waits on ``ready``, and per k16 step
  loads ``[BLOCK_N, 16]`` bytes from shared memory directly into ``wgmma``'s A-fragment layout,
  upcasts both nibbles (E2M1 bits moved into bf16, times the e4m3 group scale: exact), and issues
  two asynchronous ``wgmma`` with the activations' shared tile as operand B; it releases a stage
  (``empty`` mbarrier) once the wgmmas that read it have retired.

NVFP4's group of 16 is ``wgmma``'s K, so each A-fragment row needs one scale per step. The resident
scales ``[N, K/16]`` are read as one 8-byte word per row and chunk (``int64`` view: group ``g``
is byte ``g``), loaded by the consumer four chunks ahead; no second scale layout is needed.
The per-tensor ``out_scale`` multiplies the fp32 accumulator. Split-K adds fp32 partial sums
into a zeroed fp32 output with atomics.

``GluonConfig.upcast`` picks the upcast: ``"packed"`` (the routed one: inline PTX on whole 16-bit byte-pair words,
the scale pairs converted once per 4 lanes and shuffled, a consumer loop pipelined per half chunk; about 242 SASS
instructions per warp per chunk), ``"int16"`` (element-wise) or ``"asm"`` (inline PTX per byte); the last two are
lab baselines (backends/cuda/lab/NOTES.md sessions 11, 12 and 40).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.runtime.jit import constexpr_function
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.language.extra.cuda import gdc_wait  # griddepcontrol.wait: a no-op in a launch without PDL

from musecore_cuda.kernels import finish_workspace, pdl
from musecore_cuda.kernels.fp4_gluon_plan import UPCASTS, GluonConfig, device_sms

CHUNK_K = gl.constexpr(128)   # elements of K per resident chunk and per ring stage
EB = gl.constexpr(126)        # the upcast's bf16 bits give code * 2**-126 (musecore_triton.kernels.fp4_gemm.EXP_OFFSET)
WFMT_NVFP4 = 1
PDL_NAME = "fp4_gluon"  # the linear kernel's name for musecore_cuda.kernels.pdl (MUSECORE_CUDA_PDL=fp4_gluon, ...)


@gluon.jit
def _loader(w_desc, w2_desc, x_desc, w_smem, x_smem, ready, empty, off_n, off_m, first, n_chunks,
            STAGES: gl.constexpr, HALF: gl.constexpr, PAIR: gl.constexpr = 1, PDL: gl.constexpr = False):
    """The loader partition of one output tile: :func:`_load_chunks` from the ring's first stage."""
    _load_chunks(w_desc, w2_desc, x_desc, w_smem, x_smem, ready, empty, off_n, off_m, first, n_chunks, 0, STAGES, HALF,
                 PAIR, PDL)


@gluon.jit
def _load_chunks(w_desc, w2_desc, x_desc, w_smem, x_smem, ready, empty, off_n, off_m, first, n_chunks, base,
                 STAGES: gl.constexpr, HALF: gl.constexpr, PAIR: gl.constexpr = 1, PDL: gl.constexpr = False):
    """Per chunk: the packed weight bytes, then the activations' two 64-element halves, into stage
    ``(base + i) % STAGES`` (``base``: chunks this partition loaded before, for a persistent program's later tiles).
    With ``HALF`` > 0 the weight tile is two boxes of ``HALF`` rows, ``w_desc``'s then ``w2_desc``'s, both from row
    ``off_n`` (a gate/up pair of the grouped kernel); otherwise one box of ``w_desc``. With ``PAIR`` = 2 two
    consecutive stages share one ``ready`` and one ``empty`` mbarrier (:func:`_ring`): their chunks are loaded
    together once the consumer has released both (``n_chunks`` even, ``base`` 0). With ``PDL`` (a launch with
    programmatic dependent launch) nothing is loaded before ``griddepcontrol.wait``: requesting the first ring lap's
    weights ahead of it (they are no kernel's output) measured 0.88-0.98x of no PDL, waiting first 1.02-1.07x
    (session 64, run 107 in benchmarks/results/h200_issue26/NOTES.md)."""
    nbytes: gl.constexpr = (2 if HALF > 0 else 1) * w_desc.block_type.nbytes + 2 * x_desc.block_type.nbytes
    if PDL:
        gdc_wait()
    for i in range(0, n_chunks, PAIR):
        s = (base + i) % STAGES
        bar = s // PAIR
        mbarrier.wait(empty.index(bar), ((base + i) // STAGES) & 1)
        mbarrier.expect(ready.index(bar), PAIR * nbytes)
        for j in gl.static_range(PAIR):
            _load_weight(w_desc, w2_desc, w_smem, ready.index(bar), s + j, off_n, first + i + j, HALF)
            _load_x(x_desc, x_smem, ready.index(bar), s + j, off_m, first + i + j)


@gluon.jit
def _load_weight(w_desc, w2_desc, w_smem, bar, s, off_n, kc, HALF: gl.constexpr):
    """Chunk ``kc``'s packed weight bytes into stage ``s`` (two ``HALF``-row boxes of a gate/up pair when > 0)."""
    if HALF > 0:
        tma.async_copy_global_to_shared(w_desc, [off_n, kc * 64], bar, w_smem.index(s).slice(0, HALF, dim=0))
        tma.async_copy_global_to_shared(w2_desc, [off_n, kc * 64], bar, w_smem.index(s).slice(HALF, HALF, dim=0))
    else:
        tma.async_copy_global_to_shared(w_desc, [off_n, kc * 64], bar, w_smem.index(s))


@gluon.jit
def _load_x(x_desc, x_smem, bar, s, off_m, kc):
    """Chunk ``kc``'s activations, two 64-element halves, into stage ``s``."""
    tma.async_copy_global_to_shared(x_desc, [off_m, kc * 128], bar, x_smem.index(2 * s))
    tma.async_copy_global_to_shared(x_desc, [off_m, kc * 128 + 64], bar, x_smem.index(2 * s + 1))


@gluon.jit
def _upcast(codes, scale):
    """E2M1 codes (int16, 0-15) times a per-row bf16 multiplier: bf16, exact."""
    bits = ((codes & 7) << 6) | ((codes & 8) << 12)  # code value * 2**-126 as bf16 bits
    return bits.to(gl.bfloat16, bitcast=True) * scale[:, None]


# Four bytes (elements k, k+1 of two rows, in register order) -> the bf16 pairs of their low nibbles ($0, $1) and
# high nibbles ($2, $3), times the per-element multipliers ($5-$8). Two bytes are spread to 16-bit lanes with one
# prmt; per nibble the magnitude bits move to bf16 bits 6-8 and the sign to bit 15 with two shifts and one mask,
# for both lanes at once: about 2.5 instructions per element, where the int16 element-wise form takes about 7.
_UPCAST_ASM = gl.constexpr("""{
.reg .b32 y0, y1, a, b;
prmt.b32 y0, $4, 0, 0x4140;
prmt.b32 y1, $4, 0, 0x4342;
shl.b32 a, y0, 6; shl.b32 b, y0, 12; or.b32 a, a, b; and.b32 a, a, 0x81C081C0; mul.rn.bf16x2 $0, a, $5;
shl.b32 a, y1, 6; shl.b32 b, y1, 12; or.b32 a, a, b; and.b32 a, a, 0x81C081C0; mul.rn.bf16x2 $1, a, $6;
and.b32 y0, y0, 0x00F000F0; and.b32 y1, y1, 0x00F000F0;
shl.b32 a, y0, 2; shl.b32 b, y0, 8; or.b32 a, a, b; and.b32 a, a, 0x81C081C0; mul.rn.bf16x2 $2, a, $7;
shl.b32 a, y1, 2; shl.b32 b, y1, 8; or.b32 a, a, b; and.b32 a, a, 0x81C081C0; mul.rn.bf16x2 $3, a, $8;
}""")


@gluon.jit
def _upcast_both(bytes_u8, scale_lo, scale_hi, ASM: gl.constexpr):
    """Both nibbles of ``[BLOCK_N, 16]`` packed bytes as two bf16 A tiles (low: elements j, high: j + 64)."""
    if ASM:
        lo, hi = gl.inline_asm_elementwise(_UPCAST_ASM, "=r,=r,=r,=r,r,r,r,r,r",
                                           [bytes_u8, scale_lo[:, None], scale_hi[:, None]],
                                           dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=4)
    else:
        b = bytes_u8.to(gl.int16)
        lo = _upcast(b & 15, scale_lo)
        hi = _upcast(b >> 4, scale_hi)
    return lo, hi


@gluon.jit
def _group_scale(word, g: gl.constexpr, MULT: gl.constexpr):
    """Byte ``g`` of each row's 8-byte scale word as a bf16 multiplier (e4m3 * 2**(EB - FOLD))."""
    byte = (word >> (8 * g)).to(gl.uint8)
    return byte.to(gl.float8e4nv, bitcast=True).to(gl.bfloat16) * MULT


@gluon.jit
def _upcast_chunk(w_t, word, a_layout: gl.constexpr, MULT: gl.constexpr, ASM: gl.constexpr):
    """The eight bf16 A tiles ``[BLOCK_N, 16]`` of one chunk: k16 steps 0-3 from the low nibbles (elements
    0-63), 4-7 from the high nibbles (64-127)."""
    l0, h0 = _upcast_both(w_t.slice(0, 16, dim=1).load(a_layout), _group_scale(word, 0, MULT),
                          _group_scale(word, 4, MULT), ASM)
    l1, h1 = _upcast_both(w_t.slice(16, 16, dim=1).load(a_layout), _group_scale(word, 1, MULT),
                          _group_scale(word, 5, MULT), ASM)
    l2, h2 = _upcast_both(w_t.slice(32, 16, dim=1).load(a_layout), _group_scale(word, 2, MULT),
                          _group_scale(word, 6, MULT), ASM)
    l3, h3 = _upcast_both(w_t.slice(48, 16, dim=1).load(a_layout), _group_scale(word, 3, MULT),
                          _group_scale(word, 7, MULT), ASM)
    return (l0, l1, l2, l3, h0, h1, h2, h3)


# The packed upcast (``upcast="packed"``). Scales, once per chunk and row, from the row's 8-byte word (bytes 0-3 and
# 4-7 as two 32-bit halves): the four lanes that hold a row's A fragments (k pairs c = 0-3) each convert one pair,
# groups (c, c + 4): one prmt (selector $6 = 0x4808 + 0x1010 c) places byte c in bits 8-15 and byte c + 4 in bits
# 24-31 (the zero bytes are sign replicas of byte 0: e4m3 block scales are >= 0), a shift right by 4 leaves
# ``(b & 0x7F) << 4`` per 16-bit lane, the bf16 bits of ``e4m3 * 2**-120`` (subnormal scales included: bf16 keeps
# e4m3's 3 mantissa bits and has subnormals down to 2**-133), and two exact power-of-two products (2**120, then the
# kernel's multiplier 2**(EB - FOLD), $5) give the bf16 pair (multiplier of group c, of group c + 4). Four shuffles
# within the 4-lane segment then hand every lane all four pairs ($0-$3: groups (0, 4) .. (3, 7)): 8 instructions
# per row and chunk, where the int64 shifts, byte extraction, e4m3->f16->bf16 conversions and bf16 multiply of the
# element-wise form took about 12 per pair.
_SCALES_ASM = gl.constexpr("""{
.reg .b32 w0, w1, t, c;
mov.b64 {w0, w1}, $4;
mov.b32 c, 0x7B807B80;
prmt.b32 t, w0, w1, $6; shr.b32 t, t, 4; mul.rn.bf16x2 t, t, c; mul.rn.bf16x2 t, t, $5;
shfl.sync.idx.b32 $0, t, 0, 0x1C03, 0xffffffff;
shfl.sync.idx.b32 $1, t, 1, 0x1C03, 0xffffffff;
shfl.sync.idx.b32 $2, t, 2, 0x1C03, 0xffffffff;
shfl.sync.idx.b32 $3, t, 3, 0x1C03, 0xffffffff;
}""")

# The prmt selector of the scale conversion, 0x4808 + 0x1010 * (lane % 4): lane-dependent by design (the 4 lanes of
# a row differ), computed once before the loop.
_SCALE_SEL_ASM = gl.constexpr("""{
.reg .b32 t;
mov.u32 t, %laneid; and.b32 t, t, 3; mad.lo.u32 $0, t, 0x1010, 0x4808;
}""")

# Elements, per k16 step: the thread's four 16-bit words of packed bytes (rows r, r + 8, at k pairs c and c + 4:
# $8, $10, $12, $14; the odd operands repeat them), each zero-extended in a 32-bit register as ``ld.shared.u16``
# leaves it, and the (group l, group l + 4) multiplier pairs of rows r and r + 8 ($16, $18) -> the A fragments of
# step l (low nibbles, $0-$3) and of step l + 4 (high nibbles, $4-$7) in wgmma's register order. Per word [b0 b1]:
# y = [b0 0 b1 0] (prmt); low nibbles: (y << 6 | y << 12) & 0x81C081C0 puts bits 0-2 of each byte at bf16 bits 6-8
# and bit 3 at bit 15 (code * 2**-126); high nibbles: s = [0 rep(b0) 0 rep(b1)] (prmt's sign replication: bits 8-15
# all equal the nibble's sign) and q = y << 2 (magnitude at bits 6-8, the sign again at bit 9, the low nibble at
# bits 2-5), combined by one lop3 that takes q where the mask is 0 and s & ~q where it is 1 (0x823C823C: bits 2-5, 9
# and 15 of each lane): 7 integer instructions per two bf16 pairs, then one mul.rn.bf16x2 per pair by the row's
# multiplier with both lanes taken from one half (the low half for the low nibbles, the high for the high).
def _packed_upcast_asm():
    """The text of ``_UPCAST_PACKED_ASM``: one block per 16-bit word (operand, low-nibble and high-nibble outputs),
    the row's multiplier pair unpacked before the words of that row."""
    word = ("prmt.b32 y, ${w}, 0, 0x4140; prmt.b32 s, ${w}, 0, 0x9484;\n"
            "shl.b32 a, y, 6; shl.b32 b, y, 12; lop3.b32 lo, a, b, 0x81C081C0, 0xA8; mul.rn.bf16x2 ${lo}, lo, m0;\n"
            "shl.b32 b, y, 2; lop3.b32 hi, s, b, 0x823C823C, 0x64; mul.rn.bf16x2 ${hi}, hi, m1;\n")
    mult = "mov.b32 {{p0, p1}}, ${m}; mov.b32 m0, {{p0, p0}}; mov.b32 m1, {{p1, p1}};\n"
    text = "{\n.reg .b32 y, s, a, b, m0, m1, lo, hi;\n.reg .b16 p0, p1;\n"
    for m, words in ((16, ((8, 0, 4), (12, 2, 6))), (18, ((10, 1, 5), (14, 3, 7)))):
        text += mult.format(m=m) + "".join(word.format(w=w, lo=lo, hi=hi) for w, lo, hi in words)
    return text + "}"


_UPCAST_PACKED_ASM = gl.constexpr(_packed_upcast_asm())


# One scale word per row, ``ld.global`` (L1-cached) with a 256-byte L2 prefetch hint: the row's next 31 chunks'
# words are in L2 after the first miss, so loading them one chunk ahead is enough (rows past N read 0).
_WORD_LOAD_ASM = gl.constexpr("""{
.reg .pred p;
setp.ne.b32 p, $2, 0;
mov.b64 $0, 0;
@p ld.global.L2::256B.b64 $0, [$1];
}""")


@gluon.jit
def _load_word(ptrs, ok):
    return gl.inline_asm_elementwise(_WORD_LOAD_ASM, "=l,l,r", [ptrs, ok.to(gl.int32)], dtype=gl.int64,
                                     is_pure=False, pack=1)


@gluon.jit
def _packed_scales(word, km, sel):
    """The row's 8 group scales of one chunk as four bf16 pairs (multiplier of group l, of group l + 4), int32."""
    return gl.inline_asm_elementwise(_SCALES_ASM, "=r,=r,=r,=r,l,r,r", [word, km, sel],
                                     dtype=(gl.int32, gl.int32, gl.int32, gl.int32), is_pure=True, pack=1)


@gluon.jit
def _upcast_step_packed(w16, l: gl.constexpr, m, u_layout: gl.constexpr, a_layout: gl.constexpr):
    """k16 steps l and l + 4 of one chunk from the 16-bit view of its packed bytes ``[BLOCK_N, 32]``."""
    v = w16.slice(8 * l, 8, dim=1).load(u_layout).to(gl.int32)          # [BLOCK_N, 8]: byte pairs (k, k + 1)
    v = gl.convert_layout(gl.reshape(gl.join(v, v), [v.shape[0], 16]), a_layout, assert_trivial=True)
    return gl.inline_asm_elementwise(_UPCAST_PACKED_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r",
                                     [v, m[:, None]], dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=8)


@constexpr_function
def _pairs_layout(block_n, num_warps):
    """The byte pairs ``[block_n, 8]`` (16-bit words) of one k16 step, each thread holding the four words whose
    bytes make its A fragment (rows r, r + 8 at k pairs c, c + 4, in that register order): the bf16 A operand's
    layout (``DotOperandLayout(0, wgmma v3, k_width=2)``) with its k + 1 register basis dropped."""
    warps = [[16 << i, 0] for i in range((num_warps // 4).bit_length() + 1)]
    return gl.DistributedLinearLayout(reg_bases=[[8, 0], [0, 4]], lane_bases=[[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]],
                                      warp_bases=warps, block_bases=[], shape=[block_n, 8])


@gluon.jit
def _consumer(w_smem, x_smem, ready, empty, s_ptr, stride_s, off_n, N, first, n_chunks,
              BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, MULT: gl.constexpr,
              ASM: gl.constexpr, num_warps: gl.constexpr):
    """Per chunk: eight wgmmas issued back to back from registers, then the next chunk's upcast while they run,
    then one wait. No register that an in-flight wgmma reads is written before that wait (ptxas would
    otherwise serialize the wgmmas: warning C7513)."""
    mma: gl.constexpr = _acc_layout(BLOCK_M, num_warps)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    rows = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, a_layout))
    row_ok = rows < N
    s_ptrs = s_ptr + rows.to(gl.int64) * stride_s + first
    last = n_chunks - 1
    # scale words four chunks ahead: one HBM latency is longer than a chunk's work
    word = gl.load(s_ptrs, mask=row_ok, other=0)
    w1 = gl.load(s_ptrs + gl.minimum(1, last), mask=row_ok, other=0)
    w2 = gl.load(s_ptrs + gl.minimum(2, last), mask=row_ok, other=0)
    w3 = gl.load(s_ptrs + gl.minimum(3, last), mask=row_ok, other=0)
    mbarrier.wait(ready.index(0), 0)
    a0, a1, a2, a3, a4, a5, a6, a7 = _upcast_chunk(w_smem.index(0), word, a_layout, MULT, ASM)
    word = w1
    w1 = w2
    w2 = w3
    w3 = gl.load(s_ptrs + gl.minimum(4, last), mask=row_ok, other=0)
    acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=mma)
    for i in range(n_chunks):
        s = i % STAGES
        x_lo = x_smem.index(2 * s)
        x_hi = x_smem.index(2 * s + 1)
        acc = warpgroup_mma(a0, x_lo.slice(0, 16, dim=1).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma(a1, x_lo.slice(16, 16, dim=1).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma(a2, x_lo.slice(32, 16, dim=1).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma(a3, x_lo.slice(48, 16, dim=1).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma(a4, x_hi.slice(0, 16, dim=1).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma(a5, x_hi.slice(16, 16, dim=1).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma(a6, x_hi.slice(32, 16, dim=1).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma(a7, x_hi.slice(48, 16, dim=1).permute((1, 0)), acc, is_async=True)
        if i + 1 < n_chunks:  # the next chunk's upcast overlaps this chunk's wgmmas
            s1 = (i + 1) % STAGES
            mbarrier.wait(ready.index(s1), ((i + 1) // STAGES) & 1)
            n0, n1, n2, n3, n4, n5, n6, n7 = _upcast_chunk(w_smem.index(s1), word, a_layout, MULT, ASM)
            word = w1
            w1 = w2
            w2 = w3
            w3 = gl.load(s_ptrs + gl.minimum(i + 5, last), mask=row_ok, other=0)
        else:
            n0, n1, n2, n3, n4, n5, n6, n7 = a0, a1, a2, a3, a4, a5, a6, a7
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, a0, a1, a2, a3, a4, a5, a6, a7))[0]
        mbarrier.arrive(empty.index(s), count=1)
        a0, a1, a2, a3, a4, a5, a6, a7 = n0, n1, n2, n3, n4, n5, n6, n7
    return (acc, )


@gluon.jit
def _cat_k(a, b, a_layout: gl.constexpr):
    """Two A tiles ``[BLOCK_N, 16]`` side by side along K: ``[BLOCK_N, 32]``, the same registers (checked)."""
    ab = gl.reshape(gl.permute(gl.join(a, b), (0, 2, 1)), [a.shape[0], 32])
    return gl.convert_layout(ab, a_layout, assert_trivial=True)


@gluon.jit
def _issue_two_pairs(l0, h0, l1, h1, x_lo, x_hi, l: gl.constexpr, a_layout: gl.constexpr, acc):
    """Steps l, l + 1 (x_lo) and l + 4, l + 5 (x_hi) as two K=32 wgmma ops: four wgmmas behind two fences."""
    acc = warpgroup_mma(_cat_k(l0, l1, a_layout), x_lo.slice(16 * l, 32, dim=1).permute((1, 0)), acc, is_async=True)
    acc = warpgroup_mma(_cat_k(h0, h1, a_layout), x_hi.slice(16 * l, 32, dim=1).permute((1, 0)), acc, is_async=True)
    return acc


@gluon.jit
def _consumer_packed(w_smem, x_smem, ready, empty, s_ptr, s2_ptr, stride_s, off_n, N, first, n_chunks,
                     BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, FOLD: gl.constexpr,
                     HALF: gl.constexpr, num_warps: gl.constexpr, PAIR: gl.constexpr = 1,
                     LATE: gl.constexpr = False, AHEAD: gl.constexpr = 1):
    """The consumer partition of one output tile: :func:`_mainloop_packed` from the ring's first stage."""
    acc, _, _ = _mainloop_packed(w_smem, x_smem, ready, empty, s_ptr, s2_ptr, stride_s, off_n, N, first, n_chunks,
                                 gl.to_tensor(0), gl.to_tensor(0), BLOCK_N, BLOCK_M, STAGES, FOLD, HALF, num_warps,
                                 PAIR, LATE, AHEAD)
    return (acc, )


@gluon.jit
def _mainloop_packed(w_smem, x_smem, ready, empty, s_ptr, s2_ptr, stride_s, off_n, N, first, n_chunks, s, phase,
                     BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, FOLD: gl.constexpr,
                     HALF: gl.constexpr, num_warps: gl.constexpr, PAIR: gl.constexpr = 1,
                     LATE: gl.constexpr = False, AHEAD: gl.constexpr = 1):
    """:func:`_consumer` with the packed upcast, pipelined per half chunk instead of per chunk. A chunk is issued
    as four K=32 ``warpgroup_mma`` ops (two wgmmas behind one fence and one commit group each), in the order of
    its slices: steps 0-1 (low nibbles of slices 0-1), 4-5 (their high nibbles), 2-3, 6-7. The next chunk's
    slices 0-1 are upcast as soon as the two oldest ops have retired (``wgmma.wait_group 2``), straight into the
    registers those read, and issued; then slices 2-3 the same way. So the A fragments stay in the one set of 32
    registers that ptxas keeps for wgmma operands (the per-chunk double buffer of the other modes costs 32 moves
    a chunk, and an unrolled a/b pair of sets made ptxas sink half the upcasts past the wait), and four wgmmas run
    while each half chunk is upcast. The summation order over k differs from the other modes. With ``HALF`` > 0,
    tile rows ``HALF..`` are the second weight's (``s2_ptr``'s scales) at the same rows ``off_n..`` as the first's.
    The tile's first chunk is in stage ``s`` with ready phase ``phase``; returns the accumulator and the stage and
    phase of the chunk after its last (a persistent program's next tile).

    With ``PAIR`` = 2 (``n_chunks`` even, ``s`` 0) two stages share their mbarriers (:func:`_ring`), so the
    consumer waits for ``ready`` and arrives on ``empty`` once per two chunks. Each of those costs a warpgroup
    ``bar.sync`` besides the mbarrier: Triton's shared-memory barrier analysis puts one before every mbarrier wait
    that follows an arrive and one on both sides of every arrive (one thread arrives for all): 3 per chunk, 1.5
    paired. (ncu's "barrier" stalls of the M = 64 kernels, session 60, run 86, are mostly the warp-specialized
    launch's three spare warps, which wait at a barrier for the whole kernel; how much these cost is what the sweep
    of ``pair`` and ``LATE`` measures.) With ``LATE`` a stage is released at the top of the chunk that follows the
    next one, right before that chunk's wait on ``ready`` (one barrier then serves both: two per release instead of
    three), one and a half chunks later than the earliest point; no stage is released after the last chunk (one
    tile per program). The scale words are loaded ``AHEAD`` chunks before their chunk (1, or 2: ncu of run 86 had
    the M = 64 consumer's warps waiting on global loads for 15% of their cycles, and these are its only ones)."""
    mma: gl.constexpr = _acc_layout(BLOCK_M, num_warps)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    u_layout: gl.constexpr = _pairs_layout(BLOCK_N, num_warps)
    # the multiplier 2**(EB - FOLD) as a bf16 pair
    km = gl.full([BLOCK_N], (EB - FOLD + 127) * 128 * 65537, gl.int32, layout=gl.SliceLayout(1, a_layout))
    sel = gl.inline_asm_elementwise(_SCALE_SEL_ASM, "=r,r", [km], dtype=gl.int32, is_pure=True, pack=1)
    r = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, a_layout))
    if HALF > 0:
        rows = off_n + r % HALF
        s_ptrs = gl.where(r < HALF, s_ptr, s2_ptr) + rows.to(gl.int64) * stride_s + first
    else:
        rows = off_n + r
        s_ptrs = s_ptr + rows.to(gl.int64) * stride_s + first
    row_ok = rows < N
    last = n_chunks - 1
    word = _load_word(s_ptrs, row_ok)
    nxt = _load_word(s_ptrs + gl.minimum(1, last), row_ok)  # the scale word one chunk ahead
    if AHEAD == 2:  # and two chunks ahead
        nxt = (nxt, _load_word(s_ptrs + gl.minimum(2, last), row_ok))
    mbarrier.wait(ready.index(s // PAIR), phase)
    w16 = w_smem.index(s)._reinterpret(gl.uint16, [BLOCK_N, 32],
                                       gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=16))
    m0, m1, m2, m3 = _packed_scales(word, km, sel)
    l0, h0 = _upcast_step_packed(w16, 0, m0, u_layout, a_layout)
    l1, h1 = _upcast_step_packed(w16, 1, m1, u_layout, a_layout)
    l2, h2 = _upcast_step_packed(w16, 2, m2, u_layout, a_layout)
    l3, h3 = _upcast_step_packed(w16, 3, m3, u_layout, a_layout)
    acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=mma)
    acc = _issue_two_pairs(l0, h0, l1, h1, x_smem.index(2 * s), x_smem.index(2 * s + 1), 0, a_layout, acc)
    acc = _issue_two_pairs(l2, h2, l3, h3, x_smem.index(2 * s), x_smem.index(2 * s + 1), 2, a_layout, acc)
    state = (acc, l0, h0, l1, h1, l2, h2, l3, h3, nxt, s, phase)
    ctx = (w_smem, x_smem, ready, empty, s_ptrs, row_ok, last, km, sel)  # what every chunk reads and nothing changes
    # release: 1 = chunk i - 1's stage in the middle of chunk i, 2 = the stage (pair) of chunk i - 1 - PAIR at the top
    # of chunk i (LATE; nothing to release before chunk 1 + PAIR), 0 = none (the second chunk of a pair)
    if PAIR == 1 and not LATE:
        for i in range(1, n_chunks):
            state = _packed_chunk(state, i, ctx, u_layout, a_layout, BLOCK_N, STAGES, 1, True, 1, AHEAD)
    elif PAIR == 1:  # LATE: chunk 1 has nothing to release yet
        if n_chunks > 1:
            state = _packed_chunk(state, 1, ctx, u_layout, a_layout, BLOCK_N, STAGES, 1, True, 0, AHEAD)
        for i in range(2, n_chunks):
            state = _packed_chunk(state, i, ctx, u_layout, a_layout, BLOCK_N, STAGES, 1, True, 2, AHEAD)
    else:  # chunk 1 shares chunk 0's mbarriers; then per pair, the first chunk waits (and releases a pair)
        state = _packed_chunk(state, 1, ctx, u_layout, a_layout, BLOCK_N, STAGES, PAIR, False, 0, AHEAD)
        first_pair = 1
        if LATE:  # the second pair has nothing to release yet
            if n_chunks > 2:
                state = _packed_chunk(state, 2, ctx, u_layout, a_layout, BLOCK_N, STAGES, PAIR, True, 0, AHEAD)
                state = _packed_chunk(state, 3, ctx, u_layout, a_layout, BLOCK_N, STAGES, PAIR, False, 0, AHEAD)
            first_pair = 2
        for j in range(first_pair, n_chunks // 2):
            state = _packed_chunk(state, 2 * j, ctx, u_layout, a_layout, BLOCK_N, STAGES, PAIR, True,
                                  2 if LATE else 1, AHEAD)
            state = _packed_chunk(state, 2 * j + 1, ctx, u_layout, a_layout, BLOCK_N, STAGES, PAIR, False, 0, AHEAD)
    acc, l0, h0, l1, h1, l2, h2, l3, h3, nxt, s, phase = state
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, l0, h0, l1, h1, l2, h2, l3, h3))[0]
    mbarrier.arrive(empty.index(s // PAIR), count=1)
    s += 1
    if s == STAGES:
        s = 0
        phase ^= 1
    return acc, s, phase


@gluon.jit
def _packed_chunk(state, i, ctx, u_layout: gl.constexpr, a_layout: gl.constexpr, BLOCK_N: gl.constexpr,
                  STAGES: gl.constexpr, PAIR: gl.constexpr, SYNC: gl.constexpr, RELEASE: gl.constexpr,
                  AHEAD: gl.constexpr):
    """Chunk ``i`` (>= 1) of :func:`_mainloop_packed` (``state``: what chunk i - 1 left, returned for chunk i + 1;
    ``ctx``: the ring, its mbarriers and the scale words' pointers, the same for every chunk): its stage and ready
    phase stepped from the previous chunk's (instead of (s0 + i) % STAGES and its phase: a division for 3 and 6
    stages), its upcast and wgmmas in two halves behind ``wgmma.wait_group 2``. With ``SYNC`` it first waits for its
    stage's ``ready`` mbarrier (at ``PAIR`` = 2 only the first chunk of a pair does: the pair's data came together).
    ``RELEASE`` 1: once chunk i - 1's wgmmas have all retired (the second ``wait_group``), it arrives on that
    chunk's ``empty`` mbarrier; 2: before its wait, on the ``empty`` one of chunk i - 1 - PAIR (retired by chunk
    i - 1's second ``wait_group``; at ``PAIR`` = 2 the last chunk of the pair before the previous one); 0: neither."""
    acc, l0, h0, l1, h1, l2, h2, l3, h3, nxt, s, phase = state
    w_smem, x_smem, ready, empty, s_ptrs, row_ok, last, km, sel = ctx
    prev = s
    s += 1
    if s == STAGES:
        s = 0
        phase ^= 1
    x_lo = x_smem.index(2 * s)
    x_hi = x_smem.index(2 * s + 1)
    if RELEASE == 2:
        old = prev - PAIR
        if old < 0:
            old += STAGES
        mbarrier.arrive(empty.index(old // PAIR), count=1)  # chunk i - 1 - PAIR's wgmmas have all retired
    if SYNC:
        mbarrier.wait(ready.index(s // PAIR), phase)
    w16 = w_smem.index(s)._reinterpret(gl.uint16, [BLOCK_N, 32],
                                       gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=16))
    if AHEAD == 1:
        m0, m1, m2, m3 = _packed_scales(nxt, km, sel)
        nxt = _load_word(s_ptrs + gl.minimum(i + 1, last), row_ok)
    else:
        cur, later = nxt
        m0, m1, m2, m3 = _packed_scales(cur, km, sel)
        nxt = (later, _load_word(s_ptrs + gl.minimum(i + 2, last), row_ok))
    # two slices per wait, issued as two K=32 wgmma ops (one fence and one commit group each)
    acc = warpgroup_mma_wait(num_outstanding=2, deps=(acc, l0, h0, l1, h1))[0]
    l0, h0 = _upcast_step_packed(w16, 0, m0, u_layout, a_layout)
    l1, h1 = _upcast_step_packed(w16, 1, m1, u_layout, a_layout)
    acc = _issue_two_pairs(l0, h0, l1, h1, x_lo, x_hi, 0, a_layout, acc)
    acc = warpgroup_mma_wait(num_outstanding=2, deps=(acc, l2, h2, l3, h3))[0]
    if RELEASE == 1:
        mbarrier.arrive(empty.index(prev // PAIR), count=1)  # chunk i - 1's wgmmas have all retired
    l2, h2 = _upcast_step_packed(w16, 2, m2, u_layout, a_layout)
    l3, h3 = _upcast_step_packed(w16, 3, m3, u_layout, a_layout)
    acc = _issue_two_pairs(l2, h2, l3, h3, x_lo, x_hi, 2, a_layout, acc)
    return acc, l0, h0, l1, h1, l2, h2, l3, h3, nxt, s, phase


@gluon.jit
def _tile(pid, tiles_m, tiles_n, GROUP_M: gl.constexpr):
    """Program ``pid``'s (token tile, weight tile): ``GROUP_M`` token tiles x every weight tile, token tile fastest,
    so that consecutive programs share a weight tile (and, in the grouped kernel, its expert)."""
    per_group = GROUP_M * tiles_n
    first_m = pid // per_group * GROUP_M
    size_m = gl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % size_m, (pid % per_group) // size_m


@gluon.jit
def _ring(w_desc, x_desc, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PAIR: gl.constexpr = 1):
    """The shared ring: per stage a packed weight tile ``[BLOCK_N, 64]`` (``w_desc``'s boxes may be half of it) and
    the activations' two halves, a ``ready`` mbarrier (the loader's TMA copies landed) and an ``empty`` one (the
    consumer's wgmmas that read the stage retired); with ``PAIR`` = 2 one of each per two stages."""
    w_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_N, 64], w_desc.layout)
    x_smem = gl.allocate_shared_memory(x_desc.dtype, [2 * STAGES] + x_desc.block_type.shape, x_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES // PAIR, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES // PAIR, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES // PAIR):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
        mbarrier.arrive(empty.index(s), count=1)  # every stage starts free
    return w_smem, x_smem, ready, empty


@constexpr_function
def _acc_layout(block_m, num_warps):
    """The accumulator's layout: wgmma v3 tiles of 16 weight rows per warp by ``block_m`` tokens."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, block_m, 16])


@gluon.jit
def fp4_gluon_kernel(w_desc, x_desc, s_ptr, stride_s, out_scale_ptr, c_ptr, stride_cm, M, N, K, ws_ptr, cnt_ptr,
                     BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
                     FOLD: gl.constexpr, ATOMIC: gl.constexpr, UPCAST: gl.constexpr, FIXUP: gl.constexpr,
                     FINISH: gl.constexpr, num_warps: gl.constexpr, PAIR: gl.constexpr = 1,
                     LATE: gl.constexpr = False, AHEAD: gl.constexpr = 1, REZERO: gl.constexpr = False,
                     PDL: gl.constexpr = False):
    """C[M, N] (+)= X[M, K] @ W[N, K]^T for one NVFP4 weight; ``s_ptr`` is the scales' int64 view ``[N, K/128]``.

    Split-K either adds fp32 partials into a zeroed fp32 ``c_ptr`` with atomics (``ATOMIC``), or (``FIXUP``) each
    split stores its partial tile to the fp32 workspace ``ws_ptr [split, M, N]`` and counts itself in ``cnt_ptr``
    (one zeroed int32 per output tile); the split that arrives last sums the partials and stores the tile in
    ``c_ptr``'s dtype: no zeroed output, no atomics on the data, no cast kernel, and no split waits for another.
    Or (``FINISH``) each split adds its partial into the zeroed fp32 workspace ``ws_ptr [M, N]`` with 16-byte
    atomics, counts itself like ``FIXUP``, and the last split reads the sum back (one tile, not one per split) and
    stores it in ``c_ptr``'s dtype: the atomics of ``ATOMIC`` without its cast kernel; with ``REZERO`` it then
    zeroes the tile's sums and count again, so that the workspace is left as it was found (all zeros) for the next
    launch on the stream, which needs no memset. ``PAIR`` = 2: two ring stages
    per mbarrier pair (:func:`_mainloop_packed`; the packed upcast, an even number of chunks per split); ``LATE``:
    stages released right before a later wait; ``AHEAD``: chunks between a scale word's load and its use
    (:func:`_mainloop_packed`). ``PDL``: launched with programmatic dependent launch; the loader waits
    (``griddepcontrol.wait``) before its first load (:func:`_load_chunks`), and every thread waits before the
    epilogue writes (free by then: the earlier kernel has completed)."""
    pid = gl.program_id(0)
    pid_k = gl.program_id(1)
    pid_m, pid_n = _tile(pid, gl.cdiv(M, BLOCK_M), gl.cdiv(N, BLOCK_N), GROUP_M)
    off_n = pid_n * BLOCK_N
    off_m = pid_m * BLOCK_M
    n_chunks = K // CHUNK_K // gl.num_programs(1)
    first = pid_k * n_chunks

    w_smem, x_smem, ready, empty = _ring(w_desc, x_desc, BLOCK_N, STAGES, PAIR)
    MULT: gl.constexpr = 2.0 ** (EB - FOLD)
    if UPCAST == 2:
        acc, = gl.warp_specialize([
            (_consumer_packed, (w_smem, x_smem, ready, empty, s_ptr, s_ptr, stride_s, off_n, N, first, n_chunks,
                                BLOCK_N, BLOCK_M, STAGES, FOLD, 0, num_warps, PAIR, LATE, AHEAD)),
            (_loader, (w_desc, w_desc, x_desc, w_smem, x_smem, ready, empty, off_n, off_m, first, n_chunks, STAGES,
                       0, PAIR, PDL)),
        ], [1], [40])
    else:
        acc, = gl.warp_specialize([
            (_consumer, (w_smem, x_smem, ready, empty, s_ptr, stride_s, off_n, N, first, n_chunks,
                         BLOCK_N, BLOCK_M, STAGES, MULT, UPCAST == 1, num_warps)),
            (_loader, (w_desc, w_desc, x_desc, w_smem, x_smem, ready, empty, off_n, off_m, first, n_chunks, STAGES,
                       0, 1, PDL)),
        ], [1], [40])

    if PDL:
        gdc_wait()
    acc = acc * gl.load(out_scale_ptr)
    c_ptrs, c_mask, offs_m, offs_n = _out_tile(c_ptr, stride_cm, off_m, off_n, M, N, BLOCK_N, BLOCK_M, num_warps)
    if ATOMIC:
        gl.atomic_add(c_ptrs, acc, mask=c_mask, sem="relaxed")  # the default (acq_rel) fences every element
    elif FIXUP:
        mn = M.to(gl.int64) * N
        part = offs_m.to(gl.int64)[None, :] * N + offs_n[:, None]
        gl.store(ws_ptr + pid_k * mn + part, acc, mask=c_mask)
        if _last_split(cnt_ptr + pid):  # the others' partials are visible
            gl.thread_barrier()
            total = gl.zeros_like(acc)
            for split in range(gl.num_programs(1)):
                total += gl.load(ws_ptr + split * mn + part, mask=c_mask, other=0.0, cache_modifier=".cg")
            gl.store(c_ptrs, total.to(c_ptr.dtype.element_ty), mask=c_mask)
    elif FINISH:
        _finish_split(acc, ws_ptr, cnt_ptr + pid, c_ptr, stride_cm, off_m, off_n, M, N, BLOCK_N, BLOCK_M, num_warps,
                      REZERO)
    else:
        gl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


@gluon.jit
def _last_split(cnt_ptr):
    """Counts this split of an output tile in the tile's zeroed int32 ``cnt_ptr`` once every thread of the program
    has issued its partial (a CTA barrier, then one acq_rel gpu-scope add that releases them) and says whether it
    was the tile's last split: the one that may read the others' partials (split-K ``FIXUP`` and ``FINISH``)."""
    gl.thread_barrier()
    arrived = gl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
    return arrived == gl.num_programs(1) - 1


@gluon.jit
def _finish_split(acc, ws_ptr, cnt_ptr, c_ptr, stride_cm, off_m, off_n, M, N, BLOCK_N: gl.constexpr,
                  BLOCK_M: gl.constexpr, num_warps: gl.constexpr, REZERO: gl.constexpr = False):
    """Split-K's ``FINISH`` epilogue for one output tile: the partial ``acc`` added into the zeroed fp32 workspace
    ``ws_ptr [M, N]`` (row stride N), the split counted in the tile's zeroed ``cnt_ptr``, and by the tile's last
    split the sum stored in ``c_ptr``'s dtype. The tile first moves (through shared memory) to a layout with four
    consecutive weight rows per thread, so each thread adds 16 contiguous bytes per atomic (``atom .v4.f32``, SM90)
    and a warp covers 64 rows of two tokens, where the accumulator's layout gives each thread two tokens of one row
    (scalar atomics, 32 bytes per token row and warp). With ``REZERO`` the last split stores zeros over the sums it
    read and over the count (no other split touches the tile after it): the workspace is all zeros again."""
    epi: gl.constexpr = gl.BlockedLayout([4, 1], [16, 2], [1, num_warps], [0, 1])
    part = gl.convert_layout(acc, epi)
    offs_n = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, epi))
    offs_m = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, epi))
    mask = (offs_m < M)[None, :] & (offs_n < N)[:, None]
    ws_ptrs = ws_ptr + offs_m.to(gl.int64)[None, :] * N + offs_n[:, None]
    gl.atomic_add(ws_ptrs, part, mask=mask, sem="relaxed")
    if _last_split(cnt_ptr):  # every split's atomics are visible in L2
        gl.thread_barrier()
        total = gl.load(ws_ptrs, mask=mask, other=0.0, cache_modifier=".cg")
        c_ptrs = c_ptr + offs_m.to(gl.int64)[None, :] * stride_cm + offs_n[:, None]
        gl.store(c_ptrs, total.to(c_ptr.dtype.element_ty), mask=mask)
        if REZERO:
            gl.store(ws_ptrs, gl.zeros_like(total), mask=mask)
            gl.store(cnt_ptr, 0)


@gluon.jit
def _out_tile(c_ptr, stride_cm, off_m, off_n, M, N, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr,
              num_warps: gl.constexpr):
    """Pointers and mask of an output tile ``C[off_m : off_m + BLOCK_M, off_n : off_n + BLOCK_N]`` in the
    accumulator's layout (weight rows down, tokens across), and the token and weight-row offsets."""
    mma: gl.constexpr = _acc_layout(BLOCK_M, num_warps)
    offs_n = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma))
    offs_m = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, mma))
    c_ptrs = c_ptr + offs_m.to(gl.int64)[None, :] * stride_cm + offs_n[:, None]
    return c_ptrs, (offs_m < M)[None, :] & (offs_n < N)[:, None], offs_m, offs_n


@gluon.jit
def _loader_persistent(w_desc, x_desc, w_smem, x_smem, ready, empty, M, N, n_chunks, BLOCK_N: gl.constexpr,
                       BLOCK_M: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr):
    """The loader of a persistent program: every tile ``pid, pid + programs, ...`` in turn, one ring throughout."""
    tiles_m = gl.cdiv(M, BLOCK_M)
    tiles_n = gl.cdiv(N, BLOCK_N)
    base = gl.to_tensor(0)
    for tile in range(gl.program_id(0), tiles_m * tiles_n, gl.num_programs(0)):
        pid_m, pid_n = _tile(tile, tiles_m, tiles_n, GROUP_M)
        _load_chunks(w_desc, w_desc, x_desc, w_smem, x_smem, ready, empty, pid_n * BLOCK_N, pid_m * BLOCK_M, 0,
                     n_chunks, base, STAGES, 0)
        base += n_chunks


@gluon.jit
def _consumer_persistent(w_smem, x_smem, ready, empty, s_ptr, stride_s, out_scale_ptr, c_ptr, stride_cm, M, N,
                         n_chunks, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
                         GROUP_M: gl.constexpr, FOLD: gl.constexpr, num_warps: gl.constexpr):
    """The consumer of a persistent program: per tile the packed mainloop, then its store, while the loader already
    fills the freed stages with the next tile's chunks."""
    tiles_m = gl.cdiv(M, BLOCK_M)
    tiles_n = gl.cdiv(N, BLOCK_N)
    scale = gl.load(out_scale_ptr)
    s = gl.to_tensor(0)
    phase = gl.to_tensor(0)
    for tile in range(gl.program_id(0), tiles_m * tiles_n, gl.num_programs(0)):
        pid_m, pid_n = _tile(tile, tiles_m, tiles_n, GROUP_M)
        acc, s, phase = _mainloop_packed(w_smem, x_smem, ready, empty, s_ptr, s_ptr, stride_s, pid_n * BLOCK_N, N, 0,
                                         n_chunks, s, phase, BLOCK_N, BLOCK_M, STAGES, FOLD, 0, num_warps)
        c_ptrs, c_mask, _, _ = _out_tile(c_ptr, stride_cm, pid_m * BLOCK_M, pid_n * BLOCK_N, M, N, BLOCK_N, BLOCK_M,
                                         num_warps)
        gl.store(c_ptrs, (acc * scale).to(c_ptr.dtype.element_ty), mask=c_mask)
    return (s, )


@gluon.jit
def fp4_gluon_persistent_kernel(w_desc, x_desc, s_ptr, stride_s, out_scale_ptr, c_ptr, stride_cm, M, N, K,
                                BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
                                GROUP_M: gl.constexpr, FOLD: gl.constexpr, num_warps: gl.constexpr):
    """:func:`fp4_gluon_kernel` (packed upcast, no split-K) on a persistent grid of at most one program per SM: each
    program takes tiles ``pid, pid + programs, ...`` (in ``_tile``'s order), so the last wave is not a partial one
    and a tile's store overlaps the loads of the next."""
    w_smem, x_smem, ready, empty = _ring(w_desc, x_desc, BLOCK_N, STAGES)
    gl.warp_specialize([
        (_consumer_persistent, (w_smem, x_smem, ready, empty, s_ptr, stride_s, out_scale_ptr, c_ptr, stride_cm, M, N,
                                K // CHUNK_K, BLOCK_N, BLOCK_M, STAGES, GROUP_M, FOLD, num_warps)),
        (_loader_persistent, (w_desc, x_desc, w_smem, x_smem, ready, empty, M, N, K // CHUNK_K, BLOCK_N, BLOCK_M,
                              STAGES, GROUP_M)),
    ], [1], [40])

@gluon.jit
def fp4_gluon_moe_kernel(w_desc, w2_desc, x_desc, s_ptr, s2_ptr, stride_s, out_scale_ptr, out_scale2_ptr,
                         blk_expert_ptr, c_ptr, stride_cm, M, N, K,
                         BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
                         FOLD: gl.constexpr, SWIGLU: gl.constexpr, num_warps: gl.constexpr, PAIR: gl.constexpr = 1,
                         LATE: gl.constexpr = False, AHEAD: gl.constexpr = 1):
    """The grouped (MoE) GEMM on the same mainloop: ``X [M, K]`` holds the token-expert assignments sorted by expert,
    each expert's segment padded to a multiple of ``BLOCK_M`` rows, and token tile ``t`` belongs to expert
    ``blk_expert[t]`` (-1: past the last used tile; its programs return at once). The weights are an expert stack
    viewed as ``[E * N, K/2]`` (scales ``[E * N, K/128]`` int64, per-expert ``out_scale [E]``).

    ``SWIGLU``: ``C[M, N] = silu(X @ G[e]^T) * (X @ U[e]^T)`` with ``G`` in ``w_desc`` and ``U`` in ``w2_desc``: a
    program's tile holds ``BLOCK_N / 2`` rows of each (its ring stage gets two TMA boxes), and the epilogue pairs
    them through shared memory in fp32 (MODEL.md's SwiGLU in fp32, then rounded once to ``c_ptr``'s dtype).
    Otherwise ``C[M, N] = X @ W[e]^T``. ``N`` must be a multiple of the output tile (the host checks it): no
    program's rows cross into the next expert's. ``PAIR``, ``LATE`` and ``AHEAD``: the linear's consumer variants
    (:func:`_mainloop_packed`; the same bits)."""
    OUT_N: gl.constexpr = BLOCK_N // 2 if SWIGLU else BLOCK_N
    pid_m, pid_n = _tile(gl.program_id(0), M // BLOCK_M, N // OUT_N, GROUP_M)
    expert = gl.load(blk_expert_ptr + pid_m)
    if expert < 0:
        return
    off_m = pid_m * BLOCK_M
    off_n = expert * N + pid_n * OUT_N  # the tile's first row in the [E * N, K/2] stack
    n_chunks = K // CHUNK_K

    w_smem, x_smem, ready, empty = _ring(w_desc, x_desc, BLOCK_N, STAGES, PAIR)
    HALF: gl.constexpr = OUT_N if SWIGLU else 0
    acc, = gl.warp_specialize([
        (_consumer_packed, (w_smem, x_smem, ready, empty, s_ptr, s2_ptr, stride_s, off_n, expert * N + N, 0,
                            n_chunks, BLOCK_N, BLOCK_M, STAGES, FOLD, HALF, num_warps, PAIR, LATE, AHEAD)),
        (_loader, (w_desc, w2_desc, x_desc, w_smem, x_smem, ready, empty, off_n, off_m, 0, n_chunks, STAGES, HALF,
                   PAIR)),
    ], [1], [40])

    if SWIGLU:
        r = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, _acc_layout(BLOCK_M, num_warps)))
        mult = gl.where(r < HALF, gl.load(out_scale_ptr + expert), gl.load(out_scale2_ptr + expert))
        acc = acc * mult[:, None]
        # gate row j and up row j sit in different warps: pair them through shared memory, N contiguous
        epi = gl.allocate_shared_memory(gl.float32, [BLOCK_N, BLOCK_M],
                                        gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0, 1]))
        epi.store(acc)
        gl.thread_barrier()
        out: gl.constexpr = gl.BlockedLayout([1, 1], [32, 1], [1, num_warps], [0, 1])
        gate = epi.slice(0, HALF, dim=0).load(out)
        up = epi.slice(HALF, HALF, dim=0).load(out)
        h = gate / (1.0 + gl.exp(-gate)) * up
        offs_n = pid_n * OUT_N + gl.arange(0, OUT_N, layout=gl.SliceLayout(1, out))
        offs_m = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, out))
        gl.store(c_ptr + offs_m.to(gl.int64)[None, :] * stride_cm + offs_n[:, None], h.to(c_ptr.dtype.element_ty))
    else:
        # no mask: the tile lies inside C (rows a multiple of BLOCK_M, N of BLOCK_N), and a mask of 256 x 128 spilled
        c_ptrs, _, _, _ = _out_tile(c_ptr, stride_cm, off_m, pid_n * OUT_N, M, N, BLOCK_N, BLOCK_M, num_warps)
        gl.store(c_ptrs, (acc * gl.load(out_scale_ptr + expert)).to(c_ptr.dtype.element_ty))


def _descriptor(t: torch.Tensor, box: list[int], dtype) -> TensorDescriptor:
    """A TMA descriptor of the 2-D ``t`` copying ``box`` tiles into the default NVMMA shared layout of ``dtype``."""
    return TensorDescriptor(t, list(t.shape), list(t.stride()), box, gl.NVMMASharedLayout.get_default_for(box, dtype))


def descriptors(x: torch.Tensor, packed: torch.Tensor, cfg: GluonConfig) -> tuple[TensorDescriptor, TensorDescriptor]:
    """TMA descriptors of the packed weight ``[N, K/2]`` (box ``[block_n, 64]`` bytes) and the activations
    ``[M, K]`` (box ``[block_m, 64]`` bf16). Rows past M or N read zeros."""
    return _descriptor(packed, [cfg.block_n, 64], gl.uint8), _descriptor(x, [cfg.block_m, 64], gl.bfloat16)


def launch(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, out_scale: torch.Tensor, *, wfmt: int,
           group: int, fold_log2: int, n: int, k: int, out: torch.Tensor, cfg: GluonConfig) -> torch.Tensor:
    """Launch :func:`fp4_gluon_kernel` for one NVFP4 weight (``packed``/``scales`` ``[N, K/2]``/``[N, K/16]``, or
    the ``[1, ...]`` resident stack). ``out`` is ``[M, N]``: fp32 and zeroed when ``cfg.split_k > 1`` with atomics,
    any dtype with ``cfg.fixup`` or ``cfg.finish`` (their workspace and per-tile counts are allocated here, or with
    ``cfg.rezero`` kept: :mod:`musecore_cuda.kernels.finish_workspace` says which launches share one)."""
    if wfmt != WFMT_NVFP4 or group != 16:
        raise ValueError(f"the Gluon GEMM takes NVFP4 weights (e4m3 scales, group 16); got wfmt={wfmt}, group={group}")
    if x.dtype != torch.bfloat16 or x.dim() != 2 or x.stride(-1) != 1:
        raise TypeError(f"the Gluon GEMM takes 2-D bf16 activations contiguous along K; got {x.dtype} {x.shape}")
    if k % (CHUNK_K.value * cfg.split_k):
        raise ValueError(f"the Gluon GEMM needs K divisible by {CHUNK_K.value} x split_k={cfg.split_k}; got K={k}")
    if cfg.pair and (k // CHUNK_K.value // cfg.split_k) % 2:
        raise ValueError(f"paired ring stages take chunks two at a time: K / {CHUNK_K.value} / split_k must be even; "
                         f"got K={k}, split_k={cfg.split_k}")
    if cfg.atomic and out.dtype != torch.float32:
        raise TypeError("split-K with atomics accumulates into a zeroed float32 output")
    if cfg.upcast == "packed" and not 7 <= fold_log2 <= 116:
        raise ValueError(f"the packed upcast is exact for 7 <= fold_log2 <= 116 (multipliers up to 448 * 2**(126 - "
                         f"fold) below bf16's maximum, products above its smallest normal); got {fold_log2}")
    w2 = packed.reshape(-1, packed.shape[-1])
    s2 = scales.reshape(-1, scales.shape[-1])
    if w2.shape != (n, k // 2) or s2.shape != (n, k // 16) or not s2.is_contiguous():
        raise ValueError(f"expected packed [{n}, {k // 2}] and contiguous scales [{n}, {k // 16}]; "
                         f"got {tuple(w2.shape)} and {tuple(s2.shape)}")
    words = s2.view(torch.int64)  # [N, K/128]: the 8 group scales of one chunk per word
    w_desc, x_desc = descriptors(x, w2, cfg)
    m = x.shape[0]
    tiles = cfg.tiles(m, n)
    if (cfg.fixup or cfg.finish) and (out.shape != (m, n) or out.stride() != (n, 1)):
        raise ValueError(f"split-K {'fixup' if cfg.fixup else 'finish'} writes a contiguous [{m}, {n}] output; got "
                         f"{tuple(out.shape)} {out.stride()}")
    kept = None  # finish's workspace kept zeroed by the kernel (cfg.rezero), when there is one
    if cfg.fixup:  # the workspace is written before it is read; the counts start at zero (one memset of `tiles` ints)
        ws = torch.empty(cfg.split_k, m, n, dtype=torch.float32, device=x.device)
        counts = torch.zeros(tiles, dtype=torch.int32, device=x.device)
    elif cfg.finish:  # the sums the atomics add into and, behind them, the per-tile counts: kept zeroed by the
        # kernel (rezero) where finish_workspace has a workspace for this launch, else zeroed here (one memset)
        numel = cfg.finish_numel(m, n)
        kept = finish_workspace.workspace(x.device, numel) if cfg.rezero else None
        ws = torch.zeros(numel, dtype=torch.float32, device=x.device) if kept is None else kept[:numel]
        counts = ws[m * n:].view(torch.int32)
    else:  # unused by the kernel: no allocation, no memset on the routed path
        ws = counts = out_scale
    if cfg.persistent:
        fp4_gluon_persistent_kernel[(min(tiles, device_sms(x.device)), )](
            w_desc, x_desc, words, words.stride(0), out_scale, out, out.stride(0), m, n, k, BLOCK_N=cfg.block_n,
            BLOCK_M=cfg.block_m, STAGES=cfg.stages, GROUP_M=cfg.group_m, FOLD=fold_log2, **cfg.launch_options)
        return out
    fp4_gluon_kernel[(tiles, cfg.split_k)](w_desc, x_desc, words, words.stride(0), out_scale, out, out.stride(0), m, n,
                                           k, ws, counts, BLOCK_N=cfg.block_n, BLOCK_M=cfg.block_m, STAGES=cfg.stages,
                                           GROUP_M=cfg.group_m, FOLD=fold_log2, ATOMIC=cfg.atomic,
                                           UPCAST=UPCASTS[cfg.upcast], FIXUP=cfg.fixup, FINISH=cfg.finish,
                                           PAIR=2 if cfg.pair else 1, LATE=cfg.late, AHEAD=cfg.ahead,
                                           REZERO=kept is not None, **cfg.launch_options,
                                           **pdl.triton_options(x.device, PDL_NAME))
    return out


def _expert_stack(packed: torch.Tensor, scales: torch.Tensor, out_scale: torch.Tensor, n: int, k: int,
                  what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """An NVFP4 expert stack ``[E, N, K/2]`` / ``[E, N, K/16]`` / ``[E]`` as the kernel's 2-D views: packed
    ``[E * N, K/2]`` and the scales' int64 words ``[E * N, K/128]``."""
    e = packed.shape[0]
    if (packed.shape != (e, n, k // 2) or scales.shape != (e, n, k // 16) or out_scale.shape != (e,)
            or not (packed.is_contiguous() and scales.is_contiguous())):
        raise ValueError(f"the grouped Gluon GEMM's {what} stack must be contiguous packed [E, {n}, {k // 2}], scales "
                         f"[E, {n}, {k // 16}] and out_scale [E]; got {tuple(packed.shape)}, {tuple(scales.shape)}, "
                         f"{tuple(out_scale.shape)}")
    return packed.view(e * n, k // 2), scales.view(e * n, k // 16).view(torch.int64)


def check_grouped(x: torch.Tensor, blk_expert: torch.Tensor, stack: tuple, out: torch.Tensor, *, fold_log2: int,
                  cfg: GluonConfig, stack2: tuple | None = None) -> tuple:
    """:func:`launch_grouped`'s arguments checked (a ValueError or TypeError naming what is wrong); returns the
    stacks' 2-D views ``(w, words, w2, words2)`` (``stack``'s again without ``stack2``) and the output columns of
    one program."""
    if x.dtype != torch.bfloat16 or x.dim() != 2 or not x.is_contiguous():
        raise TypeError(f"the grouped Gluon GEMM takes contiguous 2-D bf16 activations; got {x.dtype} "
                        f"{tuple(x.shape)}")
    rows, k = x.shape
    if cfg.upcast != "packed" or cfg.split_k != 1 or cfg.persistent:
        raise ValueError(f"the grouped Gluon GEMM runs the packed upcast without split-K, one tile per program; got "
                         f"{cfg.label()}")
    if not 7 <= fold_log2 <= 116:
        raise ValueError(f"the packed upcast is exact for 7 <= fold_log2 <= 116; got {fold_log2}")
    n = stack[0].shape[1]
    out_n = cfg.block_n // 2 if stack2 is not None else cfg.block_n
    if k % CHUNK_K.value or n % out_n or rows % cfg.block_m or blk_expert.shape != (rows // cfg.block_m,):
        raise ValueError(f"the grouped Gluon GEMM needs K % {CHUNK_K.value} == 0 (K={k}), N a multiple of {out_n} "
                         f"(N={n}), rows a multiple of block_m {cfg.block_m} (rows={rows}) and one expert per token "
                         f"tile (blk_expert {tuple(blk_expert.shape)})")
    if cfg.pair and (k // CHUNK_K.value) % 2:
        raise ValueError(f"paired ring stages need an even number of {CHUNK_K.value}-element chunks; K={k}")
    if blk_expert.dtype != torch.int32 or out.shape != (rows, n) or out.stride(-1) != 1:
        raise ValueError(f"expected int32 blk_expert and an output [{rows}, {n}] contiguous along N; got "
                         f"{blk_expert.dtype}, {tuple(out.shape)} {out.stride()}")
    w, words = _expert_stack(*stack, n, k, "first" if stack2 is not None else "weight")
    w2, words2 = _expert_stack(*stack2, n, k, "second") if stack2 is not None else (w, words)
    return w, words, w2, words2, out_n


def launch_grouped(x: torch.Tensor, blk_expert: torch.Tensor, stack: tuple, out: torch.Tensor, *, fold_log2: int,
                   cfg: GluonConfig, stack2: tuple | None = None) -> torch.Tensor:
    """Launch :func:`fp4_gluon_moe_kernel`. ``x [rows, K]`` bf16: the assignments in ``align_assignments``' sorted,
    ``cfg.block_m``-aligned order (``musecore_triton.kernels.moe``), ``blk_expert`` int32 ``[rows / block_m]``.
    ``stack`` (and ``stack2`` for gate/up with SwiGLU) is ``(packed [E, N, K/2], scales [E, N, K/16], out_scale
    [E])`` of an NVFP4 expert stack in the resident layout (both with ``fold_log2``); ``out`` is ``[rows, N]``."""
    w, words, w2, words2, out_n = check_grouped(x, blk_expert, stack, out, fold_log2=fold_log2, cfg=cfg,
                                                stack2=stack2)
    rows, k = x.shape
    n = out.shape[1]
    w_desc, w2_desc = _descriptor(w, [out_n, 64], gl.uint8), _descriptor(w2, [out_n, 64], gl.uint8)
    x_desc = _descriptor(x, [cfg.block_m, 64], gl.bfloat16)
    scale2 = stack2[2] if stack2 is not None else stack[2]
    if rows:
        fp4_gluon_moe_kernel[(rows // cfg.block_m * (n // out_n),)](
            w_desc, w2_desc, x_desc, words, words2, words.stride(0), stack[2], scale2, blk_expert, out, out.stride(0),
            rows, n, k, BLOCK_N=cfg.block_n, BLOCK_M=cfg.block_m, STAGES=cfg.stages, GROUP_M=cfg.group_m,
            FOLD=fold_log2, SWIGLU=stack2 is not None, PAIR=2 if cfg.pair else 1, LATE=cfg.late, AHEAD=cfg.ahead,
            **cfg.launch_options)
    return out
