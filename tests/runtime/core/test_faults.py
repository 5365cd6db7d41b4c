"""The host's fault path (``EpDispatchCombine._raise_if_faulted`` / ``synchronize`` / ``check``)
against error records as the kernels leave them, for every rank.

``Kernels`` mirrors what the templates do with the fault words (templates/common/_prelude.j2,
_dispatch_rows.j2, ops/dispatch*.j2, ops/combine*.j2): the sending side of call g claims the call
(the rank's own record [g % 2][rank], compare-and-swap from 0) and writes its fault into record
[g % 2][rank] of every rank, itself included; every rank's receiving side of call g copies each
rank's record of the call into its process's error record of that rank (the first since the host
cleared them stays) and zeroes it; a normal dispatch's senders max the rows a rank needed into
every rank's overflow words [g % 2], and every rank's dispatch records and zeroes them after its
done flags. The words live at their ``abi.SIGNALS`` offsets; the error records are the op's own
``ErrorRecords``; the host code is the op's.

Each scenario of the fault review runs for W = 2 and 3 with the generations starting just below
2^32, so the calls wrap: a synchronize between the halves of a split call, faults and overflows on
both sides of the wrap, faults two calls apart with ranks synchronizing at different calls. The
property: every rank raises, at its first synchronize after a faulted call's receiving half, and
ranks that synchronize after the same calls raise the same text; no synchronize raises without a
fault since the rank's last one; nothing is left in the signal words after a call.
"""

import ctypes
import types

import numpy as np
import pytest

from epgen.arena import ErrorRecords
from epgen.codegen import abi
from epgen.codegen.config import EpConfig
from epgen.op import EpDispatchCombine, EpError

RECORDS = {"dispatch": "fault_dispatch", "dispatch_ll": "fault_dispatch_ll", "combine": "fault_combine",
           "combine_ll": "fault_combine_ll"}
BAD_ID, OVERFLOW, SHORT = (next(e.code for e in abi.ERRORS if e.name == n) for n in ("bad_expert", "overflow",
                                                                                      "short_input"))
START = 2 ** 32 - 3  # the last finished call of every kernel: the third call wraps to 0


class _HostMemory:
    """``ErrorRecords``' platform calls on host memory."""

    def __init__(self):
        self.buffers = {}

    def host_alloc_mapped(self, nbytes):
        buf = (ctypes.c_uint8 * nbytes)()
        self.buffers[ctypes.addressof(buf)] = buf
        return ctypes.addressof(buf)

    def free_host(self, ptr):
        del self.buffers[ptr]


class HostOp(EpDispatchCombine):
    """The op's host fault path alone: one rank of W, its error records in host memory."""

    def __init__(self, cfg: EpConfig, rank: int):
        self.config, self.local_ranks, self.virtual = cfg, [rank], False
        self.arena_layout = types.SimpleNamespace(capacity_rows=64)
        self.errors = ErrorRecords(cfg.world_size, _HostMemory())
        self.device = "cpu"
        self._start_calls()
        self._pending_tokens = [1]


class Kernels:
    """W ranks' signal words and ops, driven call by call as the kernels would leave them."""

    def __init__(self, world_size: int):
        cfg = EpConfig(world_size=world_size, hidden=2048, topk=4, num_experts=4 * world_size, max_tokens_per_rank=16)
        self.W = world_size
        self.words = [np.zeros(abi.SIGNAL_WORDS, dtype=np.uint32) for _ in range(world_size)]
        self.ops = [HostOp(cfg, r) for r in range(world_size)]
        self.gen = dict.fromkeys(RECORDS, START)

    def _record(self, d: int, kernel: str, gen: int, p: int) -> int:
        s = abi.signal(RECORDS[kernel])
        return s.index + (gen % 2) * s.copy_words + p * len(abi.FAULT_RECORD)

    def _need(self, d: int, gen: int, rank: int) -> int:
        s = abi.signal("overflow_need")
        return s.index + (gen % 2) * s.copy_words + 2 * rank

    def report(self, d: int, rank: int, code: int, a: int, b: int, c: int):
        """ep_report into rank d's process: the first since the host cleared the records stays."""
        words = self.ops[d].errors._words
        n = len(abi.ERROR_RECORD)
        if words[n * rank] == 0:
            words[n * rank + 1:n * rank + 4] = [a, b, c]
            words[n * rank] = code

    def send(self, kernel: str, faults=None, overflow=None) -> int:
        """The sending side of the next call of ``kernel`` on every rank: ``faults`` {rank: [(code, a,
        b, c), ...]} (each a block's first; the call's claim picks the first), ``overflow`` {rank
        that overflowed: [rows each sending block posted]}. Returns the call's generation."""
        gen = self.gen[kernel] = (self.gen[kernel] + 1) % 2 ** 32
        for r, found in (faults or {}).items():
            for code, a, b, c in found:
                own = self._record(r, kernel, gen, r)
                if self.words[r][own] != 0:  # the call is claimed: a second block's fault is not shared
                    continue
                self.words[r][own] = gen
                for d in range(self.W):
                    at = self._record(d, kernel, gen, r)
                    self.words[d][at:at + len(abi.FAULT_RECORD)] = (gen, code, a, b, c)
        for rank, posted in (overflow or {}).items():
            for rows in posted:
                for d in range(self.W):
                    at = self._need(d, gen, rank)
                    self.words[d][at] = max(int(self.words[d][at]), rows)
        return gen

    def receive(self, kernel: str, gen: int):
        """Every rank's receiving side of call ``gen`` of ``kernel``, after every flag of it."""
        for d in range(self.W):
            for p in range(self.W):
                at = self._record(d, kernel, gen, p)
                if self.words[d][at] == gen:
                    self.report(d, p, *(int(w) for w in self.words[d][at + 1:at + 5]))
                    self.words[d][at:at + len(abi.FAULT_RECORD)] = 0
                if kernel == "dispatch":
                    need = self._need(d, gen, p)
                    if self.words[d][need]:
                        self.report(d, p, OVERFLOW, 0, p, int(self.words[d][need]))
                        self.words[d][need] = 0

    def call(self, kernel: str, **kw) -> int:
        gen = self.send(kernel, **kw)
        self.receive(kernel, gen)
        return gen

    def synchronize(self, rank: int) -> str | None:
        """Rank ``rank``'s ``op.synchronize()`` (its stream idle): the EpError text or None."""
        try:
            self.ops[rank]._raise_if_faulted(synchronized=True)
        except EpError as e:
            assert e.recoverable, e
            return str(e)
        return None

    def everyone(self) -> list:
        return [self.synchronize(r) for r in range(self.W)]

    def left(self) -> list[str]:
        """Fault and overflow words still set in any rank's signals."""
        ranges = [abi.signal(n) for n in (*RECORDS.values(), "overflow_need")]
        return [f"rank {d} {s.name}" for d in range(self.W) for s in ranges if self.words[d][s.index:s.index + s.words].any()]


WORLDS = [2, 3]


@pytest.mark.parametrize("world_size", WORLDS)
@pytest.mark.parametrize("kernel", list(RECORDS))
def test_a_fault_of_any_rank_is_raised_by_every_rank_at_the_same_synchronize_and_leaves_nothing(world_size, kernel):
    """Each kernel's fault of each rank, across the wrap (calls START + 1 .. START + 6), with a
    second block's fault in the same call (not shared: the call is claimed) and a fault of another
    rank two calls later."""
    for culprit in range(world_size):
        k = Kernels(world_size)
        code = SHORT if kernel.startswith("combine") else BAD_ID
        for i in range(6):
            faults = {culprit: [(code, 1, 2, 3), (code, 4, 5, 6)]} if i == 1 else \
                     {(culprit + 1) % world_size: [(code, 7, 8, 9)]} if i == 3 else {}
            k.call(kernel, faults=faults)
            raised = k.everyone()
            assert not k.left(), k.left()
            if i in (1, 3):
                assert raised[0] and raised == [raised[0]] * world_size, raised
                who = culprit if i == 1 else (culprit + 1) % world_size
                assert raised[0].startswith(f"rank {who}: ") and ("1" if i == 1 else "7") in raised[0]
            else:
                assert raised == [None] * world_size, (i, raised)


@pytest.mark.parametrize("world_size", WORLDS)
def test_an_overflow_on_both_sides_of_the_wrap_is_raised_by_every_rank(world_size):
    """The overflow words hold plain row counts, consumed by every rank's dispatch: an overflow
    before the wrap cannot hide one after it (a 64-bit {generation, rows} maximum could)."""
    k = Kernels(world_size)
    for i in range(5):
        overflow = {world_size - 1: [70, 90, 65]} if i in (0, 4) else {}  # i = 0: call 2^32 - 2; i = 4: call 2
        k.call("dispatch", overflow=overflow)
        raised = k.everyone()
        assert not k.left()
        if overflow:
            assert raised == [raised[0]] * world_size and f"rank {world_size - 1}: " in raised[0]
            assert "needed 90 rows" in raised[0], raised[0]
        else:
            assert raised == [None] * world_size


@pytest.mark.parametrize("world_size", WORLDS)
@pytest.mark.parametrize("kernel", ["dispatch_ll", "combine_ll"])
def test_a_synchronize_between_the_halves_raises_on_no_rank_and_the_next_one_on_every_rank(world_size, kernel):
    """A split call's sending half found a fault on the last rank; every rank synchronizes before
    its receiving half: the fault reaches no rank's records until then, so no rank raises (the
    old design raised it on the faulting rank alone: it skipped the combine its peers ran); after
    the receiving halves every rank raises it."""
    k = Kernels(world_size)
    code = SHORT if kernel == "combine_ll" else BAD_ID
    gen = k.send(kernel, faults={world_size - 1: [(code, 2, 0, 3)]})
    assert k.everyone() == [None] * world_size
    k.receive(kernel, gen)
    raised = k.everyone()
    assert raised[0] and raised == [raised[0]] * world_size and raised[0].startswith(f"rank {world_size - 1}: ")
    assert not k.left()


@pytest.mark.parametrize("world_size", WORLDS)
def test_faults_two_calls_apart_with_ranks_synchronizing_after_different_calls(world_size):
    """Rank 0 synchronizes after every call, the others only after the third: each rank raises at
    its first synchronize after each faulted call it had not raised yet (rank 0 twice, the others
    once, the first fault: the records keep the first), nothing is lost or raised twice, and
    nothing stays in the signal words; calls then go on with no fault and raise nowhere."""
    k = Kernels(world_size)
    seen = {r: [] for r in range(world_size)}
    for i in range(3):
        k.call("combine", faults={1: [(SHORT, 10 + i, 0, 20 + i)]} if i in (0, 2) else {})
        seen[0].append(k.synchronize(0))
    for r in range(1, world_size):
        seen[r].append(k.synchronize(r))
    assert [s is not None for s in seen[0]] == [True, False, True]
    assert "y has 10 rows" in seen[0][0] and "y has 12 rows" in seen[0][2]
    assert all(seen[r] == [seen[0][0]] for r in range(1, world_size))  # the first fault, at their first synchronize
    assert not k.left()
    k.call("combine")
    assert k.everyone() == [None] * world_size


def test_a_fatal_fault_is_raised_at_every_call_and_a_recoverable_one_waits_for_an_open_handle():
    k = Kernels(2)
    gen = k.send("dispatch_ll", faults={0: [(BAD_ID, 0, 1, 99)]})
    k.receive("dispatch_ll", gen)
    op = k.ops[0]
    op._recv_handle = object()  # a split call's receiving half not waited for yet
    op._raise_if_faulted(recoverable=True)  # check(): deferred
    assert k.synchronize(0) is None
    op._recv_handle = None
    with pytest.raises(EpError, match=r"indices\[1, 0\]=99.*op.synchronize\(\) on every rank"):
        op.check()
    assert "cleared" in k.synchronize(0)
    k.report(0, 1, next(e.code for e in abi.ERRORS if e.name == "timeout"), 0, 1, 5)
    for _ in range(2):
        with pytest.raises(EpError, match="unusable after that fault"):
            op._raise_if_faulted()


def test_a_closed_op_refuses_every_call_before_it_touches_a_buffer():
    op = HostOp(EpConfig(world_size=2, hidden=2048, topk=4, num_experts=8, max_tokens_per_rank=16), 0)
    op.arenas = types.SimpleNamespace(close=lambda: None)
    op.close()
    for call in (op.check, lambda: op.dispatch(None, None, None), lambda: op.combine(None), op.expand):
        with pytest.raises(RuntimeError, match=r"closed \(close\(\) released its buffers\); build a new op"):
            call()
