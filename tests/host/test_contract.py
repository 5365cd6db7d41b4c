"""The GPU contract tests at small shapes on the host emulation (epgen.host), virtual ranks.

Each test runs the checks of a GPU test (named in its docstring) through the same harness functions
(``run_round``: every received row bit-equal to the reference and the combine within its bound and
bit-equal to the wire reference; ``run_exact_round``: integer rounds bit for bit;
``run_expert_round``), on ``EpDispatchCombine(cfg, device="cpu", arch=...)``: the arch's own kernels
on the fiber scheduler with its weak memory model. Shapes: H 128, top-4, 3 experts a rank, up to 32
tokens a rank, W = 2, 3 and 4; every arch's rendering (sm_90 and gfx1250 with 32 lanes, gfx942 and
gfx950 with 64). Every op has its own ``Schedule`` seed (``host_cases.seed_of`` of the test id),
named in the failure.

Ops are not shared between tests: their compiled kernels are (the host cache; an op compiles its
missing sources on every core, and an op of a compiled config builds in about 0.1 s), so each test
replays alone with its seed. Graph capture is a GPU's (CUDA graphs): not applicable here.
"""

from __future__ import annotations

import sys
from pathlib import Path

import attrs
import pytest
import torch

from epgen.codegen import planner
from epgen import reference
from epgen.codegen import abi
from epgen.codegen.arch import traits
from epgen.codegen.spec import Op
from epgen.harness import ROUTINGS
import epgen.harness.verify as verify
from epgen.harness.verify import (check_exact_combine, check_exact_dispatch, expect, integer_expert_stage,
                                  integer_inputs, make_inputs, op_arg, op_inputs, per_rank, poison, run_exact_round,
                                  run_round, wire_fp8_flavour, zero_copy_inputs)
from epgen.host import GEOMETRY

sys.path.insert(0, str(Path(__file__).parent))
from host_cases import (ARCHES, LANES, TMAX, cfg, host_op, seed_of, seeded,  # noqa: E402
                        host_module)


@pytest.fixture
def seed(request) -> int:
    """This test's Schedule seed (stable: a function of its id)."""
    return seed_of(request.node.name)


def _silence(inputs, ranks):
    return [attrs.evolve(i, indices=torch.full_like(i.indices, -1)) if r in ranks else i for r, i in enumerate(inputs)]


def _launched(op, since=0) -> list[str]:
    return [name for name, _, _ in op.platform.stats[since:]]


def _low_latency(name: str) -> bool:
    return name.startswith(("epgen_dispatch_ll", "epgen_combine_ll"))


# ---- the cases -------------------------------------------------------------------------------

ROUND_CASES = [  # (arch, family, W): every arch, each family at W = 2, 3 and 4; gfx942 at W = 2 and
    # sm_90 at W = 3 in both families, the configs of test_host_processes.py (their kernels compile once)
    ("gfx942", "normal", 2), ("sm_90", "normal", 3), ("gfx950", "normal", 4), ("gfx1250", "normal", 2),
    ("gfx942", "low_latency", 2), ("sm_90", "low_latency", 3), ("gfx1250", "low_latency", 4),
    ("gfx950", "low_latency", 2)]
assert {a for a, _, _ in ROUND_CASES} == set(ARCHES)
AUTO = ("gfx1250", 2)
SPLIT_CASES = [("sm_90", 3), ("gfx1250", 4)]
"""The split's cases: sm_90 runs a whole low-latency call as one launch, AMD as its two halves."""
AGAIN_CASES = [("sm_90", 3, "low_latency"), ("gfx1250", 4, "low_latency"), ("gfx942", 2, "normal"),
               ("gfx950", 4, "normal")]
PULL_CASES = [("gfx942", 2), ("gfx1250", 4)]
"""(W = 2 and 3 pull in test_host_processes.py.)"""
EXPERT_CASES = [  # (arch, W, L, K, alignment, rounds of token counts, extra config)
    ("sm_90", 2, 3, 4, 1, [[32, 32], [0, 17]], {}),
    ("gfx942", 3, 2, 6, 16, [[32, 9, 0]], {"dispatch_transport": "pull", "dtype": "fp8", "scale_bytes": 16,
                                          "combine_quant": "fp8_blockwise"}),
    ("gfx950", 4, 1, 1, 4, [[32, 0, 5, 32]], {"combine_quant": "fp4_blockwise"}),
    ("gfx1250", 3, 2, 6, 8, [[20, 3, 0]], {"kernel_family": "low_latency"}),
]
WIRE_CASES = [  # (arch, family, W, payload dtype, scale bytes, combine wire): every payload and quantized
    # wire, both families, gfx942's e4m3fnuz flavour (its low-latency fp8 payload and wire:
    # test_host_hierarchical.py)
    ("gfx942", "normal", 2, "fp8", 4, "fp8_blockwise"),
    ("sm_90", "normal", 3, "fp4", 4, "fp4_blockwise"),
    ("gfx950", "normal", 2, "bf16", 0, "fp8_direct_cast"),
    ("sm_90", "low_latency", 2, "fp8", 0, "fp8_blockwise"),
    ("gfx1250", "low_latency", 4, "fp4", 0, "fp4_blockwise"),
]
CAPPED_CASES = [("rank", "gfx950"), ("expert", "sm_90")]


def _wire_cfg(family, W, dtype, scale_bytes, wire):
    return cfg(W, family, dtype=dtype, scale_bytes=scale_bytes, combine_quant=wire)


def _expert_cfg(W, L, K, A, extra):
    extra = dict(extra)
    return cfg(W, extra.pop("kernel_family", "normal"), experts_per_rank=L, topk=K, layout="expert",
               expert_alignment=A, **extra)


def _capped_cfg(layout):
    return cfg(4, "normal", topk=2, experts_per_rank=2, max_recv_tokens=40, layout=layout,
               expert_alignment=16 if layout == "expert" else 1)


@pytest.fixture(scope="module", autouse=True)
def _host():
    """One torch thread for this module (``host_module``)."""
    with host_module():
        yield


# ---- rounds against the reference: both families, every arch, W = 2, 3, 4 ------------------------

@pytest.mark.parametrize("arch,family,W", ROUND_CASES, ids=[f"{a}-{f}-w{w}" for a, f, w in ROUND_CASES])
def test_rounds_against_the_reference(arch, family, W, seed):
    """tests/gpu/test_low_latency.py::test_rounds_against_the_reference and test_op.py's
    test_virtual_ranks at small shapes: full, mixed, zero-token and one-token ranks under every
    routing kind (-1 ids, duplicates, skewed, one rank, a shared-expert column); then exact rounds
    (test_reliability.py's -1 rows, duplicate ids and token-count edges)."""
    config = cfg(W, family)
    op = host_op(config, arch, seed)
    assert traits(arch).wave_size == LANES[arch]
    specs = [s for variants in op.plan.variants.values() for _, s in variants]
    assert specs and all(s.threads == GEOMETRY.warps_per_block * LANES[arch] for s in specs), specs
    rounds = [([TMAX] * W, "uniform"), ([TMAX] * W, "invalid"), (per_rank([0, 1, 7, TMAX], W), "duplicates"),
              (per_rank([0, 1, 7, TMAX], W), "skewed"), (per_rank([0, 13], W), "one_rank"),
              (per_rank([0, 13], W), "shared"), ([0] * W, "uniform"), ([5] + [0] * (W - 1), "invalid")]
    with seeded(op):
        for i, (tokens, kind) in enumerate(rounds):
            start = len(op.platform.stats)
            stats = run_round(op, config, tokens, kind, seed + i)
            assert stats["wire_mismatches"] == 0, (tokens, kind, stats)  # fp32 sum in rank order, one rounding
            names = _launched(op, start)
            assert all(_low_latency(n) == (family == "low_latency") for n in names), names
        # exact rounds: ranks whose rows are all -1 get +0.0 bits; nobody sends anything
        silent = {1} if W < 4 else {1, 3}
        for k, (kind, quiet) in enumerate([("invalid", silent), ("uniform", set(range(W)))]):
            inputs = _silence(integer_inputs(config, [TMAX - 3 * r for r in range(W)], kind, seed + 100 + k), quiet)
            got = run_exact_round(op, config, inputs)
            for r, out in zip(op.local_ranks, got["combined"]):
                if r in quiet:
                    assert bool((out.view(torch.int16) == 0).all()), f"rank {r}: every row -1, output not +0.0 bits"
            if quiet == set(range(W)):
                assert got["recv"] == [0] * W
        # a row [3, 3, 5, -1] reaches the ranks of experts 3 and 5 once each
        L = config.experts_per_rank
        tokens = per_rank([3, 2, 0, 4], W)
        inputs = integer_inputs(config, tokens, "uniform", seed + 200)
        for inp in inputs:
            inp.indices.copy_(torch.tensor([3, 3, 5, -1], dtype=torch.int32).expand_as(inp.indices))
        run_exact_round(op, config, inputs)
        everyone = sorted((r, t) for r in range(W) for t in range(tokens[r]))
        for r in op.local_ranks:
            buf = op.recv_buffers(r)
            n = int(buf.num_recv.item())
            want = everyone if r in {3 // L, 5 // L} else []
            assert sorted(map(tuple, buf.recv_src[:n].tolist())) == want, f"rank {r}"
    op.close()


def test_auto_takes_each_family_by_token_count_and_both_agree(table_dir, seed):
    """tests/gpu/test_low_latency.py::test_auto_takes_each_family_by_token_count_and_both_agree (a
    table of the test's own puts the threshold T_ll at 8 tokens), and its split refusals
    (test_split_halves_with_a_matmul_between_them)."""
    from epgen.codegen import tuning
    from epgen.op import RecvHandle

    arch, W = AUTO
    config = cfg(W, "auto")
    for op_ in (Op.DISPATCH_LL_SEND, Op.COMBINE_LL_SEND):
        tuning.write_entry(planner.tuning_key(config, arch, op_), [(8, GEOMETRY)], "test: T_ll 8", {})
    op = host_op(config, arch, seed)
    T_ll = op.low_latency_tokens
    assert T_ll == 8
    with seeded(op):
        for i, T in enumerate((1, T_ll, T_ll + 1, TMAX, 0, 7)):
            assert op.family(T) == ("low_latency" if T <= T_ll else "normal")
            start = len(op.platform.stats)
            run_round(op, config, [T, max(T - 1, 0)], "uniform", seed + i)
            assert all(_low_latency(n) == (T <= T_ll) for n in _launched(op, start)), (T, _launched(op, start))
        inputs = integer_inputs(config, [1] * W, "uniform", 9)
        handle = op.dispatch(*op_inputs(op, inputs), async_recv=True)
        assert isinstance(handle, RecvHandle)
        with pytest.raises(RuntimeError, match=r"handle.wait\(\) first"):
            op.dispatch(*op_inputs(op, inputs))
        handle.wait()
        with pytest.raises(RuntimeError, match="already waited"):
            handle.wait()
        big = integer_inputs(config, [T_ll + 1] * W, "uniform", 10)
        with pytest.raises(ValueError, match="the split needs the low-latency family"):
            op.dispatch(*op_inputs(op, big), async_recv=True)
        run_exact_round(op, config, big)  # the normal family, after the refusals launched nothing
    op.close()


# ---- the send / receive split, a slow rank, dispatch again before the peer received ---------------

@pytest.mark.parametrize("arch,W", SPLIT_CASES, ids=[f"{a}-w{w}" for a, w in SPLIT_CASES])
def test_split_halves_with_a_delayed_receiving_half(arch, W, seed):
    """tests/gpu/test_low_latency.py::test_split_halves_with_a_matmul_between_them: ``async_recv`` calls
    whose halves have work between them, checked against the reference (``run_round(busy=...)``) and
    exactly; the last rank's blocks start late in every launch (``Schedule.delays``), so its
    receiving half runs behind its peers'. On sm_90 also the two-launch path of an op whose whole
    grid does not fit (test_the_two_launch_path_of_an_op_whose_whole_grid_does_not_fit)."""
    config = cfg(W, "low_latency")
    op = host_op(config, arch, seed, delays={W - 1: 3000})
    between = []

    def busy():
        between.append(torch.arange(1000).sum())  # host work between the halves

    with seeded(op):
        for i, (tokens, kind) in enumerate([([TMAX] * W, "uniform"), (per_rank([0, 7, 1], W), "invalid"),
                                            ([3] * W, "duplicates")]):
            stats = run_round(op, config, tokens, kind, seed + i, busy=busy)
            assert stats["wire_mismatches"] == 0, stats
        assert len(between) == 6
        for i, T in enumerate((1, 17)):
            inputs = integer_inputs(config, [T] * W, ROUTINGS[i], seed + 10 + i)
            exp = expect(config, inputs)
            for r in op.local_ranks:
                poison(op, r)
            handle = op.dispatch(*op_inputs(op, inputs), async_recv=True)
            busy()
            for r, o in zip(op.local_ranks, handle.wait()):
                check_exact_dispatch(r, o, exp)
            ys = [integer_expert_stage(op, r) for r in op.local_ranks]
            nan = [torch.full((T, config.hidden), float("nan"), dtype=torch.bfloat16) for _ in op.local_ranks]
            handle = op.combine(op_arg(op, ys), out=op_arg(op, nan), async_recv=True)
            busy()
            for r, c in zip(op.local_ranks, handle.wait()):
                check_exact_combine(r, c, exp)
        if op.plan.whole_low_latency:  # sm_90: the whole op in one launch; now its halves one after the other
            assert all(op._fused.values())
            op._fused = dict.fromkeys(op._fused, False)
            for i, T in enumerate((0, 17)):
                run_round(op, config, [T] * W, "duplicates", seed + 20 + i)
            op._fused = dict.fromkeys(op._fused, True)
            run_round(op, config, [3] * W, "uniform", seed + 30)
    op.close()


@pytest.mark.parametrize("arch,W,family", AGAIN_CASES, ids=[f"{a}-w{w}-{f}" for a, w, f in AGAIN_CASES])
def test_dispatch_again_before_the_last_one_was_combined(arch, W, family, seed):
    """tests/gpu/test_processes.py::test_dispatch_again_while_a_peer_has_not_received_the_last_one with
    virtual ranks: 2 and 3 dispatches before a combine (a different token count a rank each time, so
    a stale count shows), the last rank's blocks late in every launch and, for the low-latency family,
    the receiving half split off; every call exact, the last one combined. (The processes test is in
    test_host_processes.py.)"""
    config = cfg(W, family)
    op = host_op(config, arch, seed, delays={W - 1: 2000})
    with seeded(op):
        for round_, repeats in enumerate((2, 3)):
            for k in range(repeats):
                tokens = [(7 + 13 * (k + r + round_)) % (TMAX + 1) for r in range(W)]
                inputs = integer_inputs(config, tokens, "uniform", 100 * round_ + k)
                exp = expect(config, inputs)
                for r in op.local_ranks:
                    poison(op, r)
                if family == "low_latency" and k % 2 == 0:
                    out = op.dispatch(*op_inputs(op, inputs), async_recv=True).wait()
                else:
                    out = op.dispatch(*op_inputs(op, inputs))
                for r, o in zip(op.local_ranks, out):
                    try:
                        check_exact_dispatch(r, o, exp)
                    except AssertionError as e:
                        raise AssertionError(f"round {round_}, dispatch {k + 1} of {repeats}: {e}") from None
            ys = [integer_expert_stage(op, r) for r in op.local_ranks]
            nan = [torch.full((exp.tokens[r], config.hidden), float("nan"), dtype=torch.bfloat16)
                   for r in op.local_ranks]
            for r, c in zip(op.local_ranks, op.combine(ys, out=nan)):
                check_exact_combine(r, c, exp)
    op.close()


# ---- push and pull ------------------------------------------------------------------------------

def _pull_rounds(op, config, zero_copy, rounds, seed):
    """tests/gpu/test_pull_dispatch.py's ``_rounds``: reference rounds ((tokens, kind) each) with x
    in dispatch_input (zero copy) or elsewhere, every call taking the pull."""
    original = verify.op_inputs

    def inputs_in_dispatch_input(op_, inputs):
        return original(op_, zero_copy_inputs(op_, inputs))

    for tokens, kind in rounds:
        seed += 1
        if zero_copy:
            verify.op_inputs = inputs_in_dispatch_input
        try:
            stats = run_round(op, config, tokens, kind, seed)
        finally:
            verify.op_inputs = original
        assert stats["wire_mismatches"] == 0, (tokens, kind, stats)
        x = op_arg(op, [op.dispatch_input(r)[: tokens[r]] for r in op.local_ranks])
        assert op.transport(max(tokens), x) == "pull"
        assert any("dispatch_pull" in n for n in _launched(op, -3)), _launched(op, -3)
    return seed


@pytest.mark.parametrize("arch,W", PULL_CASES, ids=[f"{a}-w{w}" for a, w in PULL_CASES])
def test_pull_dispatch_equals_the_reference(arch, W, seed):
    """tests/gpu/test_pull_dispatch.py::test_pull_dispatch_equals_the_reference (zero copy and copied)
    and test_exact_rounds_and_combine_after_a_pull."""
    config = cfg(W, "normal", dispatch_transport="pull")
    op = host_op(config, arch, seed)
    assert op.variant(Op.DISPATCH, 1, "pull").transport == "pull" and op.variant(Op.DISPATCH_PULL, 1)
    with seeded(op):
        s = _pull_rounds(op, config, True, [([TMAX] * W, "uniform"), (per_rank([0, 1, 17], W), "invalid"),
                                            ([0] * W, "duplicates")], seed)
        _pull_rounds(op, config, False, [(per_rank([0, 1, 17], W), "skewed")], s)
        inputs = integer_inputs(config, [TMAX - 4 * r for r in range(W)], "uniform", seed + 50)
        run_exact_round(op, config, zero_copy_inputs(op, inputs))
        run_exact_round(op, config, inputs)
    op.close()


def test_push_and_pull_calls_alternate_in_one_op(table_dir, seed):
    """tests/gpu/test_pull_dispatch.py::test_push_and_pull_calls_alternate_in_one_op: an "auto"
    op whose dispatch table bucket says pull; x in dispatch_input pulls, elsewhere pushes."""
    from epgen.codegen import tuning

    arch, W = "gfx942", 2
    config = cfg(W, "normal")
    tuning.write_entry(planner.tuning_key(config, arch, Op.DISPATCH), [(TMAX, GEOMETRY)], "test: a pull bucket", {},
                       transports={TMAX: "pull"})
    op = host_op(config, arch, seed)
    taken = []
    with seeded(op):
        for k in range(4):
            inputs = integer_inputs(config, [TMAX - k] * W, "uniform", 300 + k)
            if k % 3 != 1:
                inputs = zero_copy_inputs(op, inputs)
            taken.append(op.transport(TMAX - k, op_arg(op, [inputs[r].x for r in op.local_ranks])))
            run_exact_round(op, config, inputs)
    assert taken == ["pull", "push", "pull", "pull"]
    op.close()


def test_pull_dispatch_then_the_quantized_combine(seed):
    """tests/gpu/test_pull_dispatch.py::test_pull_dispatch_then_the_quantized_combine (gfx942: the
    e4m3fnuz wire)."""
    config = cfg(2, "normal", dispatch_transport="pull", combine_quant="fp8_blockwise")
    op = host_op(config, "gfx942", seed)
    assert (Op.COMBINE_QUANTIZE, "push") in op.plan.variants and op.variant(Op.DISPATCH_PULL, 1)
    with seeded(op):
        s = _pull_rounds(op, config, True, [([TMAX, 9], "uniform"), ([0, TMAX], "invalid")], seed)
        _pull_rounds(op, config, False, [([TMAX, 5], "duplicates")], s)
    op.close()


# ---- the expert layout and its alignment ---------------------------------------------------------

@pytest.mark.parametrize("arch,W,L,K,A,rounds,extra", EXPERT_CASES,
                         ids=[f"{c[0]}-w{c[1]}-l{c[2]}-k{c[3]}-a{c[4]}" + "".join(f"-{v}" for v in c[6].values())
                              for c in EXPERT_CASES])
def test_expert_layout_and_weighted_combine_match_the_reference(arch, W, L, K, A, rounds, extra, seed):
    """tests/gpu/test_expert_layout.py::test_expert_layout_and_weighted_combine_match_the_reference
    (and its pull, fp8-payload and quantized-wire tests): expanded rows, counts, offsets and padding
    bit for bit against ``reference.expand``, the weighted combine bit for bit against
    ``reference.combine_weighted`` (an fp8 wire in the arch's flavour), zero copy and copied y."""
    from epgen.harness import expert_verify
    from epgen.harness.expert_verify import run_expert_round

    config = _expert_cfg(W, L, K, A, extra)
    op = host_op(config, arch, seed)
    original = expert_verify.expert_inputs
    if op.payload.torch_dtype != torch.float8_e4m3fn and config.dtype == "fp8":  # gfx942 takes e4m3fnuz
        expert_verify.expert_inputs = lambda *a, **k: [(x.view(op.payload.torch_dtype), w, i, s)
                                                       for x, w, i, s in original(*a, **k)]
    try:
        with seeded(op):
            for i, tokens in enumerate(rounds):
                run_expert_round(op, config, tokens, seed + 10 * i, zero_copy=i % 2 == 0)
    finally:
        expert_verify.expert_inputs = original
    op.close()


# ---- capped receive memory and its overflow ------------------------------------------------------

@pytest.mark.parametrize("layout,arch", CAPPED_CASES)
def test_capped_receive_memory_overflow_raises_then_the_op_runs_again(layout, arch, seed):
    """tests/gpu/test_expert_layout.py::test_capped_receive_memory_overflow_raises_then_the_op_runs_again
    at W = 4, 32 tokens a rank, 40 receive rows: all to rank 0 (128 rows) raises naming the true
    count, num_recv clamped to 40 with every row below it this call's; then rounds within the cap."""
    from epgen.op import EpError

    config = _capped_cfg(layout)
    op = host_op(config, arch, seed)
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(TMAX, config.hidden, generator=g).to(torch.bfloat16) for _ in range(4)]
    ws = [torch.rand(TMAX, 2, generator=g) for _ in range(4)]
    crowd = [torch.zeros(TMAX, 2, dtype=torch.int32) for _ in range(4)]  # 128 rows for rank 0
    with seeded(op):
        with pytest.raises(EpError, match=r"^rank 0: the receive buffer of rank 0 needed 128 rows in this dispatch, "
                                          r"more than its 40") as e:
            op.dispatch(xs, ws, crowd)
        assert e.value.recoverable
        assert int(op.recv_buffers(0).num_recv) == 40
        src = op.recv_buffers(0).recv_src[:40]
        assert bool(((src[:, 0] >= 0) & (src[:, 0] < 4) & (src[:, 1] >= 0) & (src[:, 1] < TMAX)).all())
        assert len({tuple(r) for r in src.tolist()}) == 40
        spread = [torch.arange(2 * TMAX, dtype=torch.int32).view(TMAX, 2) % 8 for _ in range(4)]
        recv = op.dispatch(xs, ws, spread)  # both experts of a token on one rank: 32 rows a rank
        got = [o.recv if layout == "expert" else o for o in recv]
        want = reference.dispatch(xs, ws, spread, experts_per_rank=2, max_recv_tokens=40)
        for d, (gr, w) in enumerate(zip(got, want)):
            n = int(gr.num_recv)
            perm = reference.align_rows(w.src, gr.recv_src[:n])
            assert torch.equal(gr.recv_x[:n][perm], w.x), f"rank {d}"
        if layout == "rank":
            run_round(op, config, [20, 0, 9, 3], "invalid", seed)  # within the cap: at most 32 rows a rank
        else:
            from epgen.harness.expert_verify import run_expert_round

            run_expert_round(op, config, [9, 0, 5, 3], seed + 5)
    op.close()


# ---- every dispatch payload and combine wire, bit-equal -------------------------------------------

@pytest.mark.parametrize("arch,family,W,dtype,scale_bytes,wire", WIRE_CASES,
                         ids=[f"{c[0]}-{c[1]}-w{c[2]}-{c[3]}-s{c[4]}-{c[5]}" for c in WIRE_CASES])
def test_every_payload_and_wire_is_bit_equal_to_its_reference(arch, family, W, dtype, scale_bytes, wire, seed):
    """tests/gpu/test_quantized_combine.py::test_every_wire_is_bit_equal_to_the_wire_reference,
    test_low_latency.py's quantized payload and wire tests and test_op.py's quantized dispatch: payload
    and scale rows bit-equal to the source rows, every combined element within its bound and
    bit-equal to the wire reference in the arch's fp8 flavour (e4m3fnuz on gfx942)."""
    config = _wire_cfg(family, W, dtype, scale_bytes, wire)
    op = host_op(config, arch, seed)
    assert wire_fp8_flavour(op) == ("e4m3fnuz" if arch == "gfx942" else "e4m3fn")
    if dtype == "fp8":
        assert op.payload.torch_dtype == (torch.float8_e4m3fnuz if arch == "gfx942" else torch.float8_e4m3fn)
    assert ((Op.COMBINE_QUANTIZE, "push") in op.plan.variants) == (wire != "none" and family == "normal")
    with seeded(op):
        for i, (tokens, kind) in enumerate([([TMAX] * W, "uniform"), ([TMAX] * W, "invalid"),
                                            (per_rank([0, 1, 7, TMAX], W), "duplicates"),
                                            (per_rank([0, 1, 7, TMAX], W), "skewed"), ([0] * W, "uniform")]):
            stats = run_round(op, config, tokens, kind, seed + i)
            assert stats["wire_mismatches"] == 0, (tokens, kind, stats)
    op.close()


def test_one_kernel_launched_alone_redoes_its_call_at_any_geometry(seed):
    """``launch_kernel``: after a dispatch and combine, the combine kernel launched alone with the
    op's launch argument writes the same output bits again, at the plan's geometry and at another
    one loaded from ``kernel``'s spec (what tools/quant_profile.py and tools/local_sweep.py time);
    a kernel of another op is refused naming both."""
    config = cfg(2, "normal")
    op = host_op(config, "sm_90", seed)
    with seeded(op):
        inputs = make_inputs(config, [TMAX, 13], "duplicates", seed)
        op.dispatch(*op_inputs(op, inputs))
        for r in op.local_ranks:
            op.combine_input(r).normal_()
        outs = [torch.empty(inp.x.shape[0], config.hidden, dtype=torch.bfloat16) for inp in inputs]
        op.combine([op.combine_input(r) for r in op.local_ranks], out=outs)
        op.synchronize()
        want = [o.clone() for o in outs]
        spec, _ = op.kernel(Op.COMBINE, TMAX)
        other = spec.replace(blocks=spec.blocks + 3)
        src = op.platform.render(other)
        for kernel in (None, (other, op.platform.load_kernel(src.text, src.entry, op.device.index))):
            for o in outs:
                o.fill_(float("nan"))
            op.launch_kernel(Op.COMBINE, TMAX, kernel)
            op.synchronize()
            for r, (got, exp) in enumerate(zip(outs, want)):
                assert torch.equal(got.view(torch.int16), exp.view(torch.int16)), (r, kernel and kernel[0].name)
        with pytest.raises(ValueError, match=f"kernel: its spec {other.name} is of op combine, not dispatch"):
            op.launch_kernel(Op.DISPATCH, TMAX, (other, None))
    op.close()


def test_wire_rows_written_by_the_quantize_kernel_and_by_the_caller(seed):
    """tests/gpu/test_quantized_combine.py::test_the_quantize_kernel_writes_combine_wire_rows_for_rows_from_other_ranks
    and test_wire_rows_written_by_the_caller_give_the_same_output, gfx942 (e4m3fnuz codes)."""
    from epgen import quant

    mode = "fp8_blockwise"
    config = _wire_cfg("normal", 2, "fp8", 4, mode)
    op = host_op(config, "gfx942", seed)
    flavour = wire_fp8_flavour(op)
    inputs = make_inputs(config, [TMAX, 27], "uniform", 5)
    with seeded(op):
        outs = op.dispatch(*op_inputs(op, inputs))
        gen = torch.Generator().manual_seed(6)
        ys, before = [], []
        for r, o in zip(op.local_ranks, outs):
            n = int(o.num_recv)
            y = torch.randn(n, config.hidden, generator=gen).to(torch.bfloat16)
            y[::5, :64] = -(2.0**-90)  # flushed blocks of negatives and of -0.0
            y[1::5, :64] = -0.0
            ys.append(y)
            w = op.combine_wire_input(r)
            w.codes.fill_(0xA5)
            before.append(w.codes[:n].clone())
        first = [c.clone() for c in op.combine(op_arg(op, ys))]
        for r, o, y, b in zip(op.local_ranks, outs, ys, before):
            n = int(o.num_recv)
            other = o.recv_src[:n, 0] != r
            w = op.combine_wire_input(r)
            want_codes, want_scales = quant.combine_wire_rows(mode, y, fp8_flavour=flavour)
            assert torch.equal(w.codes[:n][other], want_codes[other]), f"rank {r}: wire codes differ"
            assert torch.equal(w.scales[:n][other].view(torch.int32), want_scales[other].view(torch.int32))
            assert torch.equal(w.codes[:n][~other], b[~other]), f"rank {r}: own rows were written"
            assert int(other.sum()) and int((~other).sum())
        # an expert stage of each row's source alone, handed in as y and as wire rows: the same output
        def stage(outs):
            ys = []
            for o in outs:
                src = o.recv_src[:int(o.num_recv)].float()
                ys.append((src[:, :1] + src[:, 1:2] / 8 + torch.arange(config.hidden) / 64).to(torch.bfloat16))
            return ys

        by_y = [c.clone() for c in op.combine(op_arg(op, stage(op.dispatch(*op_inputs(op, inputs)))))]
        wires = [op.combine_wire_input(r) for r in op.local_ranks]
        for wi, y in zip(wires, stage(op.dispatch(*op_inputs(op, inputs)))):
            codes, scales = quant.combine_wire_rows(mode, y, fp8_flavour=flavour)
            wi.codes[:y.shape[0]].copy_(codes)
            wi.scales[:y.shape[0]].copy_(scales)
        by_wire = op.combine(wires)
        for r, a, b in zip(op.local_ranks, by_y, by_wire):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16)), f"rank {r}"
    assert all(not c.isnan().any() for c in first)
    op.close()


# ---- faults: raised, then exact rounds -----------------------------------------------------------

@pytest.mark.parametrize("arch,family", [("gfx950", "normal"), ("gfx1250", "low_latency")])
def test_bad_ids_and_a_short_y_raise_naming_them_then_the_op_runs_again(arch, family, seed):
    """tests/gpu/test_reliability.py::test_expert_id_E_or_minus_2_raises_naming_it_then_the_op_runs_again
    and test_expert_layout.py::test_combine_with_a_short_y_raises_and_the_op_runs_again (rank layout)
    with virtual W = 4: the fault raised by the call (validate=True), named, recoverable; the faulted
    dispatch not combined; then exact rounds on the same op. The processes tests raise them on
    every rank (test_host_processes.py)."""
    from epgen.op import EpError

    W = 4
    config = cfg(W, family)
    op = host_op(config, arch, seed)
    victim = W - 1
    with seeded(op):
        run_exact_round(op, config, integer_inputs(config, [16] * W, "uniform", 1))
        for s, eid in ((10, config.num_experts), (20, -2)):
            inputs = integer_inputs(config, [16] * W, "uniform", s)
            inputs[victim].indices[5, 2] = eid
            with pytest.raises(EpError) as e:
                op.dispatch(*op_inputs(op, inputs))
            want = f"rank {victim}: indices[5, 2]={eid}: expert ids must be -1 or in [0, {config.num_experts})"
            assert want in str(e.value) and e.value.recoverable, str(e.value)
            assert "cleared: the op runs again from the next dispatch" in str(e.value)
            with pytest.raises(RuntimeError, match="needs a dispatch first"):
                op.combine(op_arg(op, [op.combine_input(r) for r in op.local_ranks]))
            for k in (2, 3):
                run_exact_round(op, config, integer_inputs(config, [16] * W, "uniform", s + k))
        inputs = integer_inputs(config, [TMAX] * W, "uniform", 40)
        got = op.dispatch(*op_inputs(op, inputs))
        need = [int(g.num_recv) for g in got]
        ys = [torch.zeros(n - 1, config.hidden, dtype=torch.bfloat16) for n in need]
        with pytest.raises(EpError, match=rf"combine: y has {need[0] - 1} rows but this rank's last dispatch "
                                          rf"produced {need[0]}") as e:
            op.combine(ys)
        assert e.value.recoverable
        for k in range(2):
            run_exact_round(op, config, integer_inputs(config, per_rank([TMAX, 0, 5], W), "duplicates", 50 + k))
    op.close()


def test_a_fault_in_the_sending_half_is_raised_by_wait(seed):
    """tests/gpu/test_reliability.py::test_a_fault_in_the_sending_half_is_raised_by_wait_never_between_the_halves
    on the real kernels (gfx942: the low-latency calls always run as two halves on AMD)."""
    from epgen.op import EpError

    W = 2
    config = cfg(W, "low_latency")
    op = host_op(config, "gfx942", seed)
    inputs = integer_inputs(config, [16] * W, "uniform", 5)
    inputs[W - 1].indices[5, 2] = config.num_experts
    with seeded(op):
        start = len(op.platform.stats)
        handle = op.dispatch(*op_inputs(op, inputs), async_recv=True)
        assert [n.split("_gfx")[0] for n in _launched(op, start)] == ["epgen_dispatch_ll_send"]
        with pytest.raises(EpError, match=rf"^rank {W - 1}: indices\[5, 2\]={config.num_experts}: .*cleared: the op "
                                          r"runs again"):
            handle.wait()
        assert [n.split("_gfx")[0] for n in _launched(op, start)] == ["epgen_dispatch_ll_send",
                                                                      "epgen_dispatch_ll_recv"]
        with pytest.raises(RuntimeError, match="needs a dispatch first"):
            op.combine(op_arg(op, [op.combine_input(r) for r in op.local_ranks]))
        run_exact_round(op, config, integer_inputs(config, [16] * W, "uniform", 6))
    op.close()


def test_a_kernel_that_cannot_complete_raises_a_timeout_naming_the_phase(seed):
    """tests/gpu/test_low_latency.py::test_a_wait_that_cannot_complete_raises_a_timeout_within_the_bound
    (dispatch): rank 0's receiving half waits for a call 2 ahead; EpError names the phase, not
    recoverable, and the op refuses later calls. On the scheduler's clock (50 ns a step)."""
    from epgen.op import EpError

    timeout_s = 0.05
    config = cfg(2, "low_latency", timeout_s=timeout_s)
    op = host_op(config, "gfx942", seed, validate=False)
    with seeded(op):
        run_exact_round(op, config, integer_inputs(config, [8, 8], "uniform", 1))
        calls = op.arenas.local[0][op.arena_layout.ll_calls:op.arena_layout.ll_calls + 4 * 4 * abi.LL_FLAG_SLOTS].view(torch.int32)
        calls.view(4, abi.LL_FLAG_SLOTS)[1] += 2
        inputs = integer_inputs(config, [8, 8], "uniform", 2)
        with pytest.raises(EpError) as e:
            op.dispatch(*op_inputs(op, inputs))
            op.synchronize()
        assert f"timed out after {timeout_s} s in the low-latency dispatch" in str(e.value), str(e.value)
        assert not e.value.recoverable
        with pytest.raises(EpError, match="unusable"):
            op.dispatch(*op_inputs(op, inputs))
    op.close()


@pytest.mark.skip(reason="not applicable on the host: CUDA graph capture and replay are a GPU's (a host launch "
                         "finishes before it returns; there is no stream to capture)")
def test_graph_of_dispatch_and_combine_replayed_with_fresh_routing():
    """tests/gpu/test_reliability.py, test_low_latency.py, test_pull_dispatch.py, test_expert_layout.py
    and test_quantized_combine.py's graph tests."""


@pytest.mark.parametrize("overlap", ["y", "other_out"])
def test_an_out_sharing_bytes_with_y_or_another_out_is_refused_and_the_combine_then_runs(overlap):
    """An ``out`` that overlaps any rank's y (or, virtual, another rank's out) would return rows that
    depend on the launch order: refused before any launch, naming both; the dispatch stays pending."""
    config = cfg(2)
    op = host_op(config, "sm_90", 0)
    x = [torch.randn(8, config.hidden).bfloat16() for _ in range(2)]
    w = [torch.rand(8, config.topk) for _ in range(2)]
    ids = [torch.randint(0, config.num_experts, (8, config.topk), dtype=torch.int32) for _ in range(2)]
    y = [r.recv_x[: int(r.num_recv)].clone() for r in op.dispatch(x, w, ids)]
    shared = torch.empty(8, config.hidden).bfloat16()
    outs, rule = ([y[0][:8], None], r"out\[rank 0\]: shares bytes with y\[rank 0\]") if overlap == "y" else \
        ([shared, shared], r"out\[rank 0\]: shares bytes with out\[rank 1\]")
    with pytest.raises(ValueError, match=rule):
        op.combine(y, out=outs)
    out = op.combine(y)
    assert [tuple(o.shape) for o in out] == [(8, config.hidden)] * 2
    op.close()
