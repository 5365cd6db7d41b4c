"""GPU tests of the pull dispatch (``EpConfig.dispatch_transport``): its outputs against the torch
reference, its combine (also with a quantized combine wire), graph capture with zero-copy inputs, push and pull calls in one op, two ops
in one process and a bounded wait that cannot complete.

W = 1 and W = 2, 4, 8 as virtual ranks on one GPU; W = 2, 3 and 4 as processes (``epgen.harness.ranks``).
Every call checks what it took with ``op.transport``; inputs either sit in ``op.dispatch_input()``
(zero copy) or elsewhere (the "pull" op copies them there first).
"""

import pytest
import torch

from epgen.codegen import planner
from epgen.codegen.config import EpConfig, Geometry
from epgen.codegen.spec import Op
from epgen.harness.verify import (PROCESS_WORLD_SIZES, check_exact_combine, check_exact_dispatch, expect, integer_expert_stage,
                                  integer_inputs, model_config, op_arg, op_inputs, poison, run_exact_round, run_round,
                                  zero_copy_inputs)

GEO = Geometry(blocks=16, warps_per_block=16, unroll=4)
TMAX = 4096
KINDS = ("uniform", "invalid", "duplicates", "skewed", "one_rank")
TOKENS = {1: [[0], [1], [128], [4096]],
          2: [[4096, 4096], [0, 1], [128, 0], [0, 0]],
          3: [[4096, 0, 128], [4096] * 3, [0, 1, 0], [0] * 3],
          4: [[0, 1, 128, 4096], [4096] * 4, [0] * 4, [5, 0, 0, 0]],
          8: [[4096] * 8, [0, 1, 128, 4096, 4096, 128, 1, 0], [0] * 8]}


def _op(model="deepseek-v3", world_size=1, virtual=False, transport="pull", validate=True, **kw):
    from epgen.op import EpDispatchCombine

    cfg = model_config(model, world_size, kw.pop("max_tokens", TMAX), dispatch_geometry=GEO, combine_geometry=GEO,
                       timeout_s=kw.pop("timeout_s", 10.0), kernel_family="normal", dispatch_transport=transport, **kw)
    return cfg, EpDispatchCombine(cfg, virtual=virtual and world_size > 1, validate=validate)


def _rounds(op, cfg, zero_copy: bool, kinds=KINDS, seed=0):
    """Reference rounds (``run_round``: poisoned receive rows and outputs, payload, weights, ids,
    scales and source bit-equal, the combine within its bound and, with a quantized combine wire,
    bit-equal to the wire reference) over ``TOKENS[W]`` and ``kinds``, with x in dispatch_input
    (``zero_copy``) or elsewhere; every call must take the pull."""
    import epgen.harness.verify as verify

    original = verify.op_inputs

    def inputs_in_dispatch_input(op_, inputs):
        return original(op_, verify.zero_copy_inputs(op_, inputs))

    for tokens in TOKENS[cfg.world_size]:
        for kind in kinds:
            seed += 1
            mine = max(tokens[r] for r in op.local_ranks)
            if zero_copy:
                verify.op_inputs = inputs_in_dispatch_input
            try:
                stats = run_round(op, cfg, tokens, kind, seed)
            finally:
                verify.op_inputs = original
            assert cfg.combine_quant == "none" or stats["wire_mismatches"] == 0, (tokens, kind, stats)
            x = op_arg(op, [op.dispatch_input(r)[: tokens[r]] for r in op.local_ranks])
            assert op.transport(mine, x) == "pull"
    return seed


@pytest.mark.gpu
@pytest.mark.parametrize("zero_copy", [True, False], ids=["zero_copy", "copied"])
@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_pull_dispatch_equals_the_reference(world_size, zero_copy):
    cfg, op = _op(world_size=world_size, virtual=True)
    assert op.variant(Op.DISPATCH, 1, "pull").transport == "pull" and op.variant(Op.DISPATCH_PULL, 1)
    _rounds(op, cfg, zero_copy)
    op.close()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp8", "fp4"])
def test_pull_dispatch_of_quantized_payloads_with_scales_virtual8(dtype):
    from epgen.quant import scale_bytes

    mode = {"fp8": "fp8_blockwise", "fp4": "fp4_mx"}[dtype]
    cfg, op = _op(world_size=8, virtual=True, dtype=dtype, scale_bytes=scale_bytes(mode, 7168))
    assert op.dispatch_input(0).shape == (TMAX, 7168 if dtype == "fp8" else 3584)
    _rounds(op, cfg, zero_copy=True, kinds=("uniform", "invalid", "duplicates"))
    op.close()


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["fp8_direct_cast", "fp8_blockwise", "fp4_blockwise"])
@pytest.mark.parametrize("world_size", [2, 8])
def test_pull_dispatch_then_the_quantized_combine(world_size, mode):
    """The quantized combine wire after a pull dispatch: its quantize kernel (rows from other ranks)
    and the combine's own-row encoding read the rows and sources the pull path placed; the combine
    geometry's 512 threads fit the quantized combine on sm_90 (16 warps)."""
    cfg, op = _op(world_size=world_size, virtual=True, combine_quant=mode)
    assert (Op.COMBINE_QUANTIZE, "push") in op.plan.variants and op.variant(Op.DISPATCH_PULL, 1)
    _rounds(op, cfg, zero_copy=True, kinds=("uniform", "invalid", "duplicates"))
    _rounds(op, cfg, zero_copy=False, kinds=("skewed",), seed=100)
    op.close()


@pytest.mark.gpu
@pytest.mark.parametrize("W,L,K,A,rounds", [(1, 8, 4, 1, [[0], [77], [96]]), (4, 3, 9, 64, [[96, 1, 0, 40], [96] * 4]),
                                           (8, 2, 16, 16, [[96] * 8, [0, 1, 2, 3, 96, 0, 7, 0]])])
def test_pull_dispatch_in_the_expert_layout_and_its_weighted_combine(W, L, K, A, rounds):
    """The expert layout's rounds of tests/gpu/test_expert_layout.py (expanded rows and the weighted
    combine bit-equal to the reference) on an op that pulls: the expansion runs after the pull."""
    from epgen.harness.expert_verify import expert_config as _config
    from epgen.harness.expert_verify import expert_op as _expert_op
    from epgen.harness.expert_verify import run_expert_round as _round

    cfg = _config(W, experts_per_rank=L, topk=K, alignment=A, kernel_family="normal", dispatch_transport="pull")
    op = _expert_op(cfg)
    assert op.transport(96, op_arg(op, [op.dispatch_input(r)[:96] for r in op.local_ranks])) == "pull"
    for i, tokens in enumerate(rounds):
        _round(op, cfg, tokens, 10 * i + W, zero_copy=i % 2 == 0)
    op.close()


@pytest.mark.gpu
def test_gpt_oss_shape_virtual4():
    cfg, op = _op(model="gpt-oss-120b", world_size=4, virtual=True)  # H 2880: a row of 5760 bytes
    _rounds(op, cfg, zero_copy=True, kinds=("uniform", "duplicates"))
    op.close()


def _exact_body(rank, world_size, virtual):
    """Exact rounds (``run_exact_round``: receive rows and the combine after the pull dispatch
    bit for bit) of a "pull" op, x in dispatch_input and elsewhere (copied there) in turn."""
    cfg, op = _op(model="deepseek-v3", world_size=world_size, virtual=virtual, max_tokens=256)
    for seed in range(6):
        inputs = integer_inputs(cfg, [256 - 32 * r for r in range(world_size)], "uniform", seed, device=op.device)
        for zero_copy in (True, False):
            got = run_exact_round(op, cfg, zero_copy_inputs(op, inputs) if zero_copy else inputs)
            assert got["recv"] is not None
    op.close()


@pytest.mark.gpu
@pytest.mark.parametrize("world_size", [1, 2, 8])
def test_exact_rounds_and_combine_after_a_pull(world_size):
    _exact_body(0, world_size, True)


def _two_process_body(rank, world_size):
    cfg, op = _op(world_size=world_size)
    _rounds(op, cfg, zero_copy=True, kinds=("uniform", "skewed"))  # every kind: the virtual tests
    _rounds(op, cfg, zero_copy=False, kinds=("uniform",))
    _exact_body(rank, world_size, False)
    torch.distributed.barrier()  # every peer is done reading this rank's arena
    op.close()


@pytest.mark.processes
@pytest.mark.parametrize("world_size", PROCESS_WORLD_SIZES)
def test_processes(world_size):
    from epgen.harness.ranks import run_ranks

    run_ranks(world_size, _two_process_body)


@pytest.mark.gpu
@pytest.mark.parametrize("world_size", [1, 4])
def test_push_and_pull_calls_alternate_in_one_op(world_size, table_dir):
    """An "auto" op whose dispatch bucket says pull (a table of the test's own, ``table_dir``): a
    call with x in dispatch_input pulls, one with x elsewhere pushes; both exact, in any order."""
    from epgen.codegen import tuning
    from epgen.op import EpDispatchCombine
    from epgen.platform import Platform

    base = EpConfig.for_model("deepseek-v3", world_size=world_size, max_tokens_per_rank=256, kernel_family="normal",
                              dispatch_geometry=GEO, combine_geometry=GEO, timeout_s=10.0)
    arch = Platform.current().arch(torch.cuda.current_device())
    tuning.write_entry(planner.tuning_key(base, arch, Op.DISPATCH), [(256, GEO)], "test: a pull bucket", {},
                       transports={256: "pull"})
    op = EpDispatchCombine(base, virtual=world_size > 1, validate=True)
    taken = []
    for seed in range(8):
        inputs = integer_inputs(base, [200] * world_size, "uniform", 300 + seed, device=op.device)
        zero_copy = seed % 3 != 1
        if zero_copy:
            inputs = zero_copy_inputs(op, inputs)
        x = op_arg(op, [inputs[r].x for r in op.local_ranks])
        taken.append(op.transport(200, x))
        run_exact_round(op, base, inputs)
    assert taken == ["pull", "push", "pull"] * 2 + ["pull", "push"]
    op.close()


@pytest.mark.gpu
def test_two_pull_ops_in_one_process():
    """Two ops (their own arenas, signal words and generations) interleaved on one stream."""
    (cfg_a, a), (cfg_b, b) = _op(world_size=2, virtual=True, max_tokens=128), \
        _op(model="gpt-oss-120b", world_size=4, virtual=True, max_tokens=64)
    for seed in range(4):
        for cfg, op in ((cfg_a, a), (cfg_b, b)):
            tokens = [cfg.max_tokens_per_rank - seed] * cfg.world_size
            run_exact_round(op, cfg, zero_copy_inputs(op, integer_inputs(cfg, tokens, "uniform", seed, device=op.device)))
    a.close()
    b.close()


@pytest.mark.gpu
@pytest.mark.parametrize("world_size", [1, 8])
def test_graph_of_pull_dispatch_and_combine_with_fresh_inputs_in_dispatch_input(world_size):
    """Captured after one eager call; before each replay fresh x is written into dispatch_input and
    fresh routing into the static weights and indices; each replay checked bit for bit."""
    cfg, op = _op(world_size=world_size, virtual=True, validate=False, max_tokens=64)
    T, local = cfg.max_tokens_per_rank, op.local_ranks
    static = zero_copy_inputs(op, integer_inputs(cfg, [T] * world_size, "uniform", 500, device=op.device))
    args = op_inputs(op, static)
    ys = op_arg(op, [op.combine_input(r) for r in local])
    outs = [torch.empty(T, cfg.hidden, dtype=torch.bfloat16, device=op.device) for _ in local]

    def step():
        op.dispatch(*args)
        for r in local:
            integer_expert_stage(op, r)
        op.combine(ys, out=op_arg(op, outs))

    def run_and_check(inputs, fn, what):
        for r, o in zip(local, outs):
            poison(op, r)
            o.fill_(float("nan"))
        fn()
        op.synchronize()
        exp = expect(cfg, inputs)
        try:
            for r, o in zip(local, outs):
                check_exact_dispatch(r, op.recv_buffers(r), exp)
                check_exact_combine(r, o, exp)
        except AssertionError as e:
            raise AssertionError(f"{what}: {e}") from None

    assert op.transport(T, args[0]) == "pull"
    run_and_check(static, step, "eager call")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    for i in range(20):
        fresh = integer_inputs(cfg, [T] * world_size, ("uniform", "duplicates", "invalid")[i % 3], 600 + i,
                               device=op.device)
        for r in local:
            op.dispatch_input(r)[:T].copy_(fresh[r].x)
            static[r].weights.copy_(fresh[r].weights)
            static[r].indices.copy_(fresh[r].indices)
        run_and_check(fresh, g.replay, f"replay {i}")
    op.close()


@pytest.mark.gpu
def test_a_pulled_wait_that_cannot_complete_raises_a_timeout_naming_the_phase():
    """Virtual W = 2: rank 0's call counter is advanced by one, so its pull kernel waits for rank 1's
    "pulled" flag of a generation rank 1 never raises; the bounded wait ends in EpError naming the
    pull phase and the peer, and the op refuses further calls."""
    from epgen.op import EpError

    cfg, op = _op(world_size=2, virtual=True, timeout_s=0.5, max_tokens=64)
    run_exact_round(op, cfg, zero_copy_inputs(op, integer_inputs(cfg, [64, 64], "uniform", 1, device=op.device)))
    calls = op._signal_view(0, "dispatch_calls")
    calls += 1
    with pytest.raises(EpError) as e:
        op._launch(Op.DISPATCH_PULL, 64, op._args[Op.DISPATCH_PULL])  # validate: synchronized, raised here
    msg = str(e.value)
    assert "in the pull dispatch (waiting until the peer has read its rows" in msg and "on rank 1" in msg, msg
    assert not e.value.recoverable
    with pytest.raises(EpError, match="this op is unusable after that fault"):
        op.dispatch(*op_inputs(op, integer_inputs(cfg, [1, 1], "uniform", 2, device=op.device)))
    op.close()


@pytest.mark.gpu
def test_an_x_inside_dispatch_input_but_not_at_its_start_is_refused_before_any_launch():
    cfg, op = _op(world_size=1, max_tokens=64)
    x = op.dispatch_input()[1:9]
    w = torch.rand(8, cfg.topk, device=op.device)
    i = torch.zeros(8, cfg.topk, dtype=torch.int32, device=op.device)
    with pytest.raises(ValueError, match=r"^x.data_ptr\(\)=0x[0-9a-f]+: 14336 bytes into dispatch_input\(\); an x "
                                         r"in dispatch_input must start at its first row"):
        op.dispatch(x, w, i)
    with pytest.raises(RuntimeError, match="needs a dispatch first"):  # nothing was launched
        op.combine(op.combine_input())
    op.close()
