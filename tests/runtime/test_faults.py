"""epgen.faults: the faults a rank's signal words hold of the calls since its last synchronize, as
the kernels write them (abi.FAULT_RECORD into a peer's records of the call's parity; the overflow
words as {generation, rows})."""

import numpy as np
import pytest

from epgen import faults
from epgen.codegen import abi

W = 4


def _words(**counters) -> np.ndarray:
    words = np.zeros(abi.SIGNAL_WORDS, dtype=np.uint32)
    for name, value in counters.items():
        words[abi.signal(name).index] = value
    return words


def _record(words, name, gen, peer, code, a, b, c):
    s = abi.signal(name)
    at = s.index + (gen % 2) * s.copy_words + len(abi.FAULT_RECORD) * peer
    words[at:at + len(abi.FAULT_RECORD)] = (gen, code, a, b, c)


def _need(words, gen, rank, rows):
    s = abi.signal("overflow_need")
    at = s.index + (gen % 2) * s.copy_words + 2 * rank
    words[at:at + 2] = (rows, gen)  # little-endian 64-bit {generation (high), rows (low)}


def test_a_peer_fault_of_a_call_since_the_last_synchronize_is_found_once():
    words = _words(dispatch_calls=7, combine_calls=6)
    _record(words, "fault_dispatch", 7, peer=2, code=1, a=3, b=11, c=99)
    _record(words, "fault_combine", 5, peer=3, code=4, a=10, b=0, c=12)  # before the last synchronize
    ll = np.zeros((4, abi.LL_FLAG_SLOTS), dtype=np.uint32)
    now = faults.counters(words, ll)
    assert now["fault_dispatch"] == now["overflow_need"] == 7 and now["fault_combine"] == 6
    seen = {**now, "fault_dispatch": 6, "fault_combine": 5}
    assert faults.shared_faults(words, 0, W, seen, now) == [faults.SharedFault(2, 1, 3, 11, 99)]
    assert faults.shared_faults(words, 0, W, now, now) == []  # after that synchronize: nothing new


def test_a_record_of_a_later_call_than_the_counter_is_not_yet_this_ranks():
    """A peer ahead by one call may already have written the other parity's record: it belongs to
    a call this rank has not run, and is raised at the synchronize after it."""
    words = _words(dispatch_calls=3)
    _record(words, "fault_dispatch", 4, peer=1, code=1, a=0, b=0, c=8)
    now = faults.counters(words, None)
    assert faults.shared_faults(words, 0, W, {**now, "fault_dispatch": 2}, now) == []


def test_the_low_latency_records_count_by_the_receiving_halves_and_wrap_around():
    words = _words()
    ll = np.zeros((4, abi.LL_FLAG_SLOTS), dtype=np.uint32)
    ll[1, 0] = 1  # the dispatch's receiving half, block 0: call 2**32 + 1 wrapped
    ll[3, 0] = 2 ** 32 - 1
    _record(words, "fault_dispatch_ll", 1, peer=3, code=1, a=1, b=2, c=3)
    _record(words, "fault_combine_ll", 2 ** 32 - 1, peer=1, code=4, a=5, b=0, c=6)
    now = faults.counters(words, ll)
    seen = {**now, "fault_dispatch_ll": 2 ** 32 - 2, "fault_combine_ll": 2 ** 32 - 3}
    assert faults.shared_faults(words, 2, W, seen, now) == [faults.SharedFault(3, 1, 1, 2, 3),
                                                            faults.SharedFault(1, 4, 5, 0, 6)]


def test_an_overflow_is_found_for_the_rank_that_needed_the_rows_and_a_rank_s_own_record_is_skipped():
    words = _words(dispatch_calls=9)
    _need(words, 9, rank=1, rows=300)
    _need(words, 8, rank=3, rows=77)  # an older call's, the other parity
    _record(words, "fault_dispatch", 9, peer=0, code=1, a=0, b=0, c=5)  # never written for itself
    now = faults.counters(words, None)
    found = faults.shared_faults(words, 0, W, {**now, "overflow_need": 8, "fault_dispatch": 8}, now)
    assert found == [faults.SharedFault(1, faults.OVERFLOW, 0, 1, 300)]


@pytest.mark.parametrize("name", list(faults.RECORD_COUNTERS))
def test_every_range_read_has_a_copy_per_parity(name):
    assert abi.signal(name).parities == 2
