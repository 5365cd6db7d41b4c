"""Pure-torch reference of the quantized wire formats dispatch/combine moves (CPU, deterministic).

GPU kernels are checked against these functions bit for bit (codes and scales) or within the error
bound each quantizer's docstring states and derives. The formats' numbers (block sizes, element
maxima, the combine wire's flush threshold) live in ``epgen.codegen.dtypes`` (``COMBINE_QUANTS``,
``MINIFLOATS``), which the kernel templates print too.

Modules (every public name is re-exported here, ``epgen.quant.X``):

* ``epgen.quant.codecs``: element formats, fp8 e4m3 / fp4 e2m1 / e8m0 codes <-> float32, fp4
  packing, and the rounding conventions every encoder shares.
* ``epgen.quant.quantizers``: the wire modes' quantizers and dequantizers of [T, H] payloads
  (``fp8_blockwise``, ``fp8_direct_cast``, ``fp4_mx``, ``fp4_blockwise``), ``scale_bytes``, and
  their error bounds.
* ``epgen.quant.wire``: the combine leg's wire, ``combine_wire_rows``, ``combine_roundtrip`` and
  ``combine_error_bound``, in the target's fp8 flavour (``fp8_flavour``, ``arch_fp8_flavour``).

Errors: a tensor argument that is not a torch.Tensor raises TypeError; every other rule a
function's ``Raises`` names raises ValueError (``epgen.tensors.check_tensor``).
"""

from __future__ import annotations

from epgen.quant.codecs import (
    E8M0_MAX_EXP,
    E8M0_MIN_EXP,
    FP4_E2M1,
    FP4_E2M1_MAX,
    FP8_E4M3,
    FP8_E4M3_MAX,
    e8m0_decode,
    e8m0_encode,
    fp4_e2m1_decode,
    fp4_e2m1_encode,
    fp8_e4m3_decode,
    fp8_e4m3_encode,
    pack_fp4,
    unpack_fp4,
)
from epgen.quant.quantizers import (
    MODES,
    dequantize_fp4_blockwise,
    dequantize_fp4_mx,
    dequantize_fp8_blockwise,
    dequantize_fp8_direct,
    fp8_direct_cast,
    quantize_fp4_blockwise,
    quantize_fp4_mx,
    quantize_fp8_blockwise,
    scale_bytes,
)
from epgen.quant.wire import arch_fp8_flavour, combine_error_bound, combine_roundtrip, combine_wire_rows

__all__ = [
    "E8M0_MAX_EXP",
    "E8M0_MIN_EXP",
    "FP4_E2M1",
    "FP4_E2M1_MAX",
    "FP8_E4M3",
    "FP8_E4M3_MAX",
    "MODES",
    "arch_fp8_flavour",
    "combine_error_bound",
    "combine_roundtrip",
    "combine_wire_rows",
    "dequantize_fp4_blockwise",
    "dequantize_fp4_mx",
    "dequantize_fp8_blockwise",
    "dequantize_fp8_direct",
    "e8m0_decode",
    "e8m0_encode",
    "fp4_e2m1_decode",
    "fp4_e2m1_encode",
    "fp8_direct_cast",
    "fp8_e4m3_decode",
    "fp8_e4m3_encode",
    "pack_fp4",
    "quantize_fp4_blockwise",
    "quantize_fp4_mx",
    "quantize_fp8_blockwise",
    "scale_bytes",
    "unpack_fp4",
]
