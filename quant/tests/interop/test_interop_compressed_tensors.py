"""NVFP4 against compressed-tensors 0.20.1's own quantizer and ``nvfp4-pack-quantized`` compressor.

Skipped unless compressed-tensors is importable (``pip install --no-deps compressed-tensors``
plus ``loguru``; it imports transformers and pydantic, which the main environment has). The
producer side is what llm-compressor runs for an NVFP4 weight, on CPU: the global scale from
``generate_gparam(min, max)`` (``2688 / amax``), the E4M3 block scales from
``calculate_qparams(group_min, group_max, args, global_scale)``, then
``NVFP4PackedCompressor.compress``, whose CPU path is ``quantize`` (``x / (scale / global_scale)``,
RNE ``cast_to_fp4``) and ``pack_fp4_to_uint8``.

What matches exactly, on ordinary weights: the E4M3 block-scale bytes, the nibble packing and
element rounding (RNE, same sign rule), and ``1 / weight_global_scale`` is our ``weight_scale_2``
within one fp32 ulp (their ``448 * 6 / amax`` is evaluated by torch as ``2688 * fp32(1 / amax)``;
not always bit-equal to ``amax / 2688``). Our reader turns their tensors
into the QTensor whose bf16 dequantization equals their ``decompress`` bit for bit.

Differences by design, pinned below (neither violates FORMATS.md, whose NVFP4 rule is ModelOpt's):

- element divisor: they divide by ``fp32(scale) / global_scale``, we (as ModelOpt) by
  ``fp32(scale) * weight_scale_2``. The two fp32 divisors can differ by one ulp, and then a weight
  exactly at an E2M1 tie for one of us (common with bf16 weights) is one ulp beside it for the
  other, so it rounds one code apart (ours 1.75 -> 2 where theirs is 1.7499999 -> 1.5; ours
  0.7499999 -> 0.5 where theirs is 0.75 -> 1). Every one of their bytes is reproduced by our
  element rounding applied to their divisor, and fp32 weights (no exact ties) give identical bytes.
- tiny blocks: a block scale that underflows E4M3 (``block_amax / (6 * weight_scale_2) < 2^-10``),
  and an all-zero block, get scale 0.125 from them (their "eps"); ModelOpt and we clamp to 2^-9
  (0x01), and give an all-zero block 1.0 (0x38).
- they compute the global scale in the dtype of the observed min/max: observed in bf16, it is
  rounded to bf16 (``2688 / bf16_amax`` in bf16) before the cast to fp32.
"""

import json

import pytest
import torch

pytest.importorskip("compressed_tensors",
                    reason="compressed-tensors is not installed (pip install --no-deps compressed-tensors loguru)")

from compressed_tensors.compressors.model_compressors.model_compressor import ModelCompressor  # noqa: E402
from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor  # noqa: E402
from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8  # noqa: E402
from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme  # noqa: E402
from compressed_tensors.quantization.lifecycle.forward import dequantize as ct_dequantize  # noqa: E402
from compressed_tensors.quantization.quant_scheme import NVFP4  # noqa: E402
from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam  # noqa: E402

import musecore_quant  # noqa: E402
from musecore_quant.checkpoint import open_checkpoint  # noqa: E402
from musecore_quant.formats.fp4 import fp4_encode, pack_nibbles, unpack_nibbles  # noqa: E402
from musecore_quant.formats.nvfp4 import nvfp4_input_scale  # noqa: E402
from test_checkpoint_helpers import muse_config, write_hf_checkpoint  # noqa: E402

SCHEME = QuantizationScheme(targets=["Linear"], format="nvfp4-pack-quantized", **NVFP4)
ARGS = SCHEME.weights
MOD = "model.layers.1.mlp.experts.0.up_proj"
CASES = [(0, (64, 256), torch.bfloat16), (1, (128, 512), torch.bfloat16), (2, (32, 1024), torch.bfloat16),
         (3, (256, 128), torch.float32), (4, (96, 2048), torch.bfloat16)]


def _weight(seed, shape, dtype=torch.bfloat16, std=0.02):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * std).to(dtype)


def _ct_compress(w: torch.Tensor, observe_dtype=torch.float32, input_amax=None) -> dict:
    """What llm-compressor's min-max observer + compressed-tensors' compressor write for ``w``."""
    x = w.to(observe_dtype)
    global_scale = generate_gparam(x.min(), x.max())                      # 448 * 6 / amax, fp32 [1]
    groups = x.unflatten(-1, (-1, ARGS.group_size))
    scale, zero_point = calculate_qparams(groups.amin(-1), groups.amax(-1), ARGS, global_scale=global_scale)
    state = {"weight": w, "weight_scale": scale, "weight_global_scale": global_scale,
             "weight_zero_point": zero_point}
    if input_amax is not None:
        state["input_global_scale"] = generate_gparam(torch.tensor(-input_amax), torch.tensor(input_amax))
    return dict(NVFP4PackedCompressor.compress(state, SCHEME))


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    return abs(a.float().reshape(()).view(torch.int32).item() - b.float().reshape(()).view(torch.int32).item())


def _scaled(w, scale_e4m3, divisor_of):
    """fp32 ``w / divisor`` per 16-block, with ``divisor_of(fp32 block scale)``."""
    return (w.float().unflatten(-1, (-1, 16)) / divisor_of(scale_e4m3.float()).unsqueeze(-1)).flatten(-2)


@pytest.mark.parametrize("seed,shape,dtype", CASES)
def test_nvfp4_scales_and_global_scale_match_compressed_tensors(seed, shape, dtype):
    w = _weight(seed, shape, dtype)
    theirs, ours = _ct_compress(w), musecore_quant.quantize(w, "nvfp4")
    assert set(theirs) == {"weight_packed", "weight_scale", "weight_global_scale"}
    assert theirs["weight_scale"].dtype == torch.float8_e4m3fn and theirs["weight_global_scale"].dtype == torch.float32
    amax = w.float().abs().max()
    # 448 * 6 / amax, computed as torch computes scalar / tensor: 2688 * fp32(1 / amax).
    assert _ulps(theirs["weight_global_scale"], amax.reciprocal() * 2688.0) == 0
    assert _ulps(1.0 / theirs["weight_global_scale"], ours.global_scale) <= 1        # our weight_scale_2
    assert torch.equal(theirs["weight_scale"].view(torch.uint8), ours.scale.view(torch.uint8))


@pytest.mark.parametrize("seed,shape,dtype", CASES)
def test_nvfp4_bytes_match_compressed_tensors_except_ties_moved_by_their_divisor(seed, shape, dtype):
    w = _weight(seed, shape, dtype)
    theirs, ours = _ct_compress(w), musecore_quant.quantize(w, "nvfp4")
    gs, s = theirs["weight_global_scale"], theirs["weight_scale"]
    # (1) their element rounding and packing are ours: our fp4_encode + pack on their divisor gives
    # every one of their bytes.
    their_x = _scaled(w, s, lambda f: f / gs)
    assert torch.equal(pack_nibbles(fp4_encode(their_x)), theirs["weight_packed"])
    # (2) the only codes that differ from ours are where one of the two quotients (ours
    # W / (s * weight_scale_2), theirs W / (s / global_scale)) is an exact E2M1 tie and the other
    # lies one ulp beside it: one code step apart, in the direction of their quotient.
    our_x = _scaled(w, ours.scale, lambda f: f * ours.global_scale)
    their_codes, our_codes = unpack_nibbles(theirs["weight_packed"]), unpack_nibbles(ours.data)
    differ = their_codes != our_codes
    midpoints = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    ties = torch.isin(our_x.abs(), midpoints) | torch.isin(their_x.abs(), midpoints)
    assert bool((ties | ~differ).all()), "a code differs away from a tie"
    step = torch.where(their_x.abs() < our_x.abs(), -1, 1)[differ]
    assert torch.equal((our_codes[differ] & 7).int() + step, (their_codes[differ] & 7).int())
    assert torch.equal(our_codes[differ] & 8, their_codes[differ] & 8)
    if dtype == torch.float32:
        assert not bool(differ.any()), "fp32 weights have no exact ties; the bytes must be identical"


def test_nvfp4_bytes_identical_to_compressed_tensors_when_divisors_agree():
    # Where both divisors round to the same fp32 number, there is no difference at all.
    for seed, shape, dtype in CASES:
        w = _weight(seed, shape, dtype)
        theirs, ours = _ct_compress(w), musecore_quant.quantize(w, "nvfp4")
        f = theirs["weight_scale"].float()
        same = (f / theirs["weight_global_scale"]) == (f * ours.global_scale)       # [out, in/16]
        same_bytes = same.repeat_interleave(8, dim=-1)
        assert bool(same.any())
        assert torch.equal(theirs["weight_packed"][same_bytes], ours.data[same_bytes])


def test_nvfp4_tiny_and_zero_blocks_differ_by_design():
    # Row 0: an all-zero block and a block far below the tensor amax (its E4M3 scale underflows).
    w = torch.zeros(2, 32)
    w[0, 16:] = 1e-6
    w[1, :] = torch.linspace(-1, 1, 32)
    theirs, ours = _ct_compress(w), musecore_quant.quantize(w, "nvfp4")
    assert theirs["weight_scale"].view(torch.uint8)[0].tolist() == [0x20, 0x20]      # 0.125, 0.125 (their eps)
    assert ours.scale.view(torch.uint8)[0].tolist() == [0x38, 0x01]                  # 1.0, 2^-9 (ModelOpt's clamp)
    assert torch.equal(theirs["weight_scale"].view(torch.uint8)[1], ours.scale.view(torch.uint8)[1])
    assert torch.equal(theirs["weight_packed"][1], ours.data[1])
    assert theirs["weight_packed"][0].tolist() == [0] * 16                            # 1e-6 flushes to zero


def test_nvfp4_global_scale_observed_in_bf16_is_rounded_to_bf16():
    w = _weight(2, (32, 1024))
    amax = w.float().abs().max()
    theirs = _ct_compress(w, observe_dtype=torch.bfloat16)["weight_global_scale"]
    assert theirs.item() == (torch.tensor(2688.0, dtype=torch.bfloat16) / amax.bfloat16()).float().item()
    assert _ulps(theirs, torch.tensor(2688.0) / amax) > 0


def _ct_checkpoint(tmp_path, tensors: dict) -> "object":
    """A folder as llm-compressor saves it: safetensors + config.json with compressed-tensors'
    own ``quantization_config`` (ModelCompressor.update_config)."""
    plain = {"model.norm.weight": torch.ones(256, dtype=torch.bfloat16)}
    folder = write_hf_checkpoint(tmp_path / "ct", {**plain, **tensors}, muse_config(), shards=1)
    config = QuantizationConfig(config_groups={"group_0": SCHEME}, format="nvfp4-pack-quantized",
                                quantization_status="compressed", ignore=["lm_head"])
    ModelCompressor(quantization_config=config).update_config(str(folder))
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "nvfp4-pack-quantized"
    return folder


@pytest.mark.parametrize("seed,shape,dtype", CASES[:3])
def test_reader_reads_compressed_tensors_output_into_the_same_qtensor(tmp_path, seed, shape, dtype):
    w = _weight(seed, shape, dtype)
    theirs = _ct_compress(w, input_amax=3.5)
    assert set(theirs) == {"weight_packed", "weight_scale", "weight_global_scale", "input_global_scale"}
    folder = _ct_checkpoint(tmp_path, {f"{MOD}.{k}": v for k, v in theirs.items()})
    ckpt = open_checkpoint(folder)
    assert (ckpt.format, ckpt.producer) == ("nvfp4", "compressed-tensors")
    got = ckpt.read(f"{MOD}.weight")
    assert got.format == "nvfp4" and tuple(got.shape) == tuple(w.shape)
    assert torch.equal(got.data, theirs["weight_packed"])
    assert torch.equal(got.scale.view(torch.uint8), theirs["weight_scale"].view(torch.uint8))
    assert _ulps(got.global_scale, 1.0 / theirs["weight_global_scale"]) == 0
    assert _ulps(got.global_scale, musecore_quant.quantize(w, "nvfp4").global_scale) == 0
    assert _ulps(got.input_scale, 1.0 / theirs["input_global_scale"]) == 0
    assert _ulps(got.input_scale, nvfp4_input_scale(3.5)) <= 1
    # Dequantized: their decompress (bf16) equals ours cast to bf16 bit for bit; in fp32 the two
    # multiplier orders (scale / gs vs scale * (1/gs)) agree within one ulp.
    ours = musecore_quant.dequantize(got)
    assert torch.equal(NVFP4PackedCompressor.decompress(dict(theirs), SCHEME)["weight"], ours.bfloat16())
    m, n = theirs["weight_packed"].shape
    theirs_f32 = ct_dequantize(x_q=unpack_fp4_from_uint8(theirs["weight_packed"], m, 2 * n, dtype=torch.float32),
                               scale=theirs["weight_scale"].float(), args=ARGS,
                               global_scale=theirs["weight_global_scale"], dtype=torch.float32)
    rel = ((theirs_f32 - ours).abs() / ours.abs().clamp_min(1e-30)).max().item()
    assert rel <= 2.0 ** -23
