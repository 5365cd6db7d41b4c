"""Launch-geometry schedules: one call per (arch, shape) returns every kernel's token buckets.

``schedule(ShapeKey)`` answers, for one layer shape on one arch, the buckets ``(max_tokens,
geometry)`` of every tuning entry a plan reads (the ops' ``OpRow.tuning_entry``: "dispatch",
"combine", "dispatch_ll", "combine_ll", "expand", "fold", "combine_quantize"), each bucket with the
``Source`` of its numbers: "measured" (a table entry ``epgen tune`` wrote, or a default measured
on this arch), "published" (a table entry transcribed from a peer's published geometry, its source
named in the entry's provenance) or "derived" (no entry: computed from the arch's facts by
``derived``, with the rule). The planner (``epgen.codegen.planner``) applies the config's explicit
geometries and each kernel's limits to it.

Tables live in ``codegen/tuning/<arch>.json``, keyed by ``TuningKey`` (arch, world size, row
bytes, top-k, dtype, op); every entry records where its numbers came from (``provenance``), and
``epgen tune`` writes the measured ones. A bucket of the "dispatch" op may also say which
transport the normal dispatch takes there (``"transport": "push"`` or ``"pull"``; "push" when
absent).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import attrs

from epgen.codegen.arch import ArchTraits, traits
from epgen.codegen.dtypes import combine_quant, dtype_info
from epgen.codegen.spec import OP_TABLE, TRANSPORTS

TABLE_DIR = Path(__file__).parent / "tuning"
NO_LIMIT = 1 << 30
"""``max_tokens`` of a schedule's last bucket when nothing bounds it."""
DEFAULT_UNROLL = 4


def _positive_int(_inst, attribute, value):
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"Geometry.{attribute.name}={value!r}: must be a positive int")


@attrs.frozen
class Geometry:
    """Launch geometry of one kernel: blocks per rank, warps (waves) per block, copy unroll.

    Raises:
        ValueError: a field that is not a positive int (the spec built from it checks the
            per-arch limits).
    """

    blocks: int = attrs.field(default=24, validator=_positive_int)
    warps_per_block: int = attrs.field(default=32, validator=_positive_int)
    unroll: int = attrs.field(default=DEFAULT_UNROLL, validator=_positive_int)

    def __str__(self) -> str:
        return f"{self.blocks}x{self.warps_per_block}u{self.unroll}"


@attrs.frozen
class TuningKey:
    """What a table entry is keyed by (the shape's bytes, not its name)."""

    arch: str
    world_size: int
    row_bytes: int
    topk: int
    dtype: str
    op: str


SOURCES = ("measured", "published", "derived", "stated")
"""``Source.kind`` values ("stated": the geometry the config states, ``epgen.codegen.planner``)."""


@attrs.frozen
class Source:
    """Where a bucket's numbers came from.

    Attributes:
        kind: "measured" (on this arch: a table entry ``epgen tune`` wrote, or a measured default),
            "published" (a peer's published geometry, not measured here), "derived" (computed from
            the arch's facts, ``derived``) or "stated" (the config's own geometry; the planner's).
        detail: the table entry's provenance (naming the run or the publication), or the rule.
    """

    kind: str = attrs.field(validator=attrs.validators.in_(SOURCES))
    detail: str


@attrs.frozen
class Bucket:
    """Calls with at most ``max_tokens`` tokens a rank (and more than the previous bucket's) launch
    ``geometry``; ``transport`` is the normal dispatch's there ("push" or "pull"; "dispatch" entries
    only), ``source`` where the numbers came from."""

    max_tokens: int
    geometry: Geometry
    source: Source
    transport: str = "push"


@attrs.frozen
class ShapeKey:
    """One layer shape on one arch, what a schedule answers for: the entries' ``TuningKey``s
    follow from it (``Schedule.key``)."""

    arch: str
    world_size: int
    hidden: int
    topk: int
    dtype: str
    combine_quant: str = "none"


ENTRIES = tuple(dict.fromkeys(r.tuning_entry for r in OP_TABLE))
"""The tuning entries a schedule holds, one per ``OpRow.tuning_entry``."""
_PAYLOAD_ENTRIES = {r.tuning_entry for r in OP_TABLE if r.payload}
LOW_LATENCY_ENTRIES = tuple(dict.fromkeys(r.tuning_entry for r in OP_TABLE if r.family == "low_latency"))
"""Entries of the low-latency family: one bucket each, whose ``max_tokens`` is the family's threshold."""


@attrs.frozen
class Schedule:
    """Every tuning entry's buckets for one ``ShapeKey`` (``schedule``).

    Attributes:
        shape: what it answers for.
        entries: {entry: (Bucket, ...)} ascending by max_tokens, every entry of ``ENTRIES``.
        keys: {entry: TuningKey} of the table entry each was read from (or would be written to).
        low_latency_tokens: the low-latency family's threshold: the smaller of its entries' one
            bucket (``LOW_LATENCY_MAX_TOKENS`` where an entry has none; 0: the family never won).
    """

    shape: ShapeKey
    entries: dict[str, tuple[Bucket, ...]]
    keys: dict[str, TuningKey]

    @property
    def low_latency_tokens(self) -> int:
        return min(self.entries[e][0].max_tokens for e in LOW_LATENCY_ENTRIES)

    def bucket(self, entry: str, tokens: int) -> Bucket:
        """The bucket of ``entry`` a call with ``tokens`` takes: the smallest not below it, else
        the largest."""
        buckets = self.entries[entry]
        return next((b for b in buckets if tokens <= b.max_tokens), buckets[-1])

    def rows(self) -> list[dict]:
        """One row per bucket of every entry: entry, max_tokens, geometry, transport, source kind
        and detail (what ``epgen plan --schedule`` prints)."""
        return [dict(entry=e, max_tokens=b.max_tokens, geometry=str(b.geometry), transport=b.transport,
                     source=b.source.kind, detail=b.source.detail) for e, bs in self.entries.items() for b in bs]


def entry_key(shape: ShapeKey, entry: str) -> TuningKey:
    """The table key of ``entry`` for ``shape`` (a quantized wire's combine: dtype the wire's name)."""
    dtype = shape.dtype if entry in _PAYLOAD_ENTRIES else "bf16"
    row_bytes = dtype_info(dtype).row_bytes(shape.hidden)
    if entry == "combine" and combine_quant(shape.combine_quant).quantized:
        dtype = shape.combine_quant  # the quantized wire's combine is a kernel of its own
    return TuningKey(arch=shape.arch, world_size=shape.world_size, row_bytes=row_bytes, topk=shape.topk, dtype=dtype,
                     op=entry)


def _source(provenance: str) -> Source:
    return Source("published" if provenance.startswith("published") else "measured", provenance)


def schedule(shape: ShapeKey) -> Schedule:
    """The whole schedule of ``shape``: for every entry of ``ENTRIES`` its table entry's buckets,
    else (and for a quantized wire's combine without an entry of its own, after the bf16 combine's
    entry) the arch's defaults (``MEASURED_DEFAULTS``, else ``derived``). A low-latency entry
    counts only with one bucket below ``NO_LIMIT`` (its threshold and geometry).

    Raises:
        ValueError: an unknown arch; a table file whose bucket names a bad transport.
    """
    table = _table(shape.arch)
    entries, keys = {}, {}
    for entry in ENTRIES:
        key = keys[entry] = entry_key(shape, entry)
        rows = table.get(key)
        if rows is None and entry == "combine" and key.dtype != "bf16":
            rows = table.get(attrs.evolve(key, dtype="bf16"))  # the bf16 combine's entry
        if entry in LOW_LATENCY_ENTRIES and rows is not None and (len(rows) != 1 or rows[0].max_tokens >= NO_LIMIT):
            rows = None
        entries[entry] = rows or defaults(shape.arch, entry, key.row_bytes)
    return Schedule(shape=shape, entries=entries, keys=keys)


@functools.lru_cache(maxsize=None)
def _table(arch: str) -> dict[TuningKey, tuple[Bucket, ...]]:
    path = TABLE_DIR / f"{arch}.json"
    if not path.exists():
        return {}
    table = {}
    for e in json.loads(path.read_text())["entries"]:
        key = TuningKey(**{f.name: e[f.name] for f in attrs.fields(TuningKey)})
        source = _source(e.get("provenance", ""))
        rows = []
        for b in e["buckets"]:
            transport = b.get("transport", "push")
            if transport not in TRANSPORTS or ("transport" in b and key.op != "dispatch"):
                raise ValueError(f"{path}: entry {key}: bucket max_tokens={b['max_tokens']} transport={transport!r}: "
                                 f"only 'dispatch' buckets carry a transport, one of {', '.join(TRANSPORTS)}")
            rows.append(Bucket(b["max_tokens"], Geometry(b["blocks"], b["warps_per_block"], b["unroll"]), source,
                               transport))
        table[key] = tuple(sorted(rows, key=lambda r: r.max_tokens))
    return table


# --- defaults where no table entry exists ----------------------------------------------------------

LOW_LATENCY_MAX_TOKENS = 128
"""Tokens per rank up to which ``EpConfig(kernel_family="auto")`` takes the low-latency family
without a table entry (an entry's one bucket ``max_tokens`` replaces it): a design estimate."""

MEASURED_DEFAULTS = {
    "sm_90": {
        "dispatch": ((NO_LIMIT, 24, 1024, 4),),
        "combine": ((NO_LIMIT, 24, 1024, 4),),
        "dispatch_ll": ((LOW_LATENCY_MAX_TOKENS, 64, 256, 2),),
        "combine_ll": ((LOW_LATENCY_MAX_TOKENS, 64, 256, 2),),
        "expand": ((NO_LIMIT, 132, 512, 1),),
        "fold": ((NO_LIMIT, 256, 512, 1),),
        "combine_quantize": ((NO_LIMIT, 264, 512, 2),),
    },
}
"""Per arch, the defaults measured on it: {entry: ((max_tokens, blocks, threads, unroll), ...)}.

sm_90, on the H200:
  dispatch, combine: 24 blocks of 1024 threads, unroll 4, the best geometry at 24 blocks that
    ``epgen tune`` measured for deepseek-v3 on 2 x H200 (2026-11-29,
    docs/measurements/normal-family.md#tune).
  dispatch_ll, combine_ll: 64 x 256 threads, the best at 1 and 128 tokens together among eight
    geometries ``tools/latency.py --sweep`` timed at W = 1 and virtual W = 2
    (docs/measurements/decode-latency.md#ll-geometry, 8a5b1f1, at unroll 4), at unroll 2, where
    every catalogue and test shape compiles without a spill on sm_90 (tests/codegen); the
    threshold ``LOW_LATENCY_MAX_TOKENS``.
  combine_quantize: 264 x 512 threads, unroll 2, the best compromise of 18 geometries (264-528
    blocks, 256-1024 threads, unroll 2-8) in ``tools/quant_profile.py --sweep``
    (docs/measurements/quantized-combine.md#quantize-geometry, a349056: deepseek-v3, virtual
    W = 2): at 128 tokens a rank the fastest for fp4_blockwise (3.9 us) and within 3 % of the
    fastest for fp8_blockwise; at 4096 within 5 % (fp4: 59.5 us against 56.6 at 528 x 512 u4,
    which takes 6.8 us at 128) and 2.5 % (fp8: 51.2 against 50.0).
  expand, fold: from ``tools/local_sweep.py`` (docs/measurements/moe-layer.md#local-geometry,
    6fdbde6 and 6295cde: deepseek-v3 at 1024 tokens a rank, W = 1 and virtual W = 8): the fold at
    unroll 1 with 16 warps a block (45 / 523 us against 62 / 711 us at 256 x 8 warps, unroll 2);
    expand within 1 % of any geometry at W = 8 and fastest at W = 1 with 132 blocks. Expand copies
    at unroll 1: at unroll 2 gfx950 runs out of its 106 SGPRs for top-k above 8 (52 spilled bytes
    at K = 16, H = 7168) and sm_90 spills 16-24 bytes for an fp8 payload with scales at top-k 1-2
    (offline compiles, clang 22 and NVRTC 13.0)."""


def _unroll(t: ArchTraits, row_bytes: int) -> int:
    """The largest unroll of 4, 2, 1 whose copy step (unroll x wave x vector bytes) divides the
    row; else the largest whose step still fits in the row (a step longer than the row
    degenerates); else 1."""
    steps = [(u, u * t.wave_size * t.vector_bytes) for u in (4, 2, 1)]
    return next((u for u, step in steps if row_bytes % step == 0),
                next((u for u, step in steps if step <= row_bytes), 1))


def derived(arch: str, entry: str, row_bytes: int) -> tuple[Bucket, ...]:
    """Buckets of ``entry`` on ``arch`` computed from the arch's facts (``ArchTraits``: C =
    ``compute_units``, the wave size, the resident waves of a CU), for an arch that has no
    measured default: the H200 measurements' picks under the seeds' rule (the fewest blocks
    within 3 % of the best, which leaves CUs to the work beside the kernel), taken as fractions of
    the machine, not as block counts, and checked against mori's published gfx950 geometry.

      dispatch: 1024-thread blocks; C / 2 up to 512 tokens, C up to 1024, then C x the 1024-thread
        blocks a CU holds (its resident waves: 2 on every target). ``epgen tune`` on 2 x H200
        (d969dd9, docs/measurements/normal-family.md#tune) picks 64 of 132 SMs up to 1024 tokens
        and 132 (its largest candidate, still gaining) from 4096; mori on MI350X (seeds: 256 CUs)
        runs 128 blocks up to 512 tokens and 256 at 1024, and its sweep at 4096 tokens (349.6,
        365, 368, 374, 374 GB/s at 256-4096 blocks) has 512 = 2 C as the fewest within 3 %.
      combine: 1024-thread blocks; C / 4 up to 128 tokens, then C / 8: the H200 tune picks 32 and
        16 of 132 (the combine saturates early: it loads, the dispatch stores).
      dispatch_ll, combine_ll: C / 4 blocks of 256 threads, unroll 2, up to
        ``LOW_LATENCY_MAX_TOKENS``. The H200 runs 64 x 256 of 132 SMs (C / 2), but C / 2 on gfx942
        and gfx950 (capped at 1024 / W: 128 at W = 8) fills all 1024 flag slots, and there clang 22
        spills 8 bytes of SGPRs of the whole low-latency dispatch at top-k 10 (h 2048 and 6144;
        clean at 32-120 blocks); C / 4 compiles clean (docs/measurements/import-and-compile.md#known-spills).
      expand: C blocks (the H200's 132; the planner caps it at ``PLAN_BLOCKS``); fold and
        combine_quantize: 2 C (256 and 264 on the H200); 512 threads, unroll 1, 1 and 2 (the
        register reasons of ``MEASURED_DEFAULTS``).
      unroll (dispatch, combine): the largest of 4, 2, 1 whose copy step divides the row
        (DESIGN.md: an unroll whose stride exceeds the row degenerates; mori's unroll 2 for a bf16
        row of 7168 on wave64 and the H200's unroll 4 on wave32 are the same 2048-byte step).

    Every derived number is a starting point to re-tune on the arch (``epgen tune``).

    Raises:
        ValueError: unknown arch or entry.
    """
    t = traits(arch)
    C = t.compute_units
    per_cu = t.max_waves_per_simd * t.simds_per_cu * t.wave_size // 1024  # resident 1024-thread blocks
    u = _unroll(t, row_bytes)
    rules = {
        "dispatch": ((512, C // 2, 1024, u), (1024, C, 1024, u), (NO_LIMIT, C * per_cu, 1024, u)),
        "combine": ((128, C // 4, 1024, u), (NO_LIMIT, C // 8, 1024, u)),
        "dispatch_ll": ((LOW_LATENCY_MAX_TOKENS, C // 4, 256, 2),),
        "combine_ll": ((LOW_LATENCY_MAX_TOKENS, C // 4, 256, 2),),
        "expand": ((NO_LIMIT, C, 512, 1),),
        "fold": ((NO_LIMIT, 2 * C, 512, 1),),
        "combine_quantize": ((NO_LIMIT, 2 * C, 512, 2),),
    }
    if entry not in rules:
        raise ValueError(f"entry={entry!r}: no derived geometry; known: {', '.join(rules)}")
    source = Source("derived", f"{arch} facts: {C} CUs, wave {t.wave_size} (epgen.codegen.tuning.derived)")
    return _buckets(t, rules[entry], source)


def _buckets(t: ArchTraits, rows, source: Source) -> tuple[Bucket, ...]:
    return tuple(Bucket(m, Geometry(max(1, b), threads // t.wave_size, u), source) for m, b, threads, u in rows)


def defaults(arch: str, entry: str, row_bytes: int) -> tuple[Bucket, ...]:
    """Buckets of ``entry`` without a table entry: the arch's ``MEASURED_DEFAULTS``, else
    ``derived``."""
    measured = MEASURED_DEFAULTS.get(arch, {}).get(entry)
    if measured is None:
        return derived(arch, entry, row_bytes)
    source = Source("measured", f"{arch} default (epgen.codegen.tuning.MEASURED_DEFAULTS)")
    return _buckets(traits(arch), measured, source)


def write_entry(key: TuningKey, rows: list[tuple[int, Geometry]], provenance: str, measured: dict,
                transports: dict[int, str] | None = None) -> Path:
    """Replace (or add) the entry of ``key`` in its arch's table file and return the path;
    ``transports`` (dispatch only) maps a bucket's ``max_tokens`` to its transport, written as the
    bucket's ``transport``."""
    path = TABLE_DIR / f"{key.arch}.json"
    doc = json.loads(path.read_text()) if path.exists() else {"entries": []}
    entries = [e for e in doc["entries"] if TuningKey(**{f.name: e[f.name] for f in attrs.fields(TuningKey)}) != key]
    entries.append({**attrs.asdict(key), "provenance": provenance, "measured_us": measured,
                    "buckets": [{"max_tokens": t, **attrs.asdict(g), **({"transport": transports[t]} if transports else {})}
                                for t, g in rows]})
    entries.sort(key=lambda e: (e["op"], e["world_size"], e["row_bytes"], e["topk"], e["dtype"]))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"entries": entries}, indent=1) + "\n")
    _table.cache_clear()
    return path


def pick_fewest_blocks(times_us: dict[Geometry, float], tolerance: float = 0.03) -> Geometry:
    """The geometry with the fewest blocks whose time is within ``tolerance`` of the best (ties:
    fewer warps, then faster); leaves SMs to the compute that runs beside the kernel."""
    best = min(times_us.values())
    ok = [g for g, t in times_us.items() if t <= best * (1 + tolerance)]
    return min(ok, key=lambda g: (g.blocks, g.warps_per_block, times_us[g]))
