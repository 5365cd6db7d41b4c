"""Shapes beyond the catalogue compile for every arch without scratch or spill (but the known
spills ``_known_spill`` lists): top-k that does
not divide the wave (6, 9, 10) up to 16, hidden sizes that are not powers of two, every payload
dtype, and unrolls whose chunk exceeds the row (the copy loop's predicated tail); three of them
with the pull dispatch's two kernels too."""

import pytest

from epgen.codegen.arch import ARCHES
from epgen.codegen.catalogue import shape_specs
from epgen.codegen.offline import compile_many, toolchain_status
from epgen.codegen.render import render
from epgen.codegen.tuning import Geometry

CASES = [
    dict(hidden=2880, topk=6, num_experts=128, dtype="bf16"),
    dict(hidden=3072, topk=9, num_experts=264, dtype="fp8", dispatch_transport="pull"),
    dict(hidden=6144, topk=10, num_experts=160, dtype="fp4", dispatch_transport="pull"),
    dict(hidden=8192, topk=16, num_experts=256, dtype="bf16"),
    dict(hidden=2880, topk=1, num_experts=8, dtype="fp8", geometry=Geometry(4, 4, 16),  # chunk > row
         dispatch_transport="pull"),
]


@pytest.mark.parametrize("arch", ARCHES)
def test_extra_shapes_compile_clean(arch):
    reason = toolchain_status(arch)
    if reason:
        pytest.skip(reason)
    specs = [s for case in CASES for s in shape_specs(world_size=8, arches=(arch,), **case)]
    results = compile_many([(render(s).text, s.arch, s.name) for s in specs])
    bad = [(s.name, str(r) if isinstance(r, Exception) else f"scratch {r.scratch_bytes} spill {r.spill_bytes}")
           for s, r in zip(specs, results) if isinstance(r, Exception) or not r.ok]
    known = sorted(s.name for s in specs if _known_spill(s))
    assert sorted(name for name, _ in bad) == known, bad


def _known_spill(spec) -> bool:
    """The known spill, open (docs/measurements/import-and-compile.md#known-spills):
    gfx950's low-latency dispatch at top-k 16,
    whole op and sending half (its 106 SGPRs run out; 48-56 bytes into VGPR lanes, no scratch
    memory). Listed so that a new spill, or this one fixed, fails the test."""
    return spec.topk == 16 and spec.arch == "gfx950" and spec.op.value in ("dispatch_ll", "dispatch_ll_send")
