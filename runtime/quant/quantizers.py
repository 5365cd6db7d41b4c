"""User-facing quantizers of dispatch payloads and their scales (pure torch, CPU, deterministic).

GPU kernels are checked against these functions bit for bit (codes and scales) or within the error
bound each quantizer's docstring states and derives. Element codecs: ``epgen.quant.codecs``.

Wire modes (``scale_bytes`` gives their per-token scale bytes), input ``x`` [T, H] bf16 or fp32:

* ``fp8_blockwise``: e4m3 codes [T, H] + float32 scales [T, H / 128], scale = block amax / 448.
* ``fp8_direct_cast``: e4m3 codes [T, H], no scale (saturating cast).
* ``fp4_mx``: packed e2m1 [T, H / 2] + e8m0 scales [T, H / 32], the OCP MX rule.
* ``fp4_blockwise``: packed e2m1 [T, H / 2] + float32 scales [T, H / 32], scale = amax / 6.

Error-bound summary (derivations in the docstrings; s = the block's stored scale, element-wise):

* fp8_blockwise: ``|x - dq| <= 2^-4 |x| + 2^-10 s``, s = fl(amax / 448), for blocks with
  amax >= 2^-100.
* fp8_direct_cast: ``|x - dq| <= max(2^-4 |x|, 2^-10)`` for |x| <= 448, ``|x| - 448`` above.
* The fp8 quantizers take ``flavour`` (``epgen.codegen.dtypes.FP8_FLAVOURS``, default the OCP
  e4m3fn above); with gfx942's "e4m3fnuz" the fp8 numbers are 240 for 448 and 2^-11 for 2^-10.
* fp4_mx: ``|x - dq| <= 2^-2 max(|x|, s)``, s = 2^(floor(log2 amax) - 2) clamped to e8m0; exact
  arithmetic, no condition.
* fp4_blockwise: ``|x - dq| <= 2^-2 |x| + 2^-2 s``, s = fl(amax / 6), for blocks with
  amax >= 2^-100.
"""

from __future__ import annotations

import torch

from epgen.codegen.dtypes import COMBINE_QUANTS, MX_BLOCK, dtype_info, fp8_flavour
from epgen.quant._common import (
    BLOCK_DTYPES,
    amax_scale,
    check_block,
    first_bad,
    padded_blocks,
    unblock,
)
from epgen.quant.codecs import (
    E8M0_MAX_EXP,
    E8M0_MIN_EXP,
    FP4_E2M1_MAX,
    e8m0_decode,
    fp4_e2m1_decode,
    fp4_e2m1_encode,
    fp8_e4m3_decode,
    fp8_e4m3_encode,
    pack_fp4,
    unpack_fp4,
)
from epgen.tensors import check_tensor

__all__ = [
    "MODES",
    "dequantize_fp4_blockwise",
    "dequantize_fp4_mx",
    "dequantize_fp8_blockwise",
    "dequantize_fp8_direct",
    "fp8_direct_cast",
    "quantize_fp4_blockwise",
    "quantize_fp4_mx",
    "quantize_fp8_blockwise",
    "scale_bytes",
]

MODES = {
    "fp8_blockwise": COMBINE_QUANTS["fp8_blockwise"].block,
    "fp8_direct_cast": None,
    "fp4_mx": MX_BLOCK,
    "fp4_blockwise": COMBINE_QUANTS["fp4_blockwise"].block,
}
"""Wire mode -> default block size (None: no scales); the blockwise modes' blocks are the combine
wire's (``epgen.codegen.dtypes.COMBINE_QUANTS``), fp4_mx's the OCP MX block."""

MODE_SCALES = {"fp8_blockwise": ("fp8", 4), "fp8_direct_cast": ("fp8", 0), "fp4_mx": ("fp4", 1), "fp4_blockwise": ("fp4", 4)}
"""Wire mode (a key of ``MODES``) -> (element dtype, a key of ``DTYPES``; bytes of one block's
scale: float32 4, OCP MX e8m0 1, none 0)."""


# --- validation ----------------------------------------------------------------------------------


def _blocks(x, block: int, *, even: bool) -> tuple[torch.Tensor, int]:
    """Validate a [T, H] quantizer input; return it as float32 [T, ceil(H / block), block], the
    last block zero-padded (which changes no block's amax), and H."""
    block = check_block(block, even=even)
    x = check_tensor("x", x, dtype=BLOCK_DTYPES, dim=2)
    tokens, hidden = x.shape
    if even and hidden % 2:
        raise ValueError(f"x: hidden size H={hidden} must be even (two fp4 codes a byte)")
    x32 = x.to(torch.float32)
    bad = ~torch.isfinite(x32)
    if bool(bad.any()):
        raise ValueError(
            f"{first_bad('x', bad, x32)}: must be finite (a block holding a NaN or an infinity has "
            f"no defined scale)"
        )
    return padded_blocks(x32, block), hidden


def _check_scaled(codes_name, codes, scales, scale_dtype, block, *, packed: bool) -> tuple[int, int]:
    """Validate a dequantizer's (codes, scales); return (T, H)."""
    block = check_block(block, even=packed)
    codes = check_tensor(codes_name, codes, dtype=torch.uint8, dim=2)
    scales = check_tensor("scales", scales, dtype=scale_dtype, dim=2)
    tokens, width = codes.shape
    hidden = 2 * width if packed else width
    want = (tokens, -(-hidden // block))
    if tuple(scales.shape) != want:
        raise ValueError(
            f"scales: shape {tuple(scales.shape)} must be {list(want)} ([T, ceil(H / block)] for "
            f"{codes_name} of shape {tuple(codes.shape)} and block={block})"
        )
    return tokens, hidden


def quantize_fp8_blockwise(x: torch.Tensor, block: int = MODES["fp8_blockwise"], *,
                           flavour: str = "e4m3fn") -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block scaled fp8 e4m3 ("fp8_blockwise" wire mode).

    For each block of ``block`` consecutive elements of a row: amax = max |x| (computed in
    float32), s = fl(amax / 448) (float32 true division), replaced by 1.0 when it is 0 (an all-zero
    block, or 0 < amax < 448 * 2^-150 whose quotient underflows); codes = fp8_e4m3_encode(fl(x / s))
    (float32 true division, then saturating RNE).

    Args:
        x: [T, H] bfloat16 or float32, finite; any H (even for fp4; the last block may be shorter, its amax over its own elements; T = 0 allowed).
        block: elements per scale (positive int, default 128).
        flavour: the fp8 flavour of the codes, a key of ``epgen.codegen.dtypes.FP8_FLAVOURS`` (the
            target's ``ArchTraits.fp8``). "e4m3fnuz" (gfx942): s = fl(amax / 240), codes
            ``fp8_e4m3_encode(fl(x / s), "e4m3fnuz")``, and the bound below with 240 for 448 and
            2^-11 for 2^-10.

    Returns:
        (codes, scales): codes uint8 [T, H] in ``flavour`` (e4m3fn by default); scales float32
        [T, ceil(H / block)].

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
            positive int, or x holding a NaN / infinity (names the first one); an unknown
            ``flavour`` (naming it and the known ones).
    """
    fmt = fp8_flavour(flavour, "flavour").numbers
    xb, hidden = _blocks(x, block, even=False)
    scales = amax_scale(xb, fmt.max)
    codes = fp8_e4m3_encode(xb / scales[..., None], flavour)
    return unblock(codes, hidden), scales


def dequantize_fp8_blockwise(codes: torch.Tensor, scales: torch.Tensor,
                             block: int = MODES["fp8_blockwise"], *, flavour: str = "e4m3fn") -> torch.Tensor:
    """Inverse of ``quantize_fp8_blockwise``: dq = fl(fp8_e4m3_decode(codes, flavour) * s), one
    float32 rounding.

    Args:
        codes: uint8 [T, H] codes in ``flavour``.
        scales: float32 [T, ceil(H / block)].
        block: elements per scale (positive int, default 128).
        flavour: a key of ``epgen.codegen.dtypes.FP8_FLAVOURS``, default "e4m3fn" (as
            ``quantize_fp8_blockwise``).

    Returns:
        float32 [T, H]. NaN codes (e4m3fn: 0x7F / 0xFF; e4m3fnuz: 0x80) decode to NaN.

    Raises:
        ValueError: wrong dtypes, not 2-D, or scales not [T, ceil(H / block)]; an unknown
            ``flavour``.
    """
    fp8_flavour(flavour, "flavour")
    tokens, hidden = _check_scaled("codes", codes, scales, torch.float32, block, packed=False)
    vals = padded_blocks(fp8_e4m3_decode(codes, flavour), block)
    return unblock(vals * scales[..., None], hidden)


def fp8_direct_cast(x: torch.Tensor, *, flavour: str = "e4m3fn") -> torch.Tensor:
    """Unscaled saturating cast to fp8 e4m3 ("fp8_direct_cast" wire mode): fp8_e4m3_encode of a [T, H] tensor.

    Args:
        x: [T, H] bfloat16 or float32 (NaN / infinities allowed: NaN -> 0x7F / 0xFF, +-inf ->
            +-448).
        flavour: a key of ``epgen.codegen.dtypes.FP8_FLAVOURS`` (the target's ``ArchTraits.fp8``).
            "e4m3fnuz" (gfx942): ``fp8_e4m3_encode(x, "e4m3fnuz")`` (NaN -> 0x80, +-inf -> +-240),
            and the bound below with 240 for 448 and 2^-11 for 2^-10.

    Returns:
        uint8 [T, H] codes in ``flavour`` (e4m3fn by default).

    Error bound (decode is exact, so this is fp8_e4m3_encode's): for finite x,
        ``|x - dq| <= max(2^-4 |x|, 2^-10)`` when |x| <= 448, and ``|x - dq| = |x| - 448`` above
        (saturation). Derivation: half a step of 2^(E-3) in binade [2^E, 2^(E+1)) is
        2^(E-4) <= 2^-4 |x| for |x| >= 2^-6; half the subnormal step 2^-9 below. No float32
        arithmetic besides the cast, so the bound is exact, max form included.

    Raises:
        ValueError: x not a 2-D bfloat16 / float32 tensor; an unknown ``flavour``.
    """
    fp8_flavour(flavour, "flavour")
    x = check_tensor("x", x, dtype=BLOCK_DTYPES, dim=2)
    return fp8_e4m3_encode(x, flavour)


def dequantize_fp8_direct(codes: torch.Tensor, *, flavour: str = "e4m3fn") -> torch.Tensor:
    """Decode of ``fp8_direct_cast``: [T, H] uint8 codes in ``flavour`` (a key of
    ``epgen.codegen.dtypes.FP8_FLAVOURS``, default "e4m3fn") -> float32 [T, H], exact.

    Raises:
        ValueError: codes not a 2-D uint8 tensor; an unknown ``flavour``.
    """
    fp8_flavour(flavour, "flavour")
    return fp8_e4m3_decode(check_tensor("codes", codes, dtype=torch.uint8, dim=2), flavour)


def quantize_fp4_mx(x: torch.Tensor, block: int = MODES["fp4_mx"]) -> tuple[torch.Tensor, torch.Tensor]:
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
    e = torch.where(amax > 0, floor_log2 - 2, E8M0_MIN_EXP).clamp(E8M0_MIN_EXP, E8M0_MAX_EXP)
    scales = (e + 127).to(torch.uint8)
    s = e8m0_decode(scales)
    codes = fp4_e2m1_encode(xb / s[..., None])
    return pack_fp4(unblock(codes, hidden)), scales


def _fp4_scaled(packed: torch.Tensor, scale_values: torch.Tensor, block: int) -> torch.Tensor:
    """float32 [T, H]: every unpacked e2m1 element times its block's scale (one float32 rounding)."""
    hidden = packed.shape[1] * 2
    vals = padded_blocks(fp4_e2m1_decode(unpack_fp4(packed)), block)
    return unblock(vals * scale_values[..., None], hidden)


def dequantize_fp4_mx(packed: torch.Tensor, scales: torch.Tensor, block: int = MODES["fp4_mx"]) -> torch.Tensor:
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


def quantize_fp4_blockwise(x: torch.Tensor, block: int = MODES["fp4_blockwise"]) -> tuple[torch.Tensor, torch.Tensor]:
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
    scales = amax_scale(xb, FP4_E2M1_MAX)
    codes = fp4_e2m1_encode(xb / scales[..., None])
    return pack_fp4(unblock(codes, hidden)), scales


def dequantize_fp4_blockwise(packed: torch.Tensor, scales: torch.Tensor,
                             block: int = MODES["fp4_blockwise"]) -> torch.Tensor:
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
    element, per_scale = MODE_SCALES[mode]
    packed = 8 // dtype_info(element).bits  # codes a byte
    if not isinstance(hidden, int) or isinstance(hidden, bool) or hidden < 1:
        raise ValueError(f"hidden={hidden!r}: must be a positive int")
    if MODES[mode] is None:
        if block is not None:
            raise ValueError(f"block={block!r}: must be None for mode {mode!r}, which has no scales")
        return 0
    block = check_block(MODES[mode] if block is None else block, even=packed == 2)
    if hidden % packed:
        raise ValueError(f"hidden={hidden}: must be even for mode {mode!r} (two {element} codes a byte)")
    return per_scale * -(-hidden // block)  # the last block may be shorter
