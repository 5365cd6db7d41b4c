"""Pure-torch reference of the quantized wire formats dispatch/combine moves (CPU, deterministic).

GPU kernels are checked against these functions bit for bit (codes and scales) or within the error
bound each quantizer's docstring states and derives.

Element formats (OCP "OFP8" and "MX" specifications):

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

Wire modes (``scale_bytes`` gives their per-token scale bytes), input ``x`` [T, H] bf16 or fp32:

* ``fp8_blockwise``: e4m3 codes [T, H] + float32 scales [T, H / 128], scale = block amax / 448.
* ``fp8_direct_cast``: e4m3 codes [T, H], no scale (saturating cast).
* ``fp4_mx``: packed e2m1 [T, H / 2] + e8m0 scales [T, H / 32], the OCP MX rule.
* ``fp4_blockwise``: packed e2m1 [T, H / 2] + float32 scales [T, H / 32], scale = amax / 6.

Error-bound summary (derivations in the docstrings; s = the block's stored scale, element-wise):

* fp8_blockwise: ``|x - dq| <= 2^-4 |x| + 2^-10 s``, s = fl(amax / 448), for blocks with
  amax >= 2^-100.
* fp8_direct_cast: ``|x - dq| <= max(2^-4 |x|, 2^-10)`` for |x| <= 448, ``|x| - 448`` above.
* fp4_mx: ``|x - dq| <= 2^-2 max(|x|, s)``, s = 2^(floor(log2 amax) - 2) clamped to e8m0; exact
  arithmetic, no condition.
* fp4_blockwise: ``|x - dq| <= 2^-2 |x| + 2^-2 s``, s = fl(amax / 6), for blocks with
  amax >= 2^-100.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "FP4_E2M1_MAX",
    "FP8_E4M3_MAX",
    "MODES",
    "combine_error_bound",
    "combine_roundtrip",
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

FP8_E4M3_MAX = 448.0
"""Largest finite e4m3fn magnitude (code 0x7E)."""

FP4_E2M1_MAX = 6.0
"""Largest e2m1 magnitude (code 7)."""

MODES = {"fp8_blockwise": 128, "fp8_direct_cast": None, "fp4_mx": 32, "fp4_blockwise": 32}
"""Wire mode -> default block size (None: no scales)."""

_E8M0_MIN_EXP = -127
_E8M0_MAX_EXP = 127
_ELEMENT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # all exact in float32
_BLOCK_DTYPES = (torch.float32, torch.bfloat16)


# --- decode tables -------------------------------------------------------------------------------


def _fp8_e4m3_value(code: int) -> float:
    sign = -1.0 if code & 0x80 else 1.0
    exp, man = (code >> 3) & 0xF, code & 0x7
    if exp == 0xF and man == 0x7:
        return math.copysign(math.nan, sign)
    if exp == 0:
        return sign * math.ldexp(man, -9)
    return sign * math.ldexp(8 + man, exp - 10)  # 2^(exp-7) * (1 + man/8)


_FP4_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_FP8_TABLE = torch.tensor([_fp8_e4m3_value(c) for c in range(256)], dtype=torch.float32)
_FP4_TABLE = torch.tensor([*_FP4_MAGNITUDES, *(-v for v in _FP4_MAGNITUDES)], dtype=torch.float32)
_E8M0_TABLE = torch.tensor([math.ldexp(1.0, e - 127) for e in range(255)] + [math.nan], dtype=torch.float32)


def _lookup(table: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    return table.to(codes.device)[codes.to(torch.int64)]


# --- validation helpers --------------------------------------------------------------------------


def _dtype_names(dtypes) -> str:
    return " or ".join(str(d) for d in dtypes)


def _check_tensor(name: str, value, dtypes) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{name}: must be a torch.Tensor, got {type(value).__name__}")
    if value.dtype not in dtypes:
        raise ValueError(f"{name}: dtype {value.dtype} must be {_dtype_names(dtypes)}")
    return value


def _check_2d(name: str, value, dtypes) -> torch.Tensor:
    t = _check_tensor(name, value, dtypes)
    if t.dim() != 2:
        raise ValueError(f"{name}: shape {tuple(t.shape)} must be 2-D [T, H]")
    return t


def _check_block(block, *, even: bool) -> int:
    if not isinstance(block, int) or isinstance(block, bool):
        raise ValueError(f"block={block!r}: must be an int")
    if block < 1 or (even and block % 2):
        raise ValueError(f"block={block}: must be a positive{' even' if even else ''} int")
    return block


def _where(mask: torch.Tensor) -> str:
    """'[i, j]' of the first (row-major) True entry of mask ('' for a 0-d tensor)."""
    idx = mask.nonzero()[0].tolist()
    return f"[{', '.join(map(str, idx))}]" if idx else ""


def _first_bad(name: str, mask: torch.Tensor, values: torch.Tensor) -> str:
    """'name[i, j]=value' of the first True entry of mask, plus how many more there are."""
    where = _where(mask)
    value = values[mask][0].item()
    count = int(mask.sum())
    more = f" ({count - 1} more)" if count > 1 else ""
    return f"{name}{where}={value!r}{more}"


def _check_codes(name: str, codes, limit: int | None = None) -> torch.Tensor:
    codes = _check_tensor(name, codes, (torch.uint8,))
    if limit is not None:
        bad = codes > limit
        if bool(bad.any()):
            raise ValueError(f"{_first_bad(name, bad, codes)}: codes must be in [0, {limit}]")
    return codes


def _blocks(x, block: int, *, even: bool) -> tuple[torch.Tensor, int]:
    """Validate a [T, H] quantizer input; return it as float32 [T, ceil(H / block), block], the
    last block zero-padded (which changes no block's amax), and H."""
    block = _check_block(block, even=even)
    x = _check_2d("x", x, _BLOCK_DTYPES)
    tokens, hidden = x.shape
    if even and hidden % 2:
        raise ValueError(f"x: hidden size H={hidden} must be even (two fp4 codes a byte)")
    x32 = x.to(torch.float32)
    bad = ~torch.isfinite(x32)
    if bool(bad.any()):
        raise ValueError(
            f"{_first_bad('x', bad, x32)}: must be finite (a block holding a NaN or an infinity has "
            f"no defined scale)"
        )
    return _padded_blocks(x32, block), hidden


def _padded_blocks(v: torch.Tensor, block: int) -> torch.Tensor:
    """[T, H] -> [T, ceil(H / block), block], the last block zero-padded."""
    pad = (-v.shape[1]) % block
    if pad:
        v = torch.nn.functional.pad(v, (0, pad))
    return v.reshape(v.shape[0], v.shape[1] // block, block)


def _unblock(t: torch.Tensor, hidden: int) -> torch.Tensor:
    """[T, nb, block] -> [T, H] (the padding dropped)."""
    return t.reshape(t.shape[0], -1)[:, :hidden].contiguous() if t.shape[0] else t.reshape(0, hidden)


def _check_scaled(codes_name, codes, scales, scale_dtype, block, *, packed: bool) -> tuple[int, int]:
    """Validate a dequantizer's (codes, scales); return (T, H)."""
    block = _check_block(block, even=packed)
    codes = _check_2d(codes_name, codes, (torch.uint8,))
    scales = _check_2d("scales", scales, (scale_dtype,))
    tokens, width = codes.shape
    hidden = 2 * width if packed else width
    want = (tokens, -(-hidden // block))
    if tuple(scales.shape) != want:
        raise ValueError(
            f"scales: shape {tuple(scales.shape)} must be {list(want)} ([T, ceil(H / block)] for "
            f"{codes_name} of shape {tuple(codes.shape)} and block={block})"
        )
    return tokens, hidden


# --- element codecs ------------------------------------------------------------------------------


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """Exact float32 2**e for int32 e in [-126, 127] (built from the bits)."""
    return ((e + 127) << 23).view(torch.float32)


def _encode_minifloat(x: torch.Tensor, mbits: int, emin: int, maxval: float, nan_code: int) -> torch.Tensor:
    """Saturating RNE float32 -> sign-magnitude minifloat code (uint8), sign in bit 3 + ebits + mbits.

    With E = max(floor(log2 |x|), emin) the grid step near |x| is 2^(E - mbits); n = RNE(|x| / step)
    is exact (power-of-two scaling), lies in [0, 2^(mbits+1)], and the magnitude code is
    (E - emin) * 2^mbits + n: n = 2^(mbits+1) is exactly the next binade's first code, and the
    code's parity is n's, so RNE on n is RNE on the code.
    """
    ebits = {3: 4, 1: 2}[mbits]
    sign_bit = 1 << (ebits + mbits)
    x = x.to(torch.float32)
    sign = torch.signbit(x)
    a = x.abs()
    nan = torch.isnan(a)
    a = torch.where(nan, 0.0, a).clamp(max=maxval)  # +-inf saturates too
    floor_log2 = torch.frexp(a).exponent - 1  # a = m * 2^exponent, m in [0.5, 1)
    e = torch.where(a >= 2.0**emin, floor_log2, torch.full_like(floor_log2, emin))
    n = torch.round(a / _pow2(e - mbits)).to(torch.int32)  # torch.round: half to even
    mag = ((e - emin) << mbits) + n
    mag = torch.where(nan, nan_code, mag)
    return (mag | torch.where(sign, sign_bit, 0)).to(torch.uint8)


def fp8_e4m3_encode(x: torch.Tensor) -> torch.Tensor:
    """Saturating float -> fp8 e4m3fn codes, round to nearest even.

    Args:
        x: any shape, float32 (bfloat16 and float16 are accepted, being exact in float32).

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
        ValueError: x not a tensor, or not float32 / bfloat16 / float16.
    """
    x = _check_tensor("x", x, _ELEMENT_DTYPES)
    return _encode_minifloat(x, mbits=3, emin=-6, maxval=FP8_E4M3_MAX, nan_code=0x7F)


def fp8_e4m3_decode(codes: torch.Tensor) -> torch.Tensor:
    """fp8 e4m3fn codes -> float32, exact (every e4m3fn value is a float32).

    Args:
        codes: uint8, any shape.

    Returns:
        float32, codes' shape; 0x7F / 0xFF decode to NaN, 0x80 to -0.0. Equals
        ``codes.view(torch.float8_e4m3fn).float()``.

    Raises:
        ValueError: codes not a uint8 tensor.
    """
    return _lookup(_FP8_TABLE, _check_codes("codes", codes))


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
        ValueError: x not a tensor, not float32 / bfloat16 / float16, or holding a NaN (e2m1 has
            no NaN code; the message gives the first NaN's index).
    """
    x = _check_tensor("x", x, _ELEMENT_DTYPES)
    nan = torch.isnan(x)
    if bool(nan.any()):
        raise ValueError(f"{_first_bad('x', nan, x)}: fp4 e2m1 has no NaN code; x must not hold NaN")
    return _encode_minifloat(x, mbits=1, emin=0, maxval=FP4_E2M1_MAX, nan_code=0)


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
    return _lookup(_FP4_TABLE, _check_codes("codes", codes, limit=15))


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Pack fp4 codes two per byte: element 2i in the low nibble, element 2i+1 in the high nibble.

    Args:
        codes: uint8 [..., 2n] (at least 1-D), values 0..15.

    Returns:
        uint8 [..., n]: ``codes[..., 0::2] | codes[..., 1::2] << 4``.

    Raises:
        ValueError: codes not a uint8 tensor, 0-D, its last dimension odd, or a code above 15.
    """
    codes = _check_codes("codes", codes, limit=15)
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
    packed = _check_codes("packed", packed)
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
    s = _check_tensor("scale", scale, _ELEMENT_DTYPES).to(torch.float32)
    bad = ~(torch.isfinite(s) & (s > 0))
    if bool(bad.any()):
        raise ValueError(f"{_first_bad('scale', bad, s)}: e8m0 scales must be finite and > 0")
    mantissa, exponent = torch.frexp(s)  # s = mantissa * 2^exponent, mantissa in [0.5, 1)
    e = exponent - 1  # floor(log2 s), exact (subnormals included)
    not_pow2 = mantissa != 0.5
    if rounding == "exact" and bool(not_pow2.any()):
        raise ValueError(
            f"{_first_bad('scale', not_pow2, s)}: must be a power of two with rounding='exact' "
            f"(pass rounding='floor' or 'ceil' to round the exponent)"
        )
    if rounding == "ceil":
        e = e + not_pow2.to(e.dtype)
    out = (e < _E8M0_MIN_EXP) | (e > _E8M0_MAX_EXP)
    if bool(out.any()):
        raise ValueError(
            f"{_first_bad('scale', out, s)}: log2 of the scale ({rounding}) must be in "
            f"[{_E8M0_MIN_EXP}, {_E8M0_MAX_EXP}], the e8m0 range"
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
    return _lookup(_E8M0_TABLE, _check_codes("codes", codes))


# --- block quantizers ----------------------------------------------------------------------------


def _amax_scale(xb: torch.Tensor, qmax: float) -> torch.Tensor:
    """float32 [T, B]: fl(amax / qmax) (true division), 1.0 where that is 0."""
    amax = xb.abs().amax(dim=-1)
    scale = amax / torch.full_like(amax, qmax)  # tensor / tensor: a true IEEE division
    return torch.where(scale == 0, torch.ones_like(scale), scale)


def quantize_fp8_blockwise(x: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block scaled fp8 e4m3 ("fp8_blockwise" wire mode).

    For each block of ``block`` consecutive elements of a row: amax = max |x| (computed in
    float32), s = fl(amax / 448) (float32 true division), replaced by 1.0 when it is 0 (an all-zero
    block, or 0 < amax < 448 * 2^-150 whose quotient underflows); codes = fp8_e4m3_encode(fl(x / s))
    (float32 true division, then saturating RNE).

    Args:
        x: [T, H] bfloat16 or float32, finite; any H (even for fp4; the last block may be shorter, its amax over its own elements; T = 0 allowed).
        block: elements per scale (positive int, default 128).

    Returns:
        (codes, scales): codes uint8 [T, H] e4m3fn; scales float32 [T, ceil(H / block)].

    Error bound, for blocks with amax >= 2^-100 (so s and every product below are normal float32):
        ``|x - dq| <= 2^-4 |x| + 2^-10 s``, element-wise, dq = dequantize_fp8_blockwise(...) and
        s = fl(amax / 448) <= (1 + 2^-24) amax / 448.
    Derivation: y = fl(x / s) = (x / s)(1 + d1), |d1| <= 2^-24, so |x - y s| <= 2^-24 |x| and
    |y| <= 448 (1 + 2^-23) < 464: y never saturates beyond RNE's own 448. Let c = RNE_e4m3(y) and
    dq = fl(c s) = c s (1 + d3), |d3| <= 2^-24 (d3 = 0 for c = 0). Then
    |x - dq| <= 2^-24 |x| + s |y - c| + 2^-24 |c| s.
    * |y| >= 2^-6: |y - c| <= |y| / 17 (half a step, sharp) and |c| <= (18/17) |y|, so
      |x - dq| <= |x| (1/17 + 2^-21) <= 2^-4 |x|: the 1/16 - 1/17 = 1/272 slack absorbs the two
      float32 roundings.
    * |y| < 2^-6: |y - c| <= 2^-10. If c = 0 the error is |x| <= s 2^-10 (1 + 2^-23) <=
      2^-10 s + 2^-4 |x|; otherwise |y| >= 2^-10, so |x| >= s 2^-10 (1 - 2^-23) and the rounding
      terms 2^-24 |x| + 2^-30 s fit inside 2^-4 |x|.
    The max form max(2^-4 |x|, 2^-10 s) does NOT hold exactly: at a subnormal tie (|y| an odd
    multiple of 2^-10) the error is 2^-10 s plus up to ~2^-23 |x| of float32 rounding.
    Blocks with 0 < amax < 2^-100 still quantize deterministically as defined, but the bound is
    not claimed (subnormal float32 scales; kernels flushing subnormals differ); GPU tests should
    avoid them.

    Raises:
        ValueError: x not a 2-D bfloat16 / float32 tensor, block not a
            positive int, or x holding a NaN / infinity (names the first one).
    """
    xb, hidden = _blocks(x, block, even=False)
    scales = _amax_scale(xb, FP8_E4M3_MAX)
    codes = fp8_e4m3_encode(xb / scales[..., None])
    return _unblock(codes, hidden), scales


def dequantize_fp8_blockwise(codes: torch.Tensor, scales: torch.Tensor, block: int = 128) -> torch.Tensor:
    """Inverse of ``quantize_fp8_blockwise``: dq = fl(fp8_e4m3_decode(codes) * s), one float32 rounding.

    Args:
        codes: uint8 [T, H] e4m3fn codes.
        scales: float32 [T, ceil(H / block)].
        block: elements per scale (positive int, default 128).

    Returns:
        float32 [T, H]. NaN codes (0x7F / 0xFF) decode to NaN.

    Raises:
        ValueError: wrong dtypes, not 2-D, or scales not [T, ceil(H / block)].
    """
    tokens, hidden = _check_scaled("codes", codes, scales, torch.float32, block, packed=False)
    vals = _padded_blocks(fp8_e4m3_decode(codes), block)
    return _unblock(vals * scales[..., None], hidden)


def fp8_direct_cast(x: torch.Tensor) -> torch.Tensor:
    """Unscaled saturating cast to fp8 e4m3 ("fp8_direct_cast" wire mode): fp8_e4m3_encode of a [T, H] tensor.

    Args:
        x: [T, H] bfloat16 or float32 (NaN / infinities allowed: NaN -> 0x7F / 0xFF, +-inf ->
            +-448).

    Returns:
        uint8 [T, H] e4m3fn codes.

    Error bound (decode is exact, so this is fp8_e4m3_encode's): for finite x,
        ``|x - dq| <= max(2^-4 |x|, 2^-10)`` when |x| <= 448, and ``|x - dq| = |x| - 448`` above
        (saturation). Derivation: half a step of 2^(E-3) in binade [2^E, 2^(E+1)) is
        2^(E-4) <= 2^-4 |x| for |x| >= 2^-6; half the subnormal step 2^-9 below. No float32
        arithmetic besides the cast, so the bound is exact, max form included.

    Raises:
        ValueError: x not a 2-D bfloat16 / float32 tensor.
    """
    x = _check_2d("x", x, _BLOCK_DTYPES)
    return fp8_e4m3_encode(x)


def dequantize_fp8_direct(codes: torch.Tensor) -> torch.Tensor:
    """Decode of ``fp8_direct_cast``: [T, H] uint8 e4m3fn codes -> float32 [T, H], exact.

    Raises:
        ValueError: codes not a 2-D uint8 tensor.
    """
    return fp8_e4m3_decode(_check_2d("codes", codes, (torch.uint8,)))


def quantize_fp4_mx(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """OCP MX fp4 (MXFP4, "fp4_mx" wire mode): e2m1 elements sharing one e8m0 scale per block.

    For each block: amax = max |x|; shared exponent e = floor(log2 amax) - 2 (2 = emax of e2m1),
    clamped to e8m0's [-127, 127]; an all-zero block gets e = -127 (code 0). Bit-level recipe:
    scale code = max(biased float32 exponent field of amax - 2, 0). The scale s = 2^e is exact,
    y = x / s is exact (or underflows below 2^-126, where it encodes as 0 anyway), and the element
    codes are fp4_e2m1_encode(y): RNE, saturating to +-6.

    Args:
        x: [T, H] bfloat16 or float32, finite; any H (even for fp4; the last block may be shorter, its amax over its own elements; T = 0 allowed).
        block: elements per scale (positive even int, default 32).

    Returns:
        (packed, scales): packed uint8 [T, H / 2] (``pack_fp4`` order: element 2i in the low
        nibble); scales uint8 [T, ceil(H / block)] e8m0 codes (0..252).

    Error bound (no condition; all arithmetic is exact):
        ``|x - dq| <= 2^-2 max(|x|, s)``, element-wise, with s = 2^e the block's scale
        (s in (amax / 8, amax / 4] unless clamped at 2^-127); and ``|x - dq| <= max(|x| / 5, s / 4)``
        for the elements with |x| <= 6 s, i.e. all but the clipped ones.
    Derivation: |y| <= amax / s = 4 amax / 2^floor(log2 amax) < 8 (smaller when clamped). Over
    e2m1: |y| < 1: |y - c| <= 1/4 (half the subnormal step 0.5); 1 <= |y| <= 6: |y - c| <= |y| / 5
    (half a step 2^(E-1), sharp at 1.25, 2.5, 5); 6 < |y| < 8: the MX rule clips to 6, so
    |y - c| = |y| - 6 < |y| / 4 (relative clipping error below 1/4, approaching it as |y| -> 8;
    only |x| > 1.5 * 2^floor(log2 amax), the upper half of amax's binade, clip). dq = c s
    exactly (c has at most 2 significant bits; c s >= 2^-128 is a float32), so
    |x - dq| = s |y - c|.

    Raises:
        ValueError: x not a 2-D bfloat16 / float32 tensor, block not a
            positive even int, or x holding a NaN / infinity (names the first one).
    """
    xb, hidden = _blocks(x, block, even=True)
    amax = xb.abs().amax(dim=-1)
    floor_log2 = torch.frexp(amax).exponent - 1
    e = torch.where(amax > 0, floor_log2 - 2, _E8M0_MIN_EXP).clamp(_E8M0_MIN_EXP, _E8M0_MAX_EXP)
    scales = (e + 127).to(torch.uint8)
    s = e8m0_decode(scales)
    codes = fp4_e2m1_encode(xb / s[..., None])
    return pack_fp4(_unblock(codes, hidden)), scales


def _fp4_scaled(packed: torch.Tensor, scale_values: torch.Tensor, block: int) -> torch.Tensor:
    """float32 [T, H]: every unpacked e2m1 element times its block's scale (one float32 rounding)."""
    hidden = packed.shape[1] * 2
    vals = _padded_blocks(fp4_e2m1_decode(unpack_fp4(packed)), block)
    return _unblock(vals * scale_values[..., None], hidden)


def dequantize_fp4_mx(packed: torch.Tensor, scales: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Inverse of ``quantize_fp4_mx``: dq = fp4_e2m1_decode(code) * 2^(scale - 127), exact.

    Args:
        packed: uint8 [T, H / 2] packed e2m1 codes.
        scales: uint8 [T, ceil(H / block)] e8m0 codes (255 = NaN gives NaN elements).
        block: elements per scale (positive even int, default 32).

    Returns:
        float32 [T, H].

    Raises:
        ValueError: wrong dtypes, not 2-D, or scales not [T, ceil(H / block)].
    """
    _check_scaled("packed", packed, scales, torch.uint8, block, packed=True)
    return _fp4_scaled(packed, e8m0_decode(scales), block)


def quantize_fp4_blockwise(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block float32-scaled fp4 e2m1 ("fp4_blockwise" combine wire mode).

    For each block: amax = max |x|, s = fl(amax / 6) (float32 true division), replaced by 1.0
    when it is 0 (all-zero block, or amax < 6 * 2^-150); codes = fp4_e2m1_encode(fl(x / s)).

    Args:
        x: [T, H] bfloat16 or float32, finite; any H (even for fp4; the last block may be shorter, its amax over its own elements; T = 0 allowed).
        block: elements per scale (positive even int, default 32).

    Returns:
        (packed, scales): packed uint8 [T, H / 2] (``pack_fp4`` order); scales float32
        [T, ceil(H / block)].

    Error bound, for blocks with amax >= 2^-100 (so s and every product are normal float32):
        ``|x - dq| <= 2^-2 |x| + 2^-2 s``, element-wise, s = fl(amax / 6) <= (1 + 2^-24) amax / 6.
    Derivation: y = fl(x / s) = (x / s)(1 + d1), |d1| <= 2^-24, |y| <= 6 (1 + 2^-23) (saturation
    costs at most 6 * 2^-23 <= |y| / 5); c = RNE_e2m1(y); dq = fl(c s) = c s (1 + d3).
    * |y| >= 1: |y - c| <= |y| / 5 (sharp), |c| <= 1.2 |y|, so
      |x - dq| <= |x| (1/5 + 2^-22) <= 2^-2 |x|.
    * |y| < 1: c in {0, 0.5, 1}, so c s is exact (d3 = 0) and |y - c| <= 1/4, giving
      |x - dq| <= s / 4 + 2^-24 |x|.
    The max form max(2^-2 |x|, 2^-2 s) fails by one float32 rounding at the tie |y| = 0.75.
    Blocks with 0 < amax < 2^-100: deterministic as defined, bound not claimed.

    Raises:
        ValueError: x not a 2-D bfloat16 / float32 tensor, block not a
            positive even int, or x holding a NaN / infinity (names the first one).
    """
    xb, hidden = _blocks(x, block, even=True)
    scales = _amax_scale(xb, FP4_E2M1_MAX)
    codes = fp4_e2m1_encode(xb / scales[..., None])
    return pack_fp4(_unblock(codes, hidden)), scales


def dequantize_fp4_blockwise(packed: torch.Tensor, scales: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Inverse of ``quantize_fp4_blockwise``: dq = fl(fp4_e2m1_decode(code) * s), one float32 rounding.

    Args:
        packed: uint8 [T, H / 2] packed e2m1 codes.
        scales: float32 [T, ceil(H / block)].
        block: elements per scale (positive even int, default 32).

    Returns:
        float32 [T, H].

    Raises:
        ValueError: wrong dtypes, not 2-D, or scales not [T, ceil(H / block)].
    """
    _check_scaled("packed", packed, scales, torch.float32, block, packed=True)
    return _fp4_scaled(packed, scales, block)


def scale_bytes(mode: str, hidden: int, block: int | None = None) -> int:
    """Bytes of scales per token of a wire mode.

    Args:
        mode: "fp8_blockwise" (float32 per block: 4 * ceil(H / block), block 128 by default),
            "fp4_mx" (one e8m0 byte per block: ceil(H / block), block 32), "fp4_blockwise" (float32
            per block: 4 * ceil(H / block), block 32) or "fp8_direct_cast" (no scales: 0). The
            last block may be shorter (H = 2880: 23 fp8 blocks, the last of 64 elements).
        hidden: H, a positive int (even for the fp4 modes).
        block: elements per scale; None takes the mode's default (``MODES``); a positive int (even
            for the fp4 modes) otherwise; must be None for "fp8_direct_cast".

    Returns:
        The byte count, e.g. H = 7168: fp8_blockwise 224, fp4_mx 224, fp4_blockwise 896.

    Raises:
        ValueError: unknown mode; hidden not a positive int (or odd for fp4); block
            invalid for the mode.
    """
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}: must be one of {', '.join(repr(m) for m in MODES)}")
    if not isinstance(hidden, int) or isinstance(hidden, bool) or hidden < 1:
        raise ValueError(f"hidden={hidden!r}: must be a positive int")
    if MODES[mode] is None:
        if block is not None:
            raise ValueError(f"block={block!r}: must be None for mode {mode!r}, which has no scales")
        return 0
    block = _check_block(MODES[mode] if block is None else block, even=mode.startswith("fp4"))
    if mode.startswith("fp4") and hidden % 2:
        raise ValueError(f"hidden={hidden}: must be even for mode {mode!r} (two fp4 codes a byte)")
    per_scale = 1 if mode == "fp4_mx" else 4
    return per_scale * -(-hidden // block)  # the last block may be shorter


# --- the combine leg's wire ----------------------------------------------------------------------


def _check_combine(mode: str, y) -> torch.Tensor:
    """Validate (mode, y) of a combine wire function; return y."""
    from epgen.codegen.dtypes import combine_quant

    combine_quant(mode)  # ValueError naming the known modes
    y = _check_2d("y", y, _BLOCK_DTYPES)
    if y.shape[1] == 0:
        raise ValueError(f"y: shape {tuple(y.shape)}: hidden size H must be positive")
    block = MODES.get(mode)
    if block:
        y32 = y.to(torch.float32)
        bad = ~torch.isfinite(y32)
        if bool(bad.any()):
            raise ValueError(f"{_first_bad('y', bad, y32)}: must be finite for mode {mode!r} (a block holding a "
                             f"NaN or an infinity has no defined scale)")
    return y


_TINY_BLOCK = 2.0**-80
"""Blocks of the combine wire whose amax is below this travel as zeros."""


def _flush_tiny_blocks(y: torch.Tensor, block: int) -> torch.Tensor:
    """float32 copy of [R, H] ``y`` with every block (the last may be shorter) of amax < 2^-80 zeroed."""
    yb = _padded_blocks(y.to(torch.float32), block).clone()
    yb[yb.abs().amax(dim=-1) < _TINY_BLOCK] = 0.0
    return _unblock(yb, y.shape[1])


def combine_roundtrip(mode: str, y: torch.Tensor) -> torch.Tensor:
    """What the combine wire delivers for expert outputs ``y``: dequantize(quantize(y)) of ``mode``,
    bit for bit what the kernels decode before they sum (ascending rank, float32) and round to
    bf16 once.

    Modes (``epgen.codegen.dtypes.COMBINE_QUANTS``): "none" (y itself), "fp8_direct_cast"
    (``fp8_direct_cast``), "fp8_blockwise" (``quantize_fp8_blockwise``, block 128),
    "fp4_blockwise" (``quantize_fp4_blockwise``, block 32). When H is not a multiple of the block
    the last block is shorter, as in those quantizers. A block whose amax is below 2^-80 travels
    as zeros: above that every quotient that can round to a nonzero code, and the kernels' division
    residuals, are normal float32, so kernels compiled with flush-to-zero still match bit for bit.

    Args:
        mode: the wire mode.
        y: [R, H] bfloat16 or float32 (finite for the blockwise modes).

    Returns:
        float32 [R, H].

    Raises:
        ValueError: unknown mode, y not 2-D bfloat16 / float32 with H >= 1, or (blockwise) not
            finite (naming the first bad element).
    """
    y = _check_combine(mode, y)
    if mode == "none":
        return y.to(torch.float32, copy=True)
    if mode == "fp8_direct_cast":
        return dequantize_fp8_direct(fp8_direct_cast(y))
    y = _flush_tiny_blocks(y, MODES[mode])
    if mode == "fp8_blockwise":
        return dequantize_fp8_blockwise(*quantize_fp8_blockwise(y))
    return dequantize_fp4_blockwise(*quantize_fp4_blockwise(y))


def combine_error_bound(mode: str, y: torch.Tensor) -> torch.Tensor:
    """Element-wise bound on |y - combine_roundtrip(mode, y)|, as each quantizer documents it.

    * none: 0.
    * fp8_direct_cast: ``max(2^-4 |y|, 2^-10)`` for |y| <= 448, ``|y| - 448`` above
      (``fp8_direct_cast``).
    * fp8_blockwise: ``2^-4 |y| + 2^-10 s`` (``quantize_fp8_blockwise``).
    * fp4_blockwise: ``2^-2 |y| + 2^-2 s`` (``quantize_fp4_blockwise``).

    s is the block's float32 scale (1 for a block of amax < 2^-80, which travels as zeros: its
    error |y| < 2^-80 is inside the bound too).
    A combined output adds the bounds of the rows it sums, plus its own bf16 rounding
    (2^-8 relative) and the float32 sum's (W x 2^-24 of the sum of magnitudes).

    Args:
        mode, y: as ``combine_roundtrip``.

    Returns:
        float32 [R, H].

    Raises:
        ValueError: as ``combine_roundtrip``.
    """
    a = _check_combine(mode, y).to(torch.float32).abs()
    if mode == "none":
        bound = torch.zeros_like(a)
    elif mode == "fp8_direct_cast":
        bound = torch.where(a <= FP8_E4M3_MAX, torch.clamp(a * 2.0**-4, min=2.0**-10), a - FP8_E4M3_MAX)
    else:
        block = MODES[mode]
        qmax, rel, per_scale = ((FP8_E4M3_MAX, 2.0**-4, 2.0**-10) if mode == "fp8_blockwise"
                                else (FP4_E2M1_MAX, 2.0**-2, 2.0**-2))
        s = _amax_scale(_padded_blocks(_flush_tiny_blocks(a, block), block), qmax)
        bound = rel * a + per_scale * s.repeat_interleave(block, dim=1)[:, : a.shape[1]]
    return bound
