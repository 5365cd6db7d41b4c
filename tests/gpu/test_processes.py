"""The deployment mode, one process per rank, on one GPU: W processes sharing cuda:0 (``epgen.harness.ranks``).

Each test here guards a defect that only W processes can show (a grid holding every virtual rank
rules it out) and that was reproduced that way:

* a rank that dispatches again while a peer has not yet run the receiving half of the previous call
  (the send/receive split with GPU work between the halves, or a dispatch without a combine) must
  not overwrite the flags that peer still waits for: every row exact;
* a recoverable fault seen by one rank (bad expert id, receive overflow, short ``y``) is raised on
  every rank, by the same synchronizing call and with the same text, and every rank runs again;
* a kernel whose blocks wait for blocks of its own grid (the fused low-latency op) completes
  exactly while another kernel holds most of the GPU for longer than ``timeout_s``.

Rounds are exact (``epgen.harness.verify.run_exact_round``). Nothing can hang: every in-kernel wait is
bounded by ``EpConfig.timeout_s``, every run by ``run_ranks(timeout_s=...)`` and the conftest
watchdog.
"""

import pytest
import torch

from epgen.codegen.config import EpConfig, Geometry
from epgen.harness.verify import (check_exact_combine, check_exact_dispatch, expect, hog_gpu, integer_expert_stage,
                                  integer_inputs, op_inputs, poison, run_exact_round)

PROCESSES = (2, 3, 4)
"""World sizes run as processes (on one GPU: all share cuda:0)."""
GEO = Geometry(16, 16, 4)
TIMEOUT_S = 10.0
RUN_TIMEOUT_S = 240.0
SLEEP_CYCLES = 100_000_000
"""torch.cuda._sleep between a slow rank's halves: ~50 ms at 2 GHz, long enough for its peers to
finish the call and start the next one (each process's host needs well under that to launch)."""


def proc_config(world_size: int, family: str, **kw) -> EpConfig:
    """The small layer of these tests: H 2048, top-4 of 4 experts a rank, 64 tokens a rank."""
    return EpConfig(world_size=world_size, hidden=2048, topk=4, num_experts=4 * world_size, max_tokens_per_rank=64,
                    kernel_family=family, dispatch_geometry=GEO, combine_geometry=GEO, timeout_s=TIMEOUT_S, **kw)


def _run(world_size, body, *args):
    from epgen.harness.ranks import run_ranks

    run_ranks(world_size, body, *args, timeout_s=RUN_TIMEOUT_S)


def _op(cfg, validate=False):
    from epgen.op import EpDispatchCombine

    return EpDispatchCombine(cfg, validate=validate)


def _close(op):
    torch.distributed.barrier()  # every peer is done with this rank's arena
    op.close()


def _same_on_every_rank(value: str) -> list:
    """Every rank's ``value`` (all_gather_object); asserts they are equal."""
    every = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, value)
    assert all(v == every[0] for v in every), f"the ranks differ: {every}"
    return every


# ---- a second dispatch before a peer received the first --------------------------------------

def _dispatch_again_body(rank, world_size, family, repeats):
    cfg = proc_config(world_size, family)
    op = _op(cfg)
    slow = world_size - 1
    for round_ in range(3):
        calls = []
        for k in range(repeats):  # each call a different token count a rank: a stale count shows
            seed = 100 * round_ + k
            tokens = [(7 + 13 * (k + r + round_)) % (cfg.max_tokens_per_rank + 1) for r in range(world_size)]
            inputs = integer_inputs(cfg, tokens, "uniform", seed, device=op.device)
            exp = expect(cfg, inputs)
            poison(op, rank)
            if rank == slow and family == "low_latency":
                handle = op.dispatch(*op_inputs(op, inputs), async_recv=True)
                torch.cuda._sleep(SLEEP_CYCLES)  # the receiving half waits behind GPU work
                out = handle.wait()
            else:
                if rank == slow:
                    torch.cuda._sleep(SLEEP_CYCLES)
                out = op.dispatch(*op_inputs(op, inputs))
            try:
                check_exact_dispatch(rank, out, exp)
            except AssertionError as e:
                raise AssertionError(f"round {round_}, dispatch {k + 1} of {repeats} ({family}): {e}") from None
            calls.append(exp)
        ys = integer_expert_stage(op, rank)  # the last dispatch is the one combined
        combined = op.combine(ys, out=torch.full((calls[-1].tokens[rank], cfg.hidden), float("nan"),
                                                 dtype=torch.bfloat16, device=op.device))
        check_exact_combine(rank, combined, calls[-1])
    op.synchronize()
    _close(op)


@pytest.mark.processes
@pytest.mark.parametrize("repeats", [2, 3])
@pytest.mark.parametrize("family", ["low_latency", "normal"])
@pytest.mark.parametrize("world_size", PROCESSES)
def test_dispatch_again_while_a_peer_has_not_received_the_last_one(world_size, family, repeats):
    _run(world_size, _dispatch_again_body, family, repeats)


def _combine_delayed_body(rank, world_size):
    cfg = proc_config(world_size, "low_latency")
    op = _op(cfg)
    slow = world_size - 1
    for seed in range(4):
        tokens = [(11 + 17 * (seed + r)) % (cfg.max_tokens_per_rank + 1) for r in range(world_size)]
        inputs = integer_inputs(cfg, tokens, "uniform", seed, device=op.device)
        exp = expect(cfg, inputs)
        poison(op, rank)
        check_exact_dispatch(rank, op.dispatch(*op_inputs(op, inputs)), exp)
        ys = integer_expert_stage(op, rank)
        nan = torch.full((tokens[rank], cfg.hidden), float("nan"), dtype=torch.bfloat16, device=op.device)
        if rank == slow:
            handle = op.combine(ys, out=nan, async_recv=True)
            torch.cuda._sleep(SLEEP_CYCLES)
            combined = handle.wait()
        else:
            combined = op.combine(ys, out=nan)
        check_exact_combine(rank, combined, exp)
    op.synchronize()
    _close(op)


@pytest.mark.processes
@pytest.mark.parametrize("world_size", PROCESSES)
def test_combine_while_a_peer_has_not_received_the_last_one(world_size):
    _run(world_size, _combine_delayed_body)


# ---- a recoverable fault on one rank, raised on every rank -----------------------------------

FAULTS = ("bad_id", "overflow", "short_y")


def _fault_config(world_size, family, fault):
    if fault == "overflow":  # all tokens to rank 0: it needs W x 64 rows and holds 48
        return proc_config(world_size, family, max_recv_tokens=48)
    return proc_config(world_size, family)


def _fault_body(rank, world_size, family, fault):
    from epgen.op import EpError

    cfg = _fault_config(world_size, family, fault)
    op = _op(cfg, validate=True)
    culprit = world_size - 1
    T = cfg.max_tokens_per_rank
    kind = "one_rank" if fault == "overflow" else "uniform"
    # rounds that fit every capacity (the overflow config's too: W x 8 rows at most)
    good = lambda seed: integer_inputs(cfg, [8] * world_size, "uniform", seed, device=op.device)  # noqa: E731
    run_exact_round(op, cfg, good(1))
    for attempt in range(2):
        inputs = integer_inputs(cfg, [T] * world_size, kind, 10 + attempt, device=op.device)
        if fault == "bad_id":
            inputs[culprit].indices[5, 2] = cfg.num_experts
        with pytest.raises(EpError) as e:
            out = op.dispatch(*op_inputs(op, inputs))  # validate=True: the faulted call raises itself
            y = integer_expert_stage(op, rank)
            n = int(out.num_recv.item())
            op.combine(y[: max(n - 1, 0)] if rank == culprit and fault == "short_y" else y)
        text = str(e.value)
        assert e.value.recoverable, text
        want = {"bad_id": f"rank {culprit}: indices[5, 2]={cfg.num_experts}: expert ids must be -1 or in",
                "overflow": f"needed {world_size * T} rows",
                "short_y": f"rank {culprit}: combine: y has"}[fault]
        assert want in text, text
        _same_on_every_rank(text)
        for k in range(2):  # the documented recovery: dispatch again, exact
            run_exact_round(op, cfg, good(20 + 10 * attempt + k))
    _close(op)


@pytest.mark.processes
@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("family", ["normal", "low_latency"])
@pytest.mark.parametrize("world_size", PROCESSES)
def test_a_fault_on_one_rank_is_raised_on_every_rank_then_all_run_again(world_size, family, fault):
    if fault == "overflow" and family == "low_latency":
        pytest.skip("the low-latency family cannot overflow: its receive rows hold W x low_latency_tokens")
    _run(world_size, _fault_body, family, fault)


def _halves_fault_body(rank, world_size, call):
    """A bad id (dispatch) or a short y (combine) in the sending half of a split low-latency call
    on the last rank; every rank synchronizes between the halves: none raises (the fault reaches
    the error records with the receiving halves); after wait() every rank's synchronize raises
    the same fault, and every rank runs again."""
    from epgen.op import EpError

    cfg = proc_config(world_size, "low_latency")
    op = _op(cfg)
    culprit = world_size - 1
    good = lambda seed: integer_inputs(cfg, [8] * world_size, "uniform", seed, device=op.device)  # noqa: E731
    inputs = good(3)
    if call == "dispatch":
        inputs[culprit].indices[2, 1] = cfg.num_experts
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
        run_exact_round(op, cfg, good(30 + k))
    op.synchronize()
    _close(op)


@pytest.mark.processes
@pytest.mark.parametrize("call", ["dispatch", "combine"])
@pytest.mark.parametrize("world_size", PROCESSES)
def test_a_synchronize_between_the_halves_of_a_faulted_call_defers_on_every_rank(world_size, call):
    _run(world_size, _halves_fault_body, call)


def _apart_body(rank, world_size):
    """Short y on rank 1 in combines 1 and 3 of three rounds; rank 0 synchronizes after every
    round, the others only after the third: every rank raises at its first synchronize after a
    faulted call (rank 0 twice, the others once, the first fault), and all run again exactly."""
    from epgen.op import EpError

    cfg = proc_config(world_size, "normal")
    op = _op(cfg)
    raised = []
    for i in range(3):
        out = op.dispatch(*op_inputs(op, integer_inputs(cfg, [8] * world_size, "uniform", 40 + i, device=op.device)))
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
    run_exact_round(op, cfg, integer_inputs(cfg, [8] * world_size, "uniform", 50, device=op.device))
    op.synchronize()
    _close(op)


@pytest.mark.processes
@pytest.mark.parametrize("world_size", PROCESSES)
def test_faults_two_calls_apart_with_ranks_synchronizing_after_different_calls(world_size):
    _run(world_size, _apart_body)


# ---- a kernel waiting for blocks of its own grid, beside a kernel holding the GPU -------------

def _busy_gpu_body(rank, world_size):
    """Each rank's process holds most of the GPU with a kernel on another stream for 3 x timeout_s
    while its rounds run (processes sharing a GPU are time-sliced, so a kernel holds SMs only for
    the kernels of its own process: every rank holds its own, and the ranks' holds end together)."""
    from epgen.op import EpDispatchCombine

    timeout_s = 1.0
    cfg = EpConfig(world_size=world_size, hidden=2048, topk=4, num_experts=4 * world_size, max_tokens_per_rank=64,
                   kernel_family="low_latency", low_latency_geometry=Geometry(64, 16, 2), timeout_s=timeout_s)
    op = EpDispatchCombine(cfg)
    run_exact_round(op, cfg, integer_inputs(cfg, [64] * world_size, "uniform", 1, device=op.device))
    op.synchronize()
    if world_size > 1:
        torch.distributed.barrier()
    side = torch.cuda.Stream(op.device)
    for seed in range(2):
        hog_gpu(op.device, 3 * timeout_s, side)
        run_exact_round(op, cfg, integer_inputs(cfg, [64] * world_size, "uniform", 2 + seed, device=op.device))
        op.synchronize()
        side.synchronize()
    if world_size > 1:
        _close(op)
    else:
        op.close()


@pytest.mark.gpu
def test_a_kernel_holding_the_gpu_past_timeout_s_delays_the_fused_op_but_never_breaks_it():
    _busy_gpu_body(0, 1)


@pytest.mark.processes
@pytest.mark.parametrize("world_size", PROCESSES)
def test_a_kernel_holding_the_gpu_beside_each_process_delays_the_fused_ops_but_breaks_none(world_size):
    _run(world_size, _busy_gpu_body)
