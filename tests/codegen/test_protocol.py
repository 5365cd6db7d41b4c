"""The signal protocol, checked exhaustively (``epgen.codegen.protocol``): W = 2 and 3 ranks, every
host program of 3 calls (every kernel family, dispatches without a combine), no fault or a
recoverable fault first seen by any rank in any call, every interleaving of the ranks' steps."""

import re

import numpy
import pytest

from epgen.codegen import abi, protocol
from epgen.codegen.config import EpConfig
from epgen.codegen.render import render
from epgen.codegen.spec import Op

STATES = {2: 180_000, 3: 7_500_000}
"""Fewest states each world size explores in all (186,534 and 7,548,846 when this was written):
a model that shrank, losing interleavings, fails here."""


@pytest.mark.parametrize("world_size", [2, 3])
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
        text = render(cfg.spec("sm_90", Op(kernel), cfg.geometry("sm_90", Op(kernel), 128))).text
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
])
def test_check_refuses_what_the_op_refuses_and_faults_outside_the_program(kwargs, match):
    args = dict(protocol=protocol.PROTOCOL, world_size=2, program=("dispatch", "combine"), fault=None) | kwargs
    with pytest.raises(ValueError, match=match):
        protocol.check(**args)
    with pytest.raises(TypeError, match="protocol: expected a Protocol, got NoneType"):
        protocol.check(None, 2, ("dispatch", "combine"))


def test_check_takes_lists_and_numpy_ints_as_tuples_and_ints():
    as_tuple = protocol.check(protocol.PROTOCOL, 2, ("dispatch", "combine"), (1, 0))
    assert protocol.check(protocol.PROTOCOL, numpy.int64(2), ["dispatch", "combine"],
                          [numpy.int64(1), numpy.int32(0)]) == as_tuple


@pytest.mark.parametrize("parities", [{}, {**protocol.PROTOCOL.parities, "ready_from": 0},
                                      {**protocol.PROTOCOL.parities, "ready_from": "2"}])
def test_a_protocol_names_a_missing_or_bad_copy_count(parities):
    with pytest.raises(ValueError, match=r"parities=.*: must map each of .*ready_from.* to 1 or 2 copies"):
        protocol.Protocol(parities=parities)
