"""``epgen tune``: sweep launch geometry on the GPU and write the tuning table.

Every point is one verified round, then the median of CUDA-graph replays queued behind a GPU-side
delay (``bench.measure``, ``timing.time_pairs_queued``); the time of a point is the slowest
rank's median. Geometries are picked by ``tuning.pick_fewest_blocks`` (the fewest blocks within
3% of the best), which leaves SMs to the compute beside the kernel.

Normal family (``--family normal`` or ``both``, the default): every candidate geometry (the same
one for dispatch and combine; each op is timed on its own) at every token bucket; per op and
bucket the table takes the pick. The dispatch is timed as push and, unless ``TuneOptions.pull`` is
False, as pull too (x in the op's ``dispatch_input``, as a serving engine would place it); a bucket
takes the transport whose pick is faster (``choose_transport``) and writes it as the bucket's
transport.

Low-latency family (``--family low_latency`` or ``both``): every candidate geometry
(``default_low_latency_candidates``: 16 to 128 blocks of 256 and 512 threads, unroll 4) at the small
token counts (``options.LOW_LATENCY_SWEEP``: 1, 8, 32, 128, 256), a dispatch or combine being
its sending and receiving halves back to back. Each op takes the pick at the largest small count
for all counts. The normal family is timed at the small counts too (every normal candidate; with
``--family low_latency`` alone at the tuning table's geometry, or at the ``--geometry``
candidates), and the threshold is the largest small count up to which the low-latency dispatch +
combine beats the normal family's best dispatch + best combine at every count measured
(``low_latency_threshold``); 0 when it does not win at the smallest, which
``EpConfig(kernel_family="auto")`` reads as never. The ``dispatch_ll`` and ``combine_ll`` entries
get one bucket each: (threshold, the op's pick).

With ``--virtual`` every rank runs in this process on one GPU; the entries go to the same key as
real ranks of that world size (the provenance says virtual), and a normal candidate whose blocks
of every rank cannot all be resident at once is skipped with the reason.
"""

from __future__ import annotations

import attrs
import torch

from epgen.harness.measure import environment, measure
from epgen.codegen.abi import LL_FLAG_SLOTS
from epgen.codegen.arch import traits
from epgen.codegen.planner import tuning_key
from epgen.codegen.tuning import DEFAULT_UNROLL, Geometry, pick_fewest_blocks, write_entry
from epgen.device import device_arch
from epgen.codegen.config import EpConfig
from epgen.codegen.spec import QUANTIZED_COMBINE_THREADS, TIMED_OPS, Op
from epgen.cli.options import TuneOptions, model_label, tune_counts


CANDIDATE_SHARES = (1 / 16, 1 / 8, 3 / 16, 1 / 4, 3 / 8, 1 / 2, 1, 2)
"""The normal family's candidate blocks as shares of the arch's CUs or SMs
(``ArchTraits.compute_units``): on the H200's 132 SMs 8 to 132 blocks, the range its picks came
from (docs/measurements/normal-family.md#tune), and 2 x the SMs, where mori's MI350X dispatch still
gained (its seeds' sweep)."""


def candidate_blocks(arch: str) -> tuple[int, ...]:
    """``CANDIDATE_SHARES`` of ``arch``'s compute units, ascending, without repeats."""
    return tuple(sorted({max(1, int(traits(arch).compute_units * share)) for share in CANDIDATE_SHARES}))

LOW_LATENCY_CANDIDATE_BLOCKS = (16, 32, 64, 128)
LOW_LATENCY_CANDIDATE_THREADS = (256, 512)
LOW_LATENCY_CANDIDATE_UNROLL = 4
"""Around the geometry that led ``tools/latency.py --sweep`` on the H200 (64 x 256 u4, measured on
8a5b1f1: docs/measurements/decode-latency.md#ll-geometry), where 132 blocks helped at 128 tokens."""


def default_candidates(arch: str, combine_quant: str = "none") -> tuple[Geometry, ...]:
    """``candidate_blocks`` blocks of 1024 threads (the arch's wave size decides the warps), unroll 4;
    for a quantized wire's combine, of ``QUANTIZED_COMBINE_THREADS`` and unroll 4 or 2 (its
    registers at unroll 4 allow one 512-thread block an SM on sm_90, at unroll 2 two: 132 x 16 u2
    led the geometry sweep of virtual W = 2 there, docs/measurements/quantized-combine.md#grid-rounding)."""
    warps = 1024 // traits(arch).wave_size
    if combine_quant == "none":
        return tuple(Geometry(b, warps, DEFAULT_UNROLL) for b in candidate_blocks(arch))
    warps = min(warps, QUANTIZED_COMBINE_THREADS // traits(arch).wave_size)
    return tuple(Geometry(b, warps, u) for u in (DEFAULT_UNROLL, 2) for b in candidate_blocks(arch))


def default_low_latency_candidates(arch: str, world_size: int) -> tuple[Geometry, ...]:
    """LOW_LATENCY_CANDIDATE_BLOCKS blocks of LOW_LATENCY_CANDIDATE_THREADS threads, unroll
    LOW_LATENCY_CANDIDATE_UNROLL, blocks clamped to ``LL_FLAG_SLOTS // world_size`` (one flag per
    (rank, block)), without repeats."""
    most = max(1, LL_FLAG_SLOTS // world_size)
    return tuple(dict.fromkeys(Geometry(min(b, most), threads // traits(arch).wave_size, LOW_LATENCY_CANDIDATE_UNROLL)
                               for threads in LOW_LATENCY_CANDIDATE_THREADS for b in LOW_LATENCY_CANDIDATE_BLOCKS))


@attrs.frozen
class Sweep:
    """One family's part of a tune run: ``family`` ("normal" or "low_latency"), the candidate
    ``geometries`` (None: the tuning table's, for the normal reference alone) and the token
    ``counts`` each is timed at, ascending."""

    family: str
    geometries: tuple[Geometry | None, ...]
    counts: tuple[int, ...]


def plan(layer: EpConfig, opts: TuneOptions, arch: str) -> tuple[Sweep, ...]:
    """What ``tune_process`` times for ``layer`` and ``opts`` on ``arch`` (module docstring), at the counts of
    ``options.tune_counts``: the normal sweep over ``opts.geometries`` (default
    ``default_candidates``; with ``family="low_latency"`` the tuning table's geometry, None), then
    the low-latency sweep over ``opts.low_latency_geometries`` (default
    ``default_low_latency_candidates``).

    Raises:
        ValueError: ``opts.family`` not in ``TUNE_FAMILIES``.
    """
    counts = tune_counts(opts)
    normal = opts.geometries or ((None,) if opts.family == "low_latency" else default_candidates(arch, layer.combine_quant))
    sweeps = [Sweep("normal", tuple(normal), counts["normal"])]
    if "low_latency" in counts:
        sweeps.append(Sweep("low_latency", tuple(opts.low_latency_geometries
                                                 or default_low_latency_candidates(arch, layer.world_size)),
                            counts["low_latency"]))
    return tuple(sweeps)


def low_latency_threshold(low_latency_us: dict[int, float], normal_us: dict[int, float]) -> int:
    """The largest token count T of ``low_latency_us`` (us by count) whose low-latency time is
    below ``normal_us[T]`` with every smaller count's too; 0 when the smallest count's is not
    (the low-latency family never wins). A NaN time never wins.

    Raises:
        KeyError: a count of ``low_latency_us`` missing from ``normal_us``.
    """
    threshold = 0
    for T in sorted(low_latency_us):
        if not low_latency_us[T] < normal_us[T]:
            break
        threshold = T
    return threshold


@attrs.frozen
class LowLatencyChoice:
    """The low-latency entries ``choose_low_latency`` derives: the ``dispatch`` and ``combine``
    geometries, the ``threshold`` (tokens), and per low-latency count the times compared,
    (dispatch us, combine us): ``low_latency_us`` at those geometries, ``normal_us`` the normal
    family's best dispatch and best combine."""

    dispatch: Geometry
    combine: Geometry
    threshold: int
    low_latency_us: dict
    normal_us: dict


def choose_low_latency(times: dict) -> LowLatencyChoice:
    """From ``times`` {(family, tokens): {geometry: (dispatch us, combine us)}} (as
    ``tune_process`` returns, normal at every low-latency count): each low-latency op's pick at
    the largest low-latency count, and the threshold of ``low_latency_threshold`` on dispatch +
    combine.

    Raises:
        ValueError: no low-latency point in ``times``.
        KeyError: a low-latency count without a normal point.
    """
    ll = {T: per for (family, T), per in times.items() if family == "low_latency"}
    if not ll:
        raise ValueError("choose_low_latency: times has no low-latency point")
    top = ll[max(ll)]
    picks = [pick_fewest_blocks({g: t[i] for g, t in top.items()}) for i in (0, 1)]
    ll_us = {T: (per[picks[0]][0], per[picks[1]][1]) for T, per in sorted(ll.items())}
    normal_us = {T: tuple(min(t[i] for t in times[("normal", T)].values()) for i in (0, 1)) for T in ll_us}
    threshold = low_latency_threshold({T: sum(t) for T, t in ll_us.items()}, {T: sum(t) for T, t in normal_us.items()})
    return LowLatencyChoice(picks[0], picks[1], threshold, ll_us, normal_us)


def choose_transport(push_us: dict[Geometry, float], pull_us: dict[Geometry, float]) -> tuple[Geometry, str]:
    """A dispatch bucket's (geometry, transport) from its times (us by geometry) as push and as
    pull (empty: pull not timed, or no candidate built): each transport's ``pick_fewest_blocks``,
    and pull only where its pick is faster than push's."""
    push = pick_fewest_blocks(push_us)
    if pull_us:
        pull = pick_fewest_blocks(pull_us)
        if pull_us[pull] < push_us[push]:
            return pull, "pull"
    return push, "push"


def tunes_pull(layer: EpConfig, opts: TuneOptions) -> bool:
    """Whether ``tune_process`` times the pull dispatch: ``opts.pull`` where the normal dispatch is
    tuned (family normal or both, no quantized combine wire)."""
    return opts.pull and opts.family != "low_latency" and layer.combine_quant == "none"


def tune_process(rank: int, world_size: int, layer: EpConfig, opts: TuneOptions) -> dict:
    """Returns {(key, tokens): {geometry: (dispatch us, combine us)}} on every rank, the slowest
    rank's queued medians (geometry None: the tuning table's); key is the family, or "pull" for the
    normal family's candidates with the pull dispatch (``tunes_pull``)."""
    from epgen.op import EpDispatchCombine

    dist = torch.distributed if torch.distributed.is_initialized() else None
    arch = device_arch(torch.cuda.current_device())
    sweeps = plan(layer, opts, arch)
    times: dict = {}
    skipped = []
    seed = 500
    for sweep in sweeps:
        transports = ("push", "pull") if sweep.family == "normal" and tunes_pull(layer, opts) else ("push",)
        for geo, transport in ((g, tr) for g in sweep.geometries for tr in transports):
            kw = (dict(dispatch_geometry=geo, combine_geometry=geo) if sweep.family == "normal"
                  else dict(low_latency_geometry=geo))
            key = "pull" if transport == "pull" else sweep.family
            cfg = attrs.evolve(layer, max_tokens_per_rank=max(sweep.counts), kernel_family=sweep.family,
                               timeout_s=20.0, dispatch_transport=transport, **kw)
            try:
                op = EpDispatchCombine(cfg, virtual=opts.virtual)
            except ValueError as e:  # virtual ranks: the candidate's blocks of every rank do not fit at once
                if not opts.virtual:
                    raise
                skipped.append(f"{key} {geo}: {e}")
                continue
            for T in sweep.counts:
                seed += 1
                pair, _, _ = measure(op, cfg, T, opts.routing, seed, opts.iters)  # warns if the delay ran out
                mine = [t.median_us for t in pair.queued]
                if dist:
                    every = [None] * world_size
                    dist.all_gather_object(every, mine)
                    mine = [max(v[i] for v in every) for i in range(2)]
                times.setdefault((key, T), {})[geo] = (mine[0], mine[1])
            op.close()
        if not any(family == sweep.family for family, _ in times):
            raise RuntimeError(f"epgen tune: no {sweep.family} candidate could be built: " + "; ".join(skipped))
    if rank == 0:
        _report(times, sweeps, skipped, layer, opts, arch)
    return times


def _provenance(layer: EpConfig, opts: TuneOptions, env: dict, how: str) -> str:
    virtual = " --virtual (every rank on one GPU)" if opts.virtual else ""
    return (f"measured {env['date']} on {env['gpus']}x {env['gpu']} (driver {env['driver']}, torch {env['torch']}, "
            f"cupy {env['cupy']}, commit {env['commit']}) by epgen tune --model {model_label(layer)} --world-size "
            f"{layer.world_size}{virtual} --family {opts.family}"
            f"{f' --quant {layer.combine_quant}' if layer.combine_quant != 'none' else ''}, routing {opts.routing}; "
            f"{how}")


def _report(times: dict, sweeps: tuple[Sweep, ...], skipped: list, layer: EpConfig, opts: TuneOptions, arch: str):
    from rich.console import Console
    from rich.table import Table

    env = environment()
    console = Console(width=200)
    for line in skipped:
        console.print(f"skipped candidate {line}")
    key_cfg = attrs.evolve(layer, max_tokens_per_rank=1)
    where = f"{model_label(layer)}, W={layer.world_size}{' virtual' if opts.virtual else ''}, {arch}"

    def op_table(family: str, i: int, counts, pick_at=None, key=None) -> tuple[Table, list[tuple[int, Geometry]]]:
        """Table of op ``i`` (0 dispatch, 1 combine) of ``family`` (its times under ``key``,
        default the family): tokens x measured geometries, and the pick per count (or the pick at
        ``pick_at`` for every count)."""
        op = TIMED_OPS[family][i]
        key = key or family
        geos = list(dict.fromkeys(g for T in counts for g in times[(key, T)]))
        t = Table(title=f"epgen tune {op.template}{' (pull)' if key == 'pull' else ''}: {where}, us (slowest rank's "
                        "queued median)")
        t.add_column("tokens", justify="right")
        for g in geos:
            t.add_column(str(g), justify="right")
        t.add_column(f"pick at {pick_at}" if pick_at else "pick", justify="right")
        rows = []
        for T in counts:
            per = times[(key, T)]
            pick = pick_fewest_blocks({g: v[i] for g, v in times[(key, pick_at or T)].items()})
            rows.append((T, pick))
            t.add_row(str(T), *[f"{per[g][i]:.1f}" if g in per else "-" for g in geos], str(pick))
        return t, rows

    for sweep in sweeps:
        if sweep.family != "normal" or opts.family == "low_latency":
            continue  # the normal sweep tunes only when asked to; otherwise it is the reference
        for i, op in enumerate(TIMED_OPS["normal"]):
            if op is Op.DISPATCH and layer.combine_quant != "none":
                continue  # the dispatch does not depend on the combine wire: tuned without --quant
            counts = tuple(sorted(set(opts.tokens)))
            table, rows = op_table("normal", i, counts)
            console.print(table)
            transports, how = None, "fewest blocks within 3%"
            pulled = op is Op.DISPATCH and all(("pull", T) in times for T in counts)
            if pulled:
                console.print(op_table("normal", i, counts, key="pull")[0])
                chosen = {T: choose_transport({g: v[0] for g, v in times[("normal", T)].items()},
                                              {g: v[0] for g, v in times[("pull", T)].items()}) for T in counts}
                rows = [(T, chosen[T][0]) for T in counts]
                transports = {T: chosen[T][1] for T in counts}
                console.print("transport per bucket: " + ", ".join(f"{T}: {tr} {chosen[T][0]}"
                                                                   for T, tr in transports.items()))
                how += " per transport; pull where its pick is faster than push's"
            if opts.write:
                measured = {str(T): {**{str(g): round(v[i], 1) for g, v in times[("normal", T)].items()},
                                     **({f"pull {g}": round(v[i], 1) for g, v in times[("pull", T)].items()}
                                        if pulled else {})} for T, _ in rows}
                path = write_entry(tuning_key(key_cfg, arch, op), rows, _provenance(layer, opts, env, how),
                                   measured, transports)
                console.print(f"wrote {path}")
    if opts.family == "normal":
        return
    choice = choose_low_latency(times)
    counts = tuple(choice.low_latency_us)
    for i in (0, 1):
        console.print(op_table("low_latency", i, counts, pick_at=counts[-1])[0])
    reference = "the tuning table's geometry" if sweeps[0].geometries == (None,) else "the best candidate per op"
    t = Table(title=f"epgen tune families: {where}, dispatch + combine us (normal at {reference}; low-latency "
                    f"dispatch {choice.dispatch}, combine {choice.combine})")
    for c in ("tokens", "normal dispatch", "normal combine", "normal", "low-latency dispatch",
              "low-latency combine", "low-latency", "faster"):
        t.add_column(c, justify="right")
    for T in counts:
        normal, ll = choice.normal_us[T], choice.low_latency_us[T]
        t.add_row(str(T), f"{normal[0]:.1f}", f"{normal[1]:.1f}", f"{sum(normal):.1f}", f"{ll[0]:.1f}", f"{ll[1]:.1f}",
                  f"{sum(ll):.1f}", "low-latency" if sum(ll) < sum(normal) else "normal")
    console.print(t)
    console.print(f"threshold: {choice.threshold} tokens per rank (kernel_family='auto' takes the low-latency "
                  f"family up to it{'; 0: never' if not choice.threshold else ''})")
    if not opts.write:
        return
    how = (f"geometry: fewest blocks within 3% at {counts[-1]} tokens; threshold {choice.threshold}: the largest "
           f"count up to which dispatch_ll + combine_ll beat the normal family ({reference}) at every count of "
           f"{', '.join(map(str, counts))} (0: never)")
    for i, (op, geo) in enumerate(zip(TIMED_OPS["low_latency"], (choice.dispatch, choice.combine))):
        measured = {str(T): {**{str(g): round(v[i], 1) for g, v in times[("low_latency", T)].items()},
                             "normal": round(choice.normal_us[T][i], 1)} for T in counts}
        path = write_entry(tuning_key(key_cfg, arch, op), [(choice.threshold, geo)],
                           _provenance(layer, opts, env, how), measured)
        console.print(f"wrote {path}")


def run(layer: EpConfig, opts: TuneOptions) -> None:
    """Tune ``layer``'s kernels: one process per GPU for W > 1 unless virtual, else in this process."""
    from epgen.harness.ranks import run_ranks_or_here

    run_ranks_or_here(layer.world_size, opts.virtual, tune_process, layer, opts)


__all__ = ["LowLatencyChoice", "Sweep", "TuneOptions", "choose_low_latency", "choose_transport", "low_latency_threshold",
           "plan", "run", "tune_process", "tunes_pull"]
