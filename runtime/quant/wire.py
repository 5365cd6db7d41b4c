"""Reference of the combine leg's quantized wire and its error bound (pure torch, CPU, deterministic).

The combine kernels (``templates/common/wire/``) quantize each expert output row, peers decode it
and sum in float32; ``combine_roundtrip`` is what they decode, bit for bit, and
``combine_error_bound`` bounds its distance to the input. Wire formats, block sizes and element
maxima: ``epgen.codegen.dtypes.COMBINE_QUANTS`` and ``element_format``, the numbers the kernels
print. An fp8 wire carries codes in the target's fp8 flavour (``ArchTraits.fp8``: e4m3fnuz on
gfx942, e4m3fn elsewhere), which every function here takes as ``fp8_flavour`` (default "e4m3fn");
``arch_fp8_flavour(arch)`` reads it from an arch's traits row.
"""

from __future__ import annotations

import torch

from epgen.codegen.arch import traits
from epgen.codegen.dtypes import COMBINE_FLUSH_LOG2, MiniFloat, combine_quant, dtype_info, element_format
from epgen.codegen.dtypes import fp8_flavour as _fp8_flavour_row
from epgen.quant._common import BLOCK_DTYPES, amax_scale, first_bad, padded_blocks, unblock
from epgen.tensors import check_tensor
from epgen.quant.quantizers import (
    dequantize_fp4_blockwise,
    dequantize_fp8_blockwise,
    dequantize_fp8_direct,
    fp8_direct_cast,
    quantize_fp4_blockwise,
    quantize_fp8_blockwise,
)

__all__ = ["arch_fp8_flavour", "combine_error_bound", "combine_roundtrip", "combine_wire_rows"]


WIRE_CODECS = {
    "fp8_direct_cast": (lambda y, block, flavour: (fp8_direct_cast(y, flavour=flavour), None),
                        lambda codes, scales, block, flavour: dequantize_fp8_direct(codes, flavour=flavour)),
    "fp8_blockwise": (lambda y, block, flavour: quantize_fp8_blockwise(y, block, flavour=flavour),
                      lambda codes, scales, block, flavour: dequantize_fp8_blockwise(codes, scales, block,
                                                                                     flavour=flavour)),
    "fp4_blockwise": (lambda y, block, flavour: quantize_fp4_blockwise(y, block),
                      lambda codes, scales, block, flavour: dequantize_fp4_blockwise(codes, scales, block)),
}
"""Quantized combine wire (a key of ``COMBINE_QUANTS`` whose wire carries codes) -> (encode(y,
block, flavour) -> (codes, scales or None), decode(codes, scales, block, flavour) -> float32): the
quantizers the kernels match bit for bit; the wire's block (``CombineQuant.block``) and the
target's fp8 flavour (``ArchTraits.fp8``; fp4 ignores it) are passed to both."""

def arch_fp8_flavour(arch: str) -> str:
    """The fp8 flavour an fp8 combine wire carries on target ``arch``: ``ArchTraits.fp8`` of its
    row in ``epgen.codegen.arch.ARCH_TRAITS`` ("e4m3fnuz" on gfx942, "e4m3fn" on the others), the
    value to pass as ``fp8_flavour``.

    Raises:
        ValueError: ``arch`` is not a key of ``ARCH_TRAITS`` (naming it and the known ones).
    """
    return traits(arch).fp8


def _wire_codec(mode: str):
    """(encode, decode) of quantized wire ``mode`` (``WIRE_CODECS``).

    Raises:
        ValueError: the wire has no reference codec (naming the mode and the known ones).
    """
    try:
        return WIRE_CODECS[mode]
    except KeyError:
        raise ValueError(f"mode={mode!r}: the combine wire reference has no codec for this wire; known: "
                         f"{', '.join(WIRE_CODECS)}") from None


def _check_combine(mode: str, y, fp8_flavour: str) -> torch.Tensor:
    """Validate (mode, y, fp8_flavour) of a combine wire function; return y."""
    _fp8_flavour_row(fp8_flavour, "fp8_flavour")  # on every mode: a typo never passes unseen
    quant = combine_quant(mode)  # ValueError naming the known modes
    if quant.quantized:
        _wire_codec(mode)  # ValueError for a wire the reference cannot encode
    y = check_tensor("y", y, dtype=BLOCK_DTYPES, dim=2)
    if y.shape[1] == 0:
        raise ValueError(f"y: shape {tuple(y.shape)}: hidden size H must be positive")
    if y.shape[1] * dtype_info(quant.element).bits % 8:
        raise ValueError(f"y: shape {tuple(y.shape)}: hidden size H={y.shape[1]} must be even for mode {mode!r} "
                         f"(two {quant.element} codes a byte)")
    if quant.block:
        y32 = y.to(torch.float32)
        bad = ~torch.isfinite(y32)
        if bool(bad.any()):
            raise ValueError(f"{first_bad('y', bad, y32)}: must be finite for mode {mode!r} (a block holding a "
                             f"NaN or an infinity has no defined scale)")
    return y


_TINY_BLOCK = 2.0**COMBINE_FLUSH_LOG2
"""Blocks of the combine wire whose amax is below this (2^-80) travel as zeros."""


def _flush_tiny_blocks(y: torch.Tensor, block: int) -> torch.Tensor:
    """float32 copy of [R, H] ``y`` with every block (the last may be shorter) of amax < 2^-80
    zeroed, each zero keeping its element's sign (as the kernels encode it: x / 1 rounds to a zero
    code with x's sign bit)."""
    yb = padded_blocks(y.to(torch.float32), block).clone()
    tiny = yb.abs().amax(dim=-1) < _TINY_BLOCK
    yb[tiny] = yb[tiny] * 0.0
    return unblock(yb, y.shape[1])


def _half_steps(fmt: MiniFloat) -> tuple[float, float]:
    """(relative, absolute) rounding error bounds of an RNE encode into ``fmt`` below its max:
    half a normal step relative to |x|, 2^-(mbits + 1), and half the subnormal step,
    2^(emin - mbits - 1) (fp8 e4m3fn: 2^-4, 2^-10; e4m3fnuz: 2^-4, 2^-11; fp4 e2m1: 2^-2, 2^-2)."""
    return 2.0 ** -(fmt.mbits + 1), 2.0 ** (fmt.emin - fmt.mbits - 1)


def combine_wire_rows(mode: str, y: torch.Tensor, *,
                      fp8_flavour: str = "e4m3fn") -> tuple[torch.Tensor, torch.Tensor | None]:
    """The wire rows of a quantized combine wire for expert outputs ``y``: the codes and block
    scales the kernels write for a row (the quantize kernel, the expert layout's fold) and decode
    (``combine_roundtrip``), bit for bit. What an expert stage that writes its outputs already
    quantized must write into ``EpDispatchCombine.combine_wire_input()``.

    Modes: as ``combine_roundtrip`` ("none" has no wire rows: peers read the bf16 rows). A block
    whose amax is below 2^-80 travels as zeros with scale 1.

    Args:
        mode: a quantized wire mode ("fp8_direct_cast", "fp8_blockwise", "fp4_blockwise").
        y: [R, H] bfloat16 or float32 (finite for the blockwise modes).
        fp8_flavour: as ``combine_roundtrip``.

    Returns:
        (codes, scales): codes uint8 [R, H] (fp8 in ``fp8_flavour``) or [R, H / 2] (fp4 e2m1,
        ``pack_fp4`` order: element 2j in byte j's low nibble); scales float32 [R, ceil(H / block)]
        (fp8_blockwise: amax / 448 for e4m3fn, amax / 240 for e4m3fnuz), or None for
        fp8_direct_cast.

    Raises:
        ValueError: as ``combine_roundtrip``, or mode "none".
    """
    y = _check_combine(mode, y, fp8_flavour)
    quant = combine_quant(mode)
    if not quant.quantized:
        raise ValueError("mode='none': the bf16 combine wire has no wire rows (peers read the bf16 rows themselves)")
    encode, _ = _wire_codec(mode)
    return encode(_flush_tiny_blocks(y, quant.block) if quant.block else y, quant.block, fp8_flavour)


def combine_roundtrip(mode: str, y: torch.Tensor, *, fp8_flavour: str = "e4m3fn") -> torch.Tensor:
    """What the combine wire delivers for expert outputs ``y``: dequantize(quantize(y)) of ``mode``,
    bit for bit what the kernels decode before they sum (ascending rank, float32) and round to
    bf16 once.

    Modes (``epgen.codegen.dtypes.COMBINE_QUANTS``): "none" (y itself), "fp8_direct_cast"
    (``fp8_direct_cast``), "fp8_blockwise" (``quantize_fp8_blockwise``, block 128),
    "fp4_blockwise" (``quantize_fp4_blockwise``, block 32): the decode of ``combine_wire_rows``.
    When H is not a multiple of the block the last block is shorter, as in those quantizers. A
    block whose amax is below 2^-80 travels as zeros: above that every quotient that can round to
    a nonzero code, and the kernels' division residuals, are normal float32, so kernels compiled
    with flush-to-zero still match bit for bit.

    The fp8 modes' codes are in ``fp8_flavour``, the target's (``arch_fp8_flavour(arch)``): with
    "e4m3fn" (sm_90, gfx950, gfx1250) the scale is amax / 448 and the cast saturates at 448; with
    "e4m3fnuz" (gfx942) amax / 240 and 240, as that arch's kernels encode (their software codec's
    e4m3fnuz branch). "none" and fp4_blockwise are the same in every flavour.

    Args:
        mode: the wire mode.
        y: [R, H] bfloat16 or float32 (finite for the blockwise modes).
        fp8_flavour: a key of ``epgen.codegen.dtypes.FP8_FLAVOURS`` ("e4m3fn", the default, or
            "e4m3fnuz"), checked on every mode.

    Returns:
        float32 [R, H].

    Raises:
        ValueError: unknown mode or a quantized mode without a reference codec (``WIRE_CODECS``),
            unknown fp8_flavour (``fp8_flavour='e5m2': unknown fp8 flavour; known: e4m3fn,
            e4m3fnuz``), y not 2-D bfloat16 / float32 with H >= 1, or (blockwise) not finite
            (naming the first bad element).
    """
    y = _check_combine(mode, y, fp8_flavour)
    quant = combine_quant(mode)
    if not quant.quantized:
        return y.to(torch.float32, copy=True)
    codes, scales = combine_wire_rows(mode, y, fp8_flavour=fp8_flavour)
    _, decode = _wire_codec(mode)
    return decode(codes, scales, quant.block, fp8_flavour)


def combine_error_bound(mode: str, y: torch.Tensor, *, fp8_flavour: str = "e4m3fn") -> torch.Tensor:
    """Element-wise bound on |y - combine_roundtrip(mode, y, fp8_flavour=fp8_flavour)|, as each
    quantizer documents it.

    * none: 0.
    * fp8_direct_cast: ``max(2^-4 |y|, 2^-10)`` for |y| <= 448, ``|y| - 448`` above
      (``fp8_direct_cast``); e4m3fnuz: ``max(2^-4 |y|, 2^-11)`` for |y| <= 240, ``|y| - 240``
      above.
    * fp8_blockwise: ``2^-4 |y| + 2^-10 s``, s = fl(amax / 448) (``quantize_fp8_blockwise``);
      e4m3fnuz: ``2^-4 |y| + 2^-11 s``, s = fl(amax / 240).
    * fp4_blockwise: ``2^-2 |y| + 2^-2 s`` (``quantize_fp4_blockwise``), in every flavour.

    s is the block's float32 scale (1 for a block of amax < 2^-80, which travels as zeros: its
    error |y| < 2^-80 is inside the bound too).
    A combined output adds the bounds of the rows it sums, plus its own bf16 rounding
    (2^-8 relative) and the float32 sum's (W x 2^-24 of the sum of magnitudes).

    Args:
        mode, y, fp8_flavour: as ``combine_roundtrip``.

    Returns:
        float32 [R, H].

    Raises:
        ValueError: as ``combine_roundtrip``.
    """
    a = _check_combine(mode, y, fp8_flavour).to(torch.float32).abs()
    quant = combine_quant(mode)
    if not quant.quantized:
        return torch.zeros_like(a)
    fmt = element_format(quant.element, fp8_flavour)
    rel, sub = _half_steps(fmt)
    if not quant.block:  # a saturating cast
        return torch.where(a <= fmt.max, torch.clamp(a * rel, min=sub), a - fmt.max)
    s = amax_scale(padded_blocks(_flush_tiny_blocks(a, quant.block), quant.block), fmt.max)
    return rel * a + sub * s.repeat_interleave(quant.block, dim=1)[:, : a.shape[1]]
