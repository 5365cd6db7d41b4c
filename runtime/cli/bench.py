"""``epgen bench``: dispatch and combine against the P2P ceiling and NCCL, in the same run.

For every (routing, tokens) point and kernel family: one verified round against the reference,
then dispatch and combine captured in CUDA graphs and timed by device events around each replay
(median, mean, stdev, best), the P2P ceiling kernel on the same wire bytes, and NCCL
``all_to_all_single`` on the same bytes per peer (docs/measuring.md). Rank 0 writes a CSV,
a PNG and prints a table.

Kernel families (``--family``, ``epgen.cli.options.family_points``): "both" (default) builds one op
of ``EpConfig(kernel_family="normal")`` and one of ``kernel_family="low_latency"`` and times the
normal family at every token count and the low-latency one at the counts up to
``options.BOTH_LOW_LATENCY_MAX_TOKENS`` (1024); "normal" or "low_latency" times that family alone
at every count (the low-latency family holds at most 65535 tokens a rank); "auto" builds one op
of ``kernel_family="auto"`` and each point takes the family it picks. A low-latency dispatch or
combine is its sending half and its receiving half back to back (no ``async_recv``). The CSV's
``family`` column names the family a row's calls took, ``virtual`` whether the ranks were
virtual (all in one process on one GPU).

Times (``epgen.harness.timing``): ``time_us`` (and mean, stdev, best) are queued, the replays enqueued
behind a GPU-side delay so the GPU runs them back to back; ``host_launched_us`` is the median of
the same replays launched from the host as they are enqueued (the host's launch rate at small
sizes). ``timing`` names the method of ``time_us``: ``queued``, or ``queued-short-sleep`` when the
delay ended before the host had enqueued the op's or the ceiling's launches (partly host-bound).
The P2P ceiling is timed queued; NCCL host-launched (its collective is not captured in a graph).

Row counts (CSV ``recv_rows`` / ``wire_rows``): for dispatch the rows the rank received (all /
from other ranks); for combine the rows the rank's combine gathers for its own tokens (one per
distinct rank a token reached / those on other ranks). Summed over ranks both are the same
rows; per rank they differ under skewed routing, where a pull combine moves a row on the clock
of the token's rank, not of the rank that holds it.
"""

from __future__ import annotations

import csv
import os
from pathlib import Path

import attrs
import torch

from epgen.codegen.spec import TIMED_OPS
from epgen.codegen.arch import traits
from epgen.codegen.dtypes import combine_quant
from epgen.codegen.render import render_ceiling
from epgen.device import cupy_stream
from epgen.loader import load_kernel
from epgen.codegen.config import EpConfig, Geometry
from epgen.cli.options import BenchOptions, family_config, family_points
from epgen.harness.measure import QUEUED, SHORT_SLEEP, environment, measure
from epgen.harness.timing import Timing, gbps, time_pairs, time_pairs_queued

CSV_COLUMNS = ("op", "family", "dtype", "routing", "tokens", "rank", "world_size", "virtual", "time_us", "mean_us",
               "stdev_us", "best_us",
               "host_launched_us", "timing", "recv_rows", "wire_rows", "logical_gbps", "wire_gbps", "p2p_ceiling_gbps",
               "nccl_gbps", "ratio_ceiling", "ratio_nccl", "blocks", "warps_per_block", "unroll", "transport")




def _time(fn, iters: int, warmup: int = 3, queued: bool = True) -> tuple[Timing, bool]:
    """``fn``'s Timing, queued behind a GPU-side delay (or host-launched), and whether the delay
    covered the enqueue (True when host-launched)."""
    if not queued:
        return time_pairs(fn, lambda: None, iters=iters, warmup=warmup)[0], True
    pair = time_pairs_queued(fn, lambda: None, iters=iters, warmup=warmup)
    return pair.queued[0], pair.delay.covered


class _Ceiling:
    """The P2P ceiling kernel on this process's device, full-GPU geometry."""

    def __init__(self, arch: str, device: torch.device):
        import cupy

        self.blocks = torch.cuda.get_device_properties(device).multi_processor_count
        self.threads = 16 * traits(arch).wave_size
        text, entry = render_ceiling(arch, self.blocks, 16, 4)
        with cupy.cuda.Device(device.index):
            self.fn = load_kernel(text, entry)
        self.device = device

    def run(self, src: int, dst: int, nbytes: int):
        import cupy

        with cupy.cuda.Device(self.device.index):
            self.fn((self.blocks, 1, 1), (self.threads, 1, 1), (cupy.uint64(src), cupy.uint64(dst), cupy.uint64(nbytes // 16)),
                    stream=cupy_stream(self.device))


def bench_process(rank: int, world_size: int, layer: EpConfig, opts: BenchOptions) -> list[dict]:
    """The benchmark body of one process (every rank of a real group, or the only process): one
    op of ``layer`` per kernel family of ``family_points(opts.family, opts.tokens)``
    (``family_config``), every point timed on each op that covers its token count, the ceiling
    and NCCL once per point."""
    from epgen.op import EpDispatchCombine

    dist = torch.distributed if torch.distributed.is_initialized() else None
    points = family_points(opts.family, opts.tokens)
    ops = {}
    for family, counts in points.items():
        cfg = attrs.evolve(family_config(layer, family, max(counts)), timeout_s=20.0)
        ops[family] = (cfg, EpDispatchCombine(cfg, virtual=opts.virtual))
    cfg0, first = next(iter(ops.values()))  # its arena holds the ceiling's bytes (W x its Tmax rows)
    me = first.local_ranks[0]
    ceiling = _Ceiling(first.arch, first.device)
    peer = (me + 1) % world_size
    src_ptr = first.arenas.pointers[me] + first.arena_layout.recv_x
    dst_ptr = first.arenas.pointers[peer] + first.arena_layout.combine_in  # peer's arena (own memory when W = 1)
    row_bytes = first.dispatch_spec.row_bytes
    combine_wire = combine_quant(cfg0.combine_quant)  # bf16 rows unless quantized
    combine_dtype = combine_wire.name if combine_wire.quantized else "bf16"
    env = environment() if me == 0 else None  # read once: nvidia-smi and git are slow per point
    rows = []
    seed = 100
    for routing in opts.routings:
        for T in dict.fromkeys(opts.tokens):
            seed += 1
            timed = []  # (family taken, op, pair, received rows, of them from peers, combine rows, of them remote)
            for family, (cfg, op) in ops.items():
                if T not in points[family]:
                    continue
                pair, (c_rows, c_wire), transport = measure(op, cfg, T, routing, seed, opts.iters)  # same inputs
                buf = op.recv_buffers(me)
                n = int(buf.num_recv.item())
                wire = int((buf.recv_src[:n, 0] != me).sum().item()) if world_size > 1 else n
                if world_size == 1:  # one rank: its own rows are what moves (as for dispatch)
                    c_wire = c_rows
                timed.append((op.family(T), op, pair, n, wire, c_rows, c_wire, transport))
            nbytes = max(timed[0][4], 1) * row_bytes  # every family received the same rows
            if dist:  # one size on every rank: all_to_all_single's even split hangs on unequal sizes (skew)
                agreed = torch.tensor([nbytes], device=first.device)
                dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
                nbytes = int(agreed.item())
                dist.barrier()
            ceil_t, ceil_covered = _time(lambda: ceiling.run(src_ptr, dst_ptr, nbytes), iters=10)
            ceil_gbps = gbps(nbytes, ceil_t.median_us)
            nccl_gbps = float("nan")
            if dist and world_size > 1:
                inp = torch.randint(0, 255, (world_size * nbytes,), dtype=torch.uint8, device=first.device)
                out = torch.empty_like(inp)
                dist.barrier()
                nccl_t, _ = _time(lambda: dist.all_to_all_single(out, inp), iters=10, queued=False)
                nccl_gbps = gbps(nbytes * (world_size - 1), nccl_t.median_us)
            point = []
            for family, op, pair, n, wire, c_rows, c_wire, transport in timed:
                method = QUEUED if pair.delay.covered and ceil_covered else SHORT_SLEEP
                d_op, c_op = TIMED_OPS[family]
                # dispatch: the rows this rank received; combine: the rows it gathers for its tokens
                point += [op_row(name, dtype, routing, T, me, world_size, t, host, method, rows_all, rows_wire, elem,
                                 wire_elem, ceil_gbps, nccl_gbps, geo, family=family, virtual=opts.virtual,
                                 transport=tr)
                          for name, t, host, geo, elem, wire_elem, dtype, rows_all, rows_wire, tr in (
                              ("dispatch", pair.queued[0], pair.host[0], op.variant(d_op, T), row_bytes, row_bytes,
                               cfg0.dtype, n, wire, transport),
                              ("combine", pair.queued[1], pair.host[1], op.variant(c_op, T), cfg0.hidden * 2,
                               combine_wire.wire_row_bytes(cfg0.hidden), combine_dtype, c_rows, c_wire, ""))]
            if dist:
                gathered = [None] * world_size
                dist.all_gather_object(gathered, point)
                point = [r for part in gathered for r in part]
            rows.extend(point)
            if me == 0:
                for family in dict.fromkeys(r["family"] for r in point):
                    mine = [r for r in point if r["rank"] == 0 and r["family"] == family]
                    print(f"bench {routing} {T} tokens, {family} ({mine[0]['timing']}; host-launched in brackets): "
                          + ", ".join(f"{r['op']} {r['time_us']} us ({r['host_launched_us']} us) {r['wire_gbps']} GB/s"
                                      for r in mine)
                          + f"; ceiling {round(ceil_gbps, 1)} GB/s, NCCL {round(nccl_gbps, 1)} GB/s", flush=True)
                if opts.output:
                    write_results(rows, opts.output, quiet=True, env=env)  # partial results survive an abort
    for _, op in ops.values():
        op.close()
    if me == 0 and opts.output:
        write_results(rows, opts.output, env=env)
    return rows


def op_row(name: str, dtype: str, routing: str, tokens: int, rank: int, world_size: int, queued: Timing, host: Timing,
           method: str, rows_all: int, rows_wire: int, row_bytes: int, wire_row_bytes: int, ceil_gbps: float,
           nccl_gbps: float, geo: Geometry, *, family: str, virtual: bool, transport: str = "") -> dict:
    """One CSV row (CSV_COLUMNS) of op ``name`` ("dispatch" or "combine") of kernel ``family``
    ("normal" or "low_latency") at one point: times (us) and bandwidths (GB/s) from the
    ``queued`` Timing, ``host_launched_us`` the median of ``host``, ``timing`` = ``method``
    (QUEUED or SHORT_SLEEP); ``rows_all`` / ``rows_wire`` rows of ``row_bytes`` /
    ``wire_row_bytes`` bytes (logical / wire); ``virtual``: the ranks ran in one process;
    ``transport``: the dispatch's ("push" or "pull"; empty for a combine).

    Raises:
        ValueError: ``family`` not one of TIMED_OPS.
    """
    if family not in TIMED_OPS:
        raise ValueError(f"family={family!r}: must be one of {', '.join(TIMED_OPS)}")
    w = gbps(rows_wire * wire_row_bytes, queued.median_us)
    return {"op": name, "family": family, "dtype": dtype, "routing": routing, "tokens": tokens, "rank": rank,
            "world_size": world_size, "virtual": bool(virtual),
            "time_us": round(queued.median_us, 2), "mean_us": round(queued.mean_us, 2),
            "stdev_us": round(queued.stdev_us, 2), "best_us": round(queued.best_us, 2),
            "host_launched_us": round(host.median_us, 2), "timing": method,
            "recv_rows": rows_all, "wire_rows": rows_wire,
            "logical_gbps": round(gbps(rows_all * row_bytes, queued.median_us), 1), "wire_gbps": round(w, 1),
            "p2p_ceiling_gbps": round(ceil_gbps, 1), "nccl_gbps": round(nccl_gbps, 1),
            "ratio_ceiling": round(w / ceil_gbps, 3), "ratio_nccl": round(w / nccl_gbps, 3),
            "blocks": geo.blocks, "warps_per_block": geo.warps_per_block, "unroll": geo.unroll, "transport": transport}


def run(layer: EpConfig, opts: BenchOptions) -> None:
    """Run the benchmark of ``layer``: one process per GPU for W > 1 (unless virtual), else in
    this process."""
    from epgen.harness.ranks import run_ranks_or_here

    run_ranks_or_here(layer.world_size, opts.virtual, bench_process, layer, opts)


def write_results(rows: list[dict], prefix: str, quiet: bool = False, env: dict | None = None) -> None:
    """``<prefix>.csv`` (CSV_COLUMNS), ``<prefix>.env.txt`` (``env``, default ``environment()``)
    and ``<prefix>.png``; prints a table unless ``quiet``."""
    from rich.console import Console
    from rich.table import Table

    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    with open(f"{prefix}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        w.writeheader()
        w.writerows(rows)
    Path(f"{prefix}.env.txt").write_text("".join(f"{k}: {v}\n" for k, v in (env or environment()).items()))
    _plot(rows, f"{prefix}.png")
    if quiet:
        return
    t = Table(title=f"epgen bench (rank 0): {prefix}")
    for c in ("op", "family", "virtual", "routing", "tokens", "queued us", "host-launched us", "timing", "wire GB/s",
              "logical GB/s", "ceiling GB/s", "NCCL GB/s", "x ceiling", "x NCCL", "geometry"):
        t.add_column(c, justify="right")
    for r in rows:
        if r["rank"] == 0:
            t.add_row(r["op"], r["family"], "yes" if r["virtual"] else "no", r["routing"], str(r["tokens"]),
                      f"{r['time_us']:.1f}", f"{r['host_launched_us']:.1f}",
                      r["timing"], f"{r['wire_gbps']:.1f}",
                      f"{r['logical_gbps']:.1f}", f"{r['p2p_ceiling_gbps']:.1f}", f"{r['nccl_gbps']:.1f}",
                      f"{r['ratio_ceiling']:.2f}", f"{r['ratio_nccl']:.2f}",
                      f"{r['blocks']}x{r['warps_per_block']} u{r['unroll']}"
                      + (f" {r['transport']}" if r.get("transport") else ""))
    Console(width=200).print(t)


FAMILY_STYLES = {"normal": ("-", "o"), "low_latency": ("--", "s")}
"""Line style and marker of each kernel family in the plot (the colour is the op and routing)."""


def _plot(rows: list[dict], path: str) -> None:
    """``figure(rows)`` saved as the PNG ``path``."""
    fig = figure(rows)
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt  # after figure() chose the Agg backend

    plt.close(fig)


def figure(rows: list[dict]):
    """The matplotlib figure of bench rows (CSV_COLUMNS; rank 0's are drawn) against tokens per
    rank: the bandwidth panel (wire GB/s, with the P2P ceiling and NCCL of the main routing) and
    the time panel (queued, and host-launched dotted with hollow markers); one colour per (op,
    routing), one line style and marker per family (``FAMILY_STYLES``). Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_bw, ax_t) = plt.subplots(1, 2, figsize=(13, 5))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    routings = sorted({r["routing"] for r in rows})
    for i, (routing, op) in enumerate((routing, op) for routing in routings for op in ("dispatch", "combine")):
        colour = colours[i % len(colours)]
        for family, (style, marker) in FAMILY_STYLES.items():
            pts = sorted((r["tokens"], r["wire_gbps"], r["time_us"], r["host_launched_us"]) for r in rows
                         if r["rank"] == 0 and r["op"] == op and r["routing"] == routing and r["family"] == family)
            if not pts:
                continue
            x, bw, us, host_us = zip(*pts)
            label = f"{op} {family} ({routing})"
            ax_bw.plot(x, bw, style, marker=marker, color=colour, label=label)
            ax_t.plot(x, us, style, marker=marker, color=colour, label=f"{label}, queued")
            ax_t.plot(x, host_us, ":", marker=marker, markerfacecolor="none", color=colour,
                      label=f"{label}, host-launched")
    main = "uniform" if "uniform" in routings else routings[0]
    for key, style, label in (("p2p_ceiling_gbps", "k-.", "P2P ceiling"),
                              ("nccl_gbps", "r:", "NCCL all_to_all_single")):
        per_point = {r["tokens"]: r[key] for r in rows if r["rank"] == 0 and r["op"] == "dispatch"
                     and r["routing"] == main}  # one figure a point, whichever families it timed
        if per_point:
            ax_bw.plot(*zip(*sorted(per_point.items())), style, label=f"{label} ({main}, same bytes)")
    ax_bw.set(xscale="log", xlabel="tokens per rank", ylabel="wire GB/s (per rank, queued times)", title="bandwidth")
    ax_t.set(xscale="log", yscale="log", xlabel="tokens per rank",
             ylabel="us (median of graph replays queued behind a GPU-side delay)", title="time (queued)")
    for ax in (ax_bw, ax_t):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def read_csv(path: str) -> list[dict]:
    """Rows of a bench CSV with numbers parsed and ``virtual`` a bool (to re-plot or compare runs)."""
    def value(k: str, v: str):
        if k in ("op", "family", "dtype", "routing", "timing", "transport"):
            return v
        if k == "virtual":
            return v == "True"
        return float(v) if "." in v or "n" in v else int(v)

    with open(path, newline="") as f:
        return [{k: value(k, v) for k, v in row.items()} for row in csv.DictReader(f)]


def default_output(world_size: int, virtual: bool, in_checkout: bool) -> str:
    """The path prefix of bench's files without ``-o``: ``bench-ep<W>[v]-<gpu>`` (``<gpu>``: the
    last word of GPU 0's name, lowercased; "cpu" without a GPU) under ``tools/results/`` when
    ``in_checkout`` (the current directory is an epgen checkout's root), else in the current
    directory."""
    gpu = torch.cuda.get_device_name(0).split()[-1].lower() if torch.cuda.is_available() else "cpu"
    name = f"bench-ep{world_size}{'v' if virtual else ''}-{gpu}"
    return os.path.join("tools", "results", name) if in_checkout else name
