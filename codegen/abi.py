"""The host-kernel ABI, written once: launch arguments, signal words, error records, wait phases.

``templates/common/_prelude.j2`` prints the C declarations from these tables (template variable
``abi``, this module) and ``epgen.op`` reads the same tables to build its argument struct, to find
``num_recv`` among the signal words and to word the kernels' error records. Adding a field, a
signal word, an error code or a phase is one line here (and the kernel code that uses it).
"""

from __future__ import annotations

import attrs

ERROR_RECORD = ("code", "a", "b", "c")
"""The uint32 words of one rank's error record (host-mapped); code 0 means no error."""


NUMPY_TYPES = {"ep_u64": "<u8", "ep_i64": "<i8"}
"""numpy type string of each scalar C type of the argument structs (all 8 bytes: no padding)."""


def _camel(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("_"))


@attrs.frozen
class Field:
    """One member of a launch-argument struct.

    Attributes:
        name: the member name, in C and in the host's numpy dtype.
        ctype: ``ep_u64``, ``ep_i64`` (8 bytes) or ``EpRankIO`` (the ``RANK_IO`` struct).
        comment: printed after the declaration.
        per_rank: an array of ``kWorld`` entries, one per rank.
    """

    name: str
    ctype: str
    comment: str
    per_rank: bool = False

    @property
    def decl(self) -> str:
        """The C declaration without the semicolon, e.g. ``ep_u64 arena[kWorld]``."""
        return f"{self.ctype} {self.name}{'[kWorld]' if self.per_rank else ''}"


RANK_IO = (
    Field("x", "ep_u64", "dispatch: [T, H] payload; combine: unused"),
    Field("weights", "ep_u64", "dispatch: [T, K] float32"),
    Field("indices", "ep_u64", "dispatch: [T, K] int32"),
    Field("scales", "ep_u64", "dispatch: [T, S] bytes (0 when S = 0)"),
    Field("out", "ep_u64", "combine: [T, H] bf16 output"),
    Field("y", "ep_u64", "fold, combine_quantize, the low-latency combine, the quantized combine (its own rows; 0: "
                         "from its wire rows): [y_rows, H] bf16 expert outputs (the caller's, the expert layout's, "
                         "or combine_in)"),
    Field("y_rows", "ep_u64", "combine, fold: rows of the caller's y (checked against the rows used)"),
    Field("num_tokens", "ep_u64", "T of this rank"),
    Field("quantize", "ep_u64", "fold: 1 = rows from other ranks as combine wire rows (the normal combine follows)"),
)
"""struct EpRankIO: the buffers of one rank launched by the grid (addresses, 0 when unused)."""

ARGS = (
    Field("arena", "ep_u64", "every rank's arena, as mapped in this process", per_rank=True),
    Field("signals", "ep_u64", "every rank's signal words (CUDA: arena + kOffSignals; ROCm: uncached)", per_rank=True),
    Field("io", "EpRankIO", "[0, gridDim.y) used", per_rank=True),
    Field("errors", "ep_u64", f"ep_u32[W][{len(ERROR_RECORD)}] host-mapped error records"),
    Field("rank_base", "ep_i64", "rank of blockIdx.y == 0"),
    Field("timeout_ns", "ep_i64", "bound of every spin-wait"),
)
"""struct EpArgs: the one launch argument, passed by value.

``arena`` holds the bulk data (ordinary device memory: ``cudaMalloc`` / ``hipMalloc``, which on
ROCm is coarse-grained, coherent only at kernel boundaries). ``signals`` holds each rank's
``SIGNAL_WORDS`` signal words: on CUDA the region at ``ArenaLayout.signals`` of that rank's arena
(one allocation); on ROCm a separate ``hipExtMallocWithFlags(hipDeviceMallocUncached)``
allocation, so that peers' stores and atomics are seen while the kernels run
(``epgen.platform``)."""


MAX_RANKS = 64
"""Ranks a per-peer range holds: the widest wave (64 lanes), so one wave reads a whole range."""


@attrs.frozen
class Signal:
    """A range of uint32 words of a rank's signal region: one word (the default), a per-peer
    range (``per_peer``: ``MAX_RANKS`` entries, entry r written by peer r), or ``slots`` entries;
    each entry ``width`` words, and the whole range repeated ``parities`` times, one copy per call
    parity (generation g uses copy g % 2: see ``PARITY_RULE``).

    Attributes:
        name: snake-case name; C constant ``kSig<Name>`` (the first word), and with ``parities`` 2
            ``kSig<Name>Parity``, the words from one copy to the next.
        index: word index into the signal region.
        comment: printed after the constant (after the range's shape: ``c_comment``); may be empty.
        per_peer: ``MAX_RANKS`` entries, entry r written by peer r.
        slots: entries of a range that is not per peer (the low-latency flags: one per (peer,
            sending block)).
        width: words per entry (2: a 64-bit flag, 8-byte aligned; ``FAULT_RECORD``'s words).
        parities: copies of the range, one per call parity (1 or 2).
    """

    name: str
    index: int
    comment: str = ""
    per_peer: bool = False
    slots: int = 1
    width: int = 1
    parities: int = 1

    @property
    def c_name(self) -> str:
        return "kSig" + _camel(self.name)

    @property
    def byte_offset(self) -> int:
        """Offset from the start of the signal region, bytes."""
        return 4 * self.index

    @property
    def c_comment(self) -> str:
        """The comment printed after the C constant: the range's shape ("[2]" per parity, "[W]"
        per peer) before ``comment``."""
        shape = ("[2]" if self.parities > 1 else "") + ("[W]" if self.per_peer else "")
        if not shape:
            return self.comment
        return shape + ("" if self.comment.startswith("[") else " ") + self.comment

    @property
    def copy_words(self) -> int:
        """Words of one parity's copy: entries x width."""
        return (MAX_RANKS if self.per_peer else self.slots) * self.width

    @property
    def words(self) -> int:
        """Words of the whole range, every parity's copy."""
        return self.parities * self.copy_words


LL_FLAG_SLOTS = 1024
"""Flags of each low-latency range: one per (source rank, sending block), so world size x the
low-latency blocks is at most this (``KernelSpec`` checks it)."""

FAULT_RECORD = ("generation", "code", "a", "b", "c")
"""The words of a fault record a rank writes into every rank's signal region, its own included,
when one of its kernels finds a recoverable fault of the call (``ERRORS``; the call's first, one
writer a call): the generation of the call (of the record's kernel family and op), then the error
record's words. Every rank's receiving kernel of that call, after acquiring the writer's flags,
copies the fault into its process's error record of the writer and zeroes the record, so every
rank's host raises it once its stream has passed the call's receiving half, and no record
outlives its call (rewritten in call g + 2 at the earliest: ``PARITY_RULE``)."""

PARITY_RULE = (
    "A rank's generation-g signals that carry per-call values (the low-latency flags with their row "
    "counts, fault records, overflow counts) sit in copy g % 2 and a receiver waits for exactly g "
    "(fault records and overflow counts it also zeroes once read, in its call g). "
    "A sender writes copy g % 2 again only in call g + 2, after its call g + 1 received every peer's "
    "call g + 1 signals, which each peer raised after it had finished reading its call g signals "
    "(stream order on that peer), so a copy never holds g + 2 while a rank still waits for g.")
"""Why a parity copy is never overwritten while read (the model checker, ``epgen.codegen.protocol``,
explores every interleaving of it)."""

SIGNALS = (
    Signal("dispatch_calls", 0, "last finished dispatch generation (this rank)"),
    Signal("dispatch_arrive", 1, "blocks of the running dispatch that started"),
    Signal("dispatch_depart", 2, "blocks of the running dispatch that finished"),
    Signal("recv_count", 3, "rows reserved in this rank's receive buffers"),
    Signal("num_recv", 4, "rows received by the last dispatch (user-visible)"),
    Signal("combine_calls", 8),
    Signal("combine_arrive", 9),
    Signal("combine_depart", 10),
    Signal("expand_arrive", 11, "blocks of the running expand plan that counted their rows"),
    Signal("pull_depart", 12, "blocks of the running dispatch_pull that finished their rows"),
    Signal("ready_from", 64, "peer entered dispatch g: its receive buffers are free", per_peer=True),
    Signal("done_from", 128, "peer finished writing its dispatch-g rows here", per_peer=True),
    Signal("combine_ready_from", 192, "peer's combine-g expert outputs are complete", per_peer=True),
    Signal("ll_dispatch_from", 256, "[W x blocks] 64-bit: {generation, rows} of sending block (peer, b) here",
           slots=LL_FLAG_SLOTS, width=2, parities=2),
    Signal("ll_combine_from", 256 + 4 * LL_FLAG_SLOTS, "[W x blocks] generation of sending block (peer, b) "
           "whose combine rows are here", slots=LL_FLAG_SLOTS, parities=2),
    Signal("pulled_from", 256 + 6 * LL_FLAG_SLOTS, "peer finished reading its dispatch-g rows from our dispatch_in",
           per_peer=True),
    Signal("overflow_need", 320 + 6 * LL_FLAG_SLOTS, "64-bit rows: the most rows a sender found rank d "
           "needs (atomic max; only on an overflow; the dispatch records and zeroes it)", per_peer=True, width=2,
           parities=2),
    Signal("fault_dispatch", 576 + 6 * LL_FLAG_SLOTS, "FAULT_RECORD of the peer's normal dispatch g",
           per_peer=True, width=len(FAULT_RECORD), parities=2),
    Signal("fault_dispatch_ll", 1216 + 6 * LL_FLAG_SLOTS, "FAULT_RECORD of the peer's low-latency "
           "dispatch g", per_peer=True, width=len(FAULT_RECORD), parities=2),
    Signal("fault_combine", 1856 + 6 * LL_FLAG_SLOTS, "FAULT_RECORD of the peer's normal combine g",
           per_peer=True, width=len(FAULT_RECORD), parities=2),
    Signal("fault_combine_ll", 2496 + 6 * LL_FLAG_SLOTS, "FAULT_RECORD of the peer's low-latency "
           "combine g", per_peer=True, width=len(FAULT_RECORD), parities=2),
)
"""The signal words; per-peer ranges hold up to ``MAX_RANKS`` ranks."""

SIGNAL_WORDS = 3136 + 6 * LL_FLAG_SLOTS
"""32-bit words in each rank's signal region (``ARGS`` field ``signals``; see ArenaLayout): the
normal family's 256, the low-latency flags, the pull dispatch's flags, the overflow counts and the
fault records (``SIGNALS``)."""


def signal(name: str) -> Signal:
    """The signal word called ``name``.

    Raises:
        KeyError: no signal word has that name.
    """
    for s in SIGNALS:
        if s.name == name:
            return s
    raise KeyError(f"signal {name!r}: not one of {', '.join(s.name for s in SIGNALS)}")


@attrs.frozen
class ErrorCode:
    """A fault a kernel records as (code, a, b, c).

    Attributes:
        name: snake-case name; C constant ``kErr<Name>``.
        code: the record's code word (> 0).
        a, b, c: what the argument words hold ("0" when unused).
        message: the host's text, ``str.format`` fields: ``a``, ``b``, ``c``, ``c_int32`` (c read as
            int32), ``phase_a`` (description of phase a), ``itself`` (a timeout waiting for the
            record's own rank: blocks of its own grid) and the op's ``num_experts``, ``timeout_s``
            and ``capacity_rows``.
        recoverable: the kernel that finds it still completes every signal of its call and
            hands the fault to every rank in that call (``FAULT_RECORD``), so every rank raises it
            at its first synchronize after the call's receiving half and may run again from the
            next dispatch (the faulted call's outputs are invalid); False: peers may be out of
            step (a timeout).
    """

    name: str
    code: int
    a: str
    b: str
    c: str
    message: str
    recoverable: bool

    @property
    def c_name(self) -> str:
        return "kErr" + _camel(self.name)

    @property
    def comment(self) -> str:
        return f"a = {self.a}, b = {self.b}, c = {self.c}"


ERRORS = (
    ErrorCode("bad_expert", 1, "top-k slot", "token", "expert id",
              "indices[{b}, {a}]={c_int32}: expert ids must be -1 or in [0, {num_experts})", recoverable=True),
    ErrorCode("timeout", 2, "phase", "peer", "generation waited for",
              "timed out after {timeout_s} s in {phase_a} on rank {b}{itself} (call {c})", recoverable=False),
    ErrorCode("overflow", 3, "0", "receiving rank", "rows it needed",
              "the receive buffer of rank {b} needed {c} rows in this dispatch, more than its {capacity_rows} "
              "(EpConfig.max_recv_tokens); the rows past them were dropped", recoverable=True),
    ErrorCode("short_input", 4, "rows of y", "0", "rows the last dispatch produced",
              "combine: y has {a} rows but this rank's last dispatch produced {c} (num_recv, or expert_offsets[L] "
              "in the expert layout); the rows beyond y would have been read stale", recoverable=True),
)

def error_code(code: int) -> ErrorCode | None:
    """The ``ErrorCode`` whose code word is ``code``, or None (no error uses it)."""
    return next((e for e in ERRORS if e.code == code), None)


UNKNOWN_ERROR = "unknown kernel fault code {code} ({a}, {b}, {c})"
"""The host's text for a code ``ERRORS`` lacks."""

ERROR_CLAIMED = 0xFFFFFFFF
"""The code word of a record a kernel has claimed (compare-and-swap from 0) and is still writing:
it writes a, b and c next, then the real code with a release. No ``ErrorCode`` uses it; C
constant ``kErrClaimed``."""

CLAIM_REREADS = 10_000
"""How many more times the host reads a claimed record for its real code before it reports the
fault with its details unwritten (the kernel writes them microseconds after the claim)."""

CLAIMED_ERROR = ("a kernel fault is being recorded: its code and details were still unwritten after "
                 "{rereads} reads of the error record")
"""The host's text for a record whose code stayed ``ERROR_CLAIMED``."""


@attrs.frozen
class Phase:
    """A spin-wait, named in a timeout record's ``a`` word.

    Attributes:
        name: snake-case name; C constant ``kPhase<Name>``.
        code: the value of ``a``.
        description: what the rank waited for, as the host's timeout message says it.
    """

    name: str
    code: int
    description: str

    @property
    def c_name(self) -> str:
        return "kPhase" + _camel(self.name)


PHASES = (
    Phase("dispatch_ready", 1, "dispatch (waiting until the peer's receive buffers are free)"),
    Phase("dispatch_done", 2, "dispatch (waiting for the peer's rows)"),
    Phase("combine_ready", 3, "combine (waiting for the peer's expert outputs)"),
    Phase("ll_dispatch", 4, "the low-latency dispatch (waiting for the peer's rows; a peer that took the normal "
          "family for this call never sends them: every rank must pick the same kernel family, "
          "EpConfig.kernel_family)"),
    Phase("ll_combine", 5, "the low-latency combine (waiting for the peer's expert outputs; every rank must pick "
          "the same kernel family, EpConfig.kernel_family)"),
    Phase("dispatch_pulled", 6, "the pull dispatch (waiting until the peer has read its rows from this rank's "
          "dispatch_in; a peer that took the push transport for this call never reads them: every rank must take "
          "the same dispatch transport, EpConfig.dispatch_transport)"),
)


OWN_GRID_WAIT = (", itself: blocks of its own grid that never ran (such kernels launch cooperatively, so every "
                 "block is resident; this is a defect)")
"""What a timeout record adds when the rank waited for itself (``ErrorCode`` field ``itself``)."""


def fault_message(code: int, a: int, b: int, c: int, *, rank: int, num_experts: int, timeout_s: float,
                  capacity_rows: int) -> str:
    """The host's text for error record ``rank`` (code, a, b, c), without the "rank r: " prefix.

    Args:
        code, a, b, c: the record's uint32 words (code > 0; ``ERROR_CLAIMED``: a record whose
            details were never written).
        rank: the rank the record belongs to (a timeout's b == rank: it waited for its own blocks).
        num_experts, timeout_s, capacity_rows: the op's values the messages quote (E, the
            spin-wait bound in seconds, receive rows per rank).
    """
    if code == ERROR_CLAIMED:
        return CLAIMED_ERROR.format(rereads=CLAIM_REREADS)
    err = error_code(code)
    if err is None:
        return UNKNOWN_ERROR.format(code=code, a=a, b=b, c=c)
    phase = next((p.description for p in PHASES if p.code == a), f"phase {a}")
    return err.message.format(a=a, b=b, c=c, c_int32=c - (1 << 32) if c >= 1 << 31 else c, phase_a=phase,
                              itself=OWN_GRID_WAIT if b == rank else "", num_experts=num_experts,
                              timeout_s=timeout_s, capacity_rows=capacity_rows)
