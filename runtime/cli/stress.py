"""``epgen stress``: many verified dispatch/combine rounds with random token counts and routing.

Each round draws, from one seeded generator (so every process draws the same round): the kernel
family, when the op builds both ("auto" with a threshold T_ll below max_tokens_per_rank: every
rank's tokens in [0, T_ll] for a low-latency round, in (T_ll, max] for a normal one, so that every
rank takes the same family, as one process per GPU requires); T per rank; a routing kind
(``epgen.harness.ROUTINGS``: uniform, -1 sprinkled, duplicates, skewed, all to one rank, a shared
expert column); and for every other low-latency round the send/receive split with a matmul on the
stream between the halves. ``verify.run_round`` checks the round against the reference.

With ``fault_every`` N, every Nth round injects a recoverable fault on one rank (drawn): an expert
id past E in its dispatch, or, when that rank receives rows, a y one row short in its combine.
Every rank's ``synchronize()`` must raise it, recoverable, naming that rank (and with one process
per GPU the same text on every rank); the round then ends (after a faulted dispatch no rank
combines: the documented recovery) and the next round runs exactly. With one process per GPU the
first failure ends the run (the peers cannot continue a half-done round); with virtual ranks the
run goes on and counts failures.
"""

from __future__ import annotations

import collections
import random

import attrs
import torch

from epgen.cli.options import StressOptions, model_label
from epgen.harness import ROUTINGS
from epgen.harness.verify import expert_outputs, make_inputs, op_arg, op_inputs, reference_dispatch, run_round
from epgen.codegen.config import EpConfig


@attrs.frozen
class StressResult:
    """rounds run, failures as (round, tokens, routing, message), the worst combined element's
    error as a fraction of its bound (``check.check_combine``; at most 1 when nothing failed), and
    ``counts``: rounds by kind ("low_latency", "normal", "split", "fault")."""

    rounds: int
    failures: tuple
    worst_bound_ratio: float
    counts: dict = attrs.field(factory=dict)


FAULTS = ("bad_id", "short_y")
"""The recoverable faults ``stress`` injects, in turn."""


def _family_low(op, cfg: EpConfig) -> int | None:
    """T_ll when the op builds both families (each round then draws one), else None."""
    t_ll = op.low_latency_tokens
    return t_ll if cfg.kernel_family == "auto" and 0 < t_ll < cfg.max_tokens_per_rank else None


def stress(op, cfg: EpConfig, rounds: int, seed: int, report=print, fault_every: int = 0) -> StressResult:
    """Run ``rounds`` verified rounds on ``op`` (module docstring); ``report`` receives one line per round."""
    rng = random.Random(seed)
    failures, worst, counts = [], 0.0, collections.Counter()
    t_ll = _family_low(op, cfg)
    busy = _matmul(op.device)
    split_next = False
    for i in range(rounds):
        low = t_ll is not None and rng.random() < 0.5
        lo, hi = (0, t_ll) if low else ((t_ll + 1, cfg.max_tokens_per_rank) if t_ll is not None
                                         else (0, cfg.max_tokens_per_rank))
        tokens = [rng.randint(lo, hi) for _ in range(cfg.world_size)]
        kind = rng.choice(ROUTINGS)
        family = op.family(max(tokens))
        counts[family] += 1
        split = family == "low_latency" and split_next
        split_next = not split_next if family == "low_latency" else split_next
        fault = FAULTS[(i + 1) // fault_every % len(FAULTS)] if fault_every and (i + 1) % fault_every == 0 else None
        culprit = rng.randrange(cfg.world_size)
        what = f"tokens {tokens} {kind} {family}{' split' if split else ''}"
        try:
            if fault:
                what += f", {_fault_round(op, cfg, tokens, kind, seed * 100_003 + i, fault, culprit)}"
                counts["fault"] += 1
            else:
                stats = run_round(op, cfg, tokens, kind, seed=seed * 100_003 + i, busy=busy if split else None)
                worst = max(worst, stats["bound_ratio"])
                counts["split"] += split
            report(f"round {i + 1}/{rounds}: {what}: ok")
        except AssertionError as e:
            failures.append((i, tokens, kind, str(e)))
            report(f"round {i + 1}/{rounds}: {what}: FAILED: {e}")
            if not op.virtual:
                return StressResult(i + 1, tuple(failures), worst, dict(counts))
    return StressResult(rounds, tuple(failures), worst, dict(counts))


def _matmul(device):
    """GPU work for between the halves of a split call: a 1024 x 1024 fp32 matmul on the stream."""
    a = torch.randn(1024, 1024, device=device)
    return lambda: a @ a


def _fault_round(op, cfg: EpConfig, tokens: list[int], kind: str, seed: int, fault: str, culprit: int) -> str:
    """One round with ``fault`` injected on rank ``culprit`` (a short y only where it receives rows:
    else a bad id); returns what was injected.

    Raises:
        AssertionError: no rank's synchronize raised it, or one raised something else.
    """
    from epgen.op import EpError

    tokens = list(tokens)
    tokens[culprit] = max(tokens[culprit], 1)
    inputs = make_inputs(cfg, tokens, kind, seed, device=op.device)
    rows = [r.num_rows for r in reference_dispatch(cfg, [i.to("cpu") for i in inputs])]
    received = rows[culprit]
    fault = fault if received else "bad_id"
    if fault == "bad_id":
        inputs[culprit].indices[0, 0] = cfg.num_experts
        want = f"rank {culprit}: indices[0, 0]={cfg.num_experts}: expert ids must be -1 or in"
    else:
        want = f"rank {culprit}: combine: y has {received - 1} rows but this rank's last dispatch produced {received}"
    op.dispatch(*op_inputs(op, inputs))
    if fault == "short_y":  # the culprit's y one row short of what it received; the others' whole
        gen = torch.Generator(device=op.device).manual_seed(seed + 1)
        ys = [expert_outputs(rows[r] - (r == culprit) or 1, cfg.hidden, gen)[: rows[r] - (r == culprit)]
              for r in op.local_ranks]
        op.combine(op_arg(op, ys))
    try:
        op.synchronize()
    except EpError as e:
        text = str(e)
        assert e.recoverable and want in text, f"{fault} on rank {culprit}: raised {text!r}, expected {want!r}"
        _same_everywhere(op, text)
        return f"{fault} on rank {culprit} raised on every rank"
    raise AssertionError(f"{fault} on rank {culprit}: synchronize() raised nothing")


def _same_everywhere(op, text: str) -> None:
    """With one process per GPU: every rank raised ``text`` (gathered over the op's group)."""
    if op.virtual or op.config.world_size == 1:
        return
    import torch.distributed as dist

    every = [None] * op.config.world_size
    dist.all_gather_object(every, text)
    assert all(t == text for t in every), f"the ranks raised different faults: {every}"


def stress_process(rank: int, world_size: int, cfg: EpConfig, opts: StressOptions) -> StressResult:
    from epgen.op import EpDispatchCombine

    op = EpDispatchCombine(cfg, virtual=opts.virtual)
    speak = rank == 0
    result = stress(op, cfg, opts.rounds, opts.seed, report=print if speak else (lambda _line: None),
                    fault_every=opts.fault_every)
    if not op.virtual and world_size > 1:
        import torch.distributed as dist

        dist.barrier()  # every peer is done with this rank's arena
    op.close()
    if speak:
        from epgen.harness.ranks import shares_gpu

        where = ("virtual " if opts.virtual else "") + f"W={world_size}" + (
            " processes sharing cuda:0" if not opts.virtual and shares_gpu(world_size) else "")
        print(f"stress: {result.rounds} rounds ({', '.join(f'{v} {k}' for k, v in sorted(result.counts.items()))}), "
              f"{len(result.failures)} failures, worst combine error {result.worst_bound_ratio:.3g} of its bound "
              f"({where}, {model_label(cfg)}, {cfg.dtype}, combine {cfg.combine_quant}, max tokens "
              f"{cfg.max_tokens_per_rank}, kernel family {cfg.kernel_family}, a fault every {opts.fault_every or 'no'} "
              "rounds)")
    if result.failures:
        raise AssertionError(f"rank {rank}: {len(result.failures)} of {result.rounds} rounds failed; first: "
                             f"{result.failures[0]}")
    return result


def run(cfg: EpConfig, opts: StressOptions) -> None:
    """Stress an op of ``cfg``: one process per rank for W > 1 unless virtual (sharing cuda:0 when
    there are fewer GPUs), else in this process."""
    from epgen.harness.ranks import run_ranks_or_here

    run_ranks_or_here(cfg.world_size, opts.virtual, stress_process, cfg, opts)


__all__ = ["StressOptions", "StressResult", "run", "stress"]
