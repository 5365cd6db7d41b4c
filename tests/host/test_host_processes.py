"""The deployment mode on the host emulation: one process per rank (``epgen.harness.ranks.run_ranks``:
a RankPool, gloo), each with ``EpDispatchCombine(cfg, device="cpu", arch=...)``; the arenas are shared-memory
segments the peers map by name, the kernels' clock is the OS's.

The bodies are tests/gpu/test_processes.py's, test_op.py's and test_pull_dispatch.py's process
bodies with ``time.sleep`` where the GPU tests queue ``torch.cuda._sleep`` before a slow rank's
receiving half: rounds against the reference (zero-token ranks, -1 ids, push and pull), a dispatch
again before a peer received the last one, a combine a peer has not received, and recoverable
faults raised on every rank with the same text, followed by exact rounds. W = 2 on gfx942 (64
lanes) and W = 3 on sm_90 (32 lanes); every rank's op has the Schedule seed of its test plus its
rank (with processes the OS's timing also orders the ranks: a seed does not replay exactly).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch

from epgen.harness.verify import (check_exact_combine, check_exact_dispatch, expect, integer_expert_stage,
                                  integer_inputs, op_inputs, per_rank, poison, run_exact_round, run_round,
                                  zero_copy_inputs)

sys.path.insert(0, str(Path(__file__).parent))
from host_cases import (PROCS_TIMEOUT_S, cfg, host_module, host_op, in_host_process, seed_of, seeded,  # noqa: E402
                        warm)

CASES = [(2, "gfx942"), (3, "sm_90")]
RUN_TIMEOUT_S = 150.0
"""Bound of one run of a body on every rank (the kernels' own waits end at ``PROCS_TIMEOUT_S``)."""
SLOW_S = 0.05
"""A slow rank's pause between its halves (or before its call): its peers finish the call and start
the next one meanwhile."""


@pytest.fixture(scope="module", autouse=True)
def _host():
    with host_module():
        yield


def _run(world_size, arch, configs, body, *args):
    """Compile ``configs``' kernels here first (every rank then loads them from the cache instead of
    all compiling the same sources), then ``body(rank, W, arch, *args)`` on every rank
    (``run_ranks``: its pool of W processes stays up for the next test)."""
    from epgen.harness.ranks import run_ranks

    warm([(c, arch, 1) for c in configs])
    run_ranks(world_size, in_host_process, body, arch, *args, timeout_s=RUN_TIMEOUT_S)


def _op(config, arch, seed, validate=True):
    rank = torch.distributed.get_rank()
    return host_op(config, arch, seed + 1000 * rank, virtual=False, validate=validate)


def _close(op):
    torch.distributed.barrier()  # every peer is done with this rank's arena
    op.close()


def _same_on_every_rank(value: str) -> list:
    every = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, value)
    assert all(v == every[0] for v in every), f"the ranks differ: {every}"
    return every


# ---- rounds against the reference, push and pull --------------------------------------------------

def _rounds_config(world_size, transport):
    kw = {"dispatch_transport": "pull"} if transport == "pull" else {}
    return cfg(world_size, "normal", timeout_s=PROCS_TIMEOUT_S, **kw)


def _rounds_body(rank, world_size, arch, seed):
    """test_op.py's and test_pull_dispatch.py's process bodies: zero-token ranks, -1 ids, duplicates,
    skewed routing; the pull with x in dispatch_input and elsewhere; exact rounds after a pull."""
    import epgen.harness.verify as verify

    for transport in ("push", "pull"):
        config = _rounds_config(world_size, transport)
        op = _op(config, arch, seed)
        with seeded(op, f"rank {rank}, {transport}"):
            for i, (pattern, kind) in enumerate([([32], "uniform"), ([0, 19], "invalid"), ([32, 1], "duplicates"),
                                                 ([0], "uniform"), ([7], "skewed")]):
                zero_copy = transport == "pull" and i % 2 == 0
                original = verify.op_inputs
                if zero_copy:
                    verify.op_inputs = lambda op_, inputs: original(op_, zero_copy_inputs(op_, inputs))
                try:
                    stats = run_round(op, config, per_rank(pattern, world_size), kind, seed + i)
                finally:
                    verify.op_inputs = original
                assert stats["wire_mismatches"] == 0, stats
                if transport == "pull":
                    assert any("dispatch_pull" in n for n, _, _ in op.platform.stats[-3:])
            if transport == "pull":
                inputs = integer_inputs(config, [32 - 5 * r for r in range(world_size)], "uniform", seed + 50)
                run_exact_round(op, config, zero_copy_inputs(op, inputs))
                run_exact_round(op, config, inputs)
        _close(op)


@pytest.mark.slow
@pytest.mark.parametrize("world_size,arch", CASES)
def test_rounds_push_and_pull(world_size, arch, request):
    _run(world_size, arch, [_rounds_config(world_size, t) for t in ("push", "pull")], _rounds_body,
         seed_of(request.node.name))


# ---- a dispatch again before a peer received the last one; a combine a peer has not received ------

def _proc_config(world_size, family, **kw):
    return cfg(world_size, family, timeout_s=PROCS_TIMEOUT_S, **kw)


def _dispatch_again_body(rank, world_size, arch, family, seed):
    """tests/gpu/test_processes.py's ``_dispatch_again_body``: 2 and 3 dispatches before a combine,
    a different token count a rank each time; the last rank sleeps before its receiving half
    (low-latency: the split) or before its call (normal), so its peers dispatch again first."""
    config = _proc_config(world_size, family)
    op = _op(config, arch, seed, validate=False)
    slow = world_size - 1
    with seeded(op, f"rank {rank}"):
        for round_, repeats in enumerate((2, 3)):
            calls = []
            for k in range(repeats):
                tokens = [(7 + 13 * (k + r + round_)) % (config.max_tokens_per_rank + 1) for r in range(world_size)]
                inputs = integer_inputs(config, tokens, "uniform", seed + 100 * round_ + k)
                exp = expect(config, inputs)
                poison(op, rank)
                if rank == slow and family == "low_latency":
                    handle = op.dispatch(*op_inputs(op, inputs), async_recv=True)
                    time.sleep(SLOW_S)
                    out = handle.wait()
                else:
                    if rank == slow:
                        time.sleep(SLOW_S)
                    out = op.dispatch(*op_inputs(op, inputs))
                try:
                    check_exact_dispatch(rank, out, exp)
                except AssertionError as e:
                    raise AssertionError(f"round {round_}, dispatch {k + 1} of {repeats} ({family}): {e}") from None
                calls.append(exp)
            ys = integer_expert_stage(op, rank)
            combined = op.combine(ys, out=torch.full((calls[-1].tokens[rank], config.hidden), float("nan"),
                                                     dtype=torch.bfloat16))
            check_exact_combine(rank, combined, calls[-1])
        op.synchronize()
    _close(op)


@pytest.mark.parametrize("family", ["low_latency", "normal"])
@pytest.mark.parametrize("world_size,arch", CASES)
def test_dispatch_again_while_a_peer_has_not_received_the_last_one(world_size, arch, family, request):
    _run(world_size, arch, [_proc_config(world_size, family)], _dispatch_again_body, family,
         seed_of(request.node.name))


def _combine_delayed_body(rank, world_size, arch, seed):
    """tests/gpu/test_processes.py's ``_combine_delayed_body``: the last rank's combine split, with a
    pause before its receiving half."""
    config = _proc_config(world_size, "low_latency")
    op = _op(config, arch, seed, validate=False)
    slow = world_size - 1
    with seeded(op, f"rank {rank}"):
        for s in range(3):
            tokens = [(11 + 17 * (s + r)) % (config.max_tokens_per_rank + 1) for r in range(world_size)]
            inputs = integer_inputs(config, tokens, "uniform", seed + s)
            exp = expect(config, inputs)
            poison(op, rank)
            check_exact_dispatch(rank, op.dispatch(*op_inputs(op, inputs)), exp)
            ys = integer_expert_stage(op, rank)
            nan = torch.full((tokens[rank], config.hidden), float("nan"), dtype=torch.bfloat16)
            if rank == slow:
                handle = op.combine(ys, out=nan, async_recv=True)
                time.sleep(SLOW_S)
                combined = handle.wait()
            else:
                combined = op.combine(ys, out=nan)
            check_exact_combine(rank, combined, exp)
        op.synchronize()
    _close(op)


@pytest.mark.parametrize("world_size,arch", CASES)
def test_combine_while_a_peer_has_not_received_the_last_one(world_size, arch, request):
    _run(world_size, arch, [_proc_config(world_size, "low_latency")], _combine_delayed_body,
         seed_of(request.node.name))


# ---- a recoverable fault on one rank, raised on every rank, then exact rounds ---------------------

FAULTS = [("bad_id", "normal"), ("bad_id", "low_latency"), ("overflow", "normal"), ("short_y", "normal"),
          ("short_y", "low_latency")]
"""(fault, family): the low-latency family cannot overflow (its receive rows hold W x T_ll)."""


def _fault_config(world_size, family, fault):
    if fault == "overflow":  # all tokens to rank 0: it needs W x 32 rows and holds 24
        return _proc_config(world_size, family, max_recv_tokens=24)
    return _proc_config(world_size, family)


def _fault_body(rank, world_size, arch, family, fault, seed):
    """tests/gpu/test_processes.py's ``_fault_body``: the last rank's bad id, rank 0's overflow or the
    last rank's short y raises the same recoverable EpError on every rank (validate=True: by the
    faulted call), twice, each followed by exact rounds on the same op."""
    from epgen.op import EpError

    config = _fault_config(world_size, family, fault)
    op = _op(config, arch, seed)
    culprit = world_size - 1
    T = config.max_tokens_per_rank
    kind = "one_rank" if fault == "overflow" else "uniform"

    def good(s):
        return integer_inputs(config, [6] * world_size, "uniform", s)  # W x 6 rows fit the capped config

    with seeded(op, f"rank {rank}, {fault}, {family}"):
        run_exact_round(op, config, good(seed + 1))
        for attempt in range(2):
            inputs = integer_inputs(config, [T] * world_size, kind, seed + 10 + attempt)
            if fault == "bad_id":
                inputs[culprit].indices[5, 2] = config.num_experts
            with pytest.raises(EpError) as e:
                out = op.dispatch(*op_inputs(op, inputs))
                y = integer_expert_stage(op, rank)
                n = int(out.num_recv.item())
                op.combine(y[: max(n - 1, 0)] if rank == culprit and fault == "short_y" else y)
            text = str(e.value)
            assert e.value.recoverable, text
            want = {"bad_id": f"rank {culprit}: indices[5, 2]={config.num_experts}: expert ids must be -1 or in",
                    "overflow": f"needed {world_size * T} rows",
                    "short_y": f"rank {culprit}: combine: y has"}[fault]
            assert want in text, text
            _same_on_every_rank(text)
            for k in range(2):
                run_exact_round(op, config, good(seed + 20 + 10 * attempt + k))
    _close(op)


@pytest.mark.parametrize("fault,family", FAULTS, ids=[f"{f}-{g}" for f, g in FAULTS])
@pytest.mark.parametrize("world_size,arch", CASES)
def test_a_fault_on_one_rank_is_raised_on_every_rank_then_all_run_again(world_size, arch, fault, family,
                                                                         request):
    _run(world_size, arch, [_fault_config(world_size, family, fault)], _fault_body, family, fault,
         seed_of(request.node.name))


def _halves_fault_body(rank, world_size, arch, call, seed):
    """tests/gpu/test_processes.py's ``_halves_fault_body``: a bad id (dispatch) or a short y
    (combine) in the sending half of a split call on the last rank; a synchronize between the
    halves raises nothing; after wait() every rank's synchronize raises the same fault; then exact
    rounds."""
    from epgen.op import EpError

    config = _proc_config(world_size, "low_latency")
    op = _op(config, arch, seed, validate=False)
    culprit = world_size - 1

    def good(s):
        return integer_inputs(config, [8] * world_size, "uniform", s)

    with seeded(op, f"rank {rank}, {call}"):
        inputs = good(seed + 3)
        if call == "dispatch":
            inputs[culprit].indices[2, 1] = config.num_experts
            handle = op.dispatch(*op_inputs(op, inputs), async_recv=True)
        else:
            out = op.dispatch(*op_inputs(op, inputs))
            y = integer_expert_stage(op, rank)
            n = int(out.num_recv.item())
            handle = op.combine(y[: max(n - 1, 0)] if rank == culprit else y, async_recv=True)
        op.synchronize()  # between the halves: defers, on every rank alike
        torch.distributed.barrier()
        handle.wait()
        with pytest.raises(EpError) as e:
            op.synchronize()
        text = str(e.value)
        assert e.value.recoverable and f"rank {culprit}: " in text, text
        _same_on_every_rank(text)
        for k in range(2):
            run_exact_round(op, config, good(seed + 30 + k))
        op.synchronize()
    _close(op)


@pytest.mark.parametrize("call", ["dispatch", "combine"])
@pytest.mark.parametrize("world_size,arch", CASES)
def test_a_synchronize_between_the_halves_of_a_faulted_call_defers_on_every_rank(world_size, arch, call,
                                                                                  request):
    _run(world_size, arch, [_proc_config(world_size, "low_latency")], _halves_fault_body, call,
         seed_of(request.node.name))


def _apart_body(rank, world_size, arch, seed):
    """tests/gpu/test_processes.py's ``_apart_body``: short y on rank 1 in combines 1 and 3; rank 0
    synchronizes after every round, the others only after the third; every rank raises the first
    fault at its first synchronize after it, and all run again exactly."""
    from epgen.op import EpError

    config = _proc_config(world_size, "normal")
    op = _op(config, arch, seed, validate=False)
    raised = []
    with seeded(op, f"rank {rank}"):
        for i in range(3):
            out = op.dispatch(*op_inputs(op, integer_inputs(config, [8] * world_size, "uniform", seed + 40 + i)))
            y = integer_expert_stage(op, rank)
            n = int(out.num_recv.item())
            op.combine(y[: max(n - 1 - i, 0)] if rank == 1 and i in (0, 2) else y)
            if rank == 0 or i == 2:
                try:
                    op.synchronize()
                    raised.append(None)
                except EpError as e:
                    raised.append(str(e))
        every = [None] * world_size
        torch.distributed.all_gather_object(every, raised)
        assert [r is not None for r in every[0]] == [True, False, True], every[0]
        assert all(e == [every[0][0]] for e in every[1:]), every
        run_exact_round(op, config, integer_inputs(config, [8] * world_size, "uniform", seed + 50))
        op.synchronize()
    _close(op)


@pytest.mark.parametrize("world_size,arch", CASES)
def test_faults_two_calls_apart_with_ranks_synchronizing_after_different_calls(world_size, arch, request):
    _run(world_size, arch, [_proc_config(world_size, "normal")], _apart_body, seed_of(request.node.name))
