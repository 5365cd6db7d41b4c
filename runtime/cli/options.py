"""What the GPU verbs (demo, bench, tune, stress) take beyond the ``EpConfig`` the flags build
(``epgen.cli.flags.config_from``), with their defaults: torch-free, so the command line builds its
help from them without loading torch. A field of the layer (model shape, world size, dtype,
combine wire, geometries, kernel family, transport) is the config's, never an option's."""

from __future__ import annotations

import attrs

from epgen.codegen.tuning import Geometry

DEFAULT_MODEL = "deepseek-v3"
"""The catalogue model the GPU verbs and ``epgen build`` take when none is named."""

GPU_VERB_WORLD_SIZE = 2
"""Ranks bench, tune and stress run by default (one process a GPU, unless virtual)."""

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


DEMO_ITERS = 20
"""Timed iterations of ``epgen demo``."""


def family_config(cfg, family: str, max_tokens: int):
    """The ``EpConfig`` of a bench or tune op of kernel ``family`` built from the verb's ``cfg``:
    that family, ``max_tokens`` tokens a rank, and ``cfg.dispatch_transport`` but "push" for the
    low-latency family (``family_transport``).

    Raises:
        FieldError: the family, tokens or transport break a rule of the config.
    """
    return attrs.evolve(cfg, kernel_family=family, max_tokens_per_rank=max_tokens,
                        dispatch_transport=family_transport(family, cfg.dispatch_transport))


def model_label(cfg) -> str:
    """The catalogue model of ``cfg``'s shape (``epgen.codegen.models.MODELS``), else the shape."""
    from epgen.codegen.models import MODELS

    name = next((m.name for m in MODELS.values() if (m.hidden, m.topk, m.num_experts) ==
                 (cfg.hidden, cfg.topk, cfg.num_experts)), None)
    return name or f"hidden {cfg.hidden}, top-{cfg.topk} of {cfg.num_experts} experts"


@attrs.frozen
class BenchOptions:
    """``epgen bench``'s points: the token counts, routings and kernel families timed (one op per
    family, ``family_config``), timed replays a point, virtual ranks, the output path prefix."""

    tokens: tuple[int, ...] = SWEEP
    routings: tuple[str, ...] = ("uniform", "skewed")
    iters: int = 30
    virtual: bool = False
    output: str = ""  # path prefix of the .csv/.png (rank 0 writes)
    family: str = "both"  # BENCH_FAMILIES


@attrs.frozen
class TuneOptions:
    """``epgen tune``'s sweeps: the candidates, token counts and families it times, and whether it
    writes the table."""

    tokens: tuple[int, ...] = (128, 1024, 4096, 8192)  # the normal family's buckets
    geometries: tuple[Geometry, ...] | None = None  # None: CANDIDATE_BLOCKS x 1024 threads x unroll 4
    routing: str = "uniform"
    iters: int = 20
    write: bool = True
    family: str = "both"  # TUNE_FAMILIES
    low_latency_tokens: tuple[int, ...] = LOW_LATENCY_SWEEP
    low_latency_geometries: tuple[Geometry, ...] | None = None  # None: tune.default_low_latency_candidates
    virtual: bool = False  # every rank in this process on one GPU
    pull: bool = True  # time the normal dispatch's pull transport too; a bucket takes the faster transport


@attrs.frozen
class StressOptions:
    """``epgen stress``'s rounds: how many, their seed, virtual ranks, and a fault injected every
    ``fault_every`` rounds (0: none)."""

    rounds: int = 200
    seed: int = 0
    virtual: bool = False
    fault_every: int = 0


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
