"""Payload dtypes: one row per dtype, read by the spec, the renderer and the runtime."""

from __future__ import annotations

import struct

import attrs


@attrs.frozen
class DTypeInfo:
    """One payload dtype.

    Attributes:
        name: short name used in specs, entry names and CLI flags.
        bits: bits per element.
        torch_name: attribute of ``torch`` naming the dtype of the tensors that carry it; for fp4
            that is uint8 holding two e2m1 codes (element 2i in the low nibble).
        description: what the bits mean.
        arch_flavoured: the target's ``ArchTraits.fp8`` flavour (``FP8_FLAVOURS``) says which torch
            dtype carries it (``on``); ``torch_name`` is the OCP e4m3fn flavour's.
    """

    name: str
    bits: int
    torch_name: str
    description: str
    arch_flavoured: bool = False

    def on(self, fp8: str) -> "DTypeInfo":
        """This dtype on a target whose fp8 flavour is ``fp8`` (``ArchTraits.fp8``): for an
        ``arch_flavoured`` dtype, the flavour's torch dtype; otherwise this row.

        Raises:
            ValueError: ``fp8`` is not a key of ``FP8_FLAVOURS``.
        """
        flavour = fp8_flavour(fp8)
        return attrs.evolve(self, torch_name=flavour.torch_name) if self.arch_flavoured else self

    def row_bytes(self, hidden: int) -> int:
        """Bytes of one row of ``hidden`` elements."""
        return hidden * self.bits // 8

    def columns(self, hidden: int) -> int:
        """Columns of a torch tensor holding one row of ``hidden`` elements."""
        import torch

        return self.row_bytes(hidden) // torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def torch_dtype(self):
        """The matching ``torch.dtype``."""
        import torch

        return getattr(torch, self.torch_name)


DTYPES: dict[str, DTypeInfo] = {
    d.name: d
    for d in (
        DTypeInfo(name="bf16", bits=16, torch_name="bfloat16", description="bfloat16"),
        DTypeInfo(name="fp8", bits=8, torch_name="float8_e4m3fn",
                  description="fp8 e4m3 in the target's flavour (ArchTraits.fp8, a key of FP8_FLAVOURS; "
                              "torch_name is the OCP flavour e4m3fn's)", arch_flavoured=True),
        DTypeInfo(name="fp4", bits=4, torch_name="uint8",
                  description="fp4 e2m1 (OCP MX), two codes per byte, element 2i in the low nibble"),
    )
}


def dtype_info(name: str) -> DTypeInfo:
    """Return the row of dtype ``name``.

    Raises:
        ValueError: unknown dtype (the message lists the known ones).
    """
    return _row(DTYPES, name, "dtype", "dtype")


def _row(table: dict, name, argument: str, what: str):
    """``table[name]``, or ValueError naming the argument, its value and the known names."""
    try:
        return table[name]
    except (KeyError, TypeError):
        raise ValueError(f"{argument}={name!r}: unknown {what}; known: {', '.join(table)}") from None


@attrs.frozen
class MiniFloat:
    """Numbers of one sign-magnitude minifloat element format of the quantized wires.

    The one source of these numbers: the kernels print them (``templates/common/wire/``, through
    ``KernelSpec.template_vars()``) and the pure-torch reference (``epgen.quant``) computes with
    them. Layout of a code: sign bit, then ``ebits`` exponent bits, then ``mbits`` mantissa bits.

    Attributes:
        name: the format's name in the OCP specifications.
        ebits: exponent bits.
        mbits: mantissa bits.
        bias: exponent bias; a normal code's value is 2^(exponent field - bias) * (1 + m / 2^mbits),
            a subnormal's (exponent field 0) 2^(1 - bias) * m / 2^mbits.
        max: largest finite magnitude; encoders saturate to it.
        max_code: magnitude code (sign bit clear) of ``max``.
        has_nan: whether the format has a NaN code.
        nan_code: magnitude code of NaN when ``has_nan`` (the input's sign bit joins it), or, in a
            format without negative zero, NaN's whole code, the sign bit alone (e4m3fnuz: 0x80);
            without ``has_nan``, the code the kernels' encoder gives a NaN input (0; the reference
            rejects NaN instead).
        negative_zero: whether the sign bit over magnitude 0 is negative zero (the OCP formats);
            if not, that code is NaN and a value rounding to zero takes code 0 whatever its sign.
    """

    name: str
    ebits: int
    mbits: int
    bias: int
    max: float
    max_code: int
    has_nan: bool
    nan_code: int
    negative_zero: bool

    @property
    def bits(self) -> int:
        """Bits per code: sign, exponent and mantissa."""
        return 1 + self.ebits + self.mbits

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal magnitude, 2^emin (1 - bias)."""
        return 1 - self.bias

    @property
    def sign_shift(self) -> int:
        """Position of the sign bit in a code."""
        return self.ebits + self.mbits

    def magnitude(self, code: int) -> float:
        """The value of magnitude code ``code`` (sign bit clear; the NaN code is not one)."""
        e, m = code >> self.mbits, code & ((1 << self.mbits) - 1)
        if e == 0:
            return 2.0 ** (1 - self.bias) * m / 2**self.mbits
        return 2.0 ** (e - self.bias) * (1 + m / 2**self.mbits)

    @property
    def f16_high_bytes(self) -> tuple[int, ...]:
        """The high byte of each magnitude's IEEE binary16 bits, codes 0..max_code, for a format
        whose magnitudes are all exact binary16 numbers with a zero low byte (fp4 e2m1: 0x00, 0x38,
        0x3C, 0x3E, 0x40, 0x42, 0x44, 0x46): a byte permutation then decodes codes into f16 pairs.

        Raises:
            ValueError: a magnitude is not exact in binary16 or has low bits.
        """
        out = []
        for code in range(self.max_code + 1):
            value = self.magnitude(code)
            (bits,) = struct.unpack("<H", struct.pack("<e", value))
            if struct.unpack("<e", struct.pack("<H", bits))[0] != value or bits & 0xFF:
                raise ValueError(f"{self.name}: magnitude {value} of code {code} is not a binary16 number with a "
                                 "zero low byte")
            out.append(bits >> 8)
        return tuple(out)


@attrs.frozen
class Fp8Flavour:
    """One flavour of fp8 e4m3, as a target's conversions read and write it (``ArchTraits.fp8``).

    Attributes:
        name: the flavour's name, as torch and the OCP / AMD documents spell it.
        torch_name: attribute of ``torch`` naming the dtype of fp8 payload tensors on such a target.
        numbers: the format's numbers, which the combine wire's codec prints.
    """

    name: str
    torch_name: str
    numbers: MiniFloat


FP8_FLAVOURS: dict[str, Fp8Flavour] = {
    f.name: f
    for f in (
        Fp8Flavour(name="e4m3fn", torch_name="float8_e4m3fn",
                   numbers=MiniFloat(name="e4m3fn", ebits=4, mbits=3, bias=7, max=448.0, max_code=0x7E, has_nan=True,
                                     nan_code=0x7F, negative_zero=True)),
        Fp8Flavour(name="e4m3fnuz", torch_name="float8_e4m3fnuz",
                   numbers=MiniFloat(name="e4m3fnuz", ebits=4, mbits=3, bias=8, max=240.0, max_code=0x7F, has_nan=True,
                                     nan_code=0x80, negative_zero=False)),
    )
}
"""fp8 flavours by name. e4m3fn, the OCP 8-bit floating point specification's E4M3 (bias 7, no
infinities, ``S.1111.111`` NaN, max 448; sm_90, gfx950 and gfx1250). e4m3fnuz, the FP8 of AMD's
CDNA3 ISA (gfx942) and of ``torch.float8_e4m3fnuz`` ("fn": finite, "uz": unsigned zero): bias 8,
no infinities, no negative zero, 0x80 NaN, max 240 (0x7F = 2^7 * 1.875). Each flavour needs the
combine wire codec's branch for it (``templates/common/wire/_codec.j2`` refuses any other)."""


def fp8_flavour(name: str, argument: str = "fp8") -> Fp8Flavour:
    """Return the fp8 flavour ``name``; ``argument`` is the name of the caller's argument that
    held it, which an error names.

    Raises:
        ValueError: unknown flavour (``argument=name``, and the known ones).
    """
    return _row(FP8_FLAVOURS, name, argument, "fp8 flavour")


MINIFLOATS: dict[str, MiniFloat] = {
    "fp8": FP8_FLAVOURS["e4m3fn"].numbers,
    "fp4": MiniFloat(name="e2m1", ebits=2, mbits=1, bias=1, max=6.0, max_code=7, has_nan=False, nan_code=0,
                     negative_zero=True),
}
"""Quantized wire element formats by dtype name (keys of ``DTYPES``), as the pure-torch reference
(``epgen.quant``) computes with them by default: fp8 e4m3 in its OCP flavour e4m3fn
(``FP8_FLAVOURS``) and fp4 e2m1 (OCP MX: no NaN, max 6). The kernels take fp8's from their target
(``element_format``), and so does the reference given the target's flavour (``fp8_flavour=`` /
``flavour=``, e4m3fnuz on gfx942)."""


def element_format(element: str, fp8: str) -> MiniFloat:
    """The numbers of wire element dtype ``element`` on a target whose fp8 flavour is ``fp8``
    (``ArchTraits.fp8``): fp8 in that flavour (``FP8_FLAVOURS``), another element from ``MINIFLOATS``.

    Raises:
        ValueError: ``element`` has no format there, or ``fp8`` is not a known flavour (naming
            the argument and the known names).
    """
    if element == "fp8":
        return fp8_flavour(fp8).numbers
    try:
        return MINIFLOATS[element]
    except (KeyError, TypeError):
        raise ValueError(f"element={element!r}: no minifloat format; known: {', '.join(MINIFLOATS)}") from None

MX_BLOCK = 32
"""Elements sharing one e8m0 scale in the OCP MX formats (``fp4_mx``)."""

COMBINE_FLUSH_LOG2 = -80
"""Blocks of a scaled combine wire whose amax is below 2^COMBINE_FLUSH_LOG2 travel as zeros (scale 1):
above it every quotient that can round to a nonzero code, and the kernels' division residuals, are
normal float32, so kernels that flush subnormals still match the reference bit for bit."""


def _align16(n: int) -> int:
    return (n + 15) // 16 * 16


@attrs.frozen
class CombineQuant:
    """One wire format of the combine leg: how expert outputs (bf16) travel to the token's rank.

    Each rank quantizes its received rows into a wire row in its own arena; the token's rank
    reads the wire rows of every peer the token reached, dequantizes, sums in fp32 and rounds to
    bf16 once. Reference and error bounds: ``epgen.quant`` (``combine_roundtrip``,
    ``combine_error_bound``).

    Attributes:
        name: the mode as users spell it (``EpConfig.combine_quant``, ``--quant``).
        element: wire element dtype (a key of ``DTYPES``).
        block: elements per float32 scale (scale = block amax / element max); None: no scales.
        tag: entry-name suffix ('' for the unquantized wire).
    """

    name: str
    element: str = attrs.field(validator=lambda _inst, _attr, value: dtype_info(value))
    block: int | None
    tag: str

    @property
    def quantized(self) -> bool:
        return self.name != "none"

    @property
    def template(self) -> str:
        """The template of this wire's kernel code, ``common/wire/<name>.j2`` (included by ops/combine.j2)."""
        return f"common/wire/{self.name}.j2"

    def code_bytes(self, hidden: int) -> int:
        """Bytes of one row's element codes."""
        return dtype_info(self.element).row_bytes(hidden)

    def scale_count(self, hidden: int) -> int:
        """float32 scales per row: ceil(H / block) (the last block may be partial), 0 unscaled."""
        return -(-hidden // self.block) if self.block else 0

    def scale_offset(self, hidden: int) -> int:
        """Byte offset of the scales inside a wire row (16-byte aligned)."""
        return _align16(self.code_bytes(hidden))

    def wire_row_bytes(self, hidden: int) -> int:
        """Bytes of one wire row: codes, then scales, each padded to 16 bytes."""
        return self.scale_offset(hidden) + _align16(4 * self.scale_count(hidden))


COMBINE_QUANTS: dict[str, CombineQuant] = {
    q.name: q
    for q in (
        CombineQuant(name="none", element="bf16", block=None, tag=""),
        CombineQuant(name="fp8_direct_cast", element="fp8", block=None, tag="qfp8d"),
        CombineQuant(name="fp8_blockwise", element="fp8", block=128, tag="qfp8b"),
        CombineQuant(name="fp4_blockwise", element="fp4", block=32, tag="qfp4b"),
    )
}
"""Combine wire formats: none (bf16 rows), fp8_direct_cast (saturating cast, no scales),
fp8_blockwise (128-element blocks, float32 scale = amax / 448), fp4_blockwise (32-element
blocks, float32 scale = amax / 6)."""


def combine_quant(name: str) -> CombineQuant:
    """Return the combine wire format ``name``.

    Raises:
        ValueError: unknown mode (the message lists the known ones).
    """
    try:
        return COMBINE_QUANTS[name]
    except (KeyError, TypeError):
        raise ValueError(f"combine_quant={name!r}: must be one of {', '.join(COMBINE_QUANTS)}") from None
