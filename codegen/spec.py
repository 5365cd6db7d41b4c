"""KernelSpec: every compile-time field of one generated kernel, validated on construction.

One spec drives both the rendered constants and the host-side launch geometry and buffer sizes:
every derived number is a property here, printed by the template as a ``constexpr`` and read by
the runtime for grids and allocations.
"""

from __future__ import annotations

import enum
import hashlib

import attrs

from epgen.codegen import SCHEMA_VERSION, abi
from epgen.codegen.abi import LL_FLAG_SLOTS, SIGNAL_WORDS
from epgen.codegen.arch import ARCH_TRAITS, ArchTraits, traits
from epgen.codegen.dtypes import COMBINE_QUANTS, DTYPES, CombineQuant, DTypeInfo, combine_quant, dtype_info
from epgen.codegen.dtypes import COMBINE_FLUSH_LOG2, element_format
from epgen.codegen.errors import FieldError

MAX_TOKENS_LIMIT = 1 << 20
"""Largest max_tokens_per_rank: keeps W x max tokens receive rows inside int32 offsets."""


class Op(str, enum.Enum):
    """Which kernel a spec renders.

    DISPATCH and COMBINE (the normal family) cross ranks; the expert layout
    (``KernelSpec.expert_alignment`` > 0) adds three local kernels: EXPAND_PLAN (per-expert counts
    and offsets, each expanded row's source, weight and position), EXPAND (copies received rows to
    their expanded positions) and FOLD (sums a token's weighted expert outputs of one rank into
    the row combine sends). The low-latency family (``templates/ops/dispatch_ll.j2``,
    ``combine_ll.j2``) runs each call (dispatch, combine) as a sending half, which pushes rows into fixed slots
    of the receivers' arenas and raises one flag per (receiver, block), and a receiving half, which
    waits for those flags and finishes the op: both in one kernel (DISPATCH_LL, COMBINE_LL) or each
    in its own (the ``_SEND`` and ``_RECV`` ops: the async_recv split). COMBINE_QUANTIZE (local)
    writes the quantized combine wire rows that peers read, before the normal family's COMBINE, in
    the rank layout (the expert layout's FOLD writes them itself). DISPATCH_PULL is the second
    kernel of the pull dispatch (``KernelSpec.transport`` "pull"): launched after the DISPATCH
    kernel that sent only the metadata, it loads each received row from its source rank's
    ``dispatch_in``."""

    DISPATCH = "dispatch"
    COMBINE = "combine"
    EXPAND_PLAN = "expand_plan"
    EXPAND = "expand"
    FOLD = "fold"
    COMBINE_QUANTIZE = "combine_quantize"
    DISPATCH_LL = "dispatch_ll"
    DISPATCH_LL_SEND = "dispatch_ll_send"
    DISPATCH_LL_RECV = "dispatch_ll_recv"
    COMBINE_LL = "combine_ll"
    COMBINE_LL_SEND = "combine_ll_send"
    COMBINE_LL_RECV = "combine_ll_recv"
    DISPATCH_PULL = "dispatch_pull"

    @property
    def row(self) -> "OpRow":
        """This kernel kind's row of ``OP_TABLE``."""
        return _ROWS[self]

    @property
    def call(self) -> "Op":
        """The call this kernel serves: DISPATCH or COMBINE (``OpRow.call``)."""
        return Op(self.row.call)

    @property
    def remote(self) -> bool:
        """The kernel reads or writes peers' arenas or waits for them (``OpRow.reach`` "remote")."""
        return self.row.reach == "remote"

    @property
    def payload(self) -> bool:
        """The kernel's dtype is the dispatch payload's (``OpRow.payload``); the others take bf16
        expert outputs."""
        return self.row.payload

    @property
    def low_latency(self) -> bool:
        """One half of the low-latency family (``OpRow.family``)."""
        return self.row.family == "low_latency"

    def waits_within_grid(self, ranks: int) -> bool:
        """Whether blocks of this kernel wait for blocks of the same launch when one grid runs
        ``ranks`` ranks, so that the launch must make every block resident at once (a cooperative
        launch): ``OpRow.waits`` "always" (the whole low-latency op: its receiving phase waits for
        the flags of every block's sending phase, its own rank's included), "peers" with several
        ranks a grid (virtual ranks: the normal family's kernels and the pull kernel, whose blocks
        wait for signals the other ranks' blocks of the grid raise), "never" (the halves of the
        low-latency op wait only for kernels launched before them; the local kernels)."""
        return self.row.waits == "always" or (ranks > 1 and self.row.waits == "peers")

    @property
    def template(self) -> str:
        """``templates/ops/<template>.j2`` renders it (``OpRow.template``)."""
        return self.row.template

    @property
    def tuning_entry(self) -> str:
        """The tuning tables' op name whose buckets set its geometry (``OpRow.tuning_entry``)."""
        return self.row.tuning_entry


FAMILIES = ("normal", "low_latency")
"""The kernel families a call takes (``EpConfig.kernel_family`` "auto" chooses per call)."""

TRANSPORTS = ("push", "pull")
"""``KernelSpec.transport`` values: how the normal dispatch moves the payload rows."""


def _in(choices):
    return attrs.validators.in_(choices)


@attrs.frozen
class OpRow:
    """The facts of one kernel kind (a row of ``OP_TABLE``); the planner (``epgen.codegen.planner``)
    and the runtime's routes read them, nothing compares kernel kinds by name.

    Attributes:
        op: the kind.
        call: the call it serves, "dispatch" or "combine".
        family: the kernel family that launches it: "normal", "low_latency", or "both" (the
            expert layout's local kernels, which either family's call runs).
        token_layout: the token layout (``EpConfig.layout``) that builds it: "any", "rank" or
            "expert".
        transport: "pull": built only for the pull dispatch (``EpConfig.dispatch_transport`` not
            "push"); "" otherwise.
        quantized_wire: built only where the combine wire is quantized and rows leave the rank
            (W > 1).
        waits: whether its blocks wait for blocks of the same launch (``Op.waits_within_grid``):
            "always", "peers" (with several ranks a grid), "never".
        payload: its dtype is the dispatch payload's (else bf16 expert outputs).
        reach: "remote" (reads or writes peers' arenas or waits for them) or "local".
        template: ``templates/ops/<template>.j2`` renders it.
        tuning_entry: the tuning tables' op name whose buckets set its geometry (the halves of a
            low-latency op share their template's entry; the pull dispatch's kernels and the expand
            plan share the dispatch's and expand's).
        one_geometry: the kernel has one geometry for every call (the local kernels, whose work
            follows the rows received, and the low-latency halves, whose stages are sized for T_ll)
            instead of one per token bucket.
        timed: the kernel whose time ``epgen bench`` and ``epgen tune`` report as its family's call
            (the normal op; the low-latency sending half, whose geometry the entry sets).
    """

    op: str
    call: str = attrs.field(validator=_in(("dispatch", "combine")))
    family: str = attrs.field(validator=_in(FAMILIES + ("both",)))
    token_layout: str = attrs.field(validator=_in(("any", "rank", "expert")))
    waits: str = attrs.field(validator=_in(("always", "peers", "never")))
    payload: bool
    reach: str = attrs.field(validator=_in(("remote", "local")))
    template: str
    tuning_entry: str
    one_geometry: bool = False
    transport: str = attrs.field(default="", validator=_in(("", "pull")))
    quantized_wire: bool = False
    timed: bool = False


_R = OpRow
OP_TABLE = (
    #  op                  call        family         layout    waits     payload reach     template      tuning entry
    _R("dispatch",         "dispatch", "normal",      "any",    "peers",  True,  "remote", "dispatch",    "dispatch",
       timed=True),
    _R("combine",          "combine",  "normal",      "any",    "peers",  False, "remote", "combine",     "combine",
       timed=True),
    _R("dispatch_pull",    "dispatch", "normal",      "any",    "peers",  True,  "remote", "dispatch_pull", "dispatch",
       transport="pull"),
    _R("dispatch_ll",      "dispatch", "low_latency", "any",    "always", True,  "remote", "dispatch_ll", "dispatch_ll",
       one_geometry=True),
    _R("dispatch_ll_send", "dispatch", "low_latency", "any",    "never",  True,  "remote", "dispatch_ll", "dispatch_ll",
       one_geometry=True, timed=True),
    _R("dispatch_ll_recv", "dispatch", "low_latency", "any",    "never",  True,  "remote", "dispatch_ll", "dispatch_ll",
       one_geometry=True),
    _R("combine_ll",       "combine",  "low_latency", "any",    "always", False, "remote", "combine_ll",  "combine_ll",
       one_geometry=True),
    _R("combine_ll_send",  "combine",  "low_latency", "any",    "never",  False, "remote", "combine_ll",  "combine_ll",
       one_geometry=True, timed=True),
    _R("combine_ll_recv",  "combine",  "low_latency", "any",    "never",  False, "remote", "combine_ll",  "combine_ll",
       one_geometry=True),
    _R("expand_plan",      "dispatch", "both",        "expert", "never",  True,  "local",  "expand_plan", "expand",
       one_geometry=True),
    _R("expand",           "dispatch", "both",        "expert", "never",  True,  "local",  "expand",      "expand",
       one_geometry=True),
    _R("fold",             "combine",  "both",        "expert", "never",  False, "local",  "fold",        "fold",
       one_geometry=True),
    _R("combine_quantize", "combine",  "normal",      "rank",   "never",  False, "local",  "combine_quantize",
       "combine_quantize", one_geometry=True, quantized_wire=True),
)
"""One row per kernel kind, in the order a layer's kernels are planned (the normal family's, the
pull dispatch's second kernel, the low-latency family's, then the local ones). Adding a kernel
kind is adding an ``Op`` member, a row here and a template (docs/architecture.md, "A new kernel
kind")."""

_ROWS = {Op(r.op): r for r in OP_TABLE}
assert set(_ROWS) == set(Op), "every Op has one row of OP_TABLE"


def ops_where(**facts) -> tuple[Op, ...]:
    """The kernel kinds whose rows have every one of ``facts`` (``OpRow`` fields), in
    ``OP_TABLE`` order."""
    return tuple(Op(r.op) for r in OP_TABLE if all(getattr(r, k) == v for k, v in facts.items()))


CALLS = ops_where(family="normal", timed=True)
"""The normal family's kernels that are the calls themselves, DISPATCH and COMBINE (geometry flags
and the ``dispatch_geometry`` / ``combine_geometry`` fields name them)."""
LOW_LATENCY_OPS = ops_where(family="low_latency")
"""The low-latency family's kernels: each call's whole kernel, then its sending and receiving
halves."""
EXPERT_OPS = ops_where(token_layout="expert")
"""The local kernels the expert layout adds, in launch order (plan and expand after dispatch, fold
before combine)."""
LOCAL_OPS = ops_where(reach="local")
"""Kernels local to a rank."""
TIMED_OPS = {family: ops_where(family=family, timed=True) for family in FAMILIES}
"""Per family, the (dispatch, combine) kernels ``epgen bench`` and ``epgen tune`` time."""


def _positive(name: str, lo: int, hi: int):
    def check(_inst, attribute, value):
        if not isinstance(value, int) or isinstance(value, bool):
            raise FieldError(name, f"KernelSpec.{name}={value!r}: must be an int")
        if not lo <= value <= hi:
            raise FieldError(name, f"KernelSpec.{name}={value}: must be in [{lo}, {hi}]")

    return check


def _to_op(value) -> "Op":
    try:
        return Op(value)
    except ValueError:
        raise FieldError("op", f"KernelSpec.op={value!r}: must be one of {', '.join(o.value for o in Op)}") from None


def _one_of(name: str, choices):
    def check(_inst, attribute, value):
        if value not in choices:
            raise FieldError(name, f"KernelSpec.{name}={value!r}: must be one of {', '.join(map(str, choices))}")

    return check


ALIGN = 256
"""Alignment of every arena region, bytes."""

EXPERT_ALIGNMENTS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256)
"""``KernelSpec.expert_alignment`` values: 0 (rank layout) or a power of two up to 256 rows."""

PLAN_BLOCKS = 256
"""Most blocks of the expand plan and expand kernels (they split the received rows alike); sizes
the arena's ``expert_block_base``."""

QUANTIZED_COMBINE_THREADS = 512
"""Most threads a block of the normal family's combine with a quantized wire runs: it adds a rank's
own rows as their wire rows decode, in registers, which takes 102-107 registers a thread on sm_90
and 111-126 on gfx950 and gfx1250 at unroll 4 (NVRTC 13.0, clang 22: deepseek-v3). 512 threads
leave 128 on sm_90 and 256 on gfx950 and gfx1250; 1024 would leave 64 / 128."""

PLAN_SHARED_LIMIT = 48 * 1024
"""Static shared memory the expand plan may use: the 48 KiB every target gives a block without
opting in (sm_90 needs ``cudaFuncSetAttribute`` beyond it)."""


LL_MAX_TOKENS = 65535
"""Most tokens a rank may pass to the low-latency family (``KernelSpec.ll_tokens``): its 64-bit
flags carry a sending block's first token and row count in 16 bits each."""

LL_CALL_COUNTERS = 4 * LL_FLAG_SLOTS
"""uint32 call counters of the low-latency kernels: one per (kernel, block) (``ArenaLayout.ll_calls``)."""


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _align16(n: int) -> int:
    return (n + 15) // 16 * 16


@attrs.frozen
class ArenaSizes:
    """The numbers a rank's arena is sized from (``KernelSpec.arena_layout`` fills them): W, Tmax,
    ``cap`` = ``KernelSpec.capacity_rows`` receive rows (W x Tmax unless capped), ``R`` =
    ``KernelSpec.expert_rows`` (0 in the rank layout), L, H, K, S, the combine wire's row bytes (0
    for the bf16 wire), the dispatch dtype's row bytes (0 in combine and fold specs, which never
    touch the payload rows) and T_ll (0 without the low-latency family)."""

    world_size: int
    max_tokens_per_rank: int
    capacity_rows: int
    expert_rows: int
    experts_per_rank: int
    hidden: int
    topk: int
    scale_bytes: int
    wire_row_bytes: int
    payload_row_bytes: int
    ll_tokens: int = 0

    @property
    def expert(self) -> bool:
        return self.expert_rows > 0

    @property
    def ll_stage_row_bytes(self) -> int:
        """A low-latency combine stage row: the wire row (bf16 rows for the bf16 wire) rounded up
        to 16 bytes; 0 without the family."""
        return _align16(self.wire_row_bytes or self.hidden * 2) if self.ll_tokens else 0

    @property
    def ll_meta_bytes(self) -> int:
        """What follows the payload row in a low-latency dispatch record: (source rank, token), K
        weights, K expert ids, S scale bytes, padded to 16 bytes; 0 without the family or payload."""
        return _align16(8 + 8 * self.topk + self.scale_bytes) if self.ll_tokens and self.payload_row_bytes else 0

    @property
    def ll_record_bytes(self) -> int:
        """Bytes of one low-latency dispatch record: payload row, then ``ll_meta_bytes``."""
        return self.payload_row_bytes + self.ll_meta_bytes


@attrs.frozen
class Region:
    """One region of a rank's arena (a row of ``ARENA_REGIONS``).

    Attributes:
        name: the ``ArenaLayout`` attribute that holds its byte offset; the kernels' constant is
            ``c_name`` (``kOff`` and the name in CamelCase).
        shape: its rows and element type as the kernels index it (printed beside the constant).
        doc: what it holds, who writes it and who reads it.
        size: its bytes, from ``ArenaSizes`` (0: absent; the next region starts at its offset).
        needs: what a spec's layout must have for its kernels to declare it (``ArenaLayout.declared``):
            "expert" (the expert layout), "payload" (the dispatch dtype's rows), "low_latency"
            (T_ll > 0).
    """

    name: str
    shape: str
    doc: str
    size: object
    needs: tuple[str, ...] = ()

    @property
    def c_name(self) -> str:
        return "kOff" + "".join(part.capitalize() for part in self.name.split("_"))


ARENA_REGIONS = (
    Region("signals", "[SIGNAL_WORDS] uint32", "call counters, arrival counters, per-peer flags, the low-latency "
           "family's flags (``abi.SIGNALS``)", lambda d: SIGNAL_WORDS * 4),
    Region("send_slot", "[Tmax, W] int32", "for each local token and destination rank, the receive row the token "
           "took in that rank's buffer, or -1 (written by dispatch, read by combine; the low-latency dispatch writes "
           "only the rank's own column)", lambda d: d.max_tokens_per_rank * d.world_size * 4),
    Region("send_pos", "[Tmax, W] int32", "the pair's position among the rows its dispatch block sends to that "
           "rank, or -1 (dispatch only: written by its routing phase, read by its copy)",
           lambda d: d.max_tokens_per_rank * d.world_size * 4),
    Region("recv_src", "[cap, 2] int32", "(source rank, source token) of each received row",
           lambda d: d.capacity_rows * 8),
    Region("recv_weights", "[cap, K] float32", "each received row's routing weights",
           lambda d: d.capacity_rows * d.topk * 4),
    Region("recv_indices", "[cap, K] int32", "each received row's expert ids", lambda d: d.capacity_rows * d.topk * 4),
    Region("recv_scales", "[cap, S] uint8", "each received row's scales (absent when S = 0)",
           lambda d: d.capacity_rows * d.scale_bytes),
    Region("combine_in", "[cap, H] bf16", "expert outputs that combine gathers (zero-copy target; in the expert "
           "layout the folded rows)", lambda d: d.capacity_rows * d.hidden * 2),
    Region("combine_wire", "[cap, wire row] bytes", "the quantized combine rows peers read (absent when the combine "
           "wire is bf16: peers then read combine_in)", lambda d: d.capacity_rows * d.wire_row_bytes),
    # the expert layout's regions: local to the rank, peers never touch them
    Region("slot_row", "[cap, K] int32", "expanded row of receive row i's top-k slot k, or -1 (a slot naming "
           "another rank's expert, or a local expert an earlier slot named)",
           lambda d: d.capacity_rows * d.topk * 4 if d.expert else 0, ("expert",)),
    Region("expert_counts", "[L] int32", "rows of each local expert",
           lambda d: d.experts_per_rank * 4 if d.expert else 0, ("expert",)),
    Region("expert_offsets", "[L + 1] int32", "group starts, multiples of A",
           lambda d: (d.experts_per_rank + 1) * 4 if d.expert else 0, ("expert",)),
    Region("expert_weights", "[R] float32", "summed routing weight of each expanded row",
           lambda d: d.expert_rows * 4, ("expert",)),
    Region("expert_src", "[R, 3] int32", "(source rank, source token, first top-k slot) of each expanded row",
           lambda d: d.expert_rows * 12, ("expert",)),
    Region("expert_block_base", "[PLAN_BLOCKS, L] int32", "per (expand block, expert): how many of the block's rows "
           "name the expert (plan), then where they start (the plan's last block rewrites it; expand reads it)",
           lambda d: PLAN_BLOCKS * d.experts_per_rank * 4 if d.expert else 0, ("expert",)),
    Region("expert_scales", "[R, S] uint8", "each expanded row's scales", lambda d: d.expert_rows * d.scale_bytes,
           ("expert",)),
    Region("expert_y", "[R, H] bf16", "the expert outputs fold reads (the expert layout's zero-copy target)",
           lambda d: d.expert_rows * d.hidden * 2, ("expert",)),
    # the low-latency family's regions (T_ll > 0)
    Region("ll_calls", "[4, LL_FLAG_SLOTS] uint32", "finished calls of each low-latency kernel's block b (dispatch "
           "send, dispatch recv, combine send, combine recv): every block counts its own, so no block waits for "
           "another to learn the call's generation", lambda d: LL_CALL_COUNTERS * 4 if d.ll_tokens else 0,
           ("low_latency",)),
    Region("ll_combine_stage", "[2, W, T_ll, stage row]", "combine wire rows pushed here by rank d for this rank's "
           "token t at [g % 2, d, t] (g the combine generation; ``ArenaSizes.ll_stage_row_bytes``)",
           lambda d: 2 * d.world_size * d.ll_tokens * d.ll_stage_row_bytes, ("low_latency",)),
    # the payload rows, last: their row size is the dispatch dtype's, which combine and fold specs do
    # not know (they are built with payload_row_bytes 0 and never use them)
    Region("recv_x", "[cap, H] dispatch dtype", "the received payload rows",
           lambda d: d.capacity_rows * d.payload_row_bytes),
    Region("expert_x", "[R, H] dispatch dtype", "the expanded payload rows (expert layout)",
           lambda d: d.expert_rows * d.payload_row_bytes, ("expert", "payload")),
    Region("dispatch_in", "[Tmax, H] dispatch dtype", "the rows this rank publishes for the pull dispatch (its "
           "peers read token t's row here; the caller writes x into it: zero copy)",
           lambda d: d.max_tokens_per_rank * d.payload_row_bytes, ("payload",)),
    Region("ll_dispatch_stage", "[2, W, T_ll, record]", "rows pushed here by source rank s at [g % 2, s, slot] "
           "(low-latency family): record = payload row, then (source rank, token), K weights, K expert ids, S scale "
           "bytes, padded to 16 bytes (``ArenaSizes.ll_record_bytes``)",
           lambda d: 2 * d.world_size * d.ll_tokens * d.ll_record_bytes,
           ("low_latency", "payload")),
)
"""The regions of one rank's symmetric arena, in order, each 256-byte aligned (identical on every
rank). ``ArenaLayout`` holds their offsets; the kernels' prelude declares each one their spec's
layout has (``ArenaLayout.declared``). ``cap``, ``R`` and the other letters are ``ArenaSizes``'; all
sizes in bytes.

The two low-latency stages alternate by generation parity: a sender writes stage g % 2 only after
every receiver has finished with call g - 2 (it waited for their call g - 1 flags, raised after
it), so consecutive calls never overwrite rows a receiver still reads.

Where the signal words live: on CUDA in the ``signals`` region of this arena (one allocation; the
host passes ``arena + signals`` as the launch argument ``signals``). On ROCm the arena is ordinary
``hipMalloc`` memory (coarse-grained) and the signal words live in a separate uncached
(fine-grained) allocation of ``SIGNAL_WORDS`` words passed the same way; the arena's own
``signals`` region is then unused. Every other region is bulk data in the arena on both vendors
(``epgen.platform``, ``epgen.codegen.abi.ARGS``)."""


@attrs.frozen
class ArenaLayout:
    """Byte offsets of the regions (``ARENA_REGIONS``) of one rank's arena and the sizes they were
    laid out from, both read as attributes: ``layout.recv_x`` (an offset), ``layout.capacity_rows``
    or ``layout.ll_record_bytes`` (``ArenaSizes``')."""

    offsets: tuple[tuple[str, int], ...]
    sizes: ArenaSizes
    total_bytes: int

    def __getattr__(self, name: str):
        for region, offset in object.__getattribute__(self, "offsets"):
            if region == name:
                return offset
        try:
            return getattr(object.__getattribute__(self, "sizes"), name)
        except AttributeError:
            raise AttributeError(f"ArenaLayout has no region or attribute {name!r}; regions: "
                                 f"{', '.join(r.name for r in ARENA_REGIONS)}") from None

    @classmethod
    def build(cls, sizes: ArenaSizes) -> "ArenaLayout":
        """Each region of ``ARENA_REGIONS`` at the 256-byte boundary after the one before."""
        off, offsets = 0, []
        for region in ARENA_REGIONS:
            offsets.append((region.name, off))
            off = _align(off + region.size(sizes))
        return cls(offsets=tuple(offsets), sizes=sizes, total_bytes=off)

    def declared(self) -> list[tuple[Region, int]]:
        """(region, offset) of every region a kernel of this layout declares: those whose
        ``needs`` it has."""
        d = self.sizes
        has = {"expert": d.expert, "payload": d.payload_row_bytes > 0, "low_latency": d.ll_tokens > 0}
        return [(r, off) for r, (_, off) in zip(ARENA_REGIONS, self.offsets) if all(has[n] for n in r.needs)]


@attrs.frozen
class KernelSpec:
    """All compile-time fields of one generated kernel.

    Attributes:
        op: dispatch or combine.
        arch: target (a key of ``ARCH_TRAITS``).
        dtype: payload dtype (dispatch: the tokens moved; combine: expert output, bf16).
        world_size: ranks, W (at most the wave size: one lane per destination rank).
        hidden: elements per token row, H.
        topk: experts per token, K, 1 to 16 (the dispatch kernels stay free of spills there).
        experts_per_rank: local experts per rank, L; expert e lives on rank e // L.
        max_tokens_per_rank: largest token count a rank may pass, Tmax.
        blocks: blocks per rank in the launch grid.
        warps_per_block: warps (AMD: waves) per block.
        unroll: 16-byte vectors each lane keeps in flight in the row copy loop.
        scale_bytes: opaque per-token scale bytes forwarded by dispatch, S (0 = none).
        combine_quant: wire format of the combine leg (a key of ``COMBINE_QUANTS``); dispatch
            specs carry it too because it sizes the shared arena.
        recv_tokens: receive rows of each rank, N (``EpConfig.max_recv_tokens``); 0 = the worst
            case W x Tmax. A dispatch that would need more records an overflow.
        expert_alignment: 0 = rank-major receive rows only; A >= 1 (a power of two, at most 256) =
            the expert layout, whose expert groups start at multiples of A rows.
        ll_tokens: most tokens a rank passes to the low-latency family, T_ll (its stages hold W x
            T_ll rows each); 0 = no low-latency buffers. Every spec of one op carries it (it sizes
            the shared arena); the low-latency kernels need it >= 1.
        transport: how the normal dispatch moves payload rows (op DISPATCH only; "push" otherwise):
            "push" (default): the dispatch stores each row into every destination's receive rows;
            "pull": it sends only the metadata (weights, ids, scales, source) and a DISPATCH_PULL
            kernel launched after it loads each received row from its source rank's
            ``dispatch_in`` (entry name suffix ``_pull``).

    Raises:
        epgen.codegen.errors.FieldError: a ValueError, on construction, naming the field, its
            value and the rule broken (``.field`` holds the field's name).
    """

    op: Op = attrs.field(converter=_to_op)
    arch: str = attrs.field(validator=_one_of("arch", list(ARCH_TRAITS)))
    dtype: str = attrs.field(validator=_one_of("dtype", list(DTYPES)))
    world_size: int = attrs.field(validator=_positive("world_size", 1, 64))
    hidden: int = attrs.field(validator=_positive("hidden", 1, 1 << 16))
    topk: int = attrs.field(validator=_positive("topk", 1, 16))
    experts_per_rank: int = attrs.field(validator=_positive("experts_per_rank", 1, 1 << 16))
    max_tokens_per_rank: int = attrs.field(validator=_positive("max_tokens_per_rank", 1, MAX_TOKENS_LIMIT))
    blocks: int = attrs.field(validator=_positive("blocks", 1, 65535))
    warps_per_block: int = attrs.field(validator=_positive("warps_per_block", 1, 32))
    unroll: int = attrs.field(validator=_positive("unroll", 1, 16))
    scale_bytes: int = attrs.field(default=0, validator=_positive("scale_bytes", 0, 4096))
    combine_quant: str = attrs.field(default="none", validator=_one_of("combine_quant", list(COMBINE_QUANTS)))
    recv_tokens: int = attrs.field(default=0, validator=_positive("recv_tokens", 0, 64 * MAX_TOKENS_LIMIT))
    expert_alignment: int = attrs.field(default=0, validator=[_positive("expert_alignment", 0, 256),
                                                               _one_of("expert_alignment", EXPERT_ALIGNMENTS)])
    ll_tokens: int = attrs.field(default=0, validator=_positive("ll_tokens", 0, LL_MAX_TOKENS))
    transport: str = attrs.field(default="push", validator=_one_of("transport", TRANSPORTS))

    def __attrs_post_init__(self):
        t = self.traits
        worst = self.world_size * self.max_tokens_per_rank
        if self.recv_tokens > worst:
            raise FieldError("recv_tokens", f"KernelSpec.recv_tokens={self.recv_tokens}: at most world_size x "
                             f"max_tokens_per_rank = {worst} (the most rows a rank can receive)")
        if self.ll_tokens > self.max_tokens_per_rank:
            raise FieldError("ll_tokens", f"KernelSpec.ll_tokens={self.ll_tokens}: at most max_tokens_per_rank = "
                             f"{self.max_tokens_per_rank}")
        if self.ll_tokens * self.world_size > self.capacity_rows:
            raise FieldError("recv_tokens", f"KernelSpec.recv_tokens={self.recv_tokens}: the low-latency family places "
                             f"every row it receives, up to world_size x ll_tokens = {self.world_size * self.ll_tokens}, "
                             f"so its receive rows hold at least that many (ll_tokens at most "
                             f"{self.capacity_rows // self.world_size} here)")
        if self.op.low_latency and not self.ll_tokens:
            raise FieldError("ll_tokens", f"KernelSpec.ll_tokens=0: op {self.op.value!r} belongs to the low-latency "
                             "family, whose stages need ll_tokens >= 1")
        if self.op.low_latency and self.world_size * self.blocks > LL_FLAG_SLOTS:
            raise FieldError("blocks", f"KernelSpec.blocks={self.blocks}: the low-latency family raises one flag per "
                             f"(rank, block), world_size x blocks = {self.world_size * self.blocks}, at most "
                             f"{LL_FLAG_SLOTS}; at most {LL_FLAG_SLOTS // self.world_size} blocks")
        if self.op in (Op.DISPATCH_LL, Op.DISPATCH_LL_SEND) and self.ll_shared_bytes > PLAN_SHARED_LIMIT:
            raise FieldError("blocks", f"KernelSpec.blocks={self.blocks}: the low-latency dispatch keeps each block's "
                             f"token positions in shared memory, ceil(ll_tokens / blocks) x world_size x 4 = "
                             f"{self.ll_shared_bytes} bytes, more than {PLAN_SHARED_LIMIT}; use more blocks or fewer "
                             "ll_tokens")
        if self.op is Op.COMBINE_QUANTIZE and not self.quant.quantized:
            raise FieldError("combine_quant", f"KernelSpec.combine_quant={self.combine_quant!r}: op 'combine_quantize' "
                             "writes a quantized combine wire (any mode but 'none')")
        if self.transport == "pull" and self.op is not Op.DISPATCH:
            raise FieldError("transport", f"KernelSpec.transport='pull': only op 'dispatch' pulls (op "
                             f"{self.op.value!r} takes 'push')")
        if self.op in EXPERT_OPS and not self.expert_alignment:
            raise FieldError("expert_alignment", f"KernelSpec.expert_alignment=0: op {self.op.value!r} belongs to "
                             "the expert layout (expert_alignment >= 1)")
        if self.op in (Op.EXPAND_PLAN, Op.EXPAND) and self.blocks > PLAN_BLOCKS:
            raise FieldError("blocks", f"KernelSpec.blocks={self.blocks}: {self.op.value} runs at most "
                             f"{PLAN_BLOCKS} blocks (the arena's per-block expert counts)")
        if self.op in (Op.EXPAND_PLAN, Op.EXPAND) and self.plan_shared_bytes > PLAN_SHARED_LIMIT:
            raise FieldError("experts_per_rank", f"KernelSpec.experts_per_rank={self.experts_per_rank}: the "
                             f"expert layout's expand kernel counts {self.warps_per_block} warps x {self.experts_per_rank} "
                             f"experts in {self.plan_shared_bytes} bytes of shared memory, more than "
                             f"{PLAN_SHARED_LIMIT}; at most {(PLAN_SHARED_LIMIT - 4) // 8} local experts (one warp)")
        row = self.row_bytes
        if row % t.vector_bytes:
            per = t.vector_bytes * 8 // self.dtype_info.bits
            raise FieldError(
                "hidden", f"KernelSpec.hidden={self.hidden}: a {self.dtype} row must be a multiple of "
                f"{t.vector_bytes} bytes (hidden a multiple of {per}); it is {row} bytes"
            )
        if self.topk > t.wave_size:
            raise FieldError("topk", f"KernelSpec.topk={self.topk}: must be at most the {self.arch} wave size {t.wave_size}")
        if self.world_size > t.wave_size:
            raise FieldError(
                "world_size", f"KernelSpec.world_size={self.world_size}: must be at most the {self.arch} wave size {t.wave_size}"
            )
        if self.threads > t.max_threads_per_block:
            raise FieldError(
                "warps_per_block", f"KernelSpec.warps_per_block={self.warps_per_block}: {self.threads} threads exceed the "
                f"{self.arch} limit of {t.max_threads_per_block} per block"
            )
        if self.op is Op.COMBINE and self.quant.quantized and self.threads > QUANTIZED_COMBINE_THREADS:
            raise FieldError(
                "warps_per_block", f"KernelSpec.warps_per_block={self.warps_per_block}: {self.threads} threads; a combine "
                f"with a quantized wire ({self.combine_quant}) runs at most {QUANTIZED_COMBINE_THREADS} threads a block"
            )
        if not self.op.payload and self.dtype != "bf16":
            raise FieldError("dtype", f"KernelSpec.dtype={self.dtype!r}: {self.op.value} takes bf16 expert outputs")

    # --- derived values (the one place each formula lives) -------------------------------------
    @property
    def traits(self) -> ArchTraits:
        return traits(self.arch)

    @property
    def dtype_info(self) -> DTypeInfo:
        """The payload dtype's row on this spec's arch (fp8: its ``ArchTraits.fp8`` flavour's torch dtype)."""
        return dtype_info(self.dtype).on(self.traits.fp8)

    @property
    def quant(self) -> CombineQuant:
        """The combine wire format (the row of ``combine_quant``)."""
        return combine_quant(self.combine_quant)

    @property
    def num_experts(self) -> int:
        """E = W x L."""
        return self.world_size * self.experts_per_rank

    @property
    def threads(self) -> int:
        """Threads per block."""
        return self.warps_per_block * self.traits.wave_size

    @property
    def row_bytes(self) -> int:
        """Bytes of one payload row."""
        return self.dtype_info.row_bytes(self.hidden)

    @property
    def row_vectors(self) -> int:
        """16-byte vectors per payload row."""
        return self.row_bytes // self.traits.vector_bytes

    @property
    def chunk_vectors(self) -> int:
        """16-byte vectors one warp moves per copy step: unroll x wave size."""
        return self.unroll * self.traits.wave_size

    @property
    def chunks_per_row(self) -> int:
        """Copy steps per row; the last one is predicated when the row is not a multiple."""
        return -(-self.row_vectors // self.chunk_vectors)

    @property
    def fan_in(self) -> int:
        """Source ranks whose rows combine loads together before accumulating: min(W, K, 2), 1
        for a scaled combine wire. More rows in flight per warp hide the peer read latency; a
        scaled wire's per-vector scales would exceed 64 registers in 1024-thread blocks on sm_90,
        and in the normal family, whose quantized combine has 128 (512 threads), two rows measured
        slower than one on the H200 (546 against 406 us, docs/measurements/quantized-combine.md#fan-in)."""
        return min(self.world_size, self.topk, 1 if self.quant.block else 2)

    @property
    def capacity_rows(self) -> int:
        """Receive rows each rank can hold: ``recv_tokens``, or W x Tmax when 0."""
        return self.recv_tokens or self.world_size * self.max_tokens_per_rank

    @property
    def expert_rows(self) -> int:
        """Rows of the expert layout's buffers, R = N x min(K, L) + L x (A - 1): every receive row
        expands to at most min(K, L) rows (one per distinct local expert), and each of the L
        groups is padded by fewer than A rows; 0 in the rank layout."""
        if not self.expert_alignment:
            return 0
        return (self.capacity_rows * min(self.topk, self.experts_per_rank)
                + self.experts_per_rank * (self.expert_alignment - 1))

    @property
    def plan_shared_bytes(self) -> int:
        """Shared memory of expand (the plan uses less): a count per (warp, local expert) and L + 1
        offsets, bytes."""
        return 4 * (self.warps_per_block * self.experts_per_rank + self.experts_per_rank + 1)

    @property
    def ll_block_tokens(self) -> int:
        """Most tokens one block of the low-latency dispatch routes: ceil(ll_tokens / blocks)."""
        return -(-self.ll_tokens // self.blocks)

    @property
    def ll_shared_bytes(self) -> int:
        """Shared memory of the low-latency dispatch's positions: ll_block_tokens x W int32, bytes."""
        return 4 * self.ll_block_tokens * self.world_size

    @property
    def segment_lanes(self) -> int:
        """Lanes one receive row occupies in the expand plan: top-k rounded up to a power of two
        (a wave holds wave size / segment rows)."""
        return 1 << (self.topk - 1).bit_length()

    @property
    def arena_layout(self) -> ArenaLayout:
        """Arena layout; dispatch and combine specs of one op agree on every shared offset."""
        return ArenaLayout.build(ArenaSizes(
            world_size=self.world_size,
            max_tokens_per_rank=self.max_tokens_per_rank,
            capacity_rows=self.capacity_rows,
            expert_rows=self.expert_rows,
            experts_per_rank=self.experts_per_rank,
            hidden=self.hidden,
            topk=self.topk,
            scale_bytes=self.scale_bytes,
            wire_row_bytes=self.quant.wire_row_bytes(self.hidden) if self.quant.quantized else 0,
            payload_row_bytes=self.row_bytes if self.op.payload else 0,
            ll_tokens=self.ll_tokens,
        ))

    @property
    def name(self) -> str:
        """Entry name: every compile-time field in declaration order, a valid C identifier."""
        arch = self.arch.replace("_", "")
        s = f"_s{self.scale_bytes}" if self.scale_bytes else ""
        s += f"_{self.quant.tag}" if self.quant.quantized else ""
        s += f"_r{self.recv_tokens}" if self.recv_tokens else ""
        s += f"_a{self.expert_alignment}" if self.expert_alignment else ""
        s += f"_ll{self.ll_tokens}" if self.ll_tokens else ""
        s += "_pull" if self.transport == "pull" else ""
        return (
            f"epgen_{self.op.value}_{arch}_{self.dtype}_w{self.world_size}_h{self.hidden}_k{self.topk}"
            f"_l{self.experts_per_rank}_t{self.max_tokens_per_rank}"
            f"_{self.blocks}x{self.warps_per_block}_u{self.unroll}{s}"
        )

    def describe(self) -> str:
        """One line with every field, for source headers and manifests."""
        return " ".join(f"{f.name}={getattr(self, f.name).value if f.name == 'op' else getattr(self, f.name)}"
                        for f in attrs.fields(type(self)))

    def as_dict(self) -> dict:
        """Fields as plain JSON-able values."""
        d = attrs.asdict(self)
        d["op"] = self.op.value
        return d

    def replace(self, **changes) -> "KernelSpec":
        """A copy with ``changes`` applied (validated again)."""
        return attrs.evolve(self, **changes)

    def template_vars(self) -> dict:
        """The one mapping handed to Jinja."""
        t = self.traits
        lay = self.arena_layout
        return {
            "schema_version": SCHEMA_VERSION,
            "abi": abi,
            "spec": self,
            "spec_line": self.describe(),
            "entry": self.name,
            "op": self.op.value,
            "template": self.op.template,
            "arch": t,
            "wave_size": t.wave_size,
            "hidden": self.hidden,
            "topk": self.topk,
            "experts_per_rank": self.experts_per_rank,
            "num_experts": self.num_experts,
            "world_size": self.world_size,
            "max_tokens_per_rank": self.max_tokens_per_rank,
            "capacity_rows": self.capacity_rows,
            "expert_rows": self.expert_rows,
            "expert_alignment": self.expert_alignment,
            "ll_tokens": self.ll_tokens,
            "transport": self.transport,
            "segment_lanes": self.segment_lanes,
            "scale_bytes": self.scale_bytes,
            "blocks": self.blocks,
            "warps_per_block": self.warps_per_block,
            "threads": self.threads,
            "unroll": self.unroll,
            "row_bytes": self.row_bytes,
            "row_vectors": self.row_vectors,
            "chunk_vectors": self.chunk_vectors,
            "chunks_per_row": self.chunks_per_row,
            "fan_in": self.fan_in,
            **self._combine_wire_vars(),
            "layout": lay,
        }

    # --- combine wire (templates/common/wire/) -----------------------------------------------------

    def _combine_wire_vars(self) -> dict:
        """The combine wire's template variables (the same keys for every spec; unquantized: zeros
        and None): the wire format ``quant``, its row geometry in bytes, the lanes sharing one
        scale, the element format's numbers (``element_format``: fp8 in the arch's flavour), whether the element codec is the
        software one, the flush threshold's log2, and whether the kernel quantizes a rank's own rows
        where it sums them (``encode_own_rows``: adds them as they would decode)."""
        q = self.quant
        element = element_format(q.element, self.traits.fp8) if q.quantized else None
        return {
            "quant": q,
            "wire_row_bytes": q.wire_row_bytes(self.hidden),
            "wire_scale_offset": q.scale_offset(self.hidden),
            "wire_code_bytes": q.code_bytes(self.hidden),
            "wire_scale_count": q.scale_count(self.hidden),
            "wire_lanes_per_scale": q.block // 8 if q.block else 0,  # a lane quantizes 8 bf16 (16 bytes)
            "wire_element": element,
            # fp4 has no hardware convert anywhere; fp8 takes one only where traits say it is verified
            "wire_software_codec": element is not None and not (q.element == "fp8" and self.traits.hw_fp8_convert),
            "wire_flush_log2": COMBINE_FLUSH_LOG2,
            # the normal family's combine reads a rank's own rows as bf16 and adds them as they would decode
            "encode_own_rows": q.quantized and self.op is Op.COMBINE,
        }

    def key(self, text: str, options: tuple[str, ...] = ()) -> str:
        """sha256 over rendered text and compile options (the cache identity); ``sha256_key``."""
        return sha256_key(text, options)


def sha256_key(text: str, options: tuple[str, ...] = ()) -> str:
    """Hex sha256 of ``text`` followed by each option, NUL-separated (64 characters)."""
    h = hashlib.sha256(text.encode())
    for o in options:
        h.update(b"\0" + o.encode())
    return h.hexdigest()
