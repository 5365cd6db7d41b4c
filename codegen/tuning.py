"""Launch-geometry tables: (arch, world size, row bytes, top-k, dtype, op) -> token buckets.

A table entry lists buckets ``(max_tokens, blocks, warps_per_block, unroll)``; ``lookup`` takes the
smallest bucket whose ``max_tokens`` is not below the token count and clamps above the largest.
Explicit geometry in ``EpConfig`` overrides the table. A shape with no entry gets
``default_geometry``: 24 blocks of 1024 threads, unroll 4, the best geometry at 24 blocks that
``epgen tune`` measured for deepseek-v3 on 2 x H200 (2026-11-29,
docs/measurements/normal-family.md#tune); on AMD it is
a starting point, not a measurement.

Tables live in ``codegen/tuning/<arch>.json``; every entry records where its numbers came from
(``provenance``), and ``epgen tune`` writes the measured ones. A bucket of the "dispatch" op may
also say which transport the normal dispatch takes there (``"transport": "push"`` or ``"pull"``;
"push" when absent): ``transport``.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import attrs

from epgen.codegen.arch import traits
from epgen.codegen.spec import TRANSPORTS  # a dispatch bucket's transport values

TABLE_DIR = Path(__file__).parent / "tuning"
DEFAULT_BLOCKS = 24
DEFAULT_THREADS = 1024
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

    blocks: int = attrs.field(default=DEFAULT_BLOCKS, validator=_positive_int)
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


def default_geometry(arch: str) -> Geometry:
    """The documented default for shapes without a table entry (see module docstring)."""
    return Geometry(blocks=DEFAULT_BLOCKS, warps_per_block=DEFAULT_THREADS // traits(arch).wave_size,
                    unroll=DEFAULT_UNROLL)


LOCAL_GEOMETRY = {"expand": (132, 512, 1), "fold": (256, 512, 1), "combine_quantize": (264, 512, 2)}
"""(blocks, threads, unroll) of the local kernels without a table entry. The combine's quantize
kernel: 264 x 512 threads, unroll 2, the best compromise of 18 geometries (264-528 blocks, 256-1024
threads, unroll 2-8) in ``tools/quant_profile.py --sweep`` on the H200
(docs/measurements/quantized-combine.md#quantize-geometry, a349056: deepseek-v3, virtual W = 2): at 128 tokens a rank the fastest for fp4_blockwise
(3.9 us) and within 3 % of the fastest for fp8_blockwise; at 4096 within 5 % (fp4: 59.5 us against
56.6 at 528 x 512 u4, which takes 6.8 us at 128) and 2.5 % (fp8: 51.2 against 50.0). The kernel
has one geometry for every call (``EpConfig.variants``). The expert layout's, from
``tools/local_sweep.py`` on the H200 (docs/measurements/moe-layer.md#local-geometry, 6fdbde6 and
6295cde: deepseek-v3 at 1024
tokens a rank, W = 1 and virtual W = 8): the fold at unroll 1 with 16 warps a block (45 / 523 us
against 62 / 711 us at 256 x 8 warps, unroll 2); expand within 1 % of any geometry at W = 8 and
fastest at W = 1 with 132 blocks. Expand copies at unroll 1: at unroll 2 gfx950 runs out of its 106
SGPRs for top-k above 8 (52 spilled bytes at K = 16, H = 7168) and sm_90 spills 16-24 bytes for an
fp8 payload with scales at top-k 1-2 (offline compiles, clang 22 and NVRTC 13.0). On AMD a starting
point, not a measurement."""


LOW_LATENCY_GEOMETRY = (64, 256, 2)
"""(blocks, threads, unroll) of a low-latency op and its halves without a table entry: 64 x 256 threads,
the best at 1 and 128 tokens together among eight geometries ``tools/latency.py --sweep`` timed at
W = 1 and virtual W = 2 on the H200 (docs/measurements/decode-latency.md#ll-geometry, 8a5b1f1, at
unroll 4), at unroll 2,
where every catalogue and test shape compiles without a spill on sm_90 (tests/codegen). The
measured shapes have table entries (``epgen tune``); on AMD a starting point, not a measurement."""

LOW_LATENCY_MAX_TOKENS = 128
"""Tokens per rank up to which ``EpConfig(kernel_family="auto")`` takes the low-latency family
without a table entry (an entry's one bucket ``max_tokens`` replaces it): a design estimate, as
``LOW_LATENCY_GEOMETRY``."""


def low_latency_default(arch: str) -> tuple[int, Geometry]:
    """(max tokens, geometry) of a low-latency op without a table entry (``LOW_LATENCY_*``)."""
    blocks, threads, unroll = LOW_LATENCY_GEOMETRY
    return LOW_LATENCY_MAX_TOKENS, Geometry(blocks=blocks, warps_per_block=threads // traits(arch).wave_size,
                                            unroll=unroll)


def local_geometry(arch: str, op: str) -> Geometry:
    """Geometry of the local ``op`` ("expand", "fold", "combine_quantize") without a table entry
    (``LOCAL_GEOMETRY``)."""
    blocks, threads, unroll = LOCAL_GEOMETRY[op]
    return Geometry(blocks=blocks, warps_per_block=threads // traits(arch).wave_size, unroll=unroll)


@functools.lru_cache(maxsize=None)
def _table(arch: str) -> dict[TuningKey, tuple[tuple[int, Geometry, str], ...]]:
    path = TABLE_DIR / f"{arch}.json"
    if not path.exists():
        return {}
    table = {}
    for e in json.loads(path.read_text())["entries"]:
        key = TuningKey(**{f.name: e[f.name] for f in attrs.fields(TuningKey)})
        rows = []
        for b in e["buckets"]:
            transport = b.get("transport", "push")
            if transport not in TRANSPORTS or ("transport" in b and key.op != "dispatch"):
                raise ValueError(f"{path}: entry {key}: bucket max_tokens={b['max_tokens']} transport={transport!r}: "
                                 f"only 'dispatch' buckets carry a transport, one of {', '.join(TRANSPORTS)}")
            rows.append((b["max_tokens"], Geometry(b["blocks"], b["warps_per_block"], b["unroll"]), transport))
        table[key] = tuple(sorted(rows, key=lambda r: r[0]))
    return table


def _rows(key: TuningKey, default: Geometry | None) -> tuple[tuple[int, Geometry, str], ...]:
    return _table(key.arch).get(key) or ((1 << 30, default or default_geometry(key.arch), "push"),)


def buckets(key: TuningKey, default: Geometry | None = None) -> tuple[tuple[int, Geometry], ...]:
    """Buckets ``(max_tokens, geometry)`` of ``key``, ascending; when absent, ``default`` (else
    ``default_geometry``) alone."""
    return tuple((t, g) for t, g, _ in _rows(key, default))


def bucket_transports(key: TuningKey) -> tuple[tuple[int, str], ...]:
    """``(max_tokens, transport)`` of each of ``buckets(key)``, ascending; "push" where a bucket
    names none (and for a key without an entry)."""
    return tuple((t, tr) for t, _, tr in _rows(key, None))


def transport(key: TuningKey, tokens: int) -> str:
    """The transport of the bucket ``lookup`` picks for ``tokens`` ("push" or "pull")."""
    table = bucket_transports(key)
    return next((tr for max_tokens, tr in table if tokens <= max_tokens), table[-1][1])


def has_entry(key: TuningKey) -> bool:
    """Whether the tables hold an entry for ``key``."""
    return key in _table(key.arch)


def lookup(key: TuningKey, tokens: int, default: Geometry | None = None) -> Geometry:
    """Geometry for ``tokens``: the smallest bucket not below it, clamped to the largest (``buckets``,
    ``default`` when ``key`` has no entry)."""
    table = buckets(key, default)
    for max_tokens, geo in table:
        if tokens <= max_tokens:
            return geo
    return table[-1][1]


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
