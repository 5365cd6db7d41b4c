"""CPU tests of the host-kernel ABI table (epgen.codegen.abi): every declaration the prelude prints
and everything the op builds or reads (argument struct, num_recv, fault messages) agree with it."""

from __future__ import annotations

import re
import types

import numpy as np
import pytest
import torch

from epgen.codegen import planner
from epgen.codegen import abi
from epgen.codegen.arch import ARCHES, traits
from epgen.codegen.config import EpConfig, Geometry
from epgen.codegen.render import render
from epgen.codegen.spec import EXPERT_OPS, KernelSpec, Op
from epgen.op import EpDispatchCombine, _args_dtype, _rank_io

WORLDS = (1, 2, 8)
CASES = [(op, arch, w) for op in Op for arch in ARCHES for w in WORLDS]


@pytest.fixture(params=CASES, ids=[f"{op.value}-{arch}-w{w}" for op, arch, w in CASES])
def case(request) -> tuple[KernelSpec, str]:
    op, arch, w = request.param
    s = KernelSpec(op=op, arch=arch, dtype="bf16", hidden=2048, topk=4, experts_per_rank=2, world_size=w,
                   max_tokens_per_rank=64, blocks=8, warps_per_block=4, unroll=2,
                   expert_alignment=16 if op in EXPERT_OPS else 0, ll_tokens=32 if op.low_latency else 0,
                   combine_quant="fp8_blockwise" if op is Op.COMBINE_QUANTIZE else "none")
    return s, render(s).text


def _struct(text: str, name: str) -> list[tuple[str, str, bool, str]]:
    """(ctype, member, is [kWorld] array, comment) of each member of ``struct name`` in ``text``."""
    body = re.search(rf"^struct {name} {{[^\n]*\n(.*?)^}};", text, re.S | re.M)
    assert body, f"struct {name} not found"
    lines = body.group(1).splitlines()
    members = [re.fullmatch(r"  (\w+) (\w+)(\[kWorld\])?; +// (.*)", ln) for ln in lines]
    assert all(members), f"struct {name}: a member line of another shape in {lines}"
    return [(m[1], m[2], bool(m[3]), m[4]) for m in members]


def _consts(text: str, prefix: str, ctype: str) -> dict[str, tuple[int, str]]:
    """{name: (value, comment or "")} of every ``constexpr <ctype> <prefix>...`` in ``text``."""
    found = re.findall(rf"^constexpr {ctype} ({prefix}\w+) = (\d+);(?: +// (.*))?$", text, re.M)
    return {n: (int(v), c) for n, v, c in found}


def test_structs_print_the_table_fields_in_order(case):
    _, text = case
    for name, table in (("EpRankIO", abi.RANK_IO), ("EpArgs", abi.ARGS)):
        want = [(f.ctype, f.name, f.per_rank, f.comment) for f in table]
        assert _struct(text, name) == want, name


def test_every_member_is_8_bytes_or_a_rank_io():
    for f in abi.RANK_IO:
        assert f.ctype in abi.NUMPY_TYPES and not f.per_rank, f
    for f in abi.ARGS:
        assert f.ctype in abi.NUMPY_TYPES or f.ctype == "EpRankIO", f
    assert all(np.dtype(t).itemsize == 8 for t in abi.NUMPY_TYPES.values())


def test_the_op_dtype_has_the_offsets_of_the_printed_struct(case):
    """Offsets from the rendered C (8-byte members, kWorld entries per array) against numpy's."""
    s, text = case
    assert f"constexpr int kWorld = {s.world_size};" in text
    io_members = _struct(text, "EpRankIO")
    dt = _args_dtype(s.world_size)
    io = dt["io"].base
    assert io.names == tuple(m for _, m, _, _ in io_members)
    for i, (ctype, member, _, _) in enumerate(io_members):
        assert io.fields[member] == (np.dtype(abi.NUMPY_TYPES[ctype]), 8 * i), member
    assert io.itemsize == 8 * len(io_members)
    offset = 0
    for ctype, member, per_rank, _ in _struct(text, "EpArgs"):
        sub, at = dt.fields[member]
        assert at == offset, f"EpArgs.{member}: numpy offset {at}, struct offset {offset}"
        assert sub.base == (io if ctype == "EpRankIO" else np.dtype(abi.NUMPY_TYPES[ctype])), member
        assert sub.shape == ((s.world_size,) if per_rank else ()), member
        offset += (s.world_size if per_rank else 1) * (io.itemsize if ctype == "EpRankIO" else 8)
    assert dt.itemsize == offset
    assert dt.names == tuple(m for _, m, _, _ in _struct(text, "EpArgs"))


def test_rank_io_records_are_filled_by_field_name():
    a = np.zeros((), dtype=_args_dtype(2))
    a["io"][1] = _rank_io(out=0x1000, num_tokens=7)
    assert a["io"]["out"][1] == 0x1000 and a["io"]["num_tokens"][1] == 7
    assert [int(a["io"][1][f.name]) for f in abi.RANK_IO if f.name not in ("out", "num_tokens")] == [0] * (len(abi.RANK_IO) - 2)
    assert a["io"]["out"][0] == 0
    with pytest.raises(TypeError, match="EpRankIO has no field tokens"):
        _rank_io(tokens=3)


def test_signal_words_are_the_table(case):
    _, text = case
    want = {s.c_name: (s.index, s.c_comment) for s in abi.SIGNALS}
    want |= {s.c_name + "Parity": (s.copy_words, "words from copy g % 2 = 0 to copy 1")
             for s in abi.SIGNALS if s.parities > 1}
    assert _consts(text, "kSig", "int") == want


def test_signal_words_do_not_overlap_for_the_widest_wave():
    widest = max(traits(a).wave_size for a in ARCHES)
    assert widest <= abi.MAX_RANKS
    spans = sorted((s.index, s.index + s.words, s.name) for s in abi.SIGNALS)
    for (_, end, name), (start, _, nxt) in zip(spans, spans[1:]):
        assert end <= start, f"signal {name} runs into {nxt}"
    assert spans[-1][1] == abi.SIGNAL_WORDS
    assert len({s.name for s in abi.SIGNALS}) == len(abi.SIGNALS)


def test_every_range_that_carries_per_call_values_has_a_copy_per_parity():
    """abi.PARITY_RULE: the low-latency flags (generation with row counts), the fault records and the
    overflow counts are read a call after they may be written for the next one; the normal family's
    flags carry a generation alone, where g + 1 implies g."""
    by_parity = {s.name for s in abi.SIGNALS if s.parities == 2}
    assert by_parity == {"ll_dispatch_from", "ll_combine_from", "overflow_need", "fault_dispatch", "fault_dispatch_ll",
                         "fault_combine", "fault_combine_ll"}
    assert all(s.width == len(abi.FAULT_RECORD) for s in abi.SIGNALS if s.name.startswith("fault_"))


def test_error_codes_phases_and_record_are_the_table(case):
    _, text = case
    claimed = {"kErrClaimed": (abi.ERROR_CLAIMED, "a claimed record being written (no code uses it)")}
    assert _consts(text, "kErr", "ep_u32") == {e.c_name: (e.code, e.comment) for e in abi.ERRORS} | claimed
    assert _consts(text, "kPhase", "ep_u32") == {p.c_name: (p.code, "") for p in abi.PHASES}
    assert f"in host-mapped memory: {', '.join(abi.ERROR_RECORD)}." in text
    assert f"ep_u32* rec = (ep_u32*)a.errors + rank * {len(abi.ERROR_RECORD)};" in text
    assert "if (ep_atomic_cas_system(rec, 0u, kErrClaimed) != 0u) return false;" in text
    assert f"ep_u32[W][{len(abi.ERROR_RECORD)}] host-mapped error records" in text


def test_codes_are_distinct_and_nonzero():
    for table in (abi.ERRORS, abi.PHASES):
        codes = [x.code for x in table]
        assert len(set(codes)) == len(codes) and min(codes) > 0
    assert abi.ERROR_CLAIMED not in [e.code for e in abi.ERRORS]


def _host_op(cfg: EpConfig) -> EpDispatchCombine:
    """An op with only the host state that recv_buffers and the fault messages read (no GPU)."""
    op = EpDispatchCombine.__new__(EpDispatchCombine)
    op.config, op.virtual, op.local_ranks = cfg, True, list(range(cfg.world_size))
    op.dispatch_spec = planner.explicit_spec(cfg, "sm_90", Op.DISPATCH, cfg.dispatch_geometry)
    op.arena_layout = op.dispatch_spec.arena_layout
    local = {r: torch.zeros(op.arena_layout.total_bytes, dtype=torch.uint8) for r in op.local_ranks}
    sig = slice(op.arena_layout.signals, op.arena_layout.signals + 4 * abi.SIGNAL_WORDS)  # CUDA: the arena's region
    op.arenas = types.SimpleNamespace(local=local, local_signals={r: t[sig] for r, t in local.items()})
    return op


CFG = EpConfig(world_size=2, hidden=2048, topk=4, num_experts=8, max_tokens_per_rank=16,
               dispatch_geometry=Geometry(4, 4, 2), combine_geometry=Geometry(4, 4, 2), timeout_s=2.5)


def test_num_recv_is_read_at_the_word_the_kernel_writes():
    op = _host_op(CFG)
    index, _ = _consts(render(op.dispatch_spec).text, "kSig", "int")["kSigNumRecv"]
    words = op.arenas.local[1][op.arena_layout.signals:op.arena_layout.signals + 4 * abi.SIGNAL_WORDS].view(torch.int32)
    words[index] = 13
    assert op.recv_buffers(1).num_recv.tolist() == [13]
    assert op.recv_buffers(0).num_recv.tolist() == [0]


def test_every_error_code_has_a_message_that_formats():
    for e in abi.ERRORS:
        for rank in (0, 2):  # record 2 with b = 2: a timeout waiting for its own blocks
            msg = abi.fault_message(e.code, 1, 2, 3, rank=rank, num_experts=8, timeout_s=2.5, capacity_rows=32)
            assert msg and "{" not in msg and "}" not in msg, (e.name, msg)
    unknown = max(e.code for e in abi.ERRORS) + 1
    assert abi.fault_message(unknown, 1, 2, 3, rank=0, num_experts=8, timeout_s=2.5, capacity_rows=32) == \
        abi.UNKNOWN_ERROR.format(code=unknown, a=1, b=2, c=3)


@pytest.mark.parametrize("record, message", [
    ((1, 2, 5, 0xFFFFFFFE), "rank 1: indices[5, 2]=-2: expert ids must be -1 or in [0, 8)"),
    ((1, 0, 3, 99), "rank 1: indices[3, 0]=99: expert ids must be -1 or in [0, 8)"),
    ((2, 1, 0, 7), "rank 1: timed out after 2.5 s in dispatch (waiting until the peer's receive buffers are free) "
                   "on rank 0 (call 7)"),
    ((2, 2, 0, 7), "rank 1: timed out after 2.5 s in dispatch (waiting for the peer's rows) on rank 0 (call 7)"),
    ((2, 3, 0, 4), "rank 1: timed out after 2.5 s in combine (waiting for the peer's expert outputs) on rank 0 "
                   "(call 4)"),
    ((2, 4, 1, 4), "rank 1: timed out after 2.5 s in the low-latency dispatch (waiting for the peer's rows; a peer "
                   "that took the normal family for this call never sends them: every rank must pick the same kernel "
                   "family, EpConfig.kernel_family) on rank 1" + abi.OWN_GRID_WAIT + " (call 4)"),
    ((2, 9, 0, 4), "rank 1: timed out after 2.5 s in phase 9 on rank 0 (call 4)"),
    ((3, 0, 1, 40), "rank 1: the receive buffer of rank 1 needed 40 rows in this dispatch, more than its 32 "
                    "(EpConfig.max_recv_tokens); the rows past them were dropped"),
    ((7, 1, 2, 3), "rank 1: unknown kernel fault code 7 (1, 2, 3)"),
])
def test_the_op_words_error_records_from_the_table(record, message):
    assert _host_op(CFG)._describe(1, *record) == message


def test_no_signal_word_is_written_with_a_plain_store(case):
    """Peers read (and add to) the signal words in later calls; on ROCm the end of a kernel does
    not order plain stores for them, so every write is a system-scope atomic or store."""
    spec, text = case
    body = text[text.index("EP_KERNEL("):]
    assert not re.findall(r"\bsig\s*\[[^\]]*\]\s*=(?!=)", body)
    assert not re.findall(r"ep_signals\([^)]*\)\s*\[[^\]]*\]\s*=(?!=)", body)
    if spec.op in (Op.DISPATCH, Op.COMBINE, Op.EXPAND_PLAN):  # the kernels with counters to reset
        assert "ep_store_relaxed_system(sig + kSig" in body
    if spec.op in (Op.DISPATCH_LL, Op.DISPATCH_LL_RECV):  # publish num_recv as the normal dispatch does
        assert "ep_store_relaxed_system(sig + kSigNumRecv" in body


def test_wide_signal_flags_are_8_byte_aligned():
    """64-bit flags must be naturally aligned to be single-copy atomic (one 8-byte access on every
    target; the signal region itself starts on a page)."""
    wide = [s for s in abi.SIGNALS if s.width == 2]
    assert {s.name for s in wide} == {"ll_dispatch_from", "overflow_need"}
    assert all(s.index % 2 == 0 and s.copy_words % 2 == 0 for s in wide)
    assert all(s.index + s.words <= abi.SIGNAL_WORDS for s in abi.SIGNALS)
