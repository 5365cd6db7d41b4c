"""GPU reliability tests: each kind of bug, fixed as a kind, has a test here.

Modes: ``virtual8`` = W = 8 virtual ranks on one GPU (marker gpu) and ``procsW`` = W = 2, 3 and 4
processes (marker processes: one GPU each, or all sharing cuda:0), unless a case names its own W. Rounds are checked bit for bit
on the device (``epgen.harness.verify.run_exact_round``: integer tokens whose combine sums are exact), so
even a thousand rounds cost little.

Nothing here can hang: every in-kernel wait is bounded by ``EpConfig.timeout_s``, every
two-process run by ``run_ranks(timeout_s=...)`` (which kills the ranks and raises), and every test
by the conftest watchdog. Geometry is explicit (``GEO``) so each layer compiles one variant per op.
"""

import ctypes
import os
import random
import sys
import time
import traceback
import types

import attrs
import numpy as np
import pytest
import torch

from epgen.codegen import planner
from epgen.codegen import abi
from epgen.codegen.spec import Op
from epgen.op import EpDispatchCombine, EpError, _args_dtype
from epgen.plan import Plan
from epgen.harness.verify import (PROCESS_WORLD_SIZES, ROUTINGS, check_exact_combine, check_exact_dispatch, expect,
                                  integer_expert_stage, integer_inputs, op_arg, op_inputs, per_rank, poison, run_exact_round,
                                  run_round)
from epgen.codegen.config import EpConfig, Geometry

GEO = Geometry(16, 16, 4)
TIMEOUT_S = 5.0
"""Kernel spin-wait bound where the bound itself is not under test."""
PROCS_TIMEOUT_S = 180.0
"""Bound of one two-process run: start, compile, run."""

MODES = [pytest.param(8, True, marks=pytest.mark.gpu, id="virtual8")] + [
    pytest.param(w, False, marks=pytest.mark.processes, id=f"procs{w}") for w in PROCESS_WORLD_SIZES]


def edge_config(world_size: int, max_tokens: int = 64, timeout_s: float = TIMEOUT_S) -> EpConfig:
    """The small layer of the edge cases: H 2048, top-4, E = 16 on W >= 4, 12 on W = 3 and 8 on
    W = 2, so that experts 3 and 5 live on different ranks (W = 8: ranks 1 and 2; W = 2, 3 and 4:
    ranks 0 and 1)."""
    return EpConfig(world_size=world_size, hidden=2048, topk=4,
                    num_experts=16 if world_size >= 4 else 4 * world_size,
                    max_tokens_per_rank=max_tokens, dispatch_geometry=GEO, combine_geometry=GEO, timeout_s=timeout_s)


def _op(cfg: EpConfig, virtual: bool, validate: bool = True):
    from epgen.op import EpDispatchCombine

    return EpDispatchCombine(cfg, virtual=virtual, validate=validate)


def _close(op):
    """Close after every rank is done with every peer's arena (a peer's combine may still read ours)."""
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    op.close()


def _run(world_size: int, virtual: bool, body, *args, timeout_s: float = PROCS_TIMEOUT_S):
    """``body(rank, world_size, virtual, *args)``: here with virtual ranks, else in W processes."""
    if virtual:
        body(0, world_size, virtual, *args)
    else:
        from epgen.harness.ranks import run_ranks

        run_ranks(world_size, body, virtual, *args, timeout_s=timeout_s)


def _silence(inputs, ranks):
    """``inputs`` with every row of ``ranks`` set to -1 (those tokens reach no rank)."""
    return [attrs.evolve(i, indices=torch.full_like(i.indices, -1)) if r in ranks else i for r, i in enumerate(inputs)]


# ---- token counts ------------------------------------------------------------------------------

@pytest.mark.gpu
def test_tokens_on_one_rank_on_all_but_one_and_on_none_virtual4():
    cfg = edge_config(4)
    op = _op(cfg, True)
    try:
        seed = 0
        for tokens in ([5, 0, 0, 0], [0, 5, 5, 5], [0, 0, 0, 0]):
            for kind in ROUTINGS:
                seed += 1
                stats = run_exact_round(op, cfg, integer_inputs(cfg, tokens, kind, seed, device=op.device))
                if sum(tokens) == 0:
                    assert stats["recv"] == [0, 0, 0, 0]
            run_round(op, cfg, tokens, "uniform", seed)  # and against the CPU reference
    finally:
        op.close()


# ---- -1 rows and duplicate ids -----------------------------------------------------------------

def _minus_one_body(rank, world_size, virtual):
    cfg = edge_config(world_size)
    op = _op(cfg, virtual)
    silent = {1, 3} if world_size == 8 else {1}
    for seed, (kind, quiet) in enumerate([("uniform", silent), ("duplicates", silent), ("invalid", silent),
                                          ("uniform", set(range(world_size)))]):
        tokens = [cfg.max_tokens_per_rank - 3 * r for r in range(world_size)]
        inputs = _silence(integer_inputs(cfg, tokens, kind, seed, device=op.device), quiet)
        stats = run_exact_round(op, cfg, inputs)
        for r, out in zip(op.local_ranks, stats["combined"]):
            if r in quiet:
                assert bool((out.view(torch.int16) == 0).all()), f"rank {r}: every row -1, but the combine output " \
                                                                  "is not all +0.0 bits"
        if quiet == set(range(world_size)):
            assert stats["recv"] == [0] * len(op.local_ranks)
    _close(op)


@pytest.mark.parametrize("world_size,virtual", MODES)
def test_ranks_whose_rows_are_all_minus_one_get_bitwise_zeros(world_size, virtual):
    _run(world_size, virtual, _minus_one_body)


def _dedup_body(rank, world_size, virtual):
    cfg = edge_config(world_size)
    op = _op(cfg, virtual)
    L = cfg.experts_per_rank
    targets = {3 // L, 5 // L}
    assert len(targets) == 2
    tokens = [3, 0, 2, 1, 0, 4, 1, 2] if world_size == 8 else per_rank([3, 2, 0, 4], world_size)
    inputs = integer_inputs(cfg, tokens, "uniform", 7, device=op.device)
    for i in inputs:
        i.indices.copy_(torch.tensor([3, 3, 5, -1], dtype=torch.int32, device=op.device).expand_as(i.indices))
    run_exact_round(op, cfg, inputs)
    everyone = sorted((r, t) for r in range(world_size) for t in range(tokens[r]))
    for r in op.local_ranks:
        buf = op.recv_buffers(r)
        n = int(buf.num_recv.item())
        got = sorted(map(tuple, buf.recv_src[:n].tolist()))
        want = everyone if r in targets else []
        assert n == len(want) and got == want, f"rank {r}: num_recv={n}, recv_src {got[:8]}; expected {len(want)} " \
                                               f"rows {want[:8]} (row [3, 3, 5, -1], experts 3 and 5 on ranks {sorted(targets)})"
    _close(op)


@pytest.mark.parametrize("world_size,virtual", MODES)
def test_duplicate_ids_in_a_row_reach_each_rank_once(world_size, virtual):
    _run(world_size, virtual, _dedup_body)


# ---- max_tokens_per_rank -----------------------------------------------------------------------

MAX_TOKENS = (1, 32, 63, 64, 256)


def _max_tokens_body(rank, world_size, virtual):
    for Tmax in MAX_TOKENS:
        cfg = edge_config(world_size, max_tokens=Tmax)
        op = _op(cfg, virtual)
        run_exact_round(op, cfg, integer_inputs(cfg, [Tmax] * world_size, "uniform", Tmax, device=op.device))
        # One token too many (the last rank with virtual ranks; every process with real ones, whose
        # peers would otherwise wait in the kernel): ValueError before any copy or launch.
        over = [Tmax] * (world_size - 1) + [Tmax + 1] if virtual else [Tmax + 1] * world_size
        bad = integer_inputs(cfg, over, "uniform", Tmax + 1, device=op.device)
        for r in op.local_ranks:
            poison(op, r)
            op.recv_buffers(r).num_recv.fill_(-7)  # a dispatch that ran would overwrite it
        with pytest.raises(ValueError, match=rf"x(\[rank {world_size - 1}\])?\.shape\[0\]={Tmax + 1}: more tokens "
                                             rf"than max_tokens_per_rank={Tmax}"):
            op.dispatch(*op_inputs(op, bad))
        torch.cuda.synchronize()
        for r in op.local_ranks:
            buf = op.recv_buffers(r)
            assert int(buf.num_recv.item()) == -7, f"Tmax={Tmax} rank {r}: a kernel ran for the rejected call"
            assert bool(buf.recv_x.isnan().all()), f"Tmax={Tmax} rank {r}: receive rows written for the rejected call"
        for kind in ("one_rank", "duplicates"):  # the op still works
            # every rank on one side of T_ll (128): with one process a rank each must take one family
            run_exact_round(op, cfg, integer_inputs(cfg, [Tmax] + [Tmax - 1] * (world_size - 1), kind, Tmax + 2,
                                                    device=op.device))
        _close(op)


@pytest.mark.parametrize("world_size,virtual", MODES)
def test_max_tokens_boundary(world_size, virtual):
    _run(world_size, virtual, _max_tokens_body)


# ---- top-k 6 and 9 -----------------------------------------------------------------------------

def topk_config(hidden: int, topk: int) -> EpConfig:
    """W = 8 virtual; hidden 7168 with 256 experts (deepseek-like), 2880 with 128 (gpt-oss-like).
    The 2880 layers equal tests/gpu/test_shapes.py's (same fields), so their kernels compile once a run."""
    return EpConfig(world_size=8, hidden=hidden, topk=topk, num_experts=256 if hidden == 7168 else 128,
                    max_tokens_per_rank=64, dispatch_geometry=GEO, combine_geometry=GEO, timeout_s=TIMEOUT_S)


@pytest.mark.gpu
@pytest.mark.parametrize("hidden", [7168, 2880])
@pytest.mark.parametrize("topk", [6, 9])
def test_topk_6_and_9_virtual8(hidden, topk):
    cfg = topk_config(hidden, topk)
    op = _op(cfg, True)
    try:
        for seed, (tokens, kind) in enumerate([([64] * 8, "uniform"), ([0, 1, 37, 64, 64, 37, 1, 0], "invalid"),
                                               ([64, 0, 5, 64, 0, 64, 3, 9], "duplicates"), ([33] * 8, "skewed")]):
            run_exact_round(op, cfg, integer_inputs(cfg, tokens, kind, seed, device=op.device))
    finally:
        op.close()


# ---- more than 65536 received rows -------------------------------------------------------------

@pytest.mark.gpu
def test_more_than_65536_rows_received_by_one_rank_virtual8():
    from epgen.codegen.spec import Op

    T = 8200  # 8 ranks x 8200 tokens, top-8, all to rank 0: 65600 rows there
    cfg = EpConfig(world_size=8, hidden=7168, topk=8, num_experts=256, max_tokens_per_rank=T,
                   dispatch_geometry=GEO, combine_geometry=GEO, timeout_s=TIMEOUT_S)
    arenas = 8 * planner.explicit_spec(cfg, "sm_90", Op.DISPATCH, GEO).arena_layout.total_bytes
    assert arenas < 20 * 2**30, f"arenas {arenas / 2**30:.1f} GiB"  # ~14.0 GiB; inputs and checks add ~5 GiB
    op = _op(cfg, True)
    try:
        stats = run_exact_round(op, cfg, integer_inputs(cfg, [T] * 8, "one_rank", 1, device=op.device))
        assert stats["recv"] == [8 * T] + [0] * 7 and 8 * T > 65536
        stats = run_exact_round(op, cfg, integer_inputs(cfg, [T] * 8, "skewed", 2, device=op.device))
        assert stats["recv"][0] > 8 * T // 2
    finally:
        op.close()


# ---- back-to-back pairs with host jitter -------------------------------------------------------

def _jitter_body(rank, world_size, virtual, pairs):
    cfg = edge_config(world_size)
    op = _op(cfg, virtual)
    plan = random.Random(1234)  # the same token counts and routing in both processes
    jitter = random.Random(99)

    def pause():
        if rank == 1:
            time.sleep(jitter.uniform(0.0, 0.005))

    start = time.monotonic()
    for i in range(pairs):
        tokens = [plan.randint(0, cfg.max_tokens_per_rank) for _ in range(world_size)]
        kind = ROUTINGS[i % len(ROUTINGS)]
        try:
            run_exact_round(op, cfg, integer_inputs(cfg, tokens, kind, 10_000 + i, device=op.device), pause=pause)
        except AssertionError as e:
            raise AssertionError(f"pair {i} (tokens {tokens}, {kind}): {e}") from None
    if rank == 0:
        print(f"{pairs} verified pairs in {time.monotonic() - start:.1f} s")
    _close(op)


@pytest.mark.processes
@pytest.mark.parametrize("world_size", PROCESS_WORLD_SIZES)
def test_1000_pairs_back_to_back_with_host_jitter_on_one_rank(world_size):
    _run(world_size, False, _jitter_body, 1000 if world_size == 2 else 300, timeout_s=240.0)


# ---- CUDA graphs -------------------------------------------------------------------------------

def _graph_body(rank, world_size, virtual, replays):
    # README: construct outside a capture; after one eager call, dispatch and combine can be
    # captured and replayed with new input contents. That order is what this test follows.
    cfg = edge_config(world_size)
    op = _op(cfg, virtual, validate=False)  # validate synchronizes: not allowed inside a capture
    T, local = cfg.max_tokens_per_rank, op.local_ranks
    static = integer_inputs(cfg, [T] * world_size, "uniform", 500, device=op.device)
    args = op_inputs(op, static)
    ys = op_arg(op, [op.combine_input(r) for r in local])
    outs = [torch.empty(T, cfg.hidden, dtype=torch.bfloat16, device=op.device) for _ in local]

    def step():
        op.dispatch(*args)
        for r in local:
            integer_expert_stage(op, r)
        op.combine(ys, out=op_arg(op, outs))

    def replay_and_check(inputs, fn, what):
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

    replay_and_check(static, step, "eager call")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, capture_error_mode="thread_local"):  # NCCL's and gloo's threads keep running
        step()
    choose = random.Random(77)  # the same choices in every process
    for i in range(replays):
        fresh = integer_inputs(cfg, [T] * world_size, ROUTINGS[i % len(ROUTINGS)], 600 + i, device=op.device)
        fresh = _silence(fresh, set(choose.sample(range(world_size), choose.randint(0, world_size - 1))))
        for r in local:
            for f in ("x", "weights", "indices"):
                getattr(static[r], f).copy_(getattr(fresh[r], f))
        replay_and_check(fresh, g.replay, f"replay {i}")
    _close(op)


@pytest.mark.parametrize("world_size,virtual", MODES)
def test_graph_of_dispatch_and_combine_replayed_with_fresh_routing(world_size, virtual):
    _run(world_size, virtual, _graph_body, 100)


# ---- bad expert ids ----------------------------------------------------------------------------

def _bad_id_body(rank, world_size, virtual):
    from epgen.op import EpError

    cfg = edge_config(world_size)
    victim = world_size - 1
    op = _op(cfg, virtual)
    run_exact_round(op, cfg, integer_inputs(cfg, [16] * world_size, "uniform", 1, device=op.device))
    for seed, eid in ((10, cfg.num_experts), (20, -2)):
        inputs = integer_inputs(cfg, [16] * world_size, "uniform", seed, device=op.device)
        inputs[victim].indices[5, 2] = eid
        with pytest.raises(EpError) as e:  # on every rank: the victim's kernel hands the fault to its peers
            op.dispatch(*op_inputs(op, inputs))  # validate=True: raised by this very call
        want = f"rank {victim}: indices[5, 2]={eid}: expert ids must be -1 or in [0, {cfg.num_experts})"
        assert want in str(e.value) and e.value.recoverable, str(e.value)
        assert "cleared: the op runs again from the next dispatch" in str(e.value)  # validate synchronized
        with pytest.raises(RuntimeError, match="needs a dispatch first"):  # the faulted dispatch is not combined
            op.combine(op_arg(op, [op.combine_input(r) for r in op.local_ranks]))
        for k in (2, 3):  # the same op runs again: a bad id leaves every signal in step
            run_exact_round(op, cfg, integer_inputs(cfg, [16] * world_size, "uniform", seed + k, device=op.device))
    _close(op)


@pytest.mark.parametrize("world_size,virtual", MODES)
def test_expert_id_E_or_minus_2_raises_naming_it_then_the_op_runs_again(world_size, virtual):
    _run(world_size, virtual, _bad_id_body)


# ---- a peer that dies --------------------------------------------------------------------------

DEATH_TIMEOUT_S = 2.0
DEATH_MARGIN_S = 3.0


def _peer_death_body(rank, world_size, virtual, timeout_s):
    from epgen.op import EpError

    cfg = edge_config(world_size, timeout_s=timeout_s)
    op = _op(cfg, virtual)
    for seed in range(3):
        run_exact_round(op, cfg, integer_inputs(cfg, [64] * world_size, "uniform", seed, device=op.device))
    torch.distributed.barrier()  # both ranks are done with each other's arenas: the death falls between calls
    if rank == 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # no cleanup, as if killed (status 0 only so that run_ranks lets rank 0 go on)
    try:
        inputs = integer_inputs(cfg, [64] * world_size, "uniform", 9, device=op.device)
        start = time.monotonic()
        with pytest.raises(EpError) as e:
            op.dispatch(*op_inputs(op, inputs))
        took = time.monotonic() - start
        msg = str(e.value)
        assert "timed out after" in msg and "on rank 1" in msg, msg
        # A dispatch holds two waits on the peer in sequence (its receive buffers free, its rows
        # complete), each bounded by timeout_s.
        assert 0.9 * timeout_s <= took <= 2 * timeout_s + DEATH_MARGIN_S, f"EpError after {took:.2f} s ({msg})"
        start = time.monotonic()
        for call in (lambda: op.dispatch(*op_inputs(op, inputs)), lambda: op.combine(op.combine_input()), op.check):
            with pytest.raises(EpError, match="timed out.*build a new EpDispatchCombine"):
                call()
        assert time.monotonic() - start < 1.0, "refusing a call must not wait on the dead peer"
        print(f"rank 0: EpError {took:.2f} s after its peer died: {msg}")
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    # Skip the process-group teardown: its other member is gone.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@pytest.mark.processes
def test_a_dead_peer_makes_the_survivor_raise_a_timeout_within_the_bound():
    _run(2, False, _peer_death_body, DEATH_TIMEOUT_S, timeout_s=120.0)


# ---- streams -----------------------------------------------------------------------------------

SLEEP_CYCLES = 1_000_000_000
"""torch.cuda._sleep before the op on its stream: ~0.5 s at 2 GHz, far longer than the host
takes to enqueue dispatch and combine, so a consumer that did not wait would run first."""


def _streams_body(rank, world_size, virtual):
    cfg = edge_config(world_size)
    op = _op(cfg, virtual, validate=False)
    dev, local = op.device, op.local_ranks
    producer, consumer = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    # round 0 only warms up: CUDA loads kernel modules lazily on first use, and a load can wait for
    # the device, which would make the host wait for the sleep below
    for seed, given_out in ((0, False), (1, False), (2, True)):
        tokens = [cfg.max_tokens_per_rank - 5 * r for r in range(world_size)]
        inputs = integer_inputs(cfg, tokens, "uniform", seed, device=dev)
        exp = expect(cfg, inputs)
        producer.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(producer):
            for r in local:
                poison(op, r)
            if given_out:  # fresh output tensors, NaN
                out = op_arg(op, [torch.full((tokens[r], cfg.hidden), float("nan"), dtype=torch.bfloat16, device=dev)
                                  for r in local])
            else:  # the op allocates; hand it freshly freed NaN blocks of the same size on this stream
                junk = [torch.full((tokens[r], cfg.hidden), float("nan"), dtype=torch.bfloat16, device=dev) for r in local]
                junk.clear()  # freed together: one NaN block of each size waits in this stream's pool
                out = None
            torch.cuda._sleep(SLEEP_CYCLES)
            recv = op.dispatch(*op_inputs(op, inputs))
            for r in local:
                integer_expert_stage(op, r)
            combined = op.combine(op_arg(op, [op.combine_input(r) for r in local]), out=out)
        assert seed == 0 or not producer.query(), "dispatch/combine waited on the host (or ran on another stream)"
        recv = recv if op.virtual else [recv]
        combined = combined if op.virtual else [combined]
        with torch.cuda.stream(consumer):
            consumer.wait_stream(producer)
            for r, o, c in zip(local, recv, combined):
                check_exact_dispatch(r, o, exp)
                check_exact_combine(r, c, exp)
                c.record_stream(consumer)  # kept past the producer's use: the allocator must know
        producer.wait_stream(consumer)  # the next dispatch overwrites the receive rows read above
        del combined, recv
    torch.cuda.synchronize(dev)
    op.check()
    _close(op)


@pytest.mark.parametrize("world_size,virtual", MODES)
def test_outputs_consumed_on_another_stream_after_wait_stream(world_size, virtual):
    _run(world_size, virtual, _streams_body)


# ---- the same bodies dry-run on the CPU ---------------------------------------------------------
#
# The GPU reliability tests' bodies, dry-run on the CPU against the real ``EpDispatchCombine`` host
# code with its two kernels replaced by a Python emulation of their contract (virtual ranks only).
#
# What this covers without a GPU: the op's input checks, arena views, zero-copy combine input,
# fault records turned into EpError and the refusal of later calls, and the test bodies' own logic
# (expectations, regexes, exact checks). What it cannot cover: kernels, streams, graphs, processes,
# timeouts; those run on the device (the gpu-marked tests above).

def _at(ptr: int, nbytes: int) -> torch.Tensor:
    """uint8 CPU tensor over ``nbytes`` of host memory at ``ptr`` (the kernels' raw pointers)."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(ptr), dtype=torch.uint8)


class _Records:
    """The error records as ep_report writes them: claim (code 0 -> abi.ERROR_CLAIMED), then a, b,
    c, then the code. ``report(..., unwritten_reads=n)`` leaves the record claimed for the host's
    next n reads, as a kernel still writing it would."""

    def __init__(self, world_size):
        self.words = [[0, 0, 0, 0] for _ in range(world_size)]
        self.reads = 0
        self._pending = {}  # rank -> [reads left while claimed, code, a, b, c]

    def any(self):
        return any(w[0] for w in self.words)

    def read(self, rank):
        self.reads += 1
        pending = self._pending.get(rank)
        if pending is not None:
            if pending[0] == 0:
                self.words[rank][1:] = pending[2:]
                self.words[rank][0] = pending[1]  # the code last, after a, b and c
                del self._pending[rank]
            else:
                pending[0] -= 1
        return tuple(self.words[rank])

    def clear(self):
        self.words = [[0, 0, 0, 0] for _ in self.words]
        self._pending = {}

    def report(self, rank, code, a, b, c, unwritten_reads=0):
        if self.words[rank][0] != 0:  # the compare-and-swap fails: the kernels keep the first error
            return
        self.words[rank][0] = abi.ERROR_CLAIMED
        self._pending[rank] = [unwritten_reads, code, a, b, c & 0xFFFFFFFF]
        if unwritten_reads == 0:
            self.read(rank)  # written at once
            self.reads -= 1

    def close(self):
        pass


class EmulatedOp(EpDispatchCombine):
    """EpDispatchCombine on the CPU with virtual ranks. The op's own ``_launch`` runs (its variant
    pick and its validate rule); ``platform.launch`` emulates each kernel from the launch
    argument's io records: dedup by destination rank, receive rows in a random order, bad expert
    ids recorded (code 1) and skipped; combine summing the reached ranks' rows in fp32 in ascending
    rank, the normal family's from each rank's combine_input, the low-latency family's from each
    rank's y in place (io.y, io.y_rows; fewer rows than received recorded as code 4). A
    low-latency sending half stages its rows, the receiving half places or sums them; the whole
    op does both (``fused``: every low-latency call launches the whole op, else its halves, as the
    op decides from the GPU's residency). ``launched`` lists the ops launched."""

    def __init__(self, config: EpConfig, *, virtual: bool = True, validate: bool = False, fused: bool = True):
        assert virtual, "the emulation drives virtual ranks only"
        self.config, self.validate, self.virtual = config, validate, True
        self.device = torch.device("cpu")
        self.local_ranks = list(range(config.world_size))
        self.arch = "sm_90"  # the specs' arch (the op's transport and family picks read it)
        kernels = planner.plan(config, self.arch)
        specs = {op: kernels.variant(op, config.max_tokens_per_rank) for op in kernels.ops}
        self.plan = Plan.build(config, self.arch, len(self.local_ranks)).with_variants({
            (op, "push"): ((config.max_tokens_per_rank, spec),) for op, spec in specs.items()})
        self._kernels = {spec: op for op, spec in specs.items()}  # fn: the op
        self.dispatch_spec = specs[next(op for op in kernels.ops if op.payload)]
        self.low_latency_tokens = self.dispatch_spec.ll_tokens
        self._fused = {op: fused and self.low_latency_tokens > 0 for op in (Op.DISPATCH, Op.COMBINE)}
        self.arena_layout = self.dispatch_spec.arena_layout
        self.expert_layout = False
        self.platform = types.SimpleNamespace(launch=self._emulate)
        local = {r: torch.zeros(self.arena_layout.total_bytes, dtype=torch.uint8) for r in self.local_ranks}
        sig = slice(self.arena_layout.signals, self.arena_layout.signals + 4 * abi.SIGNAL_WORDS)  # CUDA: the arena's region
        self.arenas = types.SimpleNamespace(local=local, local_signals={r: t[sig] for r, t in local.items()},
                                            close=lambda: None)
        self.errors = _Records(config.world_size)
        self._args = {op: np.zeros((), dtype=_args_dtype(config.world_size)) for op in planner.ops(config)}
        self._start_calls()
        self._staged = None  # a low-latency sending half's rows until its receiving half
        self.launched = []

    @property
    def launches(self) -> int:
        return len(self.launched)

    def synchronize(self):
        self._raise_if_faulted(synchronized=True)

    def _send_slot(self, rank):
        cfg = self.config
        return self._view(rank, self.arena_layout.send_slot, (cfg.max_tokens_per_rank, cfg.world_size), torch.int32)

    def _emulate(self, op, grid, block, args_address, device, cooperative):
        assert grid == (self.plan.variant(op, 0).blocks, len(self.local_ranks), 1) and device == self.device
        assert cooperative == op.waits_within_grid(len(self.local_ranks)), (op, cooperative)
        self.launched.append(op)
        dtype = _args_dtype(self.config.world_size)
        io = np.frombuffer((ctypes.c_uint8 * dtype.itemsize).from_address(args_address), dtype=dtype)[0]["io"]
        if op in (Op.DISPATCH, Op.DISPATCH_LL, Op.DISPATCH_LL_SEND):
            self._staged = self._route(io)
        if op in (Op.DISPATCH, Op.DISPATCH_LL, Op.DISPATCH_LL_RECV):
            self._place(self._staged)
        if op is Op.COMBINE:
            self._combine(io)
        if op in (Op.COMBINE_LL, Op.COMBINE_LL_SEND):
            self._staged = self._push_back(io)
        if op in (Op.COMBINE_LL, Op.COMBINE_LL_RECV):
            self._sum_staged(io, self._staged)

    def _route(self, io) -> dict:
        """{destination: [(source rank, token, x, weights, indices, scales addresses)]}, bad ids recorded."""
        cfg, W, K, L = self.config, self.config.world_size, self.config.topk, self.config.experts_per_rank
        incoming = {d: [] for d in range(W)}
        for r in self.local_ranks:
            x_ptr, w_ptr, i_ptr, s_ptr, T = (int(io[r][f]) for f in ("x", "weights", "indices", "scales", "num_tokens"))
            ids = _at(i_ptr, T * K * 4).view(torch.int32).view(T, K)
            for t in range(T):
                seen = set()
                for k in range(K):
                    e = int(ids[t, k])
                    if e == -1:
                        continue
                    if not 0 <= e < cfg.num_experts:
                        self.errors.report(r, 1, k, t, e)
                        continue
                    if e // L not in seen:
                        seen.add(e // L)
                        incoming[e // L].append((r, t, x_ptr, w_ptr, i_ptr, s_ptr))
        return incoming

    def _place(self, incoming: dict):
        """The routed rows into each destination's receive rows; send_slot: each (token, rank)'s row."""
        K, S, row_bytes = self.config.topk, self.config.scale_bytes, self.dispatch_spec.row_bytes
        for r in self.local_ranks:
            self._send_slot(r)[:] = -1
        for d, rows in incoming.items():
            buf = self.recv_buffers(d)
            for row, p in enumerate(torch.randperm(len(rows)).tolist()):  # row order is unspecified
                r, t, x_ptr, w_ptr, i_ptr, s_ptr = rows[p]
                buf.recv_x[row].view(torch.uint8).copy_(_at(x_ptr + t * row_bytes, row_bytes))
                buf.recv_weights[row].view(torch.uint8).copy_(_at(w_ptr + t * K * 4, K * 4))
                buf.recv_indices[row].view(torch.uint8).copy_(_at(i_ptr + t * K * 4, K * 4))
                if S:
                    buf.recv_scales[row].copy_(_at(s_ptr + t * S, S))
                buf.recv_src[row] = torch.tensor([r, t], dtype=torch.int32)
                self._send_slot(r)[t, d] = row
            buf.num_recv[0] = len(rows)

    def _sum(self, io, row):
        """Each local rank r's out[t]: the sum over the ranks d that token t reached (send_slot), in
        ascending rank, in fp32, of ``row(r, d, t, slot)`` (fp32 [H]), rounded to bf16 once."""
        W, H = self.config.world_size, self.config.hidden
        for r in self.local_ranks:
            out_ptr, T = int(io[r]["out"]), int(io[r]["num_tokens"])
            slots = self._send_slot(r)[:T].tolist()
            acc = torch.zeros(T, H)
            for t in range(T):
                for d in range(W):
                    if slots[t][d] >= 0:
                        acc[t] += row(r, d, t, slots[t][d])
            _at(out_ptr, T * H * 2).copy_(acc.to(torch.bfloat16).view(torch.uint8).reshape(-1))

    def _combine(self, io):
        for d in self.local_ranks:  # a y with fewer rows than received: recorded (code 4)
            received, y_rows = int(self.recv_buffers(d).num_recv[0]), int(io[d]["y_rows"])
            if received > y_rows:
                self.errors.report(d, 4, y_rows, 0, received)
        self._sum(io, lambda r, d, t, slot: self.combine_input(d)[slot].float())

    def _push_back(self, io) -> dict:
        """{(source rank, sending rank, token): row} from each rank's y in place (its first
        min(num_recv, y_rows) rows); a y shorter than the rows received is recorded (code 4)."""
        H, staged = self.config.hidden, {}
        for d in self.local_ranks:
            received, y_rows = int(self.recv_buffers(d).num_recv[0]), int(io[d]["y_rows"])
            if received > y_rows:
                self.errors.report(d, 4, y_rows, 0, received)
            y = _at(int(io[d]["y"]), min(received, y_rows) * H * 2).view(torch.bfloat16).view(-1, H)
            for row, (src, t) in enumerate(self.recv_buffers(d).recv_src[: y.shape[0]].tolist()):
                staged[(src, d, t)] = y[row].float()
        return staged

    def _sum_staged(self, io, staged: dict):
        zero = torch.zeros(self.config.hidden)
        self._sum(io, lambda r, d, t, slot: staged.get((r, d, t), zero))  # a row past a short y: none


EMULATED = ("whole", "halves", "normal")
"""How the emulated op moves tokens: the configs' kernel_family "auto" (the low-latency family up
to T_ll, as one kernel per op or, where its grid does not fit the GPU, as two halves), or "normal"."""


def emulated_op(cfg: EpConfig, how: str, validate: bool = False) -> EmulatedOp:
    """An EmulatedOp of ``cfg`` that moves tokens as ``how`` says (``EMULATED``)."""
    if how == "normal":
        return EmulatedOp(attrs.evolve(cfg, kernel_family="normal"), validate=validate)
    return EmulatedOp(cfg, validate=validate, fused=how == "whole")


@pytest.fixture(params=EMULATED)
def emulated(monkeypatch, request):
    monkeypatch.setattr(sys.modules[__name__], "_op",
                        lambda cfg, virtual, validate=True: emulated_op(cfg, request.param, validate))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)


@pytest.mark.slow
@pytest.mark.parametrize("how", EMULATED)
def test_the_emulation_keeps_the_contract(how):
    cfg = edge_config(4)
    op = emulated_op(cfg, how, validate=True)
    for seed, kind in enumerate(("uniform", "invalid", "duplicates", "skewed", "one_rank")):
        run_round(op, cfg, [64, 0, 17, 5], kind, seed)  # against the CPU reference
        run_exact_round(op, cfg, integer_inputs(cfg, [64, 0, 17, 5], kind, seed))


@pytest.mark.slow
def test_tokens_on_one_rank_on_all_but_one_and_on_none(emulated):
    test_tokens_on_one_rank_on_all_but_one_and_on_none_virtual4()


@pytest.mark.slow
@pytest.mark.parametrize("body", [_minus_one_body, _dedup_body, _max_tokens_body])
def test_edge_bodies(emulated, body):
    body(0, 8, True)


@pytest.mark.slow
def test_topk_body(emulated):
    test_topk_6_and_9_virtual8(2880, 9)


@pytest.mark.slow
def test_bad_id_body(emulated):
    _bad_id_body(0, 8, True)


@pytest.mark.slow
def test_jitter_body_logic(emulated):
    _jitter_body(0, 2, True, 25)


@pytest.mark.slow
def test_the_stress_rounds_take_both_families_split_and_faults_that_every_rank_raises():
    """``epgen stress``'s rounds (epgen.cli.stress.stress) on the emulated op: low-latency rounds with
    every rank's tokens at most T_ll and normal ones above it, every other low-latency round split,
    and a recoverable fault every 4 rounds, raised by synchronize and followed by exact rounds."""
    from epgen.cli.stress import stress

    cfg = edge_config(4, max_tokens=200)
    op = emulated_op(cfg, "whole")
    lines = []
    result = stress(op, cfg, rounds=24, seed=3, report=lines.append, fault_every=4)
    assert not result.failures, result.failures
    assert result.counts["low_latency"] + result.counts["normal"] == 24 and result.counts["fault"] == 6
    assert result.counts["low_latency"] and result.counts["normal"] and result.counts["split"]
    assert sum("raised on every rank" in line for line in lines) == 6, lines
    assert any("short_y" in line for line in lines) and any("bad_id" in line for line in lines)


@pytest.mark.parametrize("how", EMULATED)
def test_a_recoverable_fault_waits_for_synchronize_and_a_fatal_one_refuses_every_later_call(how):
    """A recoverable fault is raised by check() (not cleared) and by synchronize() (cleared), never
    by a call: with one process per GPU a rank that stopped at a fault its peers do not see yet
    would leave them waiting, while synchronize() on every rank raises it everywhere alike. A fatal
    fault (a timeout) is raised by every later call, which then launches nothing."""
    cfg = edge_config(8)
    op = emulated_op(cfg, how)
    good = integer_inputs(cfg, [8] * 8, "uniform", 1)
    with pytest.raises(RuntimeError, match="needs a dispatch first"):
        op.combine([op.combine_input(r) for r in range(8)])
    assert op.launches == 0
    bad = integer_inputs(cfg, [8] * 8, "uniform", 2)
    bad[6].indices[3, 1] = 99
    op.dispatch(*op_inputs(op, bad))  # validate=False
    for _ in range(2):  # check() does not clear it
        with pytest.raises(EpError, match=r"^rank 6: indices\[3, 1\]=99: expert ids must be -1 or in \[0, 16\) "
                                          r"\[the faulted call's outputs are invalid; op.synchronize\(\) on every rank"):
            op.check()
    launches = op.launches
    op.combine([op.combine_input(r) for r in range(8)])  # the calls go on: every rank runs every call
    assert op.launches > launches
    with pytest.raises(EpError, match=r"rank 6: indices\[3, 1\]=99.*cleared: the op runs again") as e:
        op.synchronize()
    assert e.value.recoverable
    run_exact_round(op, cfg, good)  # and it does
    op.errors.report(2, 2, 1, 5, 7)  # a timeout of rank 2 waiting for rank 5
    launches = op.launches
    for call in (lambda: op.dispatch(*op_inputs(op, good)), lambda: op.combine([op.combine_input(r) for r in range(8)]),
                 op.check, op.synchronize):
        with pytest.raises(EpError, match=r"^rank 2: timed out after .* on rank 5 \(call 7\) \[this op is unusable"):
            call()
    assert op.launches == launches


def test_the_lowest_rank_fault_is_raised_and_a_fatal_one_before_any_recoverable_one():
    """Every process holds a record of every rank (its own faults, its peers' recoverable ones as its
    kernels read them): all ranks pick the same one to raise."""
    cfg = edge_config(8)
    op = EmulatedOp(cfg, validate=False)
    op.errors.report(6, 1, 1, 3, 99)
    op.errors.report(4, 4, 10, 0, 12)
    with pytest.raises(EpError, match=r"^rank 4: combine: y has 10 rows but"):
        op.check()
    op.errors.report(7, 2, 4, 7, 3)  # a timeout of rank 7 waiting for itself
    with pytest.raises(EpError, match=r"^rank 7: timed out .* on rank 7, itself: blocks of its own grid"):
        op.check()


def test_a_record_claimed_but_unwritten_is_reread_until_its_code_is_there():
    cfg = edge_config(8)
    op = EmulatedOp(cfg, validate=False)
    op.errors.report(5, 3, 0, 5, 70000, unwritten_reads=40)  # an overflow still being written
    assert op.errors.words[5] == [abi.ERROR_CLAIMED, 0, 0, 0]
    with pytest.raises(EpError, match=r"^rank 5: the receive buffer of rank 5 needed 70000 rows in this dispatch, "
                                      r"more than its \d+ "):
        op.check()
    assert op.errors.reads == 5 + 40 + 1 + 2  # ranks 0-4, rank 5 claimed 40 times, then its code, ranks 6 and 7
    op.errors.report(5, 1, 0, 0, 0)  # a second fault finds the record taken
    with pytest.raises(EpError, match=r"rank 5: the receive buffer of rank 5 .*op.synchronize\(\) on every rank"):
        op.check()


def test_a_record_that_stays_claimed_is_reported_as_a_fault_whose_details_are_unwritten():
    cfg = edge_config(8)
    op = EmulatedOp(cfg, validate=False)
    op.errors.report(3, 2, 1, 4, 9, unwritten_reads=abi.CLAIM_REREADS + 1)
    with pytest.raises(EpError, match=rf"^rank 3: a kernel fault is being recorded: its code and details were "
                                      rf"still unwritten after {abi.CLAIM_REREADS} reads of the error record "
                                      r"\[this op is unusable"):
        op.check()
    assert op.errors.reads == 3 + 1 + abi.CLAIM_REREADS + 4  # ranks 0-2, rank 3's rereads, ranks 4-7
    with pytest.raises(EpError, match=r"rank 3: a kernel fault is being recorded.*build a new EpDispatchCombine"):
        op.synchronize()


FAMILY_OPS = {"whole": {Op.DISPATCH_LL, Op.COMBINE_LL},
              "halves": {Op.DISPATCH_LL_SEND, Op.DISPATCH_LL_RECV, Op.COMBINE_LL_SEND, Op.COMBINE_LL_RECV},
              "normal": {Op.DISPATCH, Op.COMBINE}}


@pytest.mark.parametrize("how", EMULATED)
def test_a_round_launches_the_kernels_of_its_family(how):
    cfg = edge_config(4, max_tokens=200)  # T_ll = tuning.LOW_LATENCY_MAX_TOKENS = 128 (no table entry)
    op = emulated_op(cfg, how, validate=True)
    assert op.low_latency_tokens == (0 if how == "normal" else 128)
    run_exact_round(op, cfg, integer_inputs(cfg, [128, 0, 17, 5], "uniform", 1))
    assert set(op.launched) == FAMILY_OPS[how]
    launched = len(op.launched)
    run_exact_round(op, cfg, integer_inputs(cfg, [129, 0, 17, 5], "uniform", 2))  # above T_ll: the normal family
    assert op.launched[launched:] == [Op.DISPATCH, Op.COMBINE]


@pytest.mark.parametrize("how", ["whole", "halves"])
def test_the_async_recv_split_finishes_the_call_in_wait(how):
    """The sending half alone, then ``wait()``: the same outputs as a synchronous call, and none
    before it (the receive rows stay poisoned, the combine output NaN)."""
    cfg = edge_config(4)
    op = emulated_op(cfg, how, validate=True)
    inputs = integer_inputs(cfg, [64, 0, 17, 5], "duplicates", 3)
    exp = expect(cfg, inputs)
    for r in op.local_ranks:
        poison(op, r)
    handle = op.dispatch(*op_inputs(op, inputs), async_recv=True)
    assert op.launched == [Op.DISPATCH_LL_SEND]
    assert all(bool(op.recv_buffers(r).recv_x.isnan().all()) for r in op.local_ranks), "rows placed before wait()"
    outs = handle.wait()
    assert op.launched == [Op.DISPATCH_LL_SEND, Op.DISPATCH_LL_RECV]
    for r, out in zip(op.local_ranks, outs):
        check_exact_dispatch(r, out, exp)
    ys = [integer_expert_stage(op, r) for r in op.local_ranks]
    nan = [torch.full((exp.tokens[r], cfg.hidden), float("nan"), dtype=torch.bfloat16) for r in op.local_ranks]
    handle = op.combine(ys, out=nan, async_recv=True)
    assert op.launched[2:] == [Op.COMBINE_LL_SEND] and all(bool(o.isnan().all()) for o in nan if o.numel())
    combined = handle.wait()
    assert op.launched[2:] == [Op.COMBINE_LL_SEND, Op.COMBINE_LL_RECV]
    assert all(c is o for c, o in zip(combined, nan))
    for r, c in zip(op.local_ranks, combined):
        check_exact_combine(r, c, exp)
    run_exact_round(op, cfg, integer_inputs(cfg, [1, 2, 3, 4], "uniform", 4))  # and the op goes on


def test_a_fault_in_the_sending_half_is_raised_by_wait_never_between_the_halves():
    """validate=True synchronizes after a receiving half only: a bad id the sending half records
    is raised by ``wait()``, which has launched the receiving half first (the halves' call counts
    stay in step), and the faulted dispatch is not combined."""
    cfg = edge_config(8)
    op = emulated_op(cfg, "halves", validate=True)
    inputs = integer_inputs(cfg, [16] * 8, "uniform", 5)
    inputs[7].indices[5, 2] = cfg.num_experts
    handle = op.dispatch(*op_inputs(op, inputs), async_recv=True)  # no synchronize after the sending half
    with pytest.raises(EpError, match=rf"^rank 7: indices\[5, 2\]={cfg.num_experts}: .*cleared: the op runs again"):
        handle.wait()
    assert op.launched == [Op.DISPATCH_LL_SEND, Op.DISPATCH_LL_RECV]
    with pytest.raises(RuntimeError, match="needs a dispatch first"):
        op.combine([op.combine_input(r) for r in op.local_ranks])
    with pytest.raises(EpError, match=r"^rank 7: indices\[5, 2\]=.*cleared: the op runs again"):
        op.dispatch(*op_inputs(op, inputs))  # the whole call, halves back to back, then the fault
    assert op.launched[2:] == [Op.DISPATCH_LL_SEND, Op.DISPATCH_LL_RECV]
    run_exact_round(op, cfg, integer_inputs(cfg, [16] * 8, "uniform", 6))


def test_the_low_latency_combine_reads_y_in_place_and_checks_its_rows():
    """The rank layout's low-latency combine sends y's own rows (no copy into combine_input), so a
    y that is not combine_input() works as well; a y with fewer rows than received is a recorded
    fault (short input), as in the normal family."""
    cfg = edge_config(4)
    op = emulated_op(cfg, "whole", validate=True)
    inputs = integer_inputs(cfg, [20, 3, 0, 9], "uniform", 7)
    exp = expect(cfg, inputs)
    op.dispatch(*op_inputs(op, inputs))
    ys = [integer_expert_stage(op, r).clone() for r in op.local_ranks]  # copies: combine_input then cleared
    for r in op.local_ranks:
        op.combine_input(r).zero_()
    for r, c in zip(op.local_ranks, op.combine(ys)):
        check_exact_combine(r, c, exp)
    op.dispatch(*op_inputs(op, inputs))
    short = [integer_expert_stage(op, r)[: max(int(op.recv_buffers(r).num_recv[0]) - 1, 0)] for r in op.local_ranks]
    victim = next(r for r in op.local_ranks if int(op.recv_buffers(r).num_recv[0]) > 0)
    with pytest.raises(EpError, match=rf"^rank {victim}: combine: y has \d+ rows but this rank's last dispatch produced"):
        op.combine(short)
