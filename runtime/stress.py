"""``epgen stress``: many verified dispatch/combine rounds with random token counts and routing.

Each round draws T per rank in [0, max_tokens_per_rank] and a routing kind (``epgen.options.ROUTINGS``:
uniform, -1 sprinkled, duplicates, skewed, all to one rank) from one seeded generator, so every
process draws the same round; ``check.run_round`` verifies it against the reference. With one
process per GPU the first failure ends the run (the peers cannot continue a half-done round);
with virtual ranks the run goes on and counts failures.
"""

from __future__ import annotations

import random

import attrs

from epgen.options import ROUTINGS, StressOptions
from epgen.verify import run_round
from epgen.codegen.config import EpConfig


@attrs.frozen
class StressResult:
    """rounds run, failures as (round, tokens, routing, message), and the worst combined element's
    error as a fraction of its bound (``check.check_combine``; at most 1 when nothing failed)."""

    rounds: int
    failures: tuple
    worst_bound_ratio: float


def stress(op, cfg: EpConfig, rounds: int, seed: int, report=print) -> StressResult:
    """Run ``rounds`` verified rounds on ``op``; ``report`` receives one line per round."""
    rng = random.Random(seed)
    failures, worst = [], 0.0
    for i in range(rounds):
        tokens = [rng.randint(0, cfg.max_tokens_per_rank) for _ in range(cfg.world_size)]
        kind = rng.choice(ROUTINGS)
        try:
            worst = max(worst, run_round(op, cfg, tokens, kind, seed=seed * 100_003 + i)["bound_ratio"])
            report(f"round {i + 1}/{rounds}: tokens {tokens} {kind}: ok")
        except AssertionError as e:
            failures.append((i, tokens, kind, str(e)))
            report(f"round {i + 1}/{rounds}: tokens {tokens} {kind}: FAILED: {e}")
            if not op.virtual:
                return StressResult(i + 1, tuple(failures), worst)
    return StressResult(rounds, tuple(failures), worst)


def stress_process(rank: int, world_size: int, opts: StressOptions) -> StressResult:
    from epgen.op import EpDispatchCombine

    cfg = EpConfig.for_model(opts.model, world_size=world_size, max_tokens_per_rank=opts.max_tokens, dtype=opts.dtype,
                             combine_quant=opts.combine_quant, kernel_family=opts.kernel_family,
                             low_latency_geometry=opts.low_latency_geometry)
    op = EpDispatchCombine(cfg, virtual=opts.virtual)
    speak = rank == 0
    result = stress(op, cfg, opts.rounds, opts.seed, report=print if speak else (lambda _line: None))
    op.close()
    if speak:
        print(f"stress: {result.rounds} rounds, {len(result.failures)} failures, worst combine error "
              f"{result.worst_bound_ratio:.3g} of its bound ({'virtual ' if opts.virtual else ''}W={world_size}, {opts.model}, "
              f"{opts.dtype}, combine {cfg.combine_quant}, max tokens {opts.max_tokens}, kernel family "
              f"{opts.kernel_family})")
    if result.failures:
        raise AssertionError(f"rank {rank}: {len(result.failures)} of {result.rounds} rounds failed; first: "
                             f"{result.failures[0]}")
    return result


def run(opts: StressOptions) -> None:
    """One process per GPU for W > 1 unless virtual, else in this process."""
    from epgen.ranks import run_ranks_or_here

    run_ranks_or_here(opts.world_size, opts.virtual, stress_process, opts)


__all__ = ["StressOptions", "StressResult", "run", "stress"]
