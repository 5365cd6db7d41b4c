"""GPU tests of the low-latency kernel family (``EpConfig(kernel_family=...)``) on one GPU.

Every round is checked against the torch reference (``epgen.harness.verify.run_round``: poisoned receive
buffers, every wire bit-equal to its reference) or exactly on the device (integer tokens,
``run_exact_round``). W = 1 and virtual W = 2, 4, 8; processes: tests/gpu/test_processes.py.
"""

import time

import pytest
import torch

from epgen.codegen import abi
from epgen.codegen.config import EpConfig
from epgen.harness.verify import (ROUTINGS, check_exact_combine, check_exact_dispatch, expect, integer_expert_stage,
                                  integer_inputs, op_arg, op_inputs, poison, run_exact_round, run_round)

TMAX = 256
TOKENS = (0, 1, 7, 128, 256)


def _op(world_size, *, family="low_latency", tmax=TMAX, timeout_s=10.0, validate=True, **kw):
    from epgen.op import EpDispatchCombine

    cfg = EpConfig.for_model("deepseek-v3", world_size=world_size, max_tokens_per_rank=tmax, kernel_family=family,
                             timeout_s=timeout_s, **kw)
    return cfg, EpDispatchCombine(cfg, virtual=world_size > 1, validate=validate)


@pytest.mark.gpu
@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_rounds_against_the_reference(world_size):
    cfg, op = _op(world_size)
    seed = 0
    mixed = [TOKENS[r % len(TOKENS)] for r in range(world_size)]  # zero-token ranks beside full ones
    for tokens in [[T] * world_size for T in TOKENS] + [mixed]:
        for kind in ("uniform", "invalid", "duplicates", "one_rank", "skewed"):
            seed += 1
            run_round(op, cfg, tokens, kind, seed)
    op.close()


@pytest.mark.gpu
@pytest.mark.parametrize("world_size", [1, 4])
def test_the_two_launch_path_of_an_op_whose_whole_grid_does_not_fit(world_size):
    """The halves launched one after the other (what a call does when the whole op's grid cannot be
    resident at once) return what the one-kernel op returns."""
    cfg, op = _op(world_size)
    assert all(op._fused.values()), "the default geometry's whole-op grids fit an H200"
    op._fused = dict.fromkeys(op._fused, False)
    for seed, T in enumerate((0, 1, 7, 128, 256)):
        run_round(op, cfg, [T] * world_size, "duplicates", seed)
    op._fused = dict.fromkeys(op._fused, True)
    run_round(op, cfg, [3] * world_size, "uniform", 9)
    op.close()


@pytest.mark.gpu
@pytest.mark.parametrize("quant", ["fp8_direct_cast", "fp8_blockwise", "fp4_blockwise"])
def test_quantized_combine_wires_virtual4(quant):
    cfg, op = _op(4, combine_quant=quant)
    for seed, T in enumerate((1, 7, 128)):
        run_round(op, cfg, [T, 0, T, 3], "uniform", seed)
    op.close()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp8", "fp4"])
def test_quantized_payloads_virtual2(dtype):
    cfg, op = _op(2, dtype=dtype, scale_bytes=56 if dtype == "fp8" else 0)
    for seed, T in enumerate((1, 128, 256)):
        run_round(op, cfg, [T, T], "duplicates", seed)
    op.close()


@pytest.mark.gpu
def test_auto_takes_each_family_by_token_count_and_both_agree():
    cfg, op = _op(2, family="auto", tmax=1024)
    threshold = op.low_latency_tokens
    assert 1 <= threshold < 1024
    seed = 0
    for T in (1, threshold, threshold + 1, 1024, 7, 512, 1):  # families interleaved in one op
        seed += 1
        assert op.family(T) == ("low_latency" if T <= threshold else "normal")
        run_round(op, cfg, [T, max(T - 1, 0)], "uniform", seed)
    op.close()


def _matmul_beside(n=2048):
    a = torch.randn(n, n, device="cuda")
    return a, lambda: a @ a


def _split_round(op, cfg, inputs, busy):
    """An exact round with a matmul between each op's halves; returns nothing, raises on a mismatch."""
    exp = expect(cfg, inputs)
    local = op.local_ranks
    for r in local:
        poison(op, r)
    handle = op.dispatch(*op_inputs(op, inputs), async_recv=True)
    product = busy()
    outs = handle.wait()
    outs = outs if op.virtual else [outs]
    for r, o in zip(local, outs):
        check_exact_dispatch(r, o, exp)
    ys = [integer_expert_stage(op, r) for r in local]
    nan = [torch.full((exp.tokens[r], cfg.hidden), float("nan"), dtype=torch.bfloat16, device=op.device) for r in local]
    handle = op.combine(op_arg(op, ys), out=op_arg(op, nan), async_recv=True)
    product2 = busy()
    combined = handle.wait()
    combined = combined if op.virtual else [combined]
    for r, c in zip(local, combined):
        check_exact_combine(r, c, exp)
    return product, product2


@pytest.mark.gpu
@pytest.mark.parametrize("world_size", [1, 2, 8])
def test_split_halves_with_a_matmul_between_them(world_size):
    from epgen.op import RecvHandle

    cfg, op = _op(world_size, family="auto", tmax=1024, validate=False)
    a, busy = _matmul_beside()
    want = a @ a
    for seed, T in enumerate((1, 7, min(128, op.low_latency_tokens))):
        inputs = integer_inputs(cfg, [T] * world_size, ROUTINGS[seed % len(ROUTINGS)], seed, device=op.device)
        p1, p2 = _split_round(op, cfg, inputs, busy)
        assert torch.equal(p1, want) and torch.equal(p2, want)
    op.synchronize()
    inputs = integer_inputs(cfg, [1] * world_size, "uniform", 9, device=op.device)
    handle = op.dispatch(*op_inputs(op, inputs), async_recv=True)
    assert isinstance(handle, RecvHandle)
    with pytest.raises(RuntimeError, match=r"handle.wait\(\) first"):
        op.dispatch(*op_inputs(op, inputs))
    handle.wait()
    with pytest.raises(RuntimeError, match="already waited"):
        handle.wait()
    big = integer_inputs(cfg, [op.low_latency_tokens + 1] * world_size, "uniform", 10, device=op.device)
    with pytest.raises(ValueError, match="the split needs the low-latency family"):
        op.dispatch(*op_inputs(op, big), async_recv=True)
    run_exact_round(op, cfg, big)  # the normal family, after the refusals launched nothing
    op.synchronize()
    op.close()


@pytest.mark.gpu
@pytest.mark.parametrize("world_size", [1, 2, 8])
def test_graph_of_split_halves_replayed_with_fresh_inputs(world_size):
    cfg, op = _op(world_size, tmax=64, validate=False)
    T = 64
    static = integer_inputs(cfg, [T] * world_size, "uniform", 1, device=op.device)
    local = op.local_ranks
    a, busy = _matmul_beside(512)
    outs = {}

    def step():
        h = op.dispatch(*op_inputs(op, static), async_recv=True)
        busy()
        recv = h.wait()
        outs["recv"] = recv if op.virtual else [recv]
        ys = [integer_expert_stage(op, r) for r in local]
        h = op.combine(op_arg(op, ys), async_recv=True)
        busy()
        out = h.wait()
        outs["combined"] = out if op.virtual else [out]

    step()  # eager, then captured
    op.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    for i in range(12):
        fresh = integer_inputs(cfg, [T] * world_size, ROUTINGS[i % len(ROUTINGS)], 100 + i, device=op.device)
        for r in local:
            for f in ("x", "weights", "indices"):
                getattr(static[r], f).copy_(getattr(fresh[r], f))
        g.replay()
        exp = expect(cfg, fresh)
        for r, o, c in zip(local, outs["recv"], outs["combined"]):
            check_exact_dispatch(r, o, exp)
            check_exact_combine(r, c, exp)
    op.synchronize()
    op.close()


@pytest.mark.gpu
@pytest.mark.parametrize("half", ["dispatch", "combine"])
def test_a_wait_that_cannot_complete_raises_a_timeout_within_the_bound(half):
    """A receiving half whose call count runs ahead of its peers' waits for flags no sender raises:
    it must end in EpError naming the phase, within the bound, and refuse the op afterwards."""
    from epgen.op import EpError

    timeout_s = 0.5
    cfg, op = _op(2, timeout_s=timeout_s, validate=False)
    run_exact_round(op, cfg, integer_inputs(cfg, [8, 8], "uniform", 1, device=op.device))
    op.synchronize()
    kernel = 1 if half == "dispatch" else 3  # ll_calls rows: dispatch send, dispatch recv, combine send, combine recv
    calls = op.arenas.local[0][op.arena_layout.ll_calls:op.arena_layout.ll_calls + 4 * 4 * abi.LL_FLAG_SLOTS].view(torch.int32)
    calls.view(4, abi.LL_FLAG_SLOTS)[kernel] += 2  # rank 0's receiving half now waits for a call 2 ahead
    inputs = integer_inputs(cfg, [8, 8], "uniform", 2, device=op.device)
    start = time.monotonic()
    with pytest.raises(EpError) as e:
        op.dispatch(*op_inputs(op, inputs))
        if half == "combine":
            op.combine(op_arg(op, [integer_expert_stage(op, r) for r in op.local_ranks]))
        op.synchronize()
    took = time.monotonic() - start
    phase = "low-latency dispatch" if half == "dispatch" else "low-latency combine"
    assert f"timed out after {timeout_s} s in the {phase}" in str(e.value) and not e.value.recoverable, str(e.value)
    assert took < 2 * timeout_s + 5.0, f"EpError after {took:.2f} s"
    with pytest.raises(EpError, match="unusable"):
        op.dispatch(*op_inputs(op, inputs))
    op.close()
