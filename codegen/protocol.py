"""The signal protocol of each kernel family, as data, and an explicit-state model checker of it.

``abi.SIGNALS`` says where each signal word lives; this module says who writes which word with
which generation and who waits for what, kernel by kernel (``KERNELS``), in the order each kernel
does it. ``check`` runs W ranks (processes) through a host program of consecutive calls and
explores every interleaving of their steps, each step atomic, looking for

* a rank that reads data or a flag of another call than the one it waits for (wrong rows),
* a state where some rank can never move again (a wait that ends in a timeout), and
* ranks that raise different recoverable faults, or at different calls (a fault must be raised by
  every rank at the call that faulted, so that all of them skip the same work).

A rank's host reads its fault records (``epgen.faults``) at the synchronize that ends each call
(``validate=True``). Windows of several calls between synchronizes are not modeled, and there the
guarantee is weaker: a rank that faults in two calls of one family two calls apart, synchronizing
between them, can replace its first fault's record (the same parity copy) before a peer's host has
read it; that peer then raises only the second fault, one synchronize later (README, "One process
per GPU").

The model follows the kernels' templates (``templates/ops``): one step per signal store, per wait
on one peer's signal, per read of one peer's rows and per fault record; a store "to each" rank is
one step per rank, in rank order, and so is a wait "from each". A rank's program is its host
calls: dispatch (of a family), combine (of the family its dispatch took), each followed, as
``validate=True`` does, by a synchronize that raises the recoverable faults its records hold, after
which the rank skips every combine until its next dispatch (the documented recovery).

What the model leaves out: the memory model itself (a step's stores are visible to the steps that
follow it; the release/acquire pairs that make that true are checked on the assembly and cited in
the templates), the blocks of a kernel (one block per rank: flags per block behave as one flag per
rank), residency (the fused low-latency kernels launch cooperatively, and in the model a whole op
and its two halves are the same steps, since any step may wait arbitrarily long), timeouts (a wait
that can never succeed is reported as such), row counts, capacities and payload bytes (a data region
holds the call that wrote it), and the caller's work between calls except where it writes a region
peers read (the expert stage's combine_in, the pull dispatch's x in dispatch_in).
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
            call), "share" (a fault this rank saw first in this call, into ``word``, the peer's
            fault records, which the peer's host reads at its synchronize), "fault" (the injected
            fault is seen here: recorded in this rank's own record) or "host" (the caller writes a
            region before the call's kernels: ``word``).
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
    # rows there, phase 3 writes the rows, phase 4 done flags, waits, and the peers' faults.
    "dispatch": (Step("write", "ready_from", "each", "gen"),
                 Step("fault", "fault_dispatch"),
                 Step("wait", "ready_from", "each"),
                 Step("write", "recv_x", "each"),
                 Step("share", "fault_dispatch", "peers"),
                 Step("write", "done_from", "each", "gen"),
                 Step("wait", "done_from", "each"),
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
                         Step("read", "ll_dispatch_stage", "each")),
    # combine.j2: the first block records a short y and raises the ready flags; every block waits
    # for every rank's and reads their combine_in (the expert stage wrote it before the kernel).
    "combine": (Step("fault", "fault_combine"),
                Step("share", "fault_combine", "peers"),
                Step("write", "combine_ready_from", "each", "gen"),
                Step("wait", "combine_ready_from", "each"),
                Step("read", "combine_in", "each")),
    # combine_ll.j2: each rank pushes its rows into the token's rank's stage, then flags.
    "combine_ll_send": (Step("fault", "fault_combine_ll"),
                        Step("write", "ll_combine_stage", "each"),
                        Step("share", "fault_combine_ll", "peers"),
                        Step("write", "ll_combine_from", "each", "gen")),
    "combine_ll_recv": (Step("wait", "ll_combine_from", "each", exact=True),
                        Step("read", "ll_combine_stage", "each")),
}
"""Each kernel's steps, in the order its template does them ("fault": where the injected fault of
a call is seen, when the model injects one there)."""

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


@attrs.frozen
class Protocol:
    """The protocol the model checks: ``KERNELS`` with the signal layout of ``abi.SIGNALS``.

    Attributes:
        parities: copies of each signal range by call parity (``abi.Signal.parities``).
        exact: whether the waits marked exact wait for exactly the generation (else any later one).
        share_faults: whether a rank hands a recoverable fault to its peers ("share" steps, read by
            each peer's host at synchronize).

    Raises:
        ValueError: ``parities`` lacks a signal the kernels use, or gives one other than 1 or 2 copies.
    """

    parities: dict = attrs.field(factory=lambda: {s.name: s.parities for s in abi.SIGNALS})
    exact: bool = True
    share_faults: bool = True

    @parities.validator
    def _check_parities(self, attribute, value) -> None:
        """Raises ValueError: a signal the kernels use missing, or a count other than 1 or 2."""
        used = {st.word for steps in KERNELS.values() for st in steps} - set(REGIONS)
        if not isinstance(value, dict) or not used <= set(value) or any(
                value[w] not in (1, 2) or isinstance(value[w], bool) for w in used):
            raise ValueError(f"parities={value!r}: must map each of {', '.join(sorted(used))} to 1 or 2 copies")

    def copies(self, word: str) -> int:
        return REGIONS[word] if word in REGIONS else self.parities[word]


PROTOCOL = Protocol()
"""The layout the kernels implement."""

SINGLE_FLAGS = Protocol(parities={**PROTOCOL.parities, "ll_dispatch_from": 1, "ll_combine_from": 1}, exact=False)
"""The earlier layout of the low-latency flags: one slot per (source, block), any later generation
accepted. ``check`` finds its defect: a rank that dispatches again before a peer's receiving half
ran overwrites the flag that peer then accepts (a row count and slots of the wrong call)."""

LOCAL_FAULTS = attrs.evolve(PROTOCOL, share_faults=False)
"""Faults seen by one rank only (each process its own records): ``check`` finds the peers waiting
for a combine the faulting rank skipped."""


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


def check(protocol: Protocol, world_size: int, program: tuple[str, ...], fault: tuple[int, int] | None = None,
          limit: int = 2_000_000) -> Result:
    """Explore every interleaving of ``world_size`` ranks running ``program`` (``programs``),
    with a recoverable fault first seen by rank ``fault[0]`` in call ``fault[1]`` (None: none).

    Raises:
        TypeError: ``protocol`` is not a Protocol.
        ValueError: ``world_size`` not an int >= 1, a program the op refuses (unknown calls, a
            combine first, two in a row, or of another family than its dispatch), or a fault
            outside the ranks and calls; each naming the argument, its value and the rule.
        RuntimeError: more than ``limit`` states (the model grew past what CI can check).
    """
    world_size, program, fault = _check_arguments(protocol, world_size, program, fault)
    m = _Model(protocol, world_size, program, fault)
    start = m.initial()
    seen = {start: None}
    queue = deque([start])
    while queue:
        state = queue.popleft()
        moves = m.moves(state)
        if not moves:
            if not m.done(state):
                return Result(len(seen), m.stuck(state), _trace(seen, state))
            bad = m.disagreement(state)
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


def _check_arguments(protocol, world_size, program, fault) -> tuple[int, tuple, tuple | None]:
    """``check``'s arguments, as its docstring says; returns them as ``_Model`` takes them."""
    def integer(x):
        return isinstance(x, numbers.Integral) and not isinstance(x, bool)

    if not isinstance(protocol, Protocol):
        raise TypeError(f"protocol: expected a Protocol, got {type(protocol).__name__}")
    if not integer(world_size) or world_size < 1:
        raise ValueError(f"world_size={world_size!r}: must be an int >= 1")
    if not isinstance(program, (tuple, list)) or not all(isinstance(c, str) and c in CALLS for c in program):
        raise ValueError(f"program={program!r}: must be a tuple or list of calls, each one of {', '.join(CALLS)}")
    program = tuple(program)
    last = None
    for i, call in enumerate(program):
        if call in COMBINE_OF:
            last = call
        elif last is None or program[i - 1] in COMBINE_OF.values() or COMBINE_OF[last] != call:
            raise ValueError(f"program={program!r}: call {i} ({call}) must follow a dispatch whose combine it "
                             "is (the op refuses a combine first, two in a row, or one of another family)")
    if fault is not None:
        if not (isinstance(fault, (tuple, list)) and len(fault) == 2 and all(map(integer, fault))
                and 0 <= fault[0] < world_size and 0 <= fault[1] < len(program)):
            raise ValueError(f"fault={fault!r}: must be None or a pair of ints (rank in [0, {world_size}), "
                             f"call in [0, {len(program)}))")
        fault = (int(fault[0]), int(fault[1]))
    return int(world_size), program, fault


def _trace(seen: dict, state) -> tuple:
    out = []
    while seen[state] is not None:
        state, step = seen[state]
        out.append(step)
    return tuple(reversed(out))


class _Model:
    """The transition system. A rank's state: (call index, step index in the call, the faults it
    raised as (call, count), the dispatch being combined, whether it skips combines, the calls it
    skipped); memory: {(word, owner, writer, copy): value}; records: each rank's error records as
    {(source rank, call)}."""

    def __init__(self, protocol: Protocol, world_size: int, program: tuple[str, ...], fault):
        self.p, self.W, self.program, self.fault = protocol, world_size, program, fault
        self.steps = {}
        self.cells = {}  # (word, owner, writer, copy) -> index into a state's memory tuple
        self.gens = {}

    def cell(self, key) -> int:
        return self.cells.setdefault(key, len(self.cells))

    def initial(self):
        ranks = tuple((0, 0, (), -1, False, ()) for _ in range(self.W))
        return ranks, (), tuple(frozenset() for _ in range(self.W))

    # -- the steps of a call on one rank -------------------------------------------------------
    def call_steps(self, call: str) -> tuple:
        """(kind, word, peer rank or None, value, exact) of every step of ``call``, expanded per rank."""
        if call in self.steps:
            return self.steps[call]
        _, host, kernels = CALLS[call]
        out = []
        for step in host + tuple(s for k in kernels for s in KERNELS[k]):
            if step.kind == "share" and not self.p.share_faults:
                continue
            peers = {"each": range(self.W), "self": [None], "peers": range(self.W)}[step.peer]
            for d in peers:
                out.append((step.kind, step.word, d, step.value, step.exact and self.p.exact, step.peer == "peers",
                            step.carries))
        shared = tuple(sorted({st.word for k in kernels for st in KERNELS[k] if st.kind == "share"}))
        out.append(("sync", shared, None, None, False, False, False))
        self.steps[call] = tuple(out)
        return self.steps[call]

    def done(self, state) -> bool:
        return all(r[0] >= len(self.program) for r in state[0])

    def stuck(self, state) -> str:
        waiting = []
        for rank, r in enumerate(state[0]):
            if r[0] < len(self.program):
                kind, word, d, *_ = self.call_steps(self.program[r[0]])[r[1]]
                waiting.append(f"rank {rank} in call {r[0]} ({self.program[r[0]]}) waits for {word} of rank {d}")
        return "no rank can move (a wait that ends in a timeout): " + "; ".join(waiting)

    def disagreement(self, state) -> str | None:
        raised = [r[2] for r in state[0]]
        if any(x != raised[0] for x in raised):
            return f"the ranks raised different faults: {raised}"
        if self.fault is not None and (self.fault[1],) != tuple(c for c, _ in raised[0]):
            return f"the fault of call {self.fault[1]} was raised at calls {[c for c, _ in raised[0]]}"
        return None

    def gen(self, call_index: int, skipped: tuple) -> int:
        """The generation of call ``call_index`` in its counter on a rank that skipped the calls
        ``skipped``: 1 + the calls of the same counter it ran before (a skipped combine launched
        no kernel)."""
        key = (call_index, skipped)
        if key not in self.gens:
            counter = CALLS[self.program[call_index]][0]
            self.gens[key] = 1 + sum(1 for k in range(call_index)
                                     if CALLS[self.program[k]][0] == counter and k not in skipped)
        return self.gens[key]

    def moves(self, state):
        ranks, mem, records = state
        memd = _Memory(self, mem)
        out = []
        for rank, (k, i, raised, combined, skipping, skipped) in enumerate(ranks):
            if k >= len(self.program):
                continue
            call = self.program[k]
            if skipping and call.startswith("combine"):  # the documented recovery: dispatch again
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
            g = self.gen(k, skipped)
            result = self._step(rank, k, g, combined, kind, word, d, value, exact, carries, memd, records, raised)
            if result is None:
                continue  # a wait not yet satisfied
            if isinstance(result, str):
                out.append(((rank, f"{kind} {word} {d}"), f"rank {rank}, call {k} ({call}): {result}"))
                continue
            mem2, records2, raised2 = result
            nxt = list(ranks)
            if kind == "sync":
                fresh = raised2 != raised
                is_dispatch = not call.startswith("combine")
                nxt[rank] = (k + 1, 0, raised2, k if is_dispatch else combined,
                             fresh or (skipping and not is_dispatch), skipped)
            else:
                nxt[rank] = (k, i + 1, raised, combined, skipping, skipped)
            out.append(((rank, f"{kind} {word} {d}"), (tuple(nxt), mem2.values, records2)))
        return out

    def _step(self, rank, k, g, combined, kind, word, d, value, exact, carries, memd, records, raised):
        copy = lambda gen: gen % self.p.copies(word)  # noqa: E731
        if kind == "host":
            return memd.set((word, rank, rank, 0), combined if word == "combine_in" else k), records, raised
        if kind == "write":
            v = g if value == "gen" else (combined if word == "combine_in" else k)
            return memd.set((word, d, rank, copy(g)), v), records, raised
        if kind == "wait":
            v = memd.get((word, rank, d, copy(g)))
            if v is None or (v != g if exact else v < g):
                return None
            if v != g and carries:
                return f"accepted generation {v} of rank {d}'s {word} for generation {g} (its count and rows " \
                       "belong to another call: wrong rows)"
            return memd, records, raised
        if kind == "read":
            want = combined if word == "combine_in" else k
            # a region the caller writes (combine_in, dispatch_in) is its owner's, read by every rank
            v = memd.get((word, d, d, 0) if word in HOST_REGIONS else (word, rank, d, copy(g)))
            if v != want:
                return f"read {word} of rank {d} holding call {v}, expected call {want}"
            return memd, records, raised
        if kind == "fault":
            if self.fault is None or self.fault != (rank, k):
                return memd, records, raised
            records = tuple(r | {(rank, k)} if i == rank else r for i, r in enumerate(records))
            return memd, records, raised
        if kind == "share":
            if (rank, k) not in records[rank]:
                return memd, records, raised
            return memd.set((word, d, rank, copy(g)), g), records, raised
        if kind == "sync":  # the host reads its own records and the peers' fault records of this call
            taken = {(peer, k) for w in (word if self.p.share_faults else ()) for peer in range(self.W)
                     if peer != rank and memd.get((w, rank, peer, g % self.p.copies(w))) == g}
            records = tuple(r | taken if i == rank else r for i, r in enumerate(records))
            fresh = tuple(sorted(c for _, c in records[rank] if c == k))
            return memd, records, raised + ((k, len(fresh)),) if fresh else raised
        raise ValueError(kind)


class _Memory:
    """A state's memory: a tuple of values indexed by ``_Model.cell`` (None: never written), read
    and updated by key."""

    def __init__(self, model: _Model, values: tuple):
        self.model, self.values = model, values

    def get(self, key):
        i = self.model.cell(key)
        return self.values[i] if i < len(self.values) else None

    def set(self, key, value) -> "_Memory":
        i = self.model.cell(key)
        values = self.values + (None,) * (i + 1 - len(self.values)) if i >= len(self.values) else self.values
        return _Memory(self.model, values[:i] + (value,) + values[i + 1:])
