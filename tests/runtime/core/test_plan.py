"""Kernel plans (``epgen.plan``): the routes a config builds, ``epgen plan``, and the launches of
``EpDispatchCombine`` on the CPU against the record taken before the op ran its plan.

``launch_records.json`` holds, per configuration of ``CASES``, the kernels the op's call
sequence launched (``launch_record.record``) and a digest of every launch's spec, grid, block,
cooperative flag and argument (pointers named by buffer): recorded from the op as it decided its
kernels in code, before ``Plan``. Regenerate it (``python tests/runtime/core/test_plan.py``) only for
a change meant to alter what the op launches, and review its diff.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

from epgen.cli import main
from epgen.codegen import planner
from epgen.codegen.config import EpConfig, Geometry
from epgen.codegen.spec import Op
from epgen.plan import Plan, describe

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
    # the AMD arches' derived defaults (no table entry: geometries from the CU count), recorded
    # when the schedule began deriving them; Tmax 1200 spans the dispatch's three buckets
    for arch, cus in (("gfx942", 304), ("gfx950", 256)):
        for layout in ("rank", "expert"):
            cfg = attrs.evolve(SMALL, max_tokens_per_rank=1200, layout=layout,
                               expert_alignment=8 if layout == "expert" else 1)
            yield f"{arch} W2 auto {layout} derived", cfg, True, cus, False, arch


CASES = {name: (rest + ["sm_90"])[:5] for name, *rest in _cases()}
"""name -> (config, virtual, SMs, validate, arch)."""


def _record(name: str) -> dict:
    import epgen.op

    cfg, virtual, sms, validate, arch = CASES[name]
    events = launch_record.record(epgen.op, cfg, virtual=virtual, arch=arch, sms=sms, validate=validate)
    calls, label = [], None
    for e in events:
        if e[0] == "step":
            label = e[1]
        elif e[0] == "launch":
            calls.append(f"{label}: {e[1].split('_' + arch.replace('_', ''))[0].removeprefix('epgen_')} {e[2][0]}x{e[3][0]}"
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
    # a stated family decides the transport alone: ranks stating "normal" all pull, whatever their T
    assert (plan.transport(5, False, "normal"), plan.transport(129, False, "normal"),
            plan.transport(5, False, "low_latency")) == ("pull", "pull", "push")


def test_a_config_drops_the_routes_whose_kernels_it_does_not_build():
    rank = Plan.build(attrs.evolve(SMALL, kernel_family="normal", combine_quant="fp4_blockwise"), "sm_90")
    assert {key: [s.op.value for s in r.steps] for key, r in rank.routes.items()} == {
        (Op.DISPATCH, "normal", "push", False): ["dispatch"],
        (Op.COMBINE, "normal", "push", False): ["combine_quantize", "combine"],
    }
    assert rank.route(Op.COMBINE, "normal").y == "in_place" and rank.transport_rules == ((1 << 30, "push"),)
    one = Plan.build(attrs.evolve(SMALL, world_size=1, kernel_family="low_latency"), "sm_90")
    assert [key[1] for key in one.routes] == ["low_latency"] * 4
    with pytest.raises(KeyError):
        one.route(Op.DISPATCH, "normal")


def test_the_buckets_split_where_any_kernel_family_or_transport_changes(table_dir):
    from epgen.codegen import tuning

    cfg = attrs.evolve(SMALL, max_tokens_per_rank=1000, kernel_family="auto")
    tuning.write_entry(planner.tuning_key(cfg, "sm_90", Op.DISPATCH), [(64, Geometry(4, 4, 2)), (512, Geometry(8, 4, 2))],
                       "test", {}, transports={64: "push", 512: "pull"})
    plan = Plan.build(cfg, "sm_90", grid_ranks=2)
    assert plan.buckets() == [(1, 64), (65, 128), (129, 512), (513, 1000)]
    rows = plan.table()
    assert {(r["tokens"], r["op"], r["transport"], r["when"]) for r in rows if r["call"] == "dispatch"
            and r["family"] == "normal"} == {  # above the largest bucket: the largest's rule
        (t, op, tr, when) for t in ((129, 512), (513, 1000)) for op, tr, when in (
            ("dispatch", "push", ""), ("dispatch", "pull", "x in dispatch_input"),
            ("dispatch_pull", "pull", "x in dispatch_input"))}
    assert Plan.build(cfg, "sm_90", grid_ranks=1).transport_rules == ((1 << 30, "push"),)  # one rank a process


def test_epgen_plan_prints_each_bucket_kernels(capsys):
    assert main(["plan", "--arch", "sm_90", "--world-size", "8", "--max-tokens", "4096"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith("deepseek-v3 on sm_90: W=8 (one process a GPU), Tmax=4096, bf16")
    assert [line.split()[:1] for line in lines[2:] if line[:1] != " "] == [["1-128"], ["129-4096"]]
    assert "dispatch_ll_send" in out and "epgen_combine_sm90_bf16_w8_h7168_k8_l32_t4096" in out
    cfg = EpConfig.for_model("deepseek-v3", world_size=8, max_tokens_per_rank=4096)
    assert out == describe(Plan.build(cfg, "sm_90"), "deepseek-v3") + "\n"


def test_epgen_plan_loads_neither_torch_nor_cupy():
    code = ("import sys, contextlib, io\nfrom epgen.cli import main\nwith contextlib.redirect_stdout(io.StringIO()):\n"
            "    main(['plan', '--model', 'mixtral-8x7b', '--layout', 'expert'])\n"
            "print(sorted(m for m in ('torch', 'cupy') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


def test_epgen_plan_json_and_flag_errors(capsys):
    assert main(["plan", "--model", "qwen3-30b-a3b", "--quant", "fp8_blockwise", "--layout", "expert", "--arch",
                 "gfx950", "--virtual", "--json"]) == 0
    (doc,) = json.loads(capsys.readouterr().out)
    assert doc["arch"] == "gfx950" and {r["op"] for r in doc["launches"]} >= {"fold", "expand", "expand_plan"}
    with pytest.raises(SystemExit):
        main(["plan", "--model", "deepseek-v3", "--kernel-family", "low_latency", "--transport", "pull"])
    assert "--transport" in capsys.readouterr().err


def test_the_whole_low_latency_op_is_the_default_on_nvidia_and_never_on_amd():
    """One rule per vendor (``epgen.plan.WHOLE_LOW_LATENCY``): the plan carries it and its table
    says when each low-latency route runs."""
    from epgen.plan import WHOLE_LOW_LATENCY

    assert WHOLE_LOW_LATENCY == {"nvidia": True, "amd": False}
    for arch, whole in (("sm_90", True), ("gfx942", False), ("gfx950", False), ("gfx1250", False)):
        plan = Plan.build(SMALL, arch)
        assert plan.whole_low_latency is whole
        when = {(r["op"], r["when"]) for r in plan.table() if r["family"] == "low_latency"}
        assert when == ({("dispatch_ll", ""), ("combine_ll", "")}
                        | {(op, "async_recv or grid too large") for op in ("dispatch_ll_send", "dispatch_ll_recv",
                                                                            "combine_ll_send", "combine_ll_recv")}
                        if whole else {("dispatch_ll", "not on amd"), ("combine_ll", "not on amd")}
                        | {(op, "") for op in ("dispatch_ll_send", "dispatch_ll_recv", "combine_ll_send",
                                               "combine_ll_recv")}), arch


def _refusals(events) -> list:
    return [e[1].split("_sm90")[0] for e in events if e[0] == "refused"]


@pytest.mark.parametrize("validate", [False, True])
def test_a_cooperative_grid_the_driver_refuses_falls_back_to_the_halves_once(validate):
    """The CUDA stand-in refuses every cooperative launch as too large: the first call of each
    kind tries the whole low-latency op once, warns naming the kernel and the grid, and completes
    with the halves; every call launches what an op whose whole grid does not fit launches (same
    kernels, grids and arguments)."""
    import epgen.op

    cfg = attrs.evolve(SMALL, world_size=1)
    halves = launch_record.record(epgen.op, cfg, virtual=False, sms=1, validate=validate)  # the grid never fits
    assert not _refusals(halves) and any(e[0] == "launch" and "_ll_send" in e[1] for e in halves)
    with pytest.warns(RuntimeWarning) as caught:
        refused = launch_record.record(epgen.op, cfg, virtual=False, validate=validate, refuse_cooperative=True)
    assert _refusals(refused) == ["epgen_dispatch_ll", "epgen_combine_ll"]  # once each: remembered
    assert [e for e in refused if e[0] != "refused"] == halves
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2 and all(m.startswith(f"{call}: the runtime refused the whole low-latency kernel "
                                                   f"epgen_{call}_ll_sm90")
                                      for m, call in zip(messages, ("dispatch", "combine")))
    assert all(" (64 x 1 blocks of 256 threads, one cooperative launch) as too large: cooperative grid 64x1x1 refused "
               "by the stand-in. This op launches " in m for m in messages), messages


def test_a_refusal_while_capturing_a_graph_raises_and_the_next_call_takes_the_halves(monkeypatch):
    """A refused cooperative launch inside a graph capture may have broken the capture: the call
    raises, saying so, and the op takes the halves from then on (capture again)."""
    import epgen.op

    monkeypatch.setattr(epgen.op, "capturing", lambda: True)
    events = launch_record.record(epgen.op, attrs.evolve(SMALL, world_size=1), virtual=False, tokens=(5, 5),
                                  refuse_cooperative=True)
    steps, label = {}, None
    for e in events:
        if e[0] == "step":
            label = e[1] + f" #{sum(k.startswith(e[1]) for k in steps)}"
            steps[label] = []
        elif e[0] in ("launch", "error", "refused"):
            steps[label].append(e[1].split("_sm90")[0] if e[0] != "error" else e[1])
    first, second = steps["dispatch 5 #0"], steps["combine 5 #1"]
    for got, call in ((first, "dispatch"), (second, "combine")):
        refused, error = got
        assert refused == f"epgen_{call}_ll" and error.startswith(f"RuntimeError: {call}: the runtime refused the whole "
                                                                  f"low-latency kernel epgen_{call}_ll_sm90"), got
        assert error.endswith(f"which the failed launch may have left unusable. The op launches {call}'s two halves "
                              "from now on: capture again (run one call eagerly before capturing to settle this "
                              "outside a capture)"), error
    assert steps["dispatch 5 #1"] == ["epgen_dispatch_ll_send", "epgen_dispatch_ll_recv"]


def test_the_platform_turns_the_drivers_too_large_into_cooperative_launch_too_large(monkeypatch):
    """CUDA: CuPy's CUDADriverError with status CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE (720)
    becomes ``CooperativeLaunchTooLarge``; any other status is raised as it came."""
    import contextlib
    import types

    import torch

    import epgen.device
    from epgen.platform import CooperativeLaunchTooLarge, Platform

    class CUDADriverError(RuntimeError):  # cupy_backends.cuda.api.driver: _CudaErrorBase keeps the status
        def __init__(self, status):
            self.status = status
            super().__init__({720: "CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE: too many blocks in cooperative launch",
                              1: "CUDA_ERROR_INVALID_VALUE: invalid argument"}[status])

    status = {"value": 720}

    def launch(*args):
        raise CUDADriverError(status["value"])

    cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(Device=lambda index: contextlib.nullcontext(),
                                                            driver=types.SimpleNamespace(launchCooperativeKernel=launch)))
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setattr(epgen.device, "cupy_stream", lambda device: types.SimpleNamespace(ptr=0))
    fn = types.SimpleNamespace(kernel=types.SimpleNamespace(ptr=0x1000))
    cuda = Platform(rocm=False)
    with pytest.raises(CooperativeLaunchTooLarge, match=r"^cooperative grid 300x1x1 of 256x1x1 threads refused by the "
                                                        r"CUDA driver \(CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE: "):
        cuda.launch(fn, (300, 1, 1), (256, 1, 1), 0, torch.device("cpu"), cooperative=True)
    status["value"] = 1
    with pytest.raises(CUDADriverError, match="CUDA_ERROR_INVALID_VALUE"):
        cuda.launch(fn, (300, 1, 1), (256, 1, 1), 0, torch.device("cpu"), cooperative=True)


if __name__ == "__main__":  # rewrite RECORDS from the op as it is now (see the module docstring)
    RECORDS.write_text(json.dumps({name: _record(name) for name in CASES}, indent=1) + "\n")
