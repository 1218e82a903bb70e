"""Format codecs: one module per number format, each knowing only bits and scales (STYLE.md rule 4).

Every quantizer takes a float weight ``[..., out, in]`` (a leading dim stacks experts) on any
device and returns a ``QTensor`` in the canonical layout documented in ``qtensor.py``; every
dequantizer returns fp32. ``musecore_quant.api`` dispatches on the format name.
"""

from .fp4 import E2M1_MAGNITUDES, FP4_MAX, fp4_decode, fp4_encode, pack_nibbles, unpack_nibbles
from .fp8 import fp8_dequantize, fp8_fake_quantize_activation, fp8_quantize
from .int4 import (AWQ_NIBBLE_ORDER, int4_dequantize, int4_from_awq, int4_from_gptq, int4_quantize,
                   int4_to_awq, int4_to_gptq)
from .int8 import INT8_MAX, int8_dequantize, int8_fake_quantize_activation, int8_quantize, int8_scale
from .mxfp4 import (e8m0_to_float, mxfp4_dequantize, mxfp4_fake_quantize_activation, mxfp4_from_gpt_oss,
                    mxfp4_quantize, mxfp4_to_gpt_oss, shared_exponent)
from .nvfp4 import (nvfp4_dequantize, nvfp4_fake_quantize_activation, nvfp4_global_amax, nvfp4_input_scale,
                    nvfp4_quantize, nvfp4_shared_global_amax)
from .requant import nvfp4_exact_weight_scale_2, requantize_mxfp4_to_nvfp4, requantize_nvfp4_to_mxfp4

__all__ = [
    "E2M1_MAGNITUDES", "FP4_MAX", "fp4_decode", "fp4_encode", "pack_nibbles", "unpack_nibbles",
    "fp8_dequantize", "fp8_fake_quantize_activation", "fp8_quantize",
    "INT8_MAX", "int8_dequantize", "int8_fake_quantize_activation", "int8_quantize", "int8_scale",
    "AWQ_NIBBLE_ORDER", "int4_dequantize", "int4_from_awq", "int4_from_gptq", "int4_quantize", "int4_to_awq",
    "int4_to_gptq",
    "e8m0_to_float", "mxfp4_dequantize", "mxfp4_fake_quantize_activation", "mxfp4_from_gpt_oss", "mxfp4_quantize",
    "mxfp4_to_gpt_oss", "shared_exponent",
    "nvfp4_dequantize", "nvfp4_fake_quantize_activation", "nvfp4_global_amax", "nvfp4_input_scale",
    "nvfp4_quantize", "nvfp4_shared_global_amax",
    "nvfp4_exact_weight_scale_2", "requantize_mxfp4_to_nvfp4", "requantize_nvfp4_to_mxfp4",
]
