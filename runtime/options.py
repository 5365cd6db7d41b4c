"""The options of the GPU verbs (demo, bench, tune, stress) and the routing kinds, with their
defaults: torch-free, so the command line builds its help from them without loading torch."""

from __future__ import annotations

import attrs

from epgen.codegen.catalogue import CATALOGUE_MAX_TOKENS, CATALOGUE_WORLD_SIZE
from epgen.codegen.tuning import Geometry

DEFAULT_MODEL = "deepseek-v3"
"""The catalogue model the GPU verbs and ``epgen build`` take when none is named."""

ROUTINGS = ("uniform", "invalid", "duplicates", "skewed", "one_rank", "shared")
"""Routing kinds of ``epgen.verify.make_inputs``."""

SWEEP = (1, 8, 32, 128, 512, 1024, 4096, 8192, 16384)
"""Tokens per rank ``epgen bench`` sweeps by default."""


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


@attrs.frozen
class TuneOptions:
    model: str = DEFAULT_MODEL
    world_size: int = 2
    tokens: tuple[int, ...] = (128, 1024, 4096, 8192)
    geometries: tuple[Geometry, ...] | None = None  # None: CANDIDATE_BLOCKS x 1024 threads x unroll 4
    routing: str = "uniform"
    dtype: str = "bf16"
    iters: int = 20
    write: bool = True


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
