"""Block shapes of every Pallas kernel of this package, the TPU tiling rules they obey, and their VMEM footprint.

Pure Python (no jax): the plan, ``kernel_choices`` and the tiling test use it without the hardware.

TPU rules (Pallas TPU guide, "Noteworthy properties and restrictions",
https://docs.jax.dev/en/latest/pallas/tpu/details.html): a block's last two dimensions are multiples of
(8, 128) for 32-bit types, or equal to the array's dimensions. Narrower types pack along sublanes, so their
second-minor multiple grows with the packing (16 for bf16, 32 for 8-bit codes; jax's
``jax/_src/pallas/mosaic/tpu_info.py`` ``_get_tiling_factor``). VMEM per TensorCore: 128 MiB on v6e, 64 MiB
on v7 (jax 0.10.2 ``pltpu.get_tpu_info_for_chip``; :data:`musecore_tpu.chips.CHIPS`). A kernel's footprint is
its blocks double-buffered by the pipeline, plus scratch, plus the decoded weight tile it builds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from musecore_quant.formats.facts import block_size

LANES = 128
SUBLANES_32BIT = 8
BYTES = {"f32": 4, "i32": 4, "bf16": 2, "u8": 1, "i8": 1, "fp8": 1}


def sublane_multiple(dtype: str) -> int:
    """Second-minor multiple of a block of ``dtype``: 8 for 32-bit, 16 for 16-bit, 32 for 8-bit."""
    return SUBLANES_32BIT * 4 // BYTES[dtype]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def round_up(a: int, b: int) -> int:
    return cdiv(a, b) * b


@dataclass(frozen=True)
class Block:
    """One operand's block: ``shape`` of the block, ``array`` the trailing dims of the array it tiles."""

    name: str
    shape: tuple[int, ...]
    array: tuple[int, ...]
    dtype: str
    buffers: int = 2  # the pipeline double-buffers inputs and outputs; scratch is 1

    @property
    def nbytes(self) -> int:
        n = BYTES[self.dtype]
        for s in self.shape:
            n *= s
        return n * self.buffers

    def violation(self) -> Optional[str]:
        """Why this block breaks the (sublane, lane) rule, or None."""
        if len(self.shape) < 2:
            return None
        (rows, cols), (arows, acols) = self.shape[-2:], self.array[-2:]
        if cols != acols and cols % LANES:
            return f"{self.name}: last dim {cols} is neither a multiple of {LANES} nor the array's {acols}"
        sub = sublane_multiple(self.dtype)
        if rows != arows and rows % sub:
            return f"{self.name}: second-minor dim {rows} is neither a multiple of {sub} ({self.dtype}) nor the array's {arows}"
        return None


@dataclass(frozen=True)
class KernelConfig:
    """A kernel launch's blocks, what it decodes in VMEM, and the grid."""

    kernel: str
    blocks: tuple[Block, ...]
    grid: tuple[int, ...]
    tiles: tuple[int, ...] = ()  # the kernel's own tile sizes, where it reads them from here

    @property
    def vmem_bytes(self) -> int:
        return sum(b.nbytes for b in self.blocks)

    def violations(self) -> list[str]:
        return [v for b in self.blocks if (v := b.violation()) is not None]


# -- matmul (linear and each expert projection) ------------------------------------------------------------------

SCALE_DTYPE = {"int4": "f32", "mxfp4": "u8", "nvfp4": "u8"}  # resident scale dtype (musecore_tpu.layouts)
GROUP = {fmt: block_size(fmt) for fmt in SCALE_DTYPE}  # from musecore_quant's format facts
TILE_N = 256   # lanes of an output tile: two MXU columns on v6e/v7 (mxu_column_size 256)
TILE_M = 256
TILE_K_DENSE = 512


def k_tile(fmt: str, K: int, group: Optional[int] = None) -> int:
    """K per grid step. 4-bit: the scale block ``[tk/g, tn]`` must have a legal second-minor dim (8 f32 rows for
    INT4 scales, 32 u8 rows for E8M0/E4M3), so ``tk = g * rows`` (INT4 g128: 1024, MXFP4: 1024, NVFP4: 512),
    halved down to 2 rows' worth when K is smaller; K itself when nothing legal divides it (one K step)."""
    if fmt in ("bf16", "fp16", "fp32", "fp8", "int8"):  # fp8 / int8: per-tensor / per-channel scale, no block rule
        for tk in (TILE_K_DENSE, 256, 128):
            if K % tk == 0:
                return tk
        return K
    g = group or GROUP[fmt]
    tk = g * sublane_multiple(SCALE_DTYPE[fmt])
    if K % tk == 0:
        return tk
    return K


def n_tile(N: int) -> int:
    for tn in (TILE_N, LANES):
        if N % tn == 0:
            return tn
    return N


def m_tile(M: int, dtype: str = "bf16") -> int:
    sub = sublane_multiple(dtype)
    return min(TILE_M, round_up(max(M, 1), sub))


def weight_blocks(fmt: str, K: int, N: int, tk: int, tn: int, group: Optional[int], label: str = "") -> list[Block]:
    """One weight's blocks for a ``[tk, tn]`` tile of ``W^T [K, N]``, and the f32 tile the kernel decodes (the
    decoded values and the broadcast block scales: two f32 tiles, counted once each)."""
    if fmt in ("bf16", "fp16", "fp32", "fp8", "int8"):
        wdt = {"fp32": "f32", "fp8": "fp8", "int8": "i8"}.get(fmt, "bf16")
        blocks = [Block("w^T" + label, (tk, tn), (K, N), wdt), Block("w f32" + label, (tk, tn), (K, N), "f32", 1)]
        if fmt == "int8":  # one f32 scale per output channel: a [1, tn] block of [1, N]
            blocks.append(Block("w scale" + label, (1, tn), (1, N), "f32"))
        return blocks
    g = group or GROUP[fmt]
    blocks = [Block("codes" + label, (tk // 2, tn), (K // 2, N), "u8"),
              Block("scales" + label, (tk // g, tn), (K // g, N), SCALE_DTYPE[fmt])]
    if fmt == "int4":
        blocks.append(Block("zeros" + label, (tk // g, tn), (K // g, N), "f32"))
    return blocks + [Block("decoded w" + label, (tk, tn), (K, N), "f32", 1),
                     Block("scales f32" + label, (tk, tn), (K, N), "f32", 1)]


def matmul_config(fmt: str, M: int, K: int, N: int, group: Optional[int] = None, act: str = "bf16") -> KernelConfig:
    """Blocks of :func:`musecore_tpu.kernels.matmul.matmul` for ``x [M,K] @ W^T`` with W ``[N,K]`` in ``fmt``."""
    tm, tk, tn = m_tile(M, act), k_tile(fmt, K, group), n_tile(N)
    Mp = round_up(M, tm)
    blocks = [Block("x", (tm, tk), (Mp, K), act), Block("x f32", (tm, tk), (Mp, K), "f32", 1)]
    blocks += weight_blocks(fmt, K, N, tk, tn, group)
    blocks += [Block("out", (tm, tn), (Mp, N), act), Block("acc", (tm, tn), (Mp, N), "f32", 1)]
    return KernelConfig(f"matmul-{fmt}", tuple(blocks), (Mp // tm, N // tn, K // tk))


# -- 8-bit weights (kernels/quantized.py) ------------------------------------------------------------------------

TILE_K_Q8 = 512


def q8_tiles(fmt: str, act: Optional[str], M: int, K: int, N: int) -> tuple[int, int, int]:
    """(tm, tk, tn) of :func:`musecore_tpu.kernels.quantized.matmul_q8`: 8-bit activations pack 32 rows per
    sublane tile, 16-bit ones 16; K tiles of 512 (the 8-bit weight block's 32-row rule holds for any multiple)."""
    tm = m_tile(M, "u8" if act else "bf16")
    tk = next((t for t in (TILE_K_Q8, 256, 128) if K % t == 0), K)
    return tm, tk, n_tile(N)


def q8_config(fmt: str, act: Optional[str], M: int, K: int, N: int, per_channel: Optional[bool] = None
              ) -> KernelConfig:
    """Blocks of ``matmul_q8`` (``per_channel``: a ``[1, N]`` weight scale; default: INT8 per channel, FP8 per
    tensor)."""
    tm, tk, tn = q8_tiles(fmt, act, M, K, N)
    Mp = round_up(M, tm)
    per_channel = fmt == "int8" if per_channel is None else per_channel
    blocks = [Block("x", (tm, tk), (Mp, K), "u8" if act else "bf16")]
    if act:
        blocks.append(Block("x scale", (tm, 1), (Mp, 1), "f32"))
    else:
        blocks.append(Block("x bf16", (tm, tk), (Mp, K), "bf16", 1))
    blocks += [Block("w q8", (tk, tn), (K, N), "u8"), Block("w bf16" if not act else "w q8 operand", (tk, tn), (K, N),
                                                                     "u8" if act else "bf16", 1),
               Block("w scale", (1, tn) if per_channel else (1, 1), (1, N) if per_channel else (1, 1), "f32"),
               Block("out", (tm, tn), (Mp, N), "bf16"), Block("acc", (tm, tn), (Mp, N), "f32", 1)]
    return KernelConfig(f"matmul-{fmt}-{act or 'a16'}", tuple(blocks), (Mp // tm, N // tn, K // tk), (tm, tk, tn))


# -- grouped experts ----------------------------------------------------------------------------------------------

TILE_ROWS = 128  # routed rows per grouped-matmul tile (each tile belongs to one expert)


def rows_tile(rows: int, experts: int, act: Optional[str] = None) -> int:
    """Routed rows per tile: about the rows an expert gets (``rows / min(E, rows)``), rounded to bf16's 16
    sublanes (32 for 8-bit ``fp8-token`` / ``int8-token`` rows), at most 128. Decode (8 rows over 8 experts) gets
    16-row tiles,
    not 128 rows of padding."""
    per_expert = cdiv(max(rows, 1), max(min(experts, rows), 1))
    return min(TILE_ROWS, round_up(per_expert, 32 if act else 16))


def moe_configs(fmt: str, tokens: int, top_k: int, experts: int, hidden: int, inter: int,
                group: Optional[int] = None, act: Optional[str] = None) -> list[KernelConfig]:
    """Blocks of the two grouped kernels of :mod:`musecore_tpu.kernels.moe`: gate/up + SwiGLU over ``[tr, tn]``
    output tiles, and down + finalize over full ``h``-wide rows (the post-expert norm needs the whole row).
    ``act="fp8-token"`` / ``"int8-token"``: 8-bit row operands and their per-row f32 scales (int32 accumulators
    for ``int8-token``)."""
    rows = tokens * top_k
    tr = rows_tile(rows, experts, act)
    tiles = cdiv(rows, tr) + min(experts, rows)
    R = tiles * tr
    tk, tn = k_tile(fmt, hidden, group), n_tile(inter)
    code = {"fp8-token": ("e4m3", "fp8"), "int8-token": ("int8", "i8")}.get(act or "", ("", ""))
    acc = "i32" if act == "int8-token" else "f32"
    if act:
        gate_up = [Block(f"x rows {code[0]}", (tr, tk), (R, hidden), code[1]),
                   Block("x scale", (tr, 1), (R, 1), "f32")]
    else:
        gate_up = [Block("x rows", (tr, tk), (R, hidden), "bf16"), Block("x f32", (tr, tk), (R, hidden), "f32", 1)]
    gate_up += weight_blocks(fmt, hidden, inter, tk, tn, group, " gate") + weight_blocks(fmt, hidden, inter, tk, tn,
                                                                                          group, " up")
    gate_up += [Block("h", (tr, tn), (R, inter), "f32"), Block("acc gate", (tr, tn), (R, inter), acc, 1),
                Block("acc up", (tr, tn), (R, inter), acc, 1)]
    tk2 = k_tile(fmt, inter, group)
    h_blocks = ([Block(f"h {code[0]}", (tr, tk2), (R, inter), code[1]), Block("h scale", (tr, 1), (R, 1), "f32")] if act
                else [Block("h", (tr, tk2), (R, inter), "f32")])
    down = h_blocks + weight_blocks(fmt, inter, hidden, tk2, hidden, group, " down")
    down += [Block("post norm", (1, hidden), (1, hidden), "bf16"), Block("routing weight", (tr, 1), (R, 1), "f32"),
             Block("rows out", (tr, hidden), (R, hidden), "f32"), Block("acc", (tr, hidden), (R, hidden), acc, 1)]
    name = fmt + ("-" + act if act else "")
    return [KernelConfig(f"moe-gate-up-{name}", tuple(gate_up), (tiles, inter // tn, hidden // tk)),
            KernelConfig(f"moe-down-{name}", tuple(down), (tiles, inter // tk2))]


# -- attention ----------------------------------------------------------------------------------------------------

TILE_Q_ROWS = 128  # query rows per KV head and step (tq queries x group heads): VMEM holds them for every KV head
TILE_KV = 512


def q_tile(tokens: int, group: int) -> int:
    """Queries per step: ``TILE_Q_ROWS / group`` (16 for the 816B model's 8-head groups), at most ``tokens``.
    With 128 queries x 16 KV heads x 8 the 816B prefill needed 76 MiB of v7's 64 MiB VMEM (libtpu's compiler said so)."""
    return min(tokens, max(1, TILE_Q_ROWS // group))


def attention_config(batch: int, tokens: int, keys: int, q_heads: int, kv_heads: int, head_dim: int,
                     kv_dtype: str = "bf16") -> KernelConfig:
    """Blocks of :func:`musecore_tpu.kernels.attention.attention`: ``tq`` queries of every head and ``tkv`` keys of
    every KV head per step; scores and f32 state per KV head."""
    group = q_heads // kv_heads
    tq, tkv = q_tile(tokens, group), min(TILE_KV, keys)  # the kernel pads tokens and keys up to whole tiles
    tokens, keys = round_up(tokens, tq), round_up(keys, tkv)
    rows = tq * group
    width = kv_heads * head_dim
    blocks = (Block("q", (kv_heads, rows, head_dim), (kv_heads, tokens * group, head_dim), "bf16"),
              Block("q positions", (rows, 1), (tokens * group, 1), "i32"),
              Block("k", (tkv, width), (keys, width), kv_dtype),
              Block("v", (tkv, width), (keys, width), kv_dtype),
              Block("k positions", (1, tkv), (1, keys), "i32"),
              Block("out", (kv_heads, rows, head_dim), (kv_heads, tokens * group, head_dim), "bf16"),
              Block("m", (kv_heads, rows, 1), (kv_heads, rows, 1), "f32", buffers=1),
              Block("l", (kv_heads, rows, 1), (kv_heads, rows, 1), "f32", buffers=1),
              Block("acc", (kv_heads, rows, head_dim), (kv_heads, rows, head_dim), "f32", buffers=1),
              Block("k, v f32", (2 * tkv, head_dim), (2 * keys, head_dim), "f32", buffers=1),
              Block("scores, probabilities", (2 * rows, tkv), (2 * rows, keys), "f32", buffers=1))
    return KernelConfig("attention", blocks, (batch, tokens // tq, keys // tkv))


# -- norms --------------------------------------------------------------------------------------------------------

TILE_NORM_ROWS = 256


def norm_rows_tile(rows: int) -> int:
    return min(TILE_NORM_ROWS, round_up(max(rows, 1), 16))


def norm_config(rows: int, width: int) -> KernelConfig:
    tr = norm_rows_tile(rows)
    Rp = round_up(rows, tr)
    blocks = (Block("residual", (tr, width), (Rp, width), "bf16"), Block("out", (tr, width), (Rp, width), "bf16"),
              Block("weights", (3, width), (3, width), "f32"),
              Block("residual out", (tr, width), (Rp, width), "bf16"), Block("normed", (tr, width), (Rp, width), "bf16"))
    return KernelConfig("residual_norm", blocks, (Rp // tr,))
