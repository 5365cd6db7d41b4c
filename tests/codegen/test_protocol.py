"""The signal protocol, checked exhaustively (``epgen.codegen.protocol``): W = 2 and 3 ranks, every
host program of 3 calls (every kernel family, dispatches without a combine), no fault or a
recoverable fault first seen by any rank in any call, every interleaving of the ranks' steps; then
the programs the design before (``protocol.WINDOWED_FAULTS``) fails on, each defect's
counterexample, and the protocol the kernels implement (``protocol.PROTOCOL``) passing them.
EPGEN_PROTOCOL_SWEEP=1 adds the larger sweeps (W = 3 of every new program, 3-call split programs)."""

import os
import re

import attrs
import numpy
import pytest

from epgen.codegen import planner
from epgen.codegen import abi, protocol
from epgen.codegen.config import EpConfig
from epgen.codegen.render import render
from epgen.codegen.spec import Op

STATES = {2: 200_000, 3: 8_200_000}
"""Fewest states each world size explores in all (202,828 and 8,263,014 when this was written):
a model that shrank, losing interleavings, fails here."""

SWEEP = pytest.mark.skipif(not os.environ.get("EPGEN_PROTOCOL_SWEEP"),
                           reason="a larger sweep of the protocol model: set EPGEN_PROTOCOL_SWEEP=1")


@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_no_interleaving_reads_another_call_hangs_or_raises_faults_unevenly(world_size):
    states, checks = 0, 0
    for program in protocol.programs(3):
        for fault in [None] + [(r, k) for r in range(world_size) for k in range(3)]:
            result = protocol.check(protocol.PROTOCOL, world_size, program, fault)
            assert result.violation is None, (program, fault, result.violation, _readable(result.trace))
            states += result.states
            checks += 1
    print(f"W = {world_size}: {checks} programs x faults, {states} states")
    assert states >= STATES[world_size]


def _readable(trace) -> list:
    return [f"rank {r}: {what}" for r, what in trace if what != "-" and not what.endswith(" None")]


def test_the_single_flag_layout_gives_a_rank_the_rows_of_another_call():
    """The low-latency flags before they had a copy per parity (and a receiver accepted any later
    generation): a rank that dispatches again before its peer's receiving half ran overwrites the
    flag; the peer takes the new call's row count and slots for its own call."""
    result = protocol.check(protocol.SINGLE_FLAGS, 2, ("dispatch_ll", "dispatch_ll", "combine_ll"))
    assert result.violation and "wrong rows" in result.violation, result
    assert "accepted generation 2" in result.violation and "for generation 1" in result.violation
    assert protocol.check(protocol.PROTOCOL, 2, ("dispatch_ll", "dispatch_ll", "combine_ll")).violation is None


def test_faults_seen_by_one_rank_leave_the_peers_waiting_for_it():
    """Each process's own error records alone: the faulting rank skips the combine (the documented
    recovery), its peers wait for its flags."""
    for program in (("dispatch", "combine", "dispatch"), ("dispatch_ll", "combine_ll", "dispatch_ll")):
        result = protocol.check(protocol.LOCAL_FAULTS, 2, program, fault=(1, 0))
        assert result.violation and "no rank can move" in result.violation, result
        assert protocol.check(protocol.PROTOCOL, 2, program, fault=(1, 0)).violation is None


def test_programs_cover_every_family_and_a_dispatch_without_a_combine():
    programs = protocol.programs(3)
    calls = {c for p in programs for c in p}
    assert calls == set(protocol.CALLS)
    assert ("dispatch_ll", "dispatch_ll", "combine_ll") in programs
    assert ("dispatch", "dispatch_ll", "combine_ll") in programs  # families change between calls
    assert all(p[0].startswith("dispatch") for p in programs)


def test_every_word_of_the_model_is_a_signal_of_the_table_or_a_region_and_the_kernels_use_it():
    """The model's words are ``abi.SIGNALS`` (or data regions), and each kernel's template uses the
    signal words the model gives it; the waits marked exact are on the ranges with a copy per
    parity, as ``abi.PARITY_RULE`` says."""
    signals = {s.name: s for s in abi.SIGNALS}
    cfg = EpConfig.for_model("deepseek-v3", world_size=2, max_tokens_per_rank=128, dispatch_transport="pull")
    for kernel, steps in protocol.KERNELS.items():
        text = render(planner.plan(cfg, "sm_90").variant(Op(kernel), 128)).text
        body = text[text.rindex("\n// ---- "):]  # the op's own part, after the platform layer and prelude
        for step in steps:
            assert step.word in signals or step.word in protocol.REGIONS, (kernel, step)
            if step.word in signals:
                assert re.search(rf"\b{signals[step.word].c_name}\b", body), (kernel, step.word)
            if step.kind == "wait":
                assert step.exact == (signals[step.word].parities == 2), (kernel, step)


@pytest.mark.parametrize("kwargs, match", [
    (dict(world_size=0), r"world_size=0: must be an int >= 1"),
    (dict(world_size=True), r"world_size=True: must be an int >= 1"),
    (dict(program=("combine",)), r"call 0 \(combine\) must follow a dispatch"),
    (dict(program=("dispatch", "combine_ll")), r"call 1 \(combine_ll\) must follow a dispatch whose combine it is"),
    (dict(program=("dispatch", "combine", "combine")), r"call 2 \(combine\) must follow"),
    (dict(program=("dispatch", "frobnicate")), r"program=.*each one of dispatch, dispatch_pull"),
    (dict(program="dispatch"), r"program='dispatch': must be a tuple or list of calls"),
    (dict(program=(c for c in ("combine",))), r"program=<generator.*: must be a tuple or list"),
    (dict(program=None), r"program=None: must be a tuple or list"),
    (dict(fault=(2, 0)), r"fault=\(2, 0\): must be None or a pair of ints \(rank in \[0, 2\), call in \[0, 2\)\)"),
    (dict(fault=(0, 5)), r"fault=\(0, 5\)"),
    (dict(fault=0), r"fault=0: must be None or a pair"),
    (dict(fault={0: "a", 1: "b"}), r"fault=\{0: 'a', 1: 'b'\}: must be None or a pair"),
    (dict(faults=((0, 2),)), r"faults=\(\(0, 2\),\): each must be a pair of ints \(rank in \[0, 2\), call in \[0, 2\)"),
    (dict(faults=(0, 1)), r"faults=\(0, 1\): each must be a pair"),
    (dict(faults=None), r"faults=None: must be a collection of \(rank, call\) pairs"),
    (dict(overflows=((0, 1, 1),)), r"overflows=.*: each must be \(sender, receiver, call\).*normal dispatch"),
    (dict(overflows=((0, 2, 0),)), r"overflows=.*ranks in \[0, 2\)"),
    (dict(overflows=7), r"overflows=7: must be a collection"),
    (dict(syncs=((1,),)), r"syncs=\(\(1,\),\): must be None or 2 collections of sync points, one per rank"),
    (dict(syncs=((1,), (2,))), r"syncs=.*: rank 1's points must be calls k in \[0, 2\) or \(k, 'halves'\)"),
    (dict(syncs=(((0, "halves"),), (1,))), r"rank 0's points must be .* of a low-latency call"),
    (dict(syncs=((1,), 1)), r"rank 1's points must be"),
    (dict(program=(("dispatch",), "combine")), r"or a tuple of 2 of them \(one per rank\)"),
])
def test_check_refuses_what_the_op_refuses_and_faults_outside_the_program(kwargs, match):
    args = dict(protocol=protocol.PROTOCOL, world_size=2, program=("dispatch", "combine"), fault=None) | kwargs
    with pytest.raises(ValueError, match=match):
        protocol.check(**args)
    with pytest.raises(TypeError, match="protocol: expected a Protocol, got NoneType"):
        protocol.check(None, 2, ("dispatch", "combine"))


@pytest.mark.parametrize("kwargs, match", [
    (dict(faults="windowed_"), r"faults='windowed_': must be 'consumed' or 'windowed'"),
    (dict(generation_bits=1), r"generation_bits=1: must be an int in \[2, 32\]"),
    (dict(generation_bits=33), r"generation_bits=33"),
    (dict(generation_bits=True), r"generation_bits=True"),
])
def test_a_protocol_names_a_bad_design_or_width(kwargs, match):
    with pytest.raises(ValueError, match=match):
        protocol.Protocol(**kwargs)


def test_check_takes_lists_and_numpy_ints_as_tuples_and_ints():
    as_tuple = protocol.check(protocol.PROTOCOL, 2, ("dispatch", "combine"), (1, 0))
    assert protocol.check(protocol.PROTOCOL, numpy.int64(2), ["dispatch", "combine"],
                          [numpy.int64(1), numpy.int32(0)]) == as_tuple
    assert protocol.check(protocol.PROTOCOL, 2, ("dispatch", "combine"), faults=[[1, 0]], syncs=[[0, 1], {1, 0}]) \
        == as_tuple  # syncs: the default, after every call


@pytest.mark.parametrize("parities", [{}, {**protocol.PROTOCOL.parities, "ready_from": 0},
                                      {**protocol.PROTOCOL.parities, "ready_from": "2"}])
def test_a_protocol_names_a_missing_or_bad_copy_count(parities):
    with pytest.raises(ValueError, match=r"parities=.*: must map each of .*ready_from.* to 1 or 2 copies"):
        protocol.Protocol(parities=parities)


def _check_all(proto, world_size, cases) -> int:
    """Every case passes; returns the states explored."""
    states = 0
    for case in cases:
        result = protocol.check(proto, world_size, **case)
        assert result.violation is None, (case, result.violation, _readable(result.trace))
        states += result.states
    return states


def test_the_windowed_design_holds_when_every_rank_synchronizes_after_every_call():
    """What the design before got right: with a synchronize after every call and one fault, its
    windows admit exactly the call's records (the same states as this model's first version)."""
    states = _check_all(protocol.WINDOWED_FAULTS, 2, [dict(program=p, fault=f) for p in protocol.programs(3)
                                                      for f in [None] + [(r, k) for r in range(2) for k in range(3)]])
    assert states == 186_534


@pytest.mark.slow
def test_overflows_of_any_receiver_found_by_any_sender_are_raised_by_every_rank():
    cases = [dict(program=p, overflows=((s, d, k),)) for p in protocol.programs(3) for k, c in enumerate(p)
             if c in ("dispatch", "dispatch_pull") for s in range(2) for d in range(2)]
    cases += [dict(program=("dispatch", "combine", "dispatch"), overflows=((0, 1, 0), (1, 1, 0), (1, 0, 2)),
                   fault=(0, 0))]
    assert _check_all(protocol.PROTOCOL, 2, cases) > 0
    assert _check_all(protocol.WINDOWED_FAULTS, 2, cases) > 0


def test_families_chosen_per_rank_wait_forever_and_the_op_refuses_them():
    """(a) An "auto" op whose processes pick the family by their own token count: ranks on both
    sides of the threshold run different kernels and wait for each other until the timeout. The op
    now refuses a dispatch without a stated family there, and ``check`` refuses the program."""
    for world_size in (2, 3):
        for case in protocol.family_cases(world_size):
            result = protocol.check(protocol.WINDOWED_FAULTS, world_size, **case)
            assert result.violation and "no rank can move" in result.violation, (case, result)
            with pytest.raises(ValueError, match=r"call 0 takes families .* every call names its family"):
                protocol.check(protocol.PROTOCOL, world_size, **case)
    result = protocol.check(protocol.WINDOWED_FAULTS, 2, (("dispatch", "dispatch_ll"), ("combine", "combine_ll")))
    assert "rank 0 in call 0 (dispatch) waits for ready_from of rank 1" in result.violation
    assert "rank 1 in call 0 (dispatch_ll) waits for ll_dispatch_from of rank 0" in result.violation
    # the same family on every rank, different transports or not, is a program the op takes
    assert protocol.check(protocol.PROTOCOL, 2, (("dispatch_ll",) * 2, "combine_ll")).violation is None


def test_a_synchronize_between_the_halves_raises_a_send_fault_on_one_rank_only():
    """(b) A bad id found by rank 1's sending half: rank 1's synchronize before handle.wait() raises
    its own record; rank 0's window admits a peer's record only after its receiving half ran, so
    it raises nothing; rank 1 skips the combine (the documented recovery), rank 0 waits in it. The
    protocol now defers recoverable faults while a receiving half has not run."""
    case = dict(program=("dispatch_ll", "combine_ll"), fault=(1, 0), syncs=(((0, "halves"), 1),) * 2)
    result = protocol.check(protocol.WINDOWED_FAULTS, 2, **case)
    assert result.violation == ("no rank can move (a wait that ends in a timeout): rank 0 in call 1 (combine_ll) "
                                "waits for ll_combine_from of rank 1"), result
    assert (1, "synchronize between the halves of call 0: raises rank 1's fault of call 0") in result.trace
    assert protocol.check(protocol.PROTOCOL, 2, **case).violation is None
    assert _check_all(protocol.PROTOCOL, 2, protocol.halves_cases(2)) > 0


@pytest.mark.slow
def test_generations_that_wrap_refire_an_old_record_and_lose_an_overflow():
    """(c) With 3-bit generations (32 in the kernels: the same after 2^32 calls): a record left by
    rank 1's fault in call 0 fires again on rank 0 only after the wrap (rank 1 skips its own slot),
    so rank 0 skips the combine rank 1 waits in; and an overflow after the wrap is reported by no
    rank, the key of the one before the wrap winning the max. Records consumed by their readers,
    and counts without a generation, have nothing to wrap."""
    old, new = (attrs.evolve(p, generation_bits=3) for p in (protocol.WINDOWED_FAULTS, protocol.PROTOCOL))
    stale, _, lost = protocol.wrap_cases(2, 3)
    result = protocol.check(old, 2, **stale)
    assert result.violation == ("no rank can move (a wait that ends in a timeout): rank 1 in call 9 (combine) "
                                "waits for combine_ready_from of rank 0"), result
    assert (0, "synchronize after call 8: raises rank 1's fault of call 0") in result.trace
    result = protocol.check(old, 2, **lost)
    assert result.violation.startswith("rank 0's synchronize after call 8 raised nothing, but the overflow of "
                                       "rank 1's receive rows in call 8"), result
    assert protocol.check(protocol.WINDOWED_FAULTS, 2, **stale).violation is None  # no wrap in 10 calls of 32 bits
    for world_size in (2, 3):
        assert _check_all(new, world_size, protocol.wrap_cases(world_size, 3)) > 0


def test_faults_two_calls_apart_with_different_synchronize_points_go_unraised():
    """(d) Rank 1 finds a short y in combines 1 and 5 and synchronizes only after the last, rank 0
    after every combine: rank 1's record of call 1 is not cleared when it faults again, so it does
    not share call 5's fault, and rank 0 takes call 5's outputs as valid. (Rank 1 synchronizing
    after call 1 instead: its second record replaces the first unread, and rank 0 raises call 5's
    fault for call 1's.) With records consumed by every rank's receiving kernel, each rank raises
    at its first synchronize after any faulted call, the lowest rank's first fault there."""
    program = ("dispatch", "combine") * 3
    result = protocol.check(protocol.WINDOWED_FAULTS, 2, program, faults=((1, 1), (1, 5)), syncs=((1, 3, 5), (5,)))
    assert result.violation == ("rank 0's synchronize after call 5 raised nothing, but rank 1's fault of call 5 "
                                "(its window: calls 4-5): that call's outputs are used as valid"), result
    result = protocol.check(protocol.WINDOWED_FAULTS, 2, program, faults=((1, 1), (1, 5)), syncs=((5,), (1, 3, 5)))
    assert result.violation.startswith("rank 0's synchronize after call 5 raised rank 1's fault of call 5, expected "
                                       "rank 1's fault of call 1"), result
    assert _check_all(protocol.PROTOCOL, 2, protocol.apart_cases(2)) > 0


def test_an_overflow_in_the_receivers_words_alone_reaches_no_peer():
    """The receiving rank reads its overflow count after its done flags, too late to hand it on:
    only it raises, and the peers wait in the combine it skips. Every rank's words get the count."""
    result = protocol.check(protocol.RECEIVER_OVERFLOW, 2, ("dispatch", "combine"), overflows=((0, 1, 0),))
    assert result.violation and "no rank can move" in result.violation, result
    assert protocol.check(protocol.PROTOCOL, 2, ("dispatch", "combine"), overflows=((0, 1, 0),)).violation is None


@SWEEP
@pytest.mark.parametrize("world_size", [2, 3])
def test_sweep_of_every_new_program(world_size):
    """W = 2 (about 35 s, 2.4 million states): every split program of 3 calls, faults two calls apart with every choice
    of synchronize points, a 2-bit wrap, an overflow between every pair of ranks in every dispatch
    of every 3-call program with any fault. W = 3 (about 5 minutes, 17 million states): split programs of 2 calls, rank
    0 alone choosing its points, overflows without a fault."""
    small = world_size > 2
    states = _check_all(protocol.PROTOCOL, world_size, protocol.halves_cases(world_size, 2 if small else 3))
    states += _check_all(protocol.PROTOCOL, world_size, protocol.apart_cases(world_size, 1 if small else None))
    states += _check_all(attrs.evolve(protocol.PROTOCOL, generation_bits=2), world_size,
                         protocol.wrap_cases(world_size, 2))
    states += _check_all(protocol.PROTOCOL, world_size,
                         [dict(program=p, overflows=((s, d, k),), fault=f) for p in protocol.programs(3)
                          for k, c in enumerate(p) if c in ("dispatch", "dispatch_pull")
                          for s in range(world_size) for d in range(world_size) if s != d
                          for f in [None] + ([] if small else [(r, j) for r in range(world_size) for j in range(3)])])
    print(f"W = {world_size}: {states} states")
