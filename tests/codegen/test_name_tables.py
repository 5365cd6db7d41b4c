"""Every branch on an arch's vendor, an fp8 flavour or a wire element looks the name up in the
table that defines it and refuses a name it does not know: each test here
gives one of them an unknown name."""

import attrs
import pytest
import torch

from epgen.codegen import arch as arch_mod
from epgen.codegen import dtypes
from epgen.codegen.arch import ARCH_TRAITS, ArchTraits
from epgen.codegen.catalogue import model_specs
from epgen.codegen.dtypes import DTYPES, FP8_FLAVOURS, Fp8Flavour, MiniFloat, element_format, fp8_flavour
from epgen.codegen.occupancy import RULES, resident_blocks
from epgen.codegen.offline import compile_options
from epgen.codegen.render import RenderError, render

# e5m2 (OCP: bias 15, max 57344): a flavour the tables can hold and the codec does not implement.
E5M2 = Fp8Flavour(name="e5m2", torch_name="float8_e5m2",
                  numbers=MiniFloat(name="e5m2", ebits=5, mbits=2, bias=15, max=57344.0, max_code=0x7B, has_nan=True,
                                    nan_code=0x7F, negative_zero=True))


def _patched_arch(monkeypatch, name="sm_90", **changes):
    monkeypatch.setitem(ARCH_TRAITS, name, attrs.evolve(ARCH_TRAITS[name], **changes))


def test_every_arch_names_a_known_fp8_flavour_and_vendor():
    for t in ARCH_TRAITS.values():
        assert t.fp8 in FP8_FLAVOURS and t.vendor in RULES
        assert compile_options(t.name)  # a toolchain for the vendor


def test_unknown_fp8_flavour_is_refused():
    with pytest.raises(ValueError, match=r"fp8='e5m2': unknown fp8 flavour; known: e4m3fn, e4m3fnuz"):
        fp8_flavour("e5m2")
    with pytest.raises(ValueError, match=r"fp8='e5m2': unknown fp8 flavour"):
        attrs.evolve(ARCH_TRAITS["gfx950"], fp8="e5m2")
    with pytest.raises(ValueError, match=r"fp8='x': unknown fp8 flavour"):
        DTYPES["fp8"].on("x")


def test_unknown_wire_element_is_refused():
    with pytest.raises(ValueError, match=r"element='bf16': no minifloat format; known: fp8, fp4"):
        element_format("bf16", "e4m3fn")
    with pytest.raises(ValueError, match=r"dtype='fp6': unknown dtype; known: bf16, fp8, fp4"):
        dtypes.CombineQuant(name="fp6_blockwise", element="fp6", block=32, tag="qfp6b")


def test_payload_dtype_follows_the_arch_flavour():
    """The torch dtype of an fp8 payload is the arch's flavour's (gfx942: e4m3fnuz); bf16 and fp4 do
    not depend on it."""
    for spec in model_specs("deepseek-v3", dtype="fp8"):
        if spec.op.payload:
            want = torch.float8_e4m3fnuz if spec.arch == "gfx942" else torch.float8_e4m3fn
            assert spec.dtype_info.torch_dtype == want
    assert any(s.arch == "gfx942" and s.op.payload for s in model_specs("deepseek-v3", dtype="fp8"))
    assert DTYPES["fp4"].on("e4m3fnuz") is DTYPES["fp4"] and DTYPES["bf16"].on("e4m3fnuz") is DTYPES["bf16"]


@pytest.mark.parametrize("wire", ["fp8_direct_cast", "fp8_blockwise"])
def test_codec_refuses_an_fp8_flavour_it_does_not_implement(monkeypatch, wire):
    """The wire codec's branches are (element, format) pairs; another flavour fails the render,
    naming it (not the e4m3fn code under another flavour's numbers)."""
    monkeypatch.setitem(FP8_FLAVOURS, E5M2.name, E5M2)
    _patched_arch(monkeypatch, fp8="e5m2", hw_fp8_convert=False)
    spec = next(s for s in model_specs("deepseek-v3", arches=("sm_90",), combine_quant=wire) if s.op.value == "combine")
    with pytest.raises(RenderError, match=r"has no branch for element 'fp8' in format 'e5m2' \(arch sm_90, "
                                          r"fp8='e5m2'\); known: fp8 as e4m3fn, fp8 as e4m3fnuz, fp4 as e2m1"):
        render.__wrapped__(spec)  # past the render cache, which holds the e4m3fn text


def test_unknown_vendor_is_refused(monkeypatch):
    _patched_arch(monkeypatch, vendor="intel")
    with pytest.raises(ValueError, match=r"vendor='intel' \(arch 'sm_90'\): no occupancy rule; known: amd, nvidia"):
        resident_blocks("sm_90", 8, 32, 0)
    with pytest.raises(ValueError, match=r"vendor='intel' \(arch 'sm_90'\): no offline toolchain; known: amd, nvidia"):
        compile_options("sm_90")


def test_arch_traits_rows_are_complete():
    """A new arch is one row: every field is set (no defaults), so a row cannot forget its fp8 flavour."""
    assert all(f.default is attrs.NOTHING for f in attrs.fields(ArchTraits))
    assert arch_mod.traits("gfx1250").fp8 == "e4m3fn"
