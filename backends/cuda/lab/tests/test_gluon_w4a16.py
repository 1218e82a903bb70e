"""The Gluon W4A16 GEMM (``musecore_cuda/kernels/fp4_gemm_gluon.py``: swap-AB, register-A ``wgmma``, TMA ring,
warp specialization) in all three upcast modes, the lab's baselines included; ``fp4_linear``'s routed "gluon" path
(packed upcast, ``pick_config``) is tested in ``backends/cuda/tests/test_cuda_linear.py``.

CPU tests (no GPU, no Triton): the packed upcast's inline PTX (``upcast="packed"``), read from the kernel's source
and run by a small interpreter of the PTX instructions it uses, against the E2M1 x E4M3 reference for every byte x
every non-negative e4m3 scale byte, and bit for bit against the element-wise form (``upcast="int16"``).

GPU tests (marked ``gpu``; they need an SM90 GPU and Triton's Gluon): the kernel against the reference linear, in
every upcast mode: ``pytest -m gpu backends/cuda/lab/tests/test_gluon_w4a16.py``."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch

import musecore_quant
from musecore.ops import Weight, tolerance
from musecore.ops import reference as ref
from musecore_quant.formats.fp4 import e2m1_table
from musecore_triton.layouts import prepare_fp4
from musecore_triton.testing import DEVICE, assert_nmse

KERNEL = Path(__file__).resolve().parents[2] / "musecore_cuda" / "kernels" / "fp4_gemm_gluon.py"
MODES = ["int16", "asm", "packed"]
MODE_IDS = ["int16_upcast", "asm_upcast", "packed_upcast"]
NVFP4_FOLD = 9  # musecore_triton.kernels.fp4_gemm.NVFP4_FOLD_LOG2
EB = 126        # fp4_gemm_gluon.EB


# ---------------------------------------------------------------------------------------------------------------
# CPU: the packed upcast's PTX, interpreted

def kernel_asm(name: str) -> str:
    """The PTX string of ``name = gl.constexpr(\"\"\"...\"\"\")`` or ``name = gl.constexpr(f())`` in fp4_gemm_gluon.py
    (parsed, not imported: the module needs Triton's Gluon; ``f`` is a plain-Python module function, run alone)."""
    tree = ast.parse(KERNEL.read_text())
    functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == name:
            arg = node.value.args[0]
            if isinstance(arg, ast.Constant):
                return arg.value
            namespace: dict = {}
            exec(compile(ast.Module([functions[arg.func.id]], []), "fp4_gemm_gluon.py", "exec"), namespace)
            return namespace[arg.func.id]()
    raise AssertionError(f"{name} not found in fp4_gemm_gluon.py")


M32 = 0xFFFFFFFF


def _bf16_mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """mul.rn.bf16x2 on 32-bit patterns: per 16-bit lane, the exact product rounded to bf16 (fp64 holds it)."""
    out = torch.zeros_like(a)
    for shift in (0, 16):
        x = (((a >> shift) & 0xFFFF).to(torch.int16)).view(torch.bfloat16).double()
        y = (((b >> shift) & 0xFFFF).to(torch.int16)).view(torch.bfloat16).double()
        out |= ((x * y).to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF) << shift
    return out


def run_ptx(asm: str, args: dict[int, torch.Tensor], lanes: torch.Tensor | None = None) -> dict[int, torch.Tensor]:
    """Interpret the PTX subset of the packed upcast on int64 tensors (one element per case; shfl works on the last
    dimension, whose index is the lane within a 4-lane segment). ``args`` maps operand numbers to inputs; returns the
    registers written to operands."""
    regs: dict[str, torch.Tensor] = {f"${k}": v for k, v in args.items()}
    like = next(iter(args.values()))

    def val(tok: str) -> torch.Tensor:
        tok = tok.strip()
        if tok in regs:
            return regs[tok]
        if tok == "%laneid":
            return lanes.expand_as(like)
        if re.fullmatch(r"0x[0-9a-fA-F]+|\d+", tok):
            return torch.full_like(like, int(tok, 0))
        raise AssertionError(f"unknown operand {tok!r}")

    body = asm.strip().strip("{}")
    for stmt in (s.strip() for s in body.replace("\n", " ").split(";")):
        if not stmt or stmt.startswith(".reg"):
            continue
        op, rest = stmt.split(None, 1)
        ops = [t.strip() for t in re.findall(r"\s*(\{[^}]*\}|[^,]+)", rest)]
        dst, src = ops[0], ops[1:]
        if op in ("mov.b64", "mov.b32", "mov.u32") and dst.startswith("{"):  # split a register into halves
            width = 32 if op == "mov.b64" else 16
            lo, hi = (t.strip() for t in dst.strip("{}").split(","))
            x = val(src[0])
            regs[lo], regs[hi] = x & ((1 << width) - 1), (x >> width) & ((1 << width) - 1)
            continue
        if op == "mov.b32" and src[0].startswith("{"):  # join two 16-bit halves
            lo, hi = (val(t) for t in src[0].strip("{}").split(","))
            regs[dst] = lo | (hi << 16)
            continue
        if op in ("mov.b32", "mov.u32"):
            regs[dst] = val(src[0]) & M32
        elif op == "prmt.b32":
            pool = val(src[0]) | (val(src[1]) << 32)
            sel = val(src[2])
            out = torch.zeros_like(pool)
            for i in range(4):
                nib = (sel >> (4 * i)) & 0xF
                byte = (pool >> (8 * (nib & 7))) & 0xFF
                byte = torch.where((nib & 8) != 0, torch.where((byte & 0x80) != 0, 0xFF, 0), byte)
                out |= byte << (8 * i)
            regs[dst] = out
        elif op == "shl.b32":
            regs[dst] = (val(src[0]) << int(src[1], 0)) & M32
        elif op == "shr.b32":
            regs[dst] = val(src[0]) >> int(src[1], 0)
        elif op == "and.b32":
            regs[dst] = val(src[0]) & val(src[1])
        elif op == "mad.lo.u32":
            regs[dst] = (val(src[0]) * val(src[1]) + val(src[2])) & M32
        elif op == "lop3.b32":
            a, b, c, lut = val(src[0]), val(src[1]), val(src[2]), int(src[3], 0)
            out = torch.zeros_like(a)
            for i in range(8):
                if lut >> i & 1:
                    out |= ((a if i & 4 else ~a) & (b if i & 2 else ~b) & (c if i & 1 else ~c)) & M32
            regs[dst] = out
        elif op == "mul.rn.bf16x2":
            regs[dst] = _bf16_mul(val(src[0]), val(src[1]))
        elif op == "shfl.sync.idx.b32":
            assert src[2] == "0x1C03" and src[3] == "0xffffffff", "only shuffles within 4-lane segments"
            x = val(src[0])
            regs[dst] = x[..., int(src[1], 0)].unsqueeze(-1).expand_as(x).clone()
        else:
            raise AssertionError(f"the interpreter does not know {op}")
    return {int(k[1:]): v for k, v in regs.items() if k.startswith("$") and int(k[1:]) not in args}


def packed_multipliers(words: torch.Tensor, fold: int) -> torch.Tensor:
    """The scale asm for 8-byte words ``[cases]`` (int64) in the 4 lanes of a row -> ``[cases, 4]`` int64 bf16 pairs
    (multiplier of group l, of group l + 4), as lane 0 sees them (every lane must see the same: checked)."""
    lanes = torch.arange(4, dtype=torch.int64)
    sel = run_ptx(kernel_asm("_SCALE_SEL_ASM"), {1: torch.zeros(1, 4, dtype=torch.int64)}, lanes)[0]
    km = (EB - fold + 127) * 128 * 65537
    out = run_ptx(kernel_asm("_SCALES_ASM"), {4: words[:, None].expand(-1, 4), 5: torch.full((len(words), 4), km),
                                              6: sel.expand(len(words), 4)}, lanes)
    pairs = torch.stack([out[g] for g in range(4)], dim=-1)  # [cases, lane, l]
    assert torch.equal(pairs, pairs[:, :1].expand_as(pairs)), "the four lanes of a row disagree"
    return pairs[:, 0]


def bf16_bits_value(bits: torch.Tensor) -> torch.Tensor:
    return (bits & 0xFFFF).to(torch.int16).view(torch.bfloat16).double()


def e4m3_value(b: torch.Tensor) -> torch.Tensor:
    return b.to(torch.uint8).view(torch.float8_e4m3fn).double()


def elementwise_form(codes: torch.Tensor, scale_bytes: torch.Tensor, fold: int) -> torch.Tensor:
    """The int16 upcast's bf16 bits (``_upcast`` x ``_group_scale``): code bits times e4m3 -> bf16 times 2**(EB -
    fold), each product rounded to bf16 (they are exact)."""
    bits = ((codes & 7) << 6) | ((codes & 8) << 12)
    mult = (e4m3_value(scale_bytes).to(torch.bfloat16).double() * 2.0 ** (EB - fold)).to(torch.bfloat16)
    return (bf16_bits_value(bits) * mult.double()).to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF


@pytest.mark.parametrize("fold", [NVFP4_FOLD, 7, 40, 116])
def test_packed_scales_every_e4m3_byte_at_every_group(fold):
    """Every non-negative e4m3 scale byte (0-126, subnormals included) at every byte g of the word, the other seven
    bytes random: the pair for group g must be e4m3 * 2**(EB - fold) exactly, in both halves as the A step needs."""
    gen = torch.Generator().manual_seed(fold)
    b = torch.arange(127, dtype=torch.int64)
    worst = 0.0
    for g in range(8):
        rest = torch.randint(0, 127, (127, 8), generator=gen, dtype=torch.int64)
        rest[:, g] = b
        words = sum(rest[:, i] << (8 * i) for i in range(8))
        pairs = packed_multipliers(words, fold)  # [127, 4]: (group l, group l + 4)
        got = bf16_bits_value(pairs[:, g % 4] >> (16 * (g // 4)))
        want = e4m3_value(b) * 2.0 ** (EB - fold)
        worst = max(worst, ((got - want).abs() / want.clamp_min(2.0 ** -140)).max().item())
        assert torch.equal(got, want), f"group {g}, fold {fold}: max relative error {worst:.3g}"


@pytest.mark.parametrize("fold", [NVFP4_FOLD, 7, 116])
def test_packed_upcast_every_byte_times_every_scale_exact(fold):
    """Every packed byte (both nibbles) x every e4m3 scale byte 0-126 through the scale asm and the element asm:
    each bf16 equals E2M1(code) * e4m3 * 2**-fold exactly (musecore_quant's E2M1 table, fp64) and is bit for bit
    the element-wise form's (negative zero included); then random words and scales, every operand distinct, to
    catch a lane or a register crossed over."""
    asm = kernel_asm("_UPCAST_PACKED_ASM")
    table = e2m1_table().double()
    gen = torch.Generator().manual_seed(fold)
    byte = torch.arange(256, dtype=torch.int64).repeat_interleave(127)       # every byte x every scale
    scale = torch.arange(127, dtype=torch.int64).repeat(256)
    for exhaustive in (True, False):
        n = len(byte)
        if exhaustive:  # four u16 words [b0 b1]: bytes b, 255 - b, (b + 85) % 256, (b * 7) % 256, one scale
            b = torch.stack([byte, 255 - byte, (byte + 85) % 256, (byte * 7) % 256,
                             (byte + 1) % 256, (byte + 128) % 256, (byte * 3) % 256, (byte ^ 0x5A)], dim=1)
            s = torch.stack([scale, scale, scale, scale], dim=1)  # (lo r, hi r, lo r+8, hi r+8)
        else:
            b = torch.randint(0, 256, (n, 8), generator=gen, dtype=torch.int64)
            s = torch.randint(0, 127, (n, 4), generator=gen, dtype=torch.int64)
        # the row words: row r's group l = s[:, 0], group l + 4 = s[:, 1]; row r + 8's: s[:, 2], s[:, 3] (l = 1)
        words = torch.stack([(s[:, 0] << 8) | (s[:, 1] << 40), (s[:, 2] << 8) | (s[:, 3] << 40)])  # bytes 1 and 5
        m = packed_multipliers(words.reshape(-1), fold).reshape(2, n, 4)[..., 1]   # pairs of step l = 1
        v = [b[:, 2 * i] | (b[:, 2 * i + 1] << 8) for i in range(4)]  # (r, c), (r+8, c), (r, c+4), (r+8, c+4)
        # pack=8 in register order: $8-$15 the words (each twice), $16-$23 the rows' pairs (r, r, r+8, r+8, ...)
        args = {8 + 2 * i + j: v[i] for i in range(4) for j in range(2)}
        args.update({16 + 2 * i + j: m[i % 2] for i in range(4) for j in range(2)})
        out = run_ptx(asm, args)
        # output register o: low nibbles ($0-$3) or high ($4-$7) of word o % 4, lanes (byte 0, byte 1)
        for o in range(8):
            word, nib = o % 4, o // 4
            row = word % 2  # words 0, 2: row r; 1, 3: row r + 8
            sb = s[:, 2 * row + nib]
            for lane in range(2):
                code = (b[:, 2 * word + lane] >> (4 * nib)) & 15
                got_bits = (out[o] >> (16 * lane)) & 0xFFFF
                got = bf16_bits_value(got_bits)
                want = table[code] * e4m3_value(sb) * 2.0 ** -fold
                err = ((got - want).abs() / want.abs().clamp_min(2.0 ** -140)).max().item()
                assert torch.equal(got, want), (f"output ${o} lane {lane} ({'exhaustive' if exhaustive else 'random'}"
                                                f", fold {fold}): max relative error {err:.3g}")
                ref_bits = elementwise_form(code, sb, fold)
                assert torch.equal(got_bits, ref_bits), f"output ${o} lane {lane}: not bit-identical to int16"


# ---------------------------------------------------------------------------------------------------------------
# GPU: the kernel

@pytest.fixture(scope="module")
def gk():
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper", reason="needs Triton's Gluon (>= 3.5)")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("needs an SM90 (Hopper) GPU: TMA and wgmma")
    from musecore_cuda.kernels import fp4_gemm_gluon
    return fp4_gemm_gluon


def reference_linear(x: torch.Tensor, qt) -> torch.Tensor:
    dense = musecore_quant.dequantize(qt).to(x.device)
    return ref.linear(x.float(), Weight(data=dense, format=qt.format, out_features=dense.shape[0],
                                        in_features=dense.shape[1]))


def gluon_linear(gk, x, w, cfg, out=None):
    n, k = w.out_features, w.in_features
    if out is None:
        out = (torch.zeros(x.shape[0], n, dtype=torch.float32, device=x.device) if cfg.atomic
               else torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device))
    gk.launch(x, w.packed, w.scales, w.out_scale, wfmt=w.wfmt, group=w.group, fold_log2=w.fold_log2, n=n, k=k,
              out=out, cfg=cfg)
    return out.to(x.dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("m,cut", [
    (5, (64, 16, 2, 4)),       # partial token tile (TMA zero fill), split-K
    (16, (128, 16, 1, 6)),
    (40, (64, 32, 1, 3)),      # two token tiles, the second partial; ring wraps (8 chunks, 3 stages)
    (64, (128, 64, 2, 4)),
    (200, (128, 128, 1, 4)),   # partial last tile
    (256, (64, 256, 1, 2)),
])
@pytest.mark.parametrize("upcast", MODES, ids=MODE_IDS)
def test_gluon_gemm_matches_reference(gk, m, cut, upcast):
    cfg = gk.GluonConfig(*cut, upcast=upcast)
    n, k = 320, 1024  # N not a multiple of 128: the last weight tile is partial (TMA zero fill, masked scales)
    w = torch.randn(n, k) * 0.05
    w[3, :16] *= 40  # one block with a large scale, one nearly empty
    w[7, 32:64] *= 1e-3
    qt = musecore_quant.quantize(w, "nvfp4")
    x = torch.randn(m, k, device=DEVICE).to(torch.bfloat16)
    y = gluon_linear(gk, x, prepare_fp4(qt, DEVICE), cfg)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    assert_nmse(reference_linear(x, qt), y, tolerance("linear"), f"nvfp4 Gluon M={m} {cfg}")


@pytest.mark.gpu
@pytest.mark.parametrize("upcast", MODES, ids=MODE_IDS)
def test_gluon_gemm_upcasts_every_code_exactly(gk, upcast):
    """Every E2M1 code at every nibble position (one-hot activation rows, 64 per call, fp32 output through
    split-K): each output within 1e-6 relative of the dequantized weight, as for the CUDA kernels."""
    n, k = 64, 1024
    codes = (torch.arange(n)[:, None] + torch.arange(k)[None, :]) % 16
    values = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])[codes]
    values = values * (1 + torch.arange(k // 16).repeat_interleave(16) % 5)[None, :]  # varied group scales
    qt = musecore_quant.quantize(values, "nvfp4")
    dense = musecore_quant.dequantize(qt).float().to(DEVICE)
    w = prepare_fp4(qt, DEVICE)
    cfg = gk.GluonConfig(64, 64, 2, 3, upcast=upcast)
    for start in range(0, k, 64):
        x = torch.eye(k, device=DEVICE)[start:start + 64].to(torch.bfloat16)
        out = torch.zeros(64, n, dtype=torch.float32, device=DEVICE)
        gk.launch(x, w.packed, w.scales, w.out_scale, wfmt=w.wfmt, group=w.group, fold_log2=w.fold_log2, n=n, k=k,
                  out=out, cfg=cfg)
        expected = dense[:, start:start + 64].T
        err = ((out - expected).abs() / expected.abs().clamp_min(1e-30)).max()
        assert err <= 1e-6, f"columns {start}..{start + 63}: max relative error {err:.3g} > 1e-6"


@pytest.mark.gpu
@pytest.mark.parametrize("upcast", MODES, ids=MODE_IDS)
def test_gluon_gemm_every_byte_and_scale_byte_exactly(gk, upcast):
    """Raw resident bytes, no quantizer in between: every packed byte value and every non-negative e4m3 scale byte
    0-126 (zero and the subnormals 1-7 included, which quantize() rarely writes) in one weight; one-hot activation
    rows read the upcast weight back through the fp32 accumulator (split-K output), each value within 1e-6 relative
    of E2M1 x e4m3 x out_scale computed on the host (the products are exact in bf16 and fp32)."""
    n, k = 128, 2048
    gen = torch.Generator().manual_seed(0)
    packed = ((torch.arange(n)[:, None] * 37 + torch.arange(k // 2)[None, :]) % 256).to(torch.uint8)
    scales = ((torch.arange(n)[:, None] * 11 + torch.arange(k // 16)[None, :] * 5) % 127).to(torch.uint8)
    scales[:, ::7] = torch.randint(0, 8, scales[:, ::7].shape, generator=gen, dtype=torch.uint8)  # zero, subnormal
    out_scale = torch.tensor([2.0 ** NVFP4_FOLD * 0.75], device=DEVICE)
    codes = torch.stack([packed & 15, packed >> 4], dim=-1)                 # resident: byte j = elements j, j + 64
    codes = codes.reshape(n, k // 128, 64, 2).permute(0, 1, 3, 2).reshape(n, k)
    dense = (e2m1_table().double()[codes.long()] * scales.view(torch.float8_e4m3fn).double().repeat_interleave(16, 1)
             * 0.75).float().to(DEVICE)
    cfg = gk.GluonConfig(64, 64, 2, 3, upcast=upcast)
    packed, scales = packed.to(DEVICE), scales.to(DEVICE)
    worst = 0.0
    for start in range(0, k, 64):
        x = torch.eye(k, device=DEVICE)[start:start + 64].to(torch.bfloat16)
        out = torch.zeros(64, n, dtype=torch.float32, device=DEVICE)
        gk.launch(x, packed, scales, out_scale, wfmt=gk.WFMT_NVFP4, group=16, fold_log2=NVFP4_FOLD, n=n, k=k,
                  out=out, cfg=cfg)
        expected = dense[:, start:start + 64].T
        err = ((out - expected).abs() / expected.abs().clamp_min(1e-30)).max().item()
        worst = max(worst, err)
    assert worst <= 1e-6, f"max relative error {worst:.3g} > 1e-6"


@pytest.mark.gpu
def test_gluon_gemm_refuses_what_it_cannot_run(gk):
    w = prepare_fp4(musecore_quant.quantize(torch.randn(64, 256) * 0.05, "nvfp4"), DEVICE)
    with pytest.raises(TypeError, match="bf16 activations"):
        gluon_linear(gk, torch.randn(4, 256, device=DEVICE).half(), w, gk.GluonConfig(64, 16, 1, 3))
    with pytest.raises(ValueError, match="divisible by 128"):
        gluon_linear(gk, torch.randn(4, 256, device=DEVICE).to(torch.bfloat16), w, gk.GluonConfig(64, 16, 4, 3))
    mx = prepare_fp4(musecore_quant.quantize(torch.randn(64, 256) * 0.05, "mxfp4"), DEVICE)
    with pytest.raises(ValueError, match="upcast must be"):
        gk.GluonConfig(64, 16, 1, 3, upcast="fp8")
    with pytest.raises(ValueError, match="NVFP4"):
        gluon_linear(gk, torch.randn(4, 256, device=DEVICE).to(torch.bfloat16), mx, gk.GluonConfig(64, 16, 1, 3))
