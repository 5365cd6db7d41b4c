"""The options of the GPU verbs (demo, bench, tune, stress) and the routing kinds, with their
defaults: torch-free, so the command line builds its help from them without loading torch."""

from __future__ import annotations

import attrs

from epgen.codegen.catalogue import CATALOGUE_MAX_TOKENS, CATALOGUE_WORLD_SIZE
from epgen.codegen.tuning import Geometry

DEFAULT_MODEL = "deepseek-v3"
"""The catalogue model the GPU verbs and ``epgen build`` take when none is named."""

SWEEP = (1, 8, 32, 128, 512, 1024, 4096, 8192, 16384)
"""Tokens per rank ``epgen bench`` sweeps by default."""

NODES_SWEEP = (128, 1024, 4096)
"""Tokens per rank ``epgen bench --nodes`` sweeps by default with the GPU's node-local op."""

NODES_SWEEP_CPU = (8, 128)
"""The same with the CPU stand-in (the torch reference on the host: minutes a point at 4096)."""

BENCH_FAMILIES = ("both", "auto", "normal", "low_latency")
"""``epgen bench --family`` values: "both" times the normal and the low-latency family (one op
each, ``EpConfig.kernel_family``), "auto" one op of ``kernel_family="auto"`` (each point takes
the family the op picks), "normal" and "low_latency" that family alone."""

BOTH_LOW_LATENCY_MAX_TOKENS = 1024
"""With ``--family both`` bench times the low-latency family at token counts up to this many
(decode sizes and the crossover); ``--family low_latency`` times it at every count asked for."""

TUNE_FAMILIES = ("both", "normal", "low_latency")
"""``epgen tune --family`` values: which families it measures and writes entries for."""

LOW_LATENCY_SWEEP = (1, 8, 32, 128, 256)
"""Tokens per rank at which ``epgen tune`` measures the low-latency family by default."""


def family_transport(family: str, transport: str) -> str:
    """The ``EpConfig.dispatch_transport`` of a bench op of kernel ``family`` given ``--transport``:
    ``transport``, but "push" for the low-latency family (it has no pull)."""
    return "push" if family == "low_latency" else transport


def family_points(family: str, tokens) -> dict[str, tuple[int, ...]]:
    """The token counts bench times per ``EpConfig.kernel_family`` for ``--family family``
    (``BENCH_FAMILIES``), in the order given, without repeats: "both" -> normal at every count
    and low_latency at those up to ``BOTH_LOW_LATENCY_MAX_TOKENS`` (left out when none is);
    otherwise the one family at every count.

    Raises:
        ValueError: ``family`` not in ``BENCH_FAMILIES``.
    """
    if family not in BENCH_FAMILIES:
        raise ValueError(f"family={family!r}: must be one of {', '.join(BENCH_FAMILIES)}")
    tokens = tuple(dict.fromkeys(tokens))
    if family != "both":
        return {family: tokens}
    small = tuple(t for t in tokens if t <= BOTH_LOW_LATENCY_MAX_TOKENS)
    return {"normal": tokens, **({"low_latency": small} if small else {})}


@attrs.frozen
class DemoOptions:
    model: str = DEFAULT_MODEL
    world_size: int = CATALOGUE_WORLD_SIZE  # virtual ranks on one GPU
    tokens: int = CATALOGUE_MAX_TOKENS  # tokens per rank
    iters: int = 20  # timed iterations


@attrs.frozen
class BenchOptions:
    model: str = DEFAULT_MODEL
    world_size: int = 2
    tokens: tuple[int, ...] = SWEEP
    routings: tuple[str, ...] = ("uniform", "skewed")
    dtype: str = "bf16"
    combine_quant: str = "none"  # combine wire format
    dispatch_geometry: Geometry | None = None  # None: the tuning table per token bucket
    combine_geometry: Geometry | None = None
    iters: int = 30
    virtual: bool = False
    output: str = ""  # path prefix of the .csv/.png (rank 0 writes)
    family: str = "both"  # BENCH_FAMILIES
    low_latency_geometry: Geometry | None = None  # None: the tuning table's
    transport: str = "auto"  # the normal family's EpConfig.dispatch_transport (x sits in dispatch_input)


@attrs.frozen
class TuneOptions:
    model: str = DEFAULT_MODEL
    world_size: int = 2
    tokens: tuple[int, ...] = (128, 1024, 4096, 8192)  # the normal family's buckets
    geometries: tuple[Geometry, ...] | None = None  # None: CANDIDATE_BLOCKS x 1024 threads x unroll 4
    routing: str = "uniform"
    dtype: str = "bf16"
    iters: int = 20
    write: bool = True
    family: str = "both"  # TUNE_FAMILIES
    low_latency_tokens: tuple[int, ...] = LOW_LATENCY_SWEEP
    low_latency_geometries: tuple[Geometry, ...] | None = None  # None: tune.default_low_latency_candidates
    virtual: bool = False  # every rank in this process on one GPU
    combine_quant: str = "none"  # a quantized wire tunes that wire's combine entry alone (family "normal")
    pull: bool = True  # time the normal dispatch's pull transport too; a bucket takes the faster transport


@attrs.frozen
class StressOptions:
    model: str = DEFAULT_MODEL
    world_size: int = 2
    max_tokens: int = CATALOGUE_MAX_TOKENS
    rounds: int = 200
    seed: int = 0
    virtual: bool = False
    dtype: str = "bf16"
    combine_quant: str = "none"
    kernel_family: str = "auto"  # EpConfig.kernel_family
    low_latency_geometry: Geometry | None = None  # None: the tuning table's
    fault_every: int = 0  # a recoverable fault injected every this many rounds (0: none)


def tune_counts(opts: TuneOptions) -> dict[str, tuple[int, ...]]:
    """The token counts ``epgen tune`` times per kernel family for ``opts``, ascending: "normal"
    at the buckets ``opts.tokens`` plus the low-latency counts when both families are tuned (the
    threshold's reference), or with ``family="low_latency"`` at the low-latency counts alone;
    "low_latency" (unless ``family="normal"``) at ``opts.low_latency_tokens``.

    Raises:
        ValueError: ``opts.family`` not in ``TUNE_FAMILIES``.
    """
    if opts.family not in TUNE_FAMILIES:
        raise ValueError(f"TuneOptions.family={opts.family!r}: must be one of {', '.join(TUNE_FAMILIES)}")
    small = tuple(sorted(set(opts.low_latency_tokens))) if opts.family != "normal" else ()
    normal = small if opts.family == "low_latency" else tuple(sorted(set(opts.tokens) | set(small)))
    return {"normal": normal, **({"low_latency": small} if small else {})}
