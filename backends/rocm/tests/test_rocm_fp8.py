"""gfx942's e4m3fnuz: e4m3fn checkpoint bytes kept with doubled scales give the same values."""

from __future__ import annotations

import torch

from musecore_rocm.fp8 import e4m3fn_to_fnuz, quantize_activation_fnuz


def test_every_e4m3fn_byte_keeps_its_value_after_the_fnuz_conversion():
    all_bytes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    fn = all_bytes.view(torch.float8_e4m3fn)
    scale = torch.tensor(0.0125)
    fnuz, fnuz_scale = e4m3fn_to_fnuz(fn, scale)
    assert fnuz_scale.item() == 2 * scale.item()
    want = fn.float() * scale
    got = fnuz.float() * fnuz_scale
    finite = torch.isfinite(want)  # 0x7F / 0xFF are NaN in e4m3fn
    assert torch.equal(got[finite], want[finite])
    assert not torch.isnan(got[finite]).any(), "0x80 (-0.0) must not become fnuz NaN"


def test_fnuz_activations_have_the_bytes_the_e4m3fn_reference_computes():
    x = torch.randn(64, 128) * 50
    x[0, 0] = 1e4  # saturates
    input_scale = torch.tensor(0.05)
    want = (x / input_scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    got, scale = quantize_activation_fnuz(x, input_scale)
    assert scale.item() == 2 * input_scale.item()
    assert torch.equal(got.float() * scale, want.float() * input_scale)
