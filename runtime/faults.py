"""The recoverable faults a rank's peers handed it, read from its signal words at synchronize.

A kernel that records a recoverable fault of its own rank first (``epgen.codegen.abi.ERRORS``)
also writes it into every peer's fault records of that call (``abi.FAULT_RECORD``: one range per
kernel and call parity, ``abi.SIGNALS`` "fault_*"), and a dispatch that overflows a rank writes the
rows that rank needed into every rank's ``overflow_need`` words, all before the call's flags. Once a
rank's stream has passed the call (``EpDispatchCombine.synchronize``), its host copies its signal
words and finds there the faults of every call since its last synchronize: the records whose
generation lies after the generation it last saw and at most the kernel's counter now. So every
rank raises the same faults at the same synchronizing call, when each synchronizes every call; with
more calls between synchronizes a record has one copy per call parity, and a rank's fault two
calls later can replace it unread, and after 2^32 calls of one kernel a record that old is read
again as new (README, "One process per GPU").
"""

from __future__ import annotations

import attrs
import numpy as np

from epgen.codegen import abi

RECORD_COUNTERS = {
    "fault_dispatch": ("signal", "dispatch_calls"),
    "fault_dispatch_ll": ("ll_calls", 1),
    "fault_combine": ("signal", "combine_calls"),
    "fault_combine_ll": ("ll_calls", 3),
    "overflow_need": ("signal", "dispatch_calls"),
}
"""Each range of per-call fault words -> the counter whose generation its entries carry: a word of
the signal region, or a row of the arena's ``ll_calls`` counters (block 0: rows 0-3 count the
low-latency dispatch's sending and receiving halves and the combine's; every block counts alike)."""

OVERFLOW = next(e.code for e in abi.ERRORS if e.name == "overflow")
"""The error code of a receive overflow, which every rank derives from its ``overflow_need`` words."""


@attrs.frozen
class SharedFault:
    """A fault some rank's kernel found, as this rank's signal words hold it.

    Attributes:
        rank: the rank the fault belongs to (error record ``rank``).
        code, a, b, c: the error record's words (``abi.ERRORS``).
    """

    rank: int
    code: int
    a: int
    b: int
    c: int


def counters(signal_words: np.ndarray, ll_calls: np.ndarray | None) -> dict[str, int]:
    """The generation each range of ``RECORD_COUNTERS`` has reached: ``signal_words`` the rank's
    uint32 signal words, ``ll_calls`` its [4, LL_FLAG_SLOTS] uint32 counters (None without the
    low-latency family: those ranges stay at 0)."""
    out = {}
    for name, (where, which) in RECORD_COUNTERS.items():
        if where == "signal":
            out[name] = int(signal_words[abi.signal(which).index])
        else:
            out[name] = int(ll_calls[which, 0]) if ll_calls is not None else 0
    return out


def _after(gen: int, seen: int, now: int) -> bool:
    """``seen < gen <= now`` in 32-bit wrap-around arithmetic."""
    return 0 < (gen - seen) % (1 << 32) <= (now - seen) % (1 << 32)


def shared_faults(signal_words: np.ndarray, rank: int, world_size: int, seen: dict[str, int],
                  now: dict[str, int]) -> list[SharedFault]:
    """The faults ``rank``'s signal words hold of calls after ``seen`` (``counters`` at the last
    synchronize) up to ``now``: every peer's fault records of those calls, and each rank whose
    receive rows a dispatch overflowed (``rank`` field: the receiving rank, c: the rows it needed).

    Args:
        signal_words: [SIGNAL_WORDS] uint32, ``rank``'s signal region, read while its stream is idle.

    Raises:
        ValueError: ``world_size`` above ``abi.MAX_RANKS`` (the ranges hold that many ranks).
    """
    if not 1 <= world_size <= abi.MAX_RANKS:
        raise ValueError(f"world_size={world_size}: the fault ranges hold 1 to {abi.MAX_RANKS} ranks")
    found = []
    width = len(abi.FAULT_RECORD)
    for name in RECORD_COUNTERS:
        s = abi.signal(name)
        for parity in range(s.parities):
            base = s.index + parity * s.copy_words
            for peer in range(world_size):
                if name == "overflow_need":
                    lo, hi = (int(w) for w in signal_words[base + 2 * peer:base + 2 * peer + 2])
                    if lo and _after(hi, seen[name], now[name]):  # {generation (high word), rows (low word)}
                        found.append(SharedFault(peer, OVERFLOW, 0, peer, lo))
                    continue
                if peer == rank:
                    continue
                gen, code, a, b, c = (int(w) for w in signal_words[base + width * peer:base + width * (peer + 1)])
                if code and _after(gen, seen[name], now[name]):  # code 0: never written
                    found.append(SharedFault(peer, code, a, b, c))
    return found
