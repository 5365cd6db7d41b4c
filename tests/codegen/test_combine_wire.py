"""CPU tests of the combine wire templates (templates/common/wire/): each wire format renders its
own template, and every number the kernels print is the table's (``epgen.codegen.dtypes``), the
same numbers the reference ``epgen.quant`` computes with."""

from __future__ import annotations

import re

import pytest

from epgen.codegen.arch import ARCHES, traits
from epgen.codegen.dtypes import COMBINE_FLUSH_LOG2, COMBINE_QUANTS, element_format
from epgen.codegen.render import environment, render
from epgen.codegen.spec import KernelSpec

BASE = dict(op="combine", dtype="bf16", hidden=2880, topk=4, experts_per_rank=5, world_size=3,
            max_tokens_per_rank=77, blocks=7, warps_per_block=3, unroll=5)
QUANTIZED = [name for name, q in COMBINE_QUANTS.items() if q.quantized]
CASES = [(arch, mode) for arch in ARCHES for mode in QUANTIZED]


def _render(arch: str, mode: str) -> tuple[KernelSpec, str]:
    s = KernelSpec(arch=arch, combine_quant=mode, **BASE)
    return s, render(s).text


def _one(pattern: str, text: str) -> re.Match:
    found = list(re.finditer(pattern, text, re.M))
    assert len(found) == 1, f"{pattern!r}: {len(found)} matches"
    return found[0]


def _int(literal: str) -> int:
    return int(literal, 0)


def test_every_wire_format_has_its_template():
    names = set(environment().list_templates())
    for q in COMBINE_QUANTS.values():
        assert q.template == f"common/wire/{q.name}.j2" and q.template in names


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("mode", list(COMBINE_QUANTS))
def test_the_wire_format_renders_its_own_section(arch, mode):
    _, text = _render(arch, mode)
    assert _one(r"^// ---- combine wire: (\w+) ----$", text).group(1) == mode
    if mode != "none":
        assert f'epgen.quant.combine_roundtrip("{mode}", ...)' in text


@pytest.mark.parametrize("arch,mode", CASES, ids=[f"{a}-{m}" for a, m in CASES])
def test_printed_numbers_are_the_tables(arch, mode):
    s, text = _render(arch, mode)
    q = COMBINE_QUANTS[mode]
    e = element_format(q.element, traits(arch).fp8)  # fp8 in the arch's flavour: gfx942's e4m3fnuz
    assert float(_one(r"^constexpr float kElementMax = ([0-9.]+)f;$", text).group(1)) == e.max
    assert int(_one(r"^constexpr int kSrcRowBytes = (\d+);$", text).group(1)) == q.wire_row_bytes(s.hidden)
    assert int(_one(r"^constexpr int kWireScaleOffset = (\d+);$", text).group(1)) == q.scale_offset(s.hidden)
    row = _one(r"^// Wire row: (\w+) codes \((\d+) bytes\)", text)
    assert (row.group(1), int(row.group(2))) == (q.element, q.code_bytes(s.hidden))
    if q.block:
        assert int(_one(r"^constexpr int kLanesPerScale = (\d+);", text).group(1)) * 8 == q.block
        scales = _one(r"^// (\d+) float32 scales at byte (\d+), one per (\d+) elements", text)
        assert [int(g) for g in scales.groups()] == [q.scale_count(s.hidden), q.scale_offset(s.hidden), q.block]
        header = _one(r"s = fl\(block amax / ([0-9.]+)\), 1 when amax < 2\^(-?\d+), NaN for a block holding a NaN", text)
        assert float(header.group(1)) == e.max and int(header.group(2)) == COMBINE_FLUSH_LOG2
        flush = _one(r"^  return amax >= (0x1p-?\d+)f \? ep_div_rn\(amax, kElementMax\) : 1\.0f;", text)
        assert float.fromhex(flush.group(1)) == 2.0**COMBINE_FLUSH_LOG2
    else:
        assert "kLanesPerScale" not in text and "a saturating cast, no scales" in text
    decodes = re.findall(r"ep_decode_minifloat<(\w+), (\w+), (\w+)>\(", text)
    if traits(arch).hw_fp8_convert and q.element == "fp8":
        assert "ep_grid_code" not in text and not decodes and "template <int kM" not in text
        assert "ep_e4m3x2_hw(lo, hi)" in text and "ep_e4m3x2_decode_hw(codes, lo, hi)" in text
        assert "ep_e4m3x2_decode_hw(ep_e4m3x2_hw(lo, hi), rlo, rhi)" in text  # own rows through the conversions
        return
    # the software codec: rounding to the grid by adding k (_codec.j2), the format's numbers printed
    t = _one(r"t = binade > (0x[0-9a-f]+)u \? binade : \1u;\n  return ep_fabs\(q\) \+ ep_bits_to_float\(t \+ (0x[0-9a-f]+)u\);",
             text)
    assert [int(g, 16) for g in t.groups()] == [(127 + e.emin) << 23, (23 - e.mbits) << 23]
    assert "rlo = ep_grid_round(lo);" in text
    # a scaled wire's grid rounding has no saturation (its quotients stay within the format)
    sign = r"\(u & 0x80000000u\)" if e.negative_zero else r"\(r != 0\.0f \? u & 0x80000000u : 0u\)"  # no -0 in fnuz
    rounded = _one(rf"^  return ep_bits_to_float\(ep_float_to_bits\((.*)\) \| {sign}\);$", text).group(1)
    assert rounded == ("r" if q.block else f"ep_fabs(q) > {e.max}f ? {e.max}f : r")
    if q.element == "fp4":  # the lines' encoder and the integer decoder, no conversion
        hb = e.f16_high_bytes  # the decoder's binary16 table, both words printed
        words = ["%#010x" % sum(b << 8 * k for k, b in enumerate(hb[i:i + 4])) for i in (0, 4)]
        assert not decodes and "template <int kM" not in text and "ep_grid_code" not in text
        assert f"ep_byte_perm({words[0]}u, {words[1]}u, sel) | sign, lo, hi);" in text
        # the decoder's selector and sign permutations tests/runtime/references/test_quant.py emulates
        assert "ep_byte_perm(shifted & 0x70707070u, word & 0x70707070u, 0x4040u + 0x1111u * j)" in text
        assert "ep_byte_perm(shifted, word, 0x4400u + 0x1111u * j) & 0x80008000u" in text
        # the constants tests/runtime/references/test_quant.py's emulation of the encoder uses
        assert "ep_fma_rn(a, 2.0f, 0x1p23f)" in text and "a + 0x1.000004p23f" in text
        assert "ep_fma_rn(a, 0.5f, 0x1.000008p23f)" in text and "n < 0x4b000007u ? n : 0x4b000007u" in text
        assert "ep_byte_perm(ep_vec_word(v, 0), ep_vec_word(v, 1), 0x5173u)" in text
        assert "ep_byte_perm(ep_vec_word(v, 2), ep_vec_word(v, 3), 0x7351u)" in text
        assert "(p & 0x8080u) | (q & 0x80800000u) | (((p >> 20) | (q << 12)) & 0x08080808u)" in text
        assert "ep_u32 codes = 0u - 0x4b000000u * 17u;" in text
    else:
        if e.negative_zero:
            code = _one(r"return \(a > ([0-9.]+)f \? (0x[0-9a-f]+)u : a == a \? code : (0x[0-9a-f]+)u\) \| \(\(u >> 31\) << (\d+)\);",
                        text)
        else:  # e4m3fnuz: magnitude 0 keeps no sign, NaN's code is 0x80 whatever the sign
            code = _one(r"const ep_u32 mag = a > ([0-9.]+)f \? (0x[0-9a-f]+)u : a == a \? code : (0x[0-9a-f]+)u;\n"
                        r"  return mag \| \(mag \? \(u >> 31\) << (\d+) : 0u\);", text)
            nan = _one(r"lo = \(codes & 0xffu\) == (0x[0-9a-f]+)u \? ep_bits_to_float\(0x7fc00000u\)", text)
            assert int(nan.group(1), 16) == e.nan_code == 0x80
        assert (float(code.group(1)), int(code.group(2), 16), int(code.group(3), 16), int(code.group(4))) == (
            e.max, e.max_code, e.nan_code, e.sign_shift)
        assert _one(r"const ep_u32 code = steps \+ \(\(t - (0x[0-9a-f]+)u\) >> (\d+)\);", text).groups() == (
            "%#x" % ((127 + e.emin) << 23), str(23 - e.mbits))
        assert {tuple(map(_int, a)) for a in decodes} == {(e.mbits, e.ebits, e.bias)}
        assert "return ep_grid_code(lo) | (ep_grid_code(hi) << 8);" in text


def test_both_codec_paths_are_rendered():
    """The catalogue's arches cover the software and the hardware fp8 codec."""
    assert {traits(a).hw_fp8_convert for a in ARCHES} == {True, False}


@pytest.mark.parametrize("arch", ARCHES)
def test_the_division_is_the_one_the_cpu_tests_emulate(arch):
    """The scaled wires' division, ep_div_rn, is what tests/runtime/references/test_quant.py emulates
    (``_sm90_div_rn``, ``_amd_div_rn``): NVIDIA's approximate reciprocal, one Newton step and the
    residual s q - x subtracted, so that a zero quotient keeps x's sign (the former x - s q added
    made -0.0 a +0 quotient, code 0x00); AMD's IEEE division."""
    _, text = _render(arch, "fp8_blockwise")
    if traits(arch).vendor == "amd":
        _one(r"^EP_DEVICE float ep_div_rn\(float x, float s\) \{ return x / s; \}", text)
        return
    body = _one(r"^EP_DEVICE float ep_div_rn\(float x, float s\) \{\n((?:  .*\n)+)\}$", text).group(1)
    assert body.splitlines() == [
        "  float r;",
        '  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(s));',
        "  r = __fmaf_rn(__fmaf_rn(-s, r, 1.0f), r, r);",
        "  const float q = x * r;",
        "  return __fmaf_rn(-__fmaf_rn(s, q, -x), r, q);",
    ]
