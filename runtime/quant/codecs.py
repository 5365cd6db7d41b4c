"""Element formats of the quantized wires: fp8 e4m3, fp4 e2m1 and e8m0 codes <-> float32 (CPU, exact).

Element formats (OCP "OFP8" and "MX" specifications; their numbers come from
``epgen.codegen.dtypes.MINIFLOATS``, which the kernels print too):

* fp8 e4m3, the OCP flavour ``e4m3fn`` (= ``torch.float8_e4m3fn``): sign, 4 exponent bits (bias 7),
  3 mantissa bits; no infinities; ``S.1111.111`` is NaN (0x7F / 0xFF); largest finite 448
  (0x7E); smallest normal 2^-6; subnormals ``m * 2^-9``, m = 1..7.
* fp4 e2m1 (OCP MX): sign, 2 exponent bits (bias 1), 1 mantissa bit; magnitudes
  {0, 0.5, 1, 1.5, 2, 3, 4, 6} for codes 0..7, code | 8 is the negative; no infinity, no NaN.
  Two codes share a byte: element 2i in the low nibble, element 2i+1 in the high nibble.
* e8m0 (OCP MX scale): 8 exponent bits, value 2^(e - 127) for e = 0..254, 255 is NaN. Code 0,
  2^-127, is a float32 subnormal (the only one); a kernel that flushes subnormals decodes it as 0.

Conventions shared by every encoder here, which kernels must follow to match bit for bit:

* Round to nearest, ties to even: a value exactly halfway between two adjacent representable
  magnitudes takes the one whose code is even (mantissa LSB 0). That includes the halfway point
  between the largest subnormal and the smallest normal (e4m3: 15 * 2^-10 -> 2^-6, code 0x08;
  e2m1: 0.75 -> 1.0, code 2).
* Saturation: magnitudes above the largest finite value (infinities included) encode as the
  largest finite value with the input's sign (e4m3: 0x7E / 0xFE; e2m1: 7 / 15).
* The sign bit is copied from the input, always: -0.0 and negative values that round to zero
  give the negative-zero code (e4m3 0x80, e2m1 8).
* float32 arithmetic is IEEE, correctly rounded (``x / s`` is a true division, not a multiply by
  a reciprocal) and keeps subnormals; a kernel using ``x * (1 / s)`` or flushing subnormals can
  differ by one code step and is then held to the error bound instead of bit equality.
"""

from __future__ import annotations

import math

import torch

from epgen.codegen.dtypes import FP8_FLAVOURS, MINIFLOATS, MiniFloat, fp8_flavour
from epgen.quant._common import ELEMENT_DTYPES, check_codes, first_bad
from epgen.tensors import check_tensor

__all__ = [
    "E8M0_MAX_EXP",
    "E8M0_MIN_EXP",
    "FP4_E2M1",
    "FP4_E2M1_MAX",
    "FP8_E4M3",
    "FP8_E4M3_MAX",
    "e8m0_decode",
    "e8m0_encode",
    "fp4_e2m1_decode",
    "fp4_e2m1_encode",
    "fp8_e4m3_decode",
    "fp8_e4m3_encode",
    "pack_fp4",
    "unpack_fp4",
]

FP8_E4M3: MiniFloat = MINIFLOATS["fp8"]
"""The fp8 e4m3fn format's numbers (``epgen.codegen.dtypes.MINIFLOATS``)."""

FP4_E2M1: MiniFloat = MINIFLOATS["fp4"]
"""The fp4 e2m1 format's numbers (``epgen.codegen.dtypes.MINIFLOATS``)."""

FP8_E4M3_MAX = FP8_E4M3.max
"""Largest finite e4m3fn magnitude, 448 (code 0x7E)."""

FP4_E2M1_MAX = FP4_E2M1.max
"""Largest e2m1 magnitude, 6 (code 7)."""

E8M0_MIN_EXP = -127
"""Exponent of the smallest e8m0 scale, 2^-127 (code 0)."""

E8M0_MAX_EXP = 127
"""Exponent of the largest e8m0 scale, 2^127 (code 254; 255 is NaN)."""


# --- decode tables -------------------------------------------------------------------------------


def _minifloat_value(fmt: MiniFloat, code: int) -> float:
    """The value of ``code`` (sign bit included) in format ``fmt``, exact."""
    sign = -1.0 if (code >> fmt.sign_shift) & 1 else 1.0
    magnitude = code & ((1 << fmt.sign_shift) - 1)
    if fmt.has_nan and fmt.nan_code in (magnitude, code):  # e4m3fnuz's NaN is its whole code 0x80
        return math.copysign(math.nan, sign)
    exp, man = magnitude >> fmt.mbits, magnitude & ((1 << fmt.mbits) - 1)
    if exp == 0:  # subnormal: 2^(1 - bias) * man / 2^mbits
        return sign * math.ldexp(man, fmt.emin - fmt.mbits)
    return sign * math.ldexp((1 << fmt.mbits) + man, exp - fmt.bias - fmt.mbits)  # 2^(exp - bias) (1 + m / 2^mbits)


_FP8_TABLES = {name: torch.tensor([_minifloat_value(f.numbers, c) for c in range(1 << f.numbers.bits)],
                                  dtype=torch.float32) for name, f in FP8_FLAVOURS.items()}
_FP4_TABLE = torch.tensor([_minifloat_value(FP4_E2M1, c) for c in range(1 << FP4_E2M1.bits)], dtype=torch.float32)
_E8M0_TABLE = torch.tensor([math.ldexp(1.0, e - 127) for e in range(255)] + [math.nan], dtype=torch.float32)


def _lookup(table: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    return table.to(codes.device)[codes.to(torch.int64)]


# --- element codecs ------------------------------------------------------------------------------


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """Exact float32 2**e for int32 e in [-126, 127] (built from the bits)."""
    return ((e + 127) << 23).view(torch.float32)


def _encode_minifloat(x: torch.Tensor, fmt: MiniFloat) -> torch.Tensor:
    """Saturating RNE float32 -> sign-magnitude minifloat code (uint8) of ``fmt``, sign in bit
    ``fmt.sign_shift``.

    With E = max(floor(log2 |x|), emin) the grid step near |x| is 2^(E - mbits); n = RNE(|x| / step)
    is exact (power-of-two scaling), lies in [0, 2^(mbits+1)], and the magnitude code is
    (E - emin) * 2^mbits + n: n = 2^(mbits+1) is exactly the next binade's first code, and the
    code's parity is n's, so RNE on n is RNE on the code.
    """
    mbits, emin = fmt.mbits, fmt.emin
    sign_bit = 1 << fmt.sign_shift
    x = x.to(torch.float32)
    sign = torch.signbit(x)
    a = x.abs()
    nan = torch.isnan(a)
    a = torch.where(nan, 0.0, a).clamp(max=fmt.max)  # +-inf saturates too
    floor_log2 = torch.frexp(a).exponent - 1  # a = m * 2^exponent, m in [0.5, 1)
    e = torch.where(a >= 2.0**emin, floor_log2, torch.full_like(floor_log2, emin))
    n = torch.round(a / _pow2(e - mbits)).to(torch.int32)  # torch.round: half to even
    mag = ((e - emin) << mbits) + n
    mag = torch.where(nan, fmt.nan_code, mag)
    if not fmt.negative_zero:  # code 0 for a value rounding to zero; NaN's code holds the sign bit
        sign &= mag != 0
    return (mag | torch.where(sign, sign_bit, 0)).to(torch.uint8)


def fp8_e4m3_encode(x: torch.Tensor, flavour: str = "e4m3fn") -> torch.Tensor:
    """Saturating float -> fp8 e4m3fn codes, round to nearest even.

    Args:
        x: any shape, float32 (bfloat16 and float16 are accepted, being exact in float32).
        flavour: a key of ``epgen.codegen.dtypes.FP8_FLAVOURS``, the target's ``ArchTraits.fp8``.
            ``"e4m3fnuz"`` (gfx942): max 240 (0x7F / 0xFF), NaN gives 0x80 whatever its sign, and
            -0.0 and negatives rounding to zero give 0x00 (no negative zero); the bound below holds
            with 240 for 448 and 2^-11 for 2^-10 (bias 8: subnormal step 2^-10).

    Returns:
        uint8, x's shape: e4m3fn codes. |x| > 448 and +-inf give +-448 (0x7E / 0xFE); NaN gives
        0x7F, or 0xFF when its sign bit is set; -0.0 and negatives rounding to zero give 0x80.

    Error bound (finite x): ``|fp8_e4m3_decode(code) - x| <= max(2^-4 |x|, 2^-10)`` for
    |x| <= 448, and ``= |x| - 448`` above (saturation). Derivation: in a binade [2^E, 2^(E+1)),
    E >= -6, the 3 mantissa bits give a step 2^(E-3); RNE errs by at most half a step, 2^(E-4)
    <= 2^-4 |x| (sharp value |x| / 17, at x = 2^E (1 + 1/16)). Below 2^-6 the step is the subnormal
    2^-9 and the error at most 2^-10, reached at odd multiples of 2^-10. Values in (448, 464)
    round to 448 anyway; saturation only changes what would overflow to NaN.

    Raises:
        TypeError: x not a tensor.
        ValueError: x not float32 / bfloat16 / float16; unknown ``flavour``.
    """
    x = check_tensor("x", x, dtype=ELEMENT_DTYPES)
    return _encode_minifloat(x, fp8_flavour(flavour, "flavour").numbers)


def fp8_e4m3_decode(codes: torch.Tensor, flavour: str = "e4m3fn") -> torch.Tensor:
    """fp8 e4m3fn codes -> float32, exact (every e4m3fn value is a float32).

    Args:
        codes: uint8, any shape.
        flavour: a key of ``FP8_FLAVOURS``; ``"e4m3fnuz"``: 0x80 decodes to NaN, 0x7F / 0xFF to
            +-240; equals ``codes.view(torch.float8_e4m3fnuz).float()``.

    Returns:
        float32, codes' shape; 0x7F / 0xFF decode to NaN, 0x80 to -0.0. Equals
        ``codes.view(torch.float8_e4m3fn).float()``.

    Raises:
        ValueError: codes not a uint8 tensor; unknown ``flavour``.
    """
    fp8_flavour(flavour, "flavour")
    return _lookup(_FP8_TABLES[flavour], check_codes("codes", codes))


def fp4_e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """Saturating float -> fp4 e2m1 codes 0..15 (one per uint8), round to nearest even.

    Args:
        x: any shape, float32 (bfloat16 and float16 are accepted, being exact in float32).

    Returns:
        uint8, x's shape, values 0..15: bit 3 the sign, bits 0-2 the index of the magnitude in
        {0, 0.5, 1, 1.5, 2, 3, 4, 6}. |x| > 6 and +-inf give +-6 (7 / 15); -0.0 and negatives
        rounding to zero give 8. Ties go to the even code, as values: 0.25 -> 0, 0.75 -> 1,
        1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4.

    Error bound: ``|fp4_e2m1_decode(code) - x| <= max(2^-2 |x|, 2^-2)`` for |x| <= 6, and
    ``= |x| - 6`` above. Derivation: in a binade [2^E, 2^(E+1)), E = 0..2, the 1 mantissa bit gives
    a step 2^(E-1); half a step is 2^(E-2) <= 2^-2 |x| (sharp value |x| / 5, at 1.25, 2.5, 5).
    Below 1 the step is the subnormal 0.5 and the error at most 0.25 (at 0.25 and 0.75).

    Raises:
        TypeError: x not a tensor.
        ValueError: x not float32 / bfloat16 / float16, or holding a NaN (e2m1 has
            no NaN code; the message gives the first NaN's index).
    """
    x = check_tensor("x", x, dtype=ELEMENT_DTYPES)
    nan = torch.isnan(x)
    if bool(nan.any()):
        raise ValueError(f"{first_bad('x', nan, x)}: fp4 e2m1 has no NaN code; x must not hold NaN")
    return _encode_minifloat(x, FP4_E2M1)


def fp4_e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """fp4 e2m1 codes (one per uint8, 0..15) -> float32, exact.

    Args:
        codes: uint8, any shape, values 0..15 (unpacked; see ``unpack_fp4``).

    Returns:
        float32, codes' shape: code c -> (-1)^(c >> 3) * {0, 0.5, 1, 1.5, 2, 3, 4, 6}[c & 7]
        (code 8 is -0.0).

    Raises:
        ValueError: codes not a uint8 tensor, or a code above 15 (names the first one).
    """
    return _lookup(_FP4_TABLE, check_codes("codes", codes, limit=15))


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Pack fp4 codes two per byte: element 2i in the low nibble, element 2i+1 in the high nibble.

    Args:
        codes: uint8 [..., 2n] (at least 1-D), values 0..15.

    Returns:
        uint8 [..., n]: ``codes[..., 0::2] | codes[..., 1::2] << 4``.

    Raises:
        ValueError: codes not a uint8 tensor, 0-D, its last dimension odd, or a code above 15.
    """
    codes = check_codes("codes", codes, limit=15)
    if codes.dim() == 0 or codes.shape[-1] % 2:
        raise ValueError(f"codes: shape {tuple(codes.shape)} must have a last dimension of even length")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_fp4``.

    Args:
        packed: uint8 [..., n] (at least 1-D).

    Returns:
        uint8 [..., 2n], values 0..15: element 2i = byte i & 0xF, element 2i+1 = byte i >> 4.

    Raises:
        ValueError: packed not a uint8 tensor, or 0-D.
    """
    packed = check_codes("packed", packed)
    if packed.dim() == 0:
        raise ValueError("packed: shape () must be at least 1-D")
    out = torch.stack((packed & 0xF, packed >> 4), dim=-1)
    return out.reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def e8m0_encode(scale: torch.Tensor, rounding: str = "exact") -> torch.Tensor:
    """Positive float32 scales -> e8m0 codes (2^(code - 127)).

    Args:
        scale: any shape, float32 (bfloat16 / float16 accepted), every entry finite and > 0.
        rounding: how a scale that is not a power of two maps to an exponent: "exact" (default)
            rejects it, "floor" takes floor(log2 scale), "ceil" takes ceil(log2 scale).

    Returns:
        uint8, scale's shape, codes 0..254 (never the NaN code 255).

    Raises:
        ValueError: scale not a float tensor; an entry <= 0, infinite or NaN; with "exact" an entry
            that is not a power of two; an exponent outside e8m0's [-127, 127] (scale outside
            [2^-127, 2^127] after rounding); rounding not one of the three. Messages name the
            first offending entry, its value and the rule.
    """
    if rounding not in ("exact", "floor", "ceil"):
        raise ValueError(f"rounding={rounding!r}: must be 'exact', 'floor' or 'ceil'")
    s = check_tensor("scale", scale, dtype=ELEMENT_DTYPES).to(torch.float32)
    bad = ~(torch.isfinite(s) & (s > 0))
    if bool(bad.any()):
        raise ValueError(f"{first_bad('scale', bad, s)}: e8m0 scales must be finite and > 0")
    mantissa, exponent = torch.frexp(s)  # s = mantissa * 2^exponent, mantissa in [0.5, 1)
    e = exponent - 1  # floor(log2 s), exact (subnormals included)
    not_pow2 = mantissa != 0.5
    if rounding == "exact" and bool(not_pow2.any()):
        raise ValueError(
            f"{first_bad('scale', not_pow2, s)}: must be a power of two with rounding='exact' "
            f"(pass rounding='floor' or 'ceil' to round the exponent)"
        )
    if rounding == "ceil":
        e = e + not_pow2.to(e.dtype)
    out = (e < E8M0_MIN_EXP) | (e > E8M0_MAX_EXP)
    if bool(out.any()):
        raise ValueError(
            f"{first_bad('scale', out, s)}: log2 of the scale ({rounding}) must be in "
            f"[{E8M0_MIN_EXP}, {E8M0_MAX_EXP}], the e8m0 range"
        )
    return (e + 127).to(torch.uint8)


def e8m0_decode(codes: torch.Tensor) -> torch.Tensor:
    """e8m0 codes -> float32 2^(code - 127), exact; 255 -> NaN.

    Code 0 is 2^-127, a float32 subnormal (flushed to 0 by FTZ arithmetic). Equals
    ``codes.view(torch.float8_e8m0fnu).float()``.

    Args:
        codes: uint8, any shape.

    Returns:
        float32, codes' shape.

    Raises:
        ValueError: codes not a uint8 tensor.
    """
    return _lookup(_E8M0_TABLE, check_codes("codes", codes))
