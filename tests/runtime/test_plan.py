"""Kernel plans (``epgen.plan``): the routes a config builds, and the launches of
``EpDispatchCombine`` on the CPU against the record taken before the op ran its plan.

``launch_records.json`` holds, per configuration of ``CASES``, the kernels the op's call
sequence launched (``launch_record.record``) and a digest of every launch's spec, grid, block,
cooperative flag and argument (pointers named by buffer): recorded from the op as it decided its
kernels in code, before ``Plan``. Regenerate it (``python tests/runtime/test_plan.py``) only for
a change meant to alter what the op launches, and review its diff.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import attrs
import pytest

from epgen.codegen.config import EpConfig, Geometry
from epgen.codegen.spec import Op
from epgen.plan import Plan

sys.path.insert(0, str(Path(__file__).parent))
import launch_record  # noqa: E402

RECORDS = Path(__file__).parent / "launch_records.json"
SMALL = EpConfig(world_size=2, hidden=2048, topk=4, num_experts=8, max_tokens_per_rank=160)
"""No tuning entry: T_ll = 128 < Tmax, so "auto" takes both families."""


def _cases():
    yield "W4 auto rank fp8_blockwise", attrs.evolve(SMALL, world_size=4, combine_quant="fp8_blockwise"), True, 132, False
    for W in (1, 2):
        for family in ("auto", "normal", "low_latency"):
            for layout in ("rank", "expert"):
                for wire in ("none", "fp8_blockwise", "fp4_blockwise"):
                    transport = "pull" if family == "normal" and wire == "fp4_blockwise" else "auto"
                    cfg = attrs.evolve(SMALL, world_size=W, kernel_family=family, layout=layout, combine_quant=wire,
                                       expert_alignment=8 if layout == "expert" else 1, dispatch_transport=transport)
                    yield f"W{W} {family} {layout} {wire} {transport}", cfg, W > 1, 132, False
    yield "halves validate", attrs.evolve(SMALL, combine_quant="fp8_direct_cast"), True, 2, True
    yield "fp8 scales explicit", attrs.evolve(SMALL, dtype="fp8", scale_bytes=32, dispatch_geometry=Geometry(4, 4, 2),
                                              combine_geometry=Geometry(8, 4, 2), max_recv_tokens=300), True, 132, True


CASES = {name: rest for name, *rest in _cases()}


def _record(name: str) -> dict:
    import epgen.op

    cfg, virtual, sms, validate = CASES[name]
    events = launch_record.record(epgen.op, cfg, virtual=virtual, sms=sms, validate=validate)
    calls, label = [], None
    for e in events:
        if e[0] == "step":
            label = e[1]
        elif e[0] == "launch":
            calls.append(f"{label}: {e[1].split('_sm90')[0].removeprefix('epgen_')} {e[2][0]}x{e[3][0]}"
                         + (" coop" if e[4] else ""))
        elif e[0] == "sync":
            calls.append(f"{label}: sync")
    return {"launches": calls, "sha256": hashlib.sha256(repr(events).encode()).hexdigest()}


@pytest.mark.parametrize("name", list(CASES))
def test_the_op_launches_what_it_launched_before_it_ran_a_plan(name):
    assert _record(name) == json.loads(RECORDS.read_text())[name]


def test_each_call_takes_a_route_of_its_family_transport_and_split():
    plan = Plan.build(attrs.evolve(SMALL, layout="expert", expert_alignment=8, combine_quant="fp8_blockwise",
                                   dispatch_transport="pull"), "sm_90")
    ops = {key: [s.op.value for s in r.steps] for key, r in plan.routes.items()}
    assert ops == {
        (Op.DISPATCH, "normal", "push", False): ["dispatch", "expand_plan", "expand"],
        (Op.DISPATCH, "normal", "pull", False): ["dispatch", "dispatch_pull", "expand_plan", "expand"],
        (Op.DISPATCH, "low_latency", "push", False): ["dispatch_ll", "expand_plan", "expand"],
        (Op.DISPATCH, "low_latency", "push", True): ["dispatch_ll_send", "dispatch_ll_recv", "expand_plan", "expand"],
        (Op.COMBINE, "normal", "push", False): ["fold", "combine"],  # the fold writes the wire rows: no quantize kernel
        (Op.COMBINE, "low_latency", "push", False): ["fold", "combine_ll"],
        (Op.COMBINE, "low_latency", "push", True): ["fold", "combine_ll_send", "combine_ll_recv"],
    }
    assert plan.route(Op.COMBINE, "normal").send[0].quantize and not plan.route(Op.COMBINE, "low_latency").send[0].quantize
    assert {r.y for r in plan.routes.values() if r.call is Op.COMBINE} == {"folded"}
    assert plan.route(Op.DISPATCH, "normal", "push", split=True) is plan.route(Op.DISPATCH, "normal", "push")
    assert (plan.family(128), plan.family(129), plan.transport(5, False), plan.transport(129, False)) == (
        "low_latency", "normal", "push", "pull")  # the low-latency family never pulls


def test_a_config_drops_the_routes_whose_kernels_it_does_not_build():
    rank = Plan.build(attrs.evolve(SMALL, kernel_family="normal", combine_quant="fp4_blockwise"), "sm_90")
    assert {key: [s.op.value for s in r.steps] for key, r in rank.routes.items()} == {
        (Op.DISPATCH, "normal", "push", False): ["dispatch"],
        (Op.COMBINE, "normal", "push", False): ["combine_quantize", "combine"],
    }
    assert rank.route(Op.COMBINE, "normal").y == "in_place" and rank.transports == ((1 << 30, "push"),)
    one = Plan.build(attrs.evolve(SMALL, world_size=1, kernel_family="low_latency"), "sm_90")
    assert [key[1] for key in one.routes] == ["low_latency"] * 4
    with pytest.raises(KeyError):
        one.route(Op.DISPATCH, "normal")


if __name__ == "__main__":  # rewrite RECORDS from the op as it is now (see the module docstring)
    RECORDS.write_text(json.dumps({name: _record(name) for name in CASES}, indent=1) + "\n")
