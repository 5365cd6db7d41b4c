"""The signal protocol of each kernel family, as data, and an explicit-state model checker of it.

``abi.SIGNALS`` says where each signal word lives; this module says who writes which word with
which generation and who waits for what, kernel by kernel (``KERNELS``), in the order each kernel
does it. ``check`` runs W ranks (processes) through a host program of consecutive calls and
explores every interleaving of their steps, each step atomic, looking for

* a rank that reads data, a flag, a fault record or an overflow count of another call than the one
  it runs (wrong rows, or a fault blamed on the wrong call),
* a state where some rank can never move again (a wait that ends in a timeout), and
* a synchronize that raises the wrong recoverable fault: the property checked, on every rank r and
  at every synchronize S of r that does not defer, is

      S raises a recoverable fault iff some rank's kernel found one (an injected fault, or an
      overflow of some receiving rank) in a call of S's window, and then the one of the lowest
      rank among them, that rank's first (by call; a bad id or short y before an overflow of the
      same call),

  where S's window is the calls whose last kernel finished on r after r's previous synchronize
  that did not defer (or the start) and before S. A call's outputs are used as valid exactly when
  a synchronize after it raises nothing, so this says: no faulted call's outputs are used
  unraised, no fault is raised twice or for a call that did not fault, and ranks that synchronize
  after the same calls raise the same fault at the same synchronize (the rule stated to callers,
  under which each rank's recovery, skipping the combines until its next dispatch, is the same).

A program (``check``'s ``program``) is a call per step, the same on every rank, or a tuple of one
call per rank (families chosen per rank: only the old variant's op can be driven so); a rank
synchronizes (``syncs``) after every call, as ``validate=True`` does, or at chosen points: after
call k, or between the two halves of a low-latency call k (``async_recv=True``, then
``synchronize()`` before ``handle.wait()``). A raise makes the rank skip every combine until its
next dispatch (the documented recovery). Generations are ``Protocol.generation_bits`` wide, and
wrap: with a few bits the wrap is reached in a short program.

Two fault designs (``Protocol.faults``):

* "consumed" (``PROTOCOL``, the kernels since f5455b47): a kernel writes the recoverable fault of
  every call that has one (the call's first: one claim per rank and call) into each rank's fault
  record [g % 2][rank], its own included, before its flags; each rank's receiving kernel of call
  g, once it has acquired peer p's call-g flag, takes slot [g % 2][p]: a record of call g goes
  into this rank's error record of p (first wins per rank) and the slot is zeroed
  (``abi.PARITY_RULE``: p writes it again in call g + 2). A sender that overflows receiver d maxes the rows (no generation) into
  entry d of every rank's overflow words [g % 2]; each rank's dispatch, after its done flags of g,
  records every nonzero entry d into its error record of d and zeroes it. The host reads only its
  error records: a synchronize while a split call's receiving half has not run defers (raises
  fatal faults only); otherwise it raises the lowest rank's record and clears them all.
* "windowed" (``WINDOWED_FAULTS``, the design before): a kernel shares only a fault its rank
  recorded first (``ep_report``); the overflow words hold {generation, rows} (atomic max); records
  are never cleared, and a host admits a peer's record or an overflow at synchronize when its
  generation lies in (seen, now] of its counter (wrap-around arithmetic of the width), and its own
  error record whatever the counters say (runtime/faults.py before f5455b47). ``check`` finds its
  defects: families chosen per rank hang; a synchronize between a split call's halves raises the faulting rank's
  own fault there and its peers' nowhere before the combine it skips (a hang); after a wrap an old
  record fires again on the peers only, and an overflow is reported by no rank (the old key wins
  the max); with ranks synchronizing at different calls a fault of a rank whose record is not
  cleared yet is never shared, so a peer uses that call's outputs unraised.

The model follows the kernels' templates (``templates/ops``): one step per signal store, per wait
on one peer's signal, per read of one peer's rows and per fault record shared (the records a
receiving kernel takes, each written by one peer and read by this rank alone, are one step); a store
"to each" rank is one step per rank, in rank order, and so is a wait "from each". Steps that can
only be no-ops in a check (the take of records when it injects no fault, the overflow words when
it injects no overflow, the point between the halves when no rank synchronizes there) are left
out of that check.

What the model leaves out: the memory model itself (a step's stores are visible to the steps that
follow it; the release/acquire pairs that make that true are checked on the assembly and cited in
the templates), the blocks of a kernel (one block per rank: flags per block behave as one flag per
rank), residency (the fused low-latency kernels launch cooperatively, and in the model a whole op
and its two halves are the same steps, since any step may wait arbitrarily long), timeouts (a wait
that can never succeed is reported as such) and fatal faults, row counts, capacities and payload
bytes (a data region holds the call that wrote it; an overflow count is one row over), a sender's
atomic max into every rank's overflow words (one step per destination), and the caller's work
between calls except where it writes a region peers read (the expert stage's combine_in, the pull
dispatch's x in dispatch_in).
"""

from __future__ import annotations

import itertools
import numbers
from collections import deque

import attrs

from epgen.codegen import abi


@attrs.frozen
class Step:
    """One atomic action of a rank in the model.

    Attributes:
        kind: "write" (store ``value`` into ``word`` of rank ``peer``), "wait" (until ``word`` of
            this rank written by ``peer`` holds the call's generation, or any later one when not
            ``exact``), "read" (this rank reads ``word`` written by ``peer``: it must hold this
            call), "fault" (the injected fault is seen here: recorded in this rank's own error
            record, first wins), "share" (a fault this kernel found in this call, into ``word``,
            the peer's fault records; the "windowed" design shares only a rank's first),
            "take" (the "consumed" design: this rank takes each peer's record of this call from
            ``word`` into its error records and zeroes it; one step, since each slot is written by
            its peer alone and no other step reads it), "overflow" (a sender that overflowed
            receiver ``peer`` maxes the rows into the overflow words), "overflow_take" (the
            "consumed" design: this rank's dispatch records and zeroes its own overflow words) or
            "host" (the caller writes a region before the call's kernels: ``word``).
        word: a signal of ``abi.SIGNALS`` or a data region (``REGIONS``).
        peer: "each" (every rank, this one included), "peers" (every other rank) or "self".
        value: what a write stores: "gen" (the kernel family's generation of the call) or "call"
            (the call itself: rows, which the reader checks against the call it runs, or for
            combine_in the dispatch being combined).
        exact: a wait for exactly the generation (a parity copy: ``abi.PARITY_RULE``); otherwise
            the generation or any later one, as the kernels' ``ep_flag_reached``.
        carries: the flag carries values of its call (the low-latency dispatch flag's row count and
            first token): a wait that accepts another call's generation gives wrong rows. A flag of
            a generation alone (the normal family's) may hold a later one: g + 1 implies g.
    """

    kind: str
    word: str
    peer: str = "self"
    value: str = "call"
    exact: bool = False
    carries: bool = False


REGIONS = {"ll_dispatch_stage": 2, "ll_combine_stage": 2, "recv_x": 1, "combine_in": 1, "dispatch_in": 1}
"""Data regions the model follows, with their copies by call parity (``ArenaLayout``): the
low-latency stages alternate by generation parity; the rest are single."""

HOST_REGIONS = ("combine_in", "dispatch_in")
"""Regions the caller writes into its own arena before a call (its expert outputs, its x for the
pull dispatch), which the peers' kernels read."""

KERNELS = {
    # dispatch.j2: phase 1 ready flags, phase 2 waits for each destination's ready flag and reserves
    # rows there (an overflow reaches the overflow words), phase 3 writes the rows, phase 4 the
    # faults for the peers, done flags, waits, and (consumed design) the peers' faults and the
    # overflow words taken.
    "dispatch": (Step("write", "ready_from", "each", "gen"),
                 Step("fault", "fault_dispatch"),
                 Step("wait", "ready_from", "each"),
                 Step("overflow", "overflow_need", "each"),
                 Step("write", "recv_x", "each"),
                 Step("share", "fault_dispatch", "peers"),
                 Step("write", "done_from", "each", "gen"),
                 Step("wait", "done_from", "each"),
                 Step("take", "fault_dispatch"),
                 Step("overflow_take", "overflow_need"),
                 Step("read", "recv_x", "each")),
    # dispatch_pull.j2 after dispatch.j2 (transport "pull"): loads each source's dispatch_in, then
    # raises "pulled" everywhere and waits for every rank's.
    "dispatch_pull": (Step("read", "dispatch_in", "each"),
                      Step("write", "pulled_from", "each", "gen"),
                      Step("wait", "pulled_from", "each")),
    # dispatch_ll.j2: the sending half, then the receiving half (one kernel, or the async_recv split).
    "dispatch_ll_send": (Step("fault", "fault_dispatch_ll"),
                         Step("write", "ll_dispatch_stage", "each"),
                         Step("share", "fault_dispatch_ll", "peers"),
                         Step("write", "ll_dispatch_from", "each", "gen")),
    "dispatch_ll_recv": (Step("wait", "ll_dispatch_from", "each", exact=True, carries=True),
                         Step("take", "fault_dispatch_ll"),
                         Step("read", "ll_dispatch_stage", "each")),
    # combine.j2: the first block records a short y and raises the ready flags; every block waits
    # for every rank's and reads their combine_in (the expert stage wrote it before the kernel).
    "combine": (Step("fault", "fault_combine"),
                Step("share", "fault_combine", "peers"),
                Step("write", "combine_ready_from", "each", "gen"),
                Step("wait", "combine_ready_from", "each"),
                Step("take", "fault_combine"),
                Step("read", "combine_in", "each")),
    # combine_ll.j2: each rank pushes its rows into the token's rank's stage, then flags.
    "combine_ll_send": (Step("fault", "fault_combine_ll"),
                        Step("write", "ll_combine_stage", "each"),
                        Step("share", "fault_combine_ll", "peers"),
                        Step("write", "ll_combine_from", "each", "gen")),
    "combine_ll_recv": (Step("wait", "ll_combine_from", "each", exact=True),
                        Step("take", "fault_combine_ll"),
                        Step("read", "ll_combine_stage", "each")),
}
"""Each kernel's steps, in the order its template does them ("fault": where the injected fault of
a call is seen, when the model injects one there; "take" and "overflow_take" belong to the
"consumed" design only)."""

CALLS = {
    # call: (kernel family counter, steps of the caller before the kernels, kernels)
    "dispatch": ("dispatch", (), ("dispatch",)),
    "dispatch_pull": ("dispatch", (Step("host", "dispatch_in"),), ("dispatch", "dispatch_pull")),
    "dispatch_ll": ("dispatch_ll", (), ("dispatch_ll_send", "dispatch_ll_recv")),
    "combine": ("combine", (Step("host", "combine_in"),), ("combine",)),
    "combine_ll": ("combine_ll", (), ("combine_ll_send", "combine_ll_recv")),
}
"""Each host call: the generation counter its kernels share (the normal dispatch and its pull
variant count together; each low-latency kernel block counts alike), what the caller writes
before it, and its kernels in stream order."""

COMBINE_OF = {"dispatch": "combine", "dispatch_pull": "combine", "dispatch_ll": "combine_ll"}
"""The combine of the family a dispatch took."""

FAMILY = {"dispatch": "normal", "dispatch_pull": "normal", "combine": "normal",
          "dispatch_ll": "low_latency", "combine_ll": "low_latency"}
"""The kernel family of each call (``EpConfig.kernel_family``)."""

HALVES = {"dispatch_ll": "dispatch_ll_send", "combine_ll": "combine_ll_send"}
"""The calls that run as two halves (``async_recv``), each with the kernel after which the host
may synchronize before ``handle.wait()`` launches the receiving half."""

RECORDS = {"fault_dispatch": "dispatch", "fault_dispatch_ll": "dispatch_ll", "fault_combine": "combine",
           "fault_combine_ll": "combine_ll", "overflow_need": "dispatch"}
"""Each range of per-call fault words -> the counter of ``CALLS`` whose generation its entries
carry (the "windowed" host compares with its window)."""


@attrs.frozen
class Protocol:
    """The protocol the model checks: ``KERNELS`` with the signal layout of ``abi.SIGNALS``.

    Attributes:
        parities: copies of each signal range by call parity (``abi.Signal.parities``).
        exact: whether the waits marked exact wait for exactly the generation (else any later one).
        share_faults: whether a rank hands a recoverable fault to its peers ("share" steps; in the
            "consumed" design also the "take" steps that read them).
        faults: the fault design, "consumed" or "windowed" (the module docstring says both).
        generation_bits: the width of every generation (32 in the kernels); the model stores and
            compares them modulo 2 ** width.
        overflow_everywhere: ("consumed") a sender maxes an overflow into every rank's overflow
            words; False: into the receiving rank's only.
        stated_family: every call names its family, the same on every rank: ``check`` refuses a
            program whose ranks take different families in a call, as the op refuses a dispatch
            without a stated family on an "auto" op with one process a rank.

    Raises:
        ValueError: ``parities`` lacks a signal the kernels use, or gives one other than 1 or 2
            copies; ``faults`` other than "consumed" or "windowed"; ``generation_bits`` not an int
            in [2, 32].
    """

    parities: dict = attrs.field(factory=lambda: {s.name: s.parities for s in abi.SIGNALS})
    exact: bool = True
    share_faults: bool = True
    faults: str = attrs.field(default="consumed")
    generation_bits: int = attrs.field(default=32)
    overflow_everywhere: bool = True
    stated_family: bool = True

    @parities.validator
    def _check_parities(self, attribute, value) -> None:
        """Raises ValueError: a signal the kernels use missing, or a count other than 1 or 2."""
        used = {st.word for steps in KERNELS.values() for st in steps} - set(REGIONS)
        if not isinstance(value, dict) or not used <= set(value) or any(
                value[w] not in (1, 2) or isinstance(value[w], bool) for w in used):
            raise ValueError(f"parities={value!r}: must map each of {', '.join(sorted(used))} to 1 or 2 copies")

    @faults.validator
    def _check_faults(self, attribute, value) -> None:
        if value not in ("consumed", "windowed"):
            raise ValueError(f"faults={value!r}: must be 'consumed' or 'windowed'")

    @generation_bits.validator
    def _check_bits(self, attribute, value) -> None:
        if not isinstance(value, numbers.Integral) or isinstance(value, bool) or not 2 <= value <= 32:
            raise ValueError(f"generation_bits={value!r}: must be an int in [2, 32]")

    def copies(self, word: str) -> int:
        return REGIONS[word] if word in REGIONS else self.parities[word]

    @property
    def modulus(self) -> int:
        return 1 << self.generation_bits


PROTOCOL = Protocol()
"""The protocol the kernels implement: fault records consumed by their readers."""

WINDOWED_FAULTS = Protocol(faults="windowed", stated_family=False)
"""The design before: records read by each host with a generation window, never cleared, a
rank's first fault alone shared, overflows as {generation, rows} maxed, and the family of an
"auto" op chosen by each process. ``check`` finds its defects (module docstring)."""

SINGLE_FLAGS = Protocol(parities={**PROTOCOL.parities, "ll_dispatch_from": 1, "ll_combine_from": 1}, exact=False)
"""The earlier layout of the low-latency flags: one slot per (source, block), any later generation
accepted. ``check`` finds its defect: a rank that dispatches again before a peer's receiving half
ran overwrites the flag that peer then accepts (a row count and slots of the wrong call)."""

LOCAL_FAULTS = attrs.evolve(PROTOCOL, share_faults=False)
"""Faults seen by one rank only (each process its own records): ``check`` finds the peers waiting
for a combine the faulting rank skipped."""

RECEIVER_OVERFLOW = attrs.evolve(PROTOCOL, overflow_everywhere=False)
"""The consumed design with a sender's overflow count in the receiving rank's words only: that
rank records its overflow after its done flags, too late to hand it to its peers in the call, and
``check`` finds the peers raising nothing (and waiting for the combine the receiver skips)."""


@attrs.frozen
class Result:
    """What ``check`` found: ``states`` explored, and the first ``violation`` (None: none) with the
    ``trace`` of (rank, step) that reaches it."""

    states: int
    violation: str | None
    trace: tuple = ()


def programs(calls: int = 3) -> list[tuple[str, ...]]:
    """Every host program of ``calls`` calls: dispatches of any family, each combine (of the family
    its dispatch took: ``COMBINE_OF``) right after a dispatch or after several (a dispatch without a
    combine: the documented recovery and the send/receive split's users), never a combine first or
    two in a row."""
    out = []
    for seq in itertools.product(("dispatch", "dispatch_pull", "dispatch_ll", "combine"), repeat=calls):
        if seq[0] == "combine" or any(a == b == "combine" for a, b in zip(seq, seq[1:])):
            continue
        last, calls_ = None, []
        for call in seq:
            last = call if call != "combine" else last
            calls_.append(COMBINE_OF[last] if call == "combine" else call)
        out.append(tuple(calls_))
    return out



def family_cases(world_size: int) -> list[dict]:
    """Programs whose ranks take different families in a call (an "auto" op whose processes each
    pick by their own token count): a dispatch of family F_r on rank r, then its combine, for every
    choice of F_r that is not the same on every rank. ``check``'s keyword arguments."""
    out = []
    for pick in itertools.product(("dispatch", "dispatch_ll"), repeat=world_size):
        if len(set(pick)) > 1:
            out.append(dict(program=(pick, tuple(COMBINE_OF[c] for c in pick))))
    return out


def halves_cases(world_size: int, calls: int = 2) -> list[dict]:
    """Programs of ``programs(calls)`` with low-latency calls, every rank synchronizing between the
    halves of some of them (every nonempty choice) and after a choice of calls that includes the
    last, with no fault or one in any call of any rank."""
    out = []
    for program in programs(calls):
        split = [k for k, c in enumerate(program) if c in HALVES]
        for n in range(1, len(split) + 1):
            for halves in itertools.combinations(split, n):
                for ends in _subsets_with_last(calls):
                    points = tuple((k, "halves") for k in halves) + ends
                    for fault in [None] + [(r, k) for r in range(world_size) for k in range(calls)]:
                        out.append(dict(program=program, fault=fault, syncs=(points,) * world_size))
    return out


def apart_cases(world_size: int, choosing: int | None = None) -> list[dict]:
    """Faults two calls apart in one kernel's counter (the same parity copy) by any ranks, each rank
    synchronizing after its own choice of calls (always the last): a short y in combines 1 and 5 of
    three dispatch-combine pairs of either family, ranks synchronizing after combines only (a
    dispatch fault raised by some ranks before the combine they skip and the others run hangs
    whatever the design: every rank synchronizes after the same calls, the rule stated to
    callers), and a bad id in dispatches 0 and 2 of three dispatches of either family. Ranks from
    ``choosing`` on (None: none) synchronize at every point instead of choosing."""
    out = []
    shapes = [(("dispatch", "combine") * 3, (1, 5), (1, 3, 5)),
              (("dispatch_ll", "combine_ll") * 3, (1, 5), (1, 3, 5)),
              (("dispatch",) * 3, (0, 2), (0, 1, 2)),
              (("dispatch_ll",) * 3, (0, 2), (0, 1, 2))]
    for program, (a, b), points in shapes:
        choices = [s for n in range(len(points)) for s in itertools.combinations(points[:-1], n)]
        fixed = world_size - (world_size if choosing is None else min(choosing, world_size))
        for syncs in itertools.product(choices, repeat=world_size - fixed):
            syncs += (points[:-1],) * fixed
            for ra, rb in itertools.product(range(world_size), repeat=2):
                out.append(dict(program=program, faults=((ra, a), (rb, b)),
                                syncs=tuple(s + (points[-1],) for s in syncs)))
    return out


def wrap_cases(world_size: int, generation_bits: int) -> list[dict]:
    """Programs that pass a wrap of ``generation_bits``-bit generations (check them with
    ``Protocol.generation_bits`` set to it): 2 ** bits + 1 dispatches of either family, then a
    combine, with a fault of rank ``world_size - 1`` in the first dispatch; and 2 ** bits + 1 normal
    dispatches with overflows of rank 1's rows in the dispatches of generations 2 ** bits - 1 and
    2 ** bits + 1 (the same parity copy), every rank synchronizing after every call."""
    m = 1 << generation_bits
    out = []
    for dispatch in ("dispatch", "dispatch_ll"):
        program = (dispatch,) * (m + 1) + (COMBINE_OF[dispatch],)
        out.append(dict(program=program, fault=(world_size - 1, 0)))
    if world_size > 1:
        out.append(dict(program=("dispatch",) * (m + 1), overflows=((0, 1, m - 2), (0, 1, m))))
    return out


def _subsets_with_last(calls: int) -> list[tuple]:
    return [s + (calls - 1,) for n in range(calls) for s in itertools.combinations(range(calls - 1), n)]


def check(protocol: Protocol, world_size: int, program, fault: tuple[int, int] | None = None, *,
          faults=(), overflows=(), syncs=None, limit: int = 2_000_000) -> Result:
    """Explore every interleaving of ``world_size`` ranks running ``program`` (``programs``, or
    with a tuple of one call per rank in place of a call: families chosen per rank), with
    recoverable faults first seen by rank ``r`` in call ``k`` for ``fault`` = (r, k) and each pair
    of ``faults``, receive overflows of rank ``d`` found by sender ``s`` in dispatch ``k`` for each
    (s, d, k) of ``overflows``, and each rank synchronizing at its points of ``syncs`` (None: after
    every call; else one collection per rank of call indices k, after call k, or pairs
    (k, "halves"): between the halves of low-latency call k).

    Raises:
        TypeError: ``protocol`` is not a Protocol.
        ValueError: ``world_size`` not an int >= 1, a program the op refuses (unknown calls, a
            combine first, two in a row, or of another family than its dispatch; families that
            differ between ranks in a call, with ``Protocol.stated_family``), faults or overflows
            outside the ranks and calls (an overflow in a call that is not a normal dispatch), or
            sync points outside the calls (halves of a call that has none); each naming the
            argument, its value and the rule.
        RuntimeError: more than ``limit`` states (the model grew past what CI can check).
    """
    args = _check_arguments(protocol, world_size, program, fault, faults, overflows, syncs)
    m = _Model(protocol, *args)
    start = m.initial()
    seen = {start: None}
    queue = deque([start])
    while queue:
        state = queue.popleft()
        moves = m.moves(state)
        if not moves:
            if not m.done(state):
                return Result(len(seen), m.stuck(state), _trace(seen, state))
            bad = m.wrong_raise(state)
            if bad:
                return Result(len(seen), bad, _trace(seen, state))
            continue
        for step, nxt in moves:
            if isinstance(nxt, str):
                return Result(len(seen), nxt, _trace(seen, state) + (step,))
            if nxt not in seen:
                seen[nxt] = (state, step)
                if len(seen) > limit:
                    raise RuntimeError(f"check: more than {limit} states")
                queue.append(nxt)
    return Result(len(seen), None)


def _integer(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _check_arguments(protocol, world_size, program, fault, faults, overflows, syncs):
    """``check``'s arguments, as its docstring says; returns them as ``_Model`` takes them: the
    world size, each rank's calls, the faults {(rank, call)}, the overflows {(sender, receiver,
    call)} and each rank's sync points {(call, 0: between the halves, 1: after the call)}."""
    if not isinstance(protocol, Protocol):
        raise TypeError(f"protocol: expected a Protocol, got {type(protocol).__name__}")
    if not _integer(world_size) or world_size < 1:
        raise ValueError(f"world_size={world_size!r}: must be an int >= 1")
    W = int(world_size)

    def each_rank(c):
        if isinstance(c, str) and c in CALLS:
            return (c,) * W
        if isinstance(c, (tuple, list)) and len(c) == W and all(isinstance(x, str) and x in CALLS for x in c):
            return tuple(c)
        return None

    steps = [each_rank(c) for c in program] if isinstance(program, (tuple, list)) else [None]
    if not isinstance(program, (tuple, list)) or any(s is None for s in steps):
        raise ValueError(f"program={program!r}: must be a tuple or list of calls, each one of {', '.join(CALLS)} "
                         f"or a tuple of {W} of them (one per rank)")
    program = tuple(program)
    for i, calls in enumerate(steps):
        if protocol.stated_family and len({FAMILY[c] for c in calls}) > 1:
            raise ValueError(f"program={program!r}: call {i} takes families {[FAMILY[c] for c in calls]} on the "
                             "ranks; every call names its family, the same on every rank (the op refuses a "
                             "dispatch without a stated family on an 'auto' op with one process a rank)")
    ranks = tuple(tuple(s[r] for s in steps) for r in range(W))
    for calls in ranks:
        last = None
        for i, call in enumerate(calls):
            if call in COMBINE_OF:
                last = call
            elif last is None or calls[i - 1] in COMBINE_OF.values() or COMBINE_OF[last] != call:
                raise ValueError(f"program={program!r}: call {i} ({call}) must follow a dispatch whose combine it "
                                 "is (the op refuses a combine first, two in a row, or one of another family)")
    n = len(program)
    found = set()
    for name, given in (("fault", [] if fault is None else [fault]), ("faults", faults)):
        if name == "faults" and not isinstance(given, (tuple, list, set, frozenset)):
            raise ValueError(f"faults={given!r}: must be a collection of (rank, call) pairs")
        for f in given:
            if not (isinstance(f, (tuple, list)) and len(f) == 2 and all(map(_integer, f))
                    and 0 <= f[0] < W and 0 <= f[1] < n):
                raise ValueError(f"{name}={(fault if name == 'fault' else given)!r}: must be None or a pair of ints "
                                 f"(rank in [0, {W}), call in [0, {n}))" if name == "fault" else
                                 f"faults={given!r}: each must be a pair of ints (rank in [0, {W}), call in [0, {n}))")
            found.add((int(f[0]), int(f[1])))
    if not isinstance(overflows, (tuple, list, set, frozenset)):
        raise ValueError(f"overflows={overflows!r}: must be a collection of (sender, receiver, call) triples")
    over = set()
    for o in overflows:
        if not (isinstance(o, (tuple, list)) and len(o) == 3 and all(map(_integer, o)) and 0 <= o[0] < W
                and 0 <= o[1] < W and 0 <= o[2] < n and CALLS[ranks[int(o[0])][int(o[2])]][0] == "dispatch"):
            raise ValueError(f"overflows={overflows!r}: each must be (sender, receiver, call), ranks in [0, {W}) "
                             f"and a call in [0, {n}) that is a normal dispatch on the sender")
        over.add(tuple(int(x) for x in o))
    if syncs is None:
        points = tuple(frozenset((k, 1) for k in range(n)) for _ in range(W))
    else:
        if not isinstance(syncs, (tuple, list)) or len(syncs) != W:
            raise ValueError(f"syncs={syncs!r}: must be None or {W} collections of sync points, one per rank")
        points = []
        for r, mine in enumerate(syncs):
            out = set()
            for p in (mine if isinstance(mine, (tuple, list, set, frozenset)) else [object()]):
                if _integer(p) and 0 <= p < n:
                    out.add((int(p), 1))
                elif (isinstance(p, (tuple, list)) and len(p) == 2 and _integer(p[0]) and p[1] == "halves"
                      and 0 <= p[0] < n and ranks[r][int(p[0])] in HALVES):
                    out.add((int(p[0]), 0))
                else:
                    raise ValueError(f"syncs={syncs!r}: rank {r}'s points must be calls k in [0, {n}) or "
                                     "(k, 'halves') of a low-latency call")
            points.append(frozenset(out))
        points = tuple(points)
    return W, ranks, frozenset(found), frozenset(over), points


def _trace(seen: dict, state) -> tuple:
    out = []
    while seen[state] is not None:
        state, step = seen[state]
        out.append(step)
    return tuple(reversed(out))


def _after(gen: int, seen: int, now: int, modulus: int) -> bool:
    """``seen < gen <= now`` in wrap-around arithmetic (``epgen.faults``)."""
    return 0 < (gen - seen) % modulus <= (now - seen) % modulus


def _where(pos) -> str:
    return f"between the halves of call {pos[0]}" if pos[1] == 0 else f"after call {pos[0]}"


def _describe(fault) -> str:
    rank, call, kind = fault
    if kind == "overflow":
        return f"the overflow of rank {rank}'s receive rows in call {call}"
    return f"rank {rank}'s fault of call {call}"


class _Model:
    """The transition system. A rank's state: (call index, step index in the call, the faults it
    raised as ((call, 0 between the halves or 1 after it), (rank, call, kind)), the dispatch being
    combined, whether it skips combines, the calls it skipped); memory: {(word, owner, writer,
    copy): value}; records: each rank's error records, one entry per rank: None or (call, kind),
    the first fault of that rank recorded since the last clear."""

    def __init__(self, protocol: Protocol, world_size: int, programs: tuple, faults, overflows, syncs):
        self.p, self.W, self.programs = protocol, world_size, programs
        self.faults, self.overflows, self.syncs = faults, overflows, syncs
        self.M = protocol.modulus
        self.consumed = protocol.faults == "consumed"
        self.halves = any(k == 0 for points in syncs for _, k in points)
        self.steps = {}
        self.cells = {}  # (word, owner, writer, copy) -> index into a state's memory tuple
        self.gens = {}
        self.counts = {}

    def cell(self, key) -> int:
        return self.cells.setdefault(key, len(self.cells))

    def initial(self):
        ranks = tuple((0, 0, (), -1, False, ()) for _ in range(self.W))
        return ranks, (), tuple((None,) * self.W for _ in range(self.W))

    # -- the steps of a call on one rank -------------------------------------------------------
    def call_steps(self, call: str) -> tuple:
        """(kind, word, peer rank or None, value, exact, peers only, carries) of every step of
        ``call``, expanded per rank; the steps that can only be no-ops in this check left out."""
        if call in self.steps:
            return self.steps[call]
        _, host, kernels = CALLS[call]
        keep = {"share": self.p.share_faults,
                "take": self.p.share_faults and self.consumed and bool(self.faults),
                "overflow": bool(self.overflows),
                "overflow_take": self.consumed and bool(self.overflows)}
        out = []
        for kernel in (None,) + kernels:
            for step in host if kernel is None else KERNELS[kernel]:
                if not keep.get(step.kind, True):
                    continue
                peers = {"each": range(self.W), "self": [None], "peers": range(self.W)}[step.peer]
                for d in peers:
                    out.append((step.kind, step.word, d, step.value, step.exact and self.p.exact,
                                step.peer == "peers", step.carries))
            if self.halves and kernel == HALVES.get(call):
                out.append(("halves", None, None, None, False, False, False))
        out.append(("end", None, None, None, False, False, False))
        self.steps[call] = tuple(out)
        return self.steps[call]

    def done(self, state) -> bool:
        return all(r[0] >= len(self.programs[0]) for r in state[0])

    def stuck(self, state) -> str:
        waiting = []
        for rank, r in enumerate(state[0]):
            if r[0] < len(self.programs[rank]):
                call = self.programs[rank][r[0]]
                kind, word, d, *_ = self.call_steps(call)[r[1]]
                waiting.append(f"rank {rank} in call {r[0]} ({call}) waits for {word} of rank {d}")
        return "no rank can move (a wait that ends in a timeout): " + "; ".join(waiting)

    def gen(self, rank: int, call_index: int, skipped: tuple) -> int:
        """The generation of call ``call_index`` in its counter on ``rank`` that skipped the calls
        ``skipped``: 1 + the calls of the same counter it ran before (a skipped combine launched
        no kernel)."""
        key = (rank, call_index, skipped)
        if key not in self.gens:
            program = self.programs[rank]
            counter = CALLS[program[call_index]][0]
            self.gens[key] = 1 + sum(1 for k in range(call_index)
                                     if CALLS[program[k]][0] == counter and k not in skipped)
        return self.gens[key]

    def counters(self, rank: int, pos, skipped: tuple) -> dict:
        """Each counter's count (modulo the width) of the calls ``rank`` finished by sync point
        ``pos`` (None: none): the "windowed" host's ``now`` there."""
        key = (rank, pos, skipped)
        if key not in self.counts:
            program = self.programs[rank]
            self.counts[key] = {c: sum(1 for k, call in enumerate(program) if CALLS[call][0] == c
                                       and k not in skipped and pos is not None and (k, 1) <= pos) % self.M
                                for c in CALLS}
        return self.counts[key]

    def schedule(self, rank: int, skipped: tuple) -> list:
        """The sync points of ``rank`` that take effect, in order: not those of a skipped call, and
        in the "consumed" design not those between the halves (they defer)."""
        return sorted(p for p in self.syncs[rank] if p[0] not in skipped and (p[1] == 1 or not self.consumed))

    def wrong_raise(self, state) -> str | None:
        """The first synchronize that breaks the property of the module docstring, said in words."""
        ranks = state[0]
        happened = {(q, k, "fault") for q, k in self.faults if k not in ranks[q][5]}
        happened |= {(d, k, "overflow") for _, d, k in self.overflows}
        for rank, (_, _, raised, _, _, skipped) in enumerate(ranks):
            got = dict(raised)
            previous = (-1, 1)
            for pos in self.schedule(rank, skipped):
                window = {k for k in range(len(self.programs[rank])) if previous < (k, 1) <= pos and k not in skipped}
                faulted = sorted(f for f in happened if f[1] in window)
                want, have = (faulted[0] if faulted else None), got.pop(pos, None)
                span = f"calls {min(window)}-{max(window)}" if window else "no call"
                if have != want:
                    if have is None:
                        return (f"rank {rank}'s synchronize {_where(pos)} raised nothing, but {_describe(want)} "
                                f"(its window: {span}): that call's outputs are used as valid")
                    if want is None:
                        return (f"rank {rank}'s synchronize {_where(pos)} raised {_describe(have)}, but no call of "
                                f"its window ({span}) faulted; ranks: {[r[2] for r in ranks]}")
                    return (f"rank {rank}'s synchronize {_where(pos)} raised {_describe(have)}, expected "
                            f"{_describe(want)} (the lowest rank's first fault of its window, {span})")
                previous = pos
            if got:
                return f"rank {rank} raised at points that are no synchronize of its window: {got}"
        return None

    def moves(self, state):
        ranks, mem, records = state
        memd = _Memory(self, mem)
        out = []
        for rank, (k, i, raised, combined, skipping, skipped) in enumerate(ranks):
            program = self.programs[rank]
            if k >= len(program):
                continue
            call = program[k]
            if i == 0 and skipping and call.startswith("combine"):  # the documented recovery: dispatch again
                nxt = list(ranks)
                nxt[rank] = (k + 1, 0, raised, combined, True, skipped + (k,))
                out.append(((rank, "skip " + call), (tuple(nxt), mem, records)))
                continue
            kind, word, d, value, exact, peers_only, carries = self.call_steps(call)[i]
            if peers_only and d == rank:
                nxt = list(ranks)
                nxt[rank] = (k, i + 1, raised, combined, skipping, skipped)
                out.append(((rank, "-"), (tuple(nxt), mem, records)))
                continue
            if kind in ("halves", "end"):
                pos = (k, 0 if kind == "halves" else 1)
                records2, fault = records, None
                if pos in self.syncs[rank]:
                    records2, fault = self.synchronize(rank, pos, memd, records, skipped)
                raised2 = raised + ((pos, fault),) if fault else raised
                nxt = list(ranks)
                if kind == "halves":
                    nxt[rank] = (k, i + 1, raised2, combined, skipping or bool(fault), skipped)
                else:
                    is_dispatch = not call.startswith("combine")
                    now = bool(fault) or bool(raised) and raised[-1][0] == (k, 0)
                    nxt[rank] = (k + 1, 0, raised2, k if is_dispatch else combined,
                                 now or (skipping and not is_dispatch), skipped)
                label = f"synchronize {_where(pos)}" + (f": raises {_describe(fault)}" if fault else "") \
                    if pos in self.syncs[rank] else "end"
                out.append(((rank, label), (tuple(nxt), mem, records2)))
                continue
            g = self.gen(rank, k, skipped)
            result = self._step(rank, k, g, combined, kind, word, d, value, exact, carries, memd, records)
            if result is None:
                continue  # a wait not yet satisfied
            if isinstance(result, str):
                out.append(((rank, f"{kind} {word} {d}"), f"rank {rank}, call {k} ({call}): {result}"))
                continue
            mem2, records2 = result
            nxt = list(ranks)
            nxt[rank] = (k, i + 1, raised, combined, skipping, skipped)
            out.append(((rank, f"{kind} {word} {d}"), (tuple(nxt), mem2.values, records2)))
        return out

    @staticmethod
    def _record(records, rank, entry, value):
        """``records`` with ``rank``'s error record of rank ``entry`` set to ``value`` unless it
        holds one (first wins, as ``ep_report``)."""
        if records[rank][entry] is not None:
            return records
        mine = records[rank][:entry] + (value,) + records[rank][entry + 1:]
        return records[:rank] + (mine,) + records[rank + 1:]

    def synchronize(self, rank, pos, memd, records, skipped):
        """The host's synchronize at ``pos``: (records after it, the fault it raises or None)."""
        if self.consumed:
            if pos[1] == 0:
                return records, None  # a receiving half has not run: recoverable faults wait
            mine = records[rank]
            first = next((p for p in range(self.W) if mine[p] is not None), None)
            if first is None:
                return records, None
            cleared = records[:rank] + ((None,) * self.W,) + records[rank + 1:]
            return cleared, (first,) + mine[first]
        # windowed: this process's own error record first, then every record whose generation lies
        # in (seen, now] of its counter; the lowest rank's is raised (epgen.faults, op._read_fault)
        earlier = [p for p in self.syncs[rank] if p < pos and p[0] not in skipped]
        seen = self.counters(rank, max(earlier) if earlier else None, skipped)
        now = self.counters(rank, pos, skipped)
        found = [(rank,) + records[rank][rank]] if records[rank][rank] is not None else []
        for word, counter in RECORDS.items():
            for parity in range(self.p.copies(word)):
                for peer in range(self.W):
                    if word != "overflow_need" and peer == rank:
                        continue
                    v = memd.get((word, rank, peer, parity))
                    if v is not None and _after(v[0], seen[counter], now[counter], self.M):
                        found.append((peer, v[1], "overflow" if word == "overflow_need" else "fault"))
        if not found:
            return records, None
        cleared = records[:rank] + ((None,) * self.W,) + records[rank + 1:]
        return cleared, min(found, key=lambda f: f[0])

    def _step(self, rank, k, g, combined, kind, word, d, value, exact, carries, memd, records):
        copy = g % self.p.copies(word)
        gm = g % self.M
        if kind == "host":
            return memd.set((word, rank, rank, 0), combined if word == "combine_in" else k), records
        if kind == "write":
            v = gm if value == "gen" else (combined if word == "combine_in" else k)
            return memd.set((word, d, rank, copy), v), records
        if kind == "wait":
            v = memd.get((word, rank, d, copy))
            if v is None or (v != gm if exact else (v - gm) % self.M >= self.M // 2):
                return None
            if v != gm and carries:
                return f"accepted generation {v} of rank {d}'s {word} for generation {gm} (its count and rows " \
                       "belong to another call: wrong rows)"
            return memd, records
        if kind == "read":
            want = combined if word == "combine_in" else k
            # a region the caller writes (combine_in, dispatch_in) is its owner's, read by every rank
            v = memd.get((word, d, d, 0) if word in HOST_REGIONS else (word, rank, d, copy))
            if v != want:
                return f"read {word} of rank {d} holding call {v}, expected call {want}"
            return memd, records
        if kind == "fault":
            if (rank, k) not in self.faults:
                return memd, records
            return memd, self._record(records, rank, rank, (k, "fault"))
        if kind == "share":
            found = (rank, k) in self.faults
            if not found or (not self.consumed and records[rank][rank] != (k, "fault")):
                return memd, records  # windowed: only a fault the rank recorded first (ep_report_call)
            return memd.set((word, d, rank, copy), (gm, k)), records
        if kind == "take":  # every peer's slot in one step: each is written by its peer alone
            for e in range(self.W):
                v = memd.get((word, rank, e, copy)) if e != rank else None
                if v is None or v[0] != gm:
                    continue
                if v[1] != k:
                    return f"took rank {e}'s fault record of call {v[1]} from {word} as call {k}'s"
                memd = memd.set((word, rank, e, copy), None)
                records = self._record(records, rank, e, (k, "fault"))
            return memd, records
        if kind == "overflow":
            if (rank, d, k) not in self.overflows:
                return memd, records
            for r in range(self.W) if not self.consumed or self.p.overflow_everywhere else [d]:
                v = memd.get((word, r, d, copy))
                if self.consumed:  # rows alone: one row over, the max of equal counts keeps the first
                    memd = memd if v is not None else memd.set((word, r, d, copy), k)
                elif v is None or v[0] < gm:  # {generation, rows}: the larger key wins
                    memd = memd.set((word, r, d, copy), (gm, k))
            return memd, records
        if kind == "overflow_take":
            for e in range(self.W):
                v = memd.get((word, rank, e, copy))
                if v is None:
                    continue
                if v != k:
                    return f"read rank {e}'s overflow count of call {v} from {word} as call {k}'s"
                memd = memd.set((word, rank, e, copy), None)
                records = self._record(records, rank, e, (k, "overflow"))
            return memd, records
        raise ValueError(kind)


class _Memory:
    """A state's memory: a tuple of values indexed by ``_Model.cell`` (None: never written, or
    zeroed), read and updated by key."""

    def __init__(self, model: _Model, values: tuple):
        self.model, self.values = model, values

    def get(self, key):
        i = self.model.cell(key)
        return self.values[i] if i < len(self.values) else None

    def set(self, key, value) -> "_Memory":
        i = self.model.cell(key)
        values = self.values + (None,) * (i + 1 - len(self.values)) if i >= len(self.values) else self.values
        return _Memory(self.model, values[:i] + (value,) + values[i + 1:])
