"""``epgen tune``: sweep launch geometry on the GPU and write the tuning table.

For every geometry (the same one for dispatch and combine; each op is timed on its own) and token
count: one verified round, then the median of CUDA-graph replays queued behind a GPU-side delay
(``bench.measure``, ``timing.time_pairs_queued``); the time of a point is the slowest rank's
median. Per op and token bucket the table takes the fewest blocks within 3% of the best
(``tuning.pick_fewest_blocks``), which leaves SMs to the compute beside it.
"""

from __future__ import annotations


import attrs
import torch

from epgen.bench import environment, measure
from epgen.codegen.spec import Op
from epgen.codegen.tuning import DEFAULT_UNROLL, Geometry, default_geometry, pick_fewest_blocks, write_entry
from epgen.device import device_arch
from epgen.codegen.config import EpConfig
from epgen.options import TuneOptions


CANDIDATE_BLOCKS = (8, 16, 24, 32, 48, 64, 132)


def default_candidates(arch: str) -> tuple[Geometry, ...]:
    """CANDIDATE_BLOCKS blocks of 1024 threads (the arch's wave size decides the warps), unroll 4."""
    warps = default_geometry(arch).warps_per_block
    return tuple(Geometry(b, warps, DEFAULT_UNROLL) for b in CANDIDATE_BLOCKS)


def tune_process(rank: int, world_size: int, opts: TuneOptions) -> dict:
    """Returns {(op, tokens): {geometry: us}} on every rank."""
    from epgen.op import EpDispatchCombine

    dist = torch.distributed if torch.distributed.is_initialized() else None
    geometries = opts.geometries or default_candidates(device_arch(torch.cuda.current_device()))
    opts = attrs.evolve(opts, geometries=geometries)
    times: dict = {}
    seed = 500
    for geo in geometries:
        cfg = EpConfig.for_model(opts.model, world_size=world_size, max_tokens_per_rank=max(opts.tokens),
                                 dtype=opts.dtype, dispatch_geometry=geo, combine_geometry=geo, timeout_s=20.0)
        op = EpDispatchCombine(cfg)
        for T in opts.tokens:
            seed += 1
            pair, _ = measure(op, cfg, T, opts.routing, seed, opts.iters)  # warns if the delay ran out
            mine = [t.median_us for t in pair.queued]
            if dist:
                every = [None] * world_size
                dist.all_gather_object(every, mine)
                mine = [max(v[i] for v in every) for i in range(2)]
            times.setdefault((Op.DISPATCH, T), {})[geo] = mine[0]
            times.setdefault((Op.COMBINE, T), {})[geo] = mine[1]
        arch, key_cfg = op.arch, cfg
        op.close()
    if rank == 0:
        _report(times, opts, arch, key_cfg)
    return times


def _report(times, opts: TuneOptions, arch: str, cfg: EpConfig):
    from rich.console import Console
    from rich.table import Table

    env = environment()
    console = Console(width=200)
    for op in (Op.DISPATCH, Op.COMBINE):
        t = Table(title=f"epgen tune {op.value}: {opts.model}, W={cfg.world_size}, {arch}, "
                        f"us (slowest rank's queued median)")
        t.add_column("tokens", justify="right")
        for g in opts.geometries:
            t.add_column(str(g), justify="right")
        t.add_column("pick", justify="right")
        rows = []
        for T in opts.tokens:
            per = times[(op, T)]
            pick = pick_fewest_blocks(per)
            rows.append((T, pick))
            t.add_row(str(T), *[f"{per[g]:.1f}" for g in opts.geometries], str(pick))
        console.print(t)
        if opts.write:
            provenance = (f"measured {env['date']} on {env['gpus']}x {env['gpu']} (driver {env['driver']}, torch "
                          f"{env['torch']}, cupy {env['cupy']}, commit {env['commit']}) by epgen tune --model "
                          f"{opts.model} --world-size {cfg.world_size}, routing {opts.routing}; fewest blocks within 3%")
            measured = {str(T): {str(g): round(times[(op, T)][g], 1) for g in opts.geometries} for T in opts.tokens}
            path = write_entry(cfg.tuning_key(arch, op), rows, provenance, measured)
            console.print(f"wrote {path}")


def run(opts: TuneOptions) -> None:
    """One process per GPU for W > 1, else in this process."""
    from epgen.ranks import run_ranks_or_here

    run_ranks_or_here(opts.world_size, False, tune_process, opts)


__all__ = ["TuneOptions", "run", "tune_process"]
