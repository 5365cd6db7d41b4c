"""Decode latency of both kernel families on one GPU: W = 1 and virtual W = 2 and 8.

For every (family, world size, tokens): one round verified against the reference, then dispatch
and combine captured in CUDA graphs and timed both ways (``epgen.harness.timing.time_pairs_queued``: the
replays queued behind a GPU-side delay, the primary figure, and launched from the host), 50
iterations, deepseek-v3, bf16, uniform routing, the tuning table's geometry. Also times the floor
of a graph of one and of two trivial kernels the same way, and the overlap the split offers: a
matmul then a dispatch (or combine) against the sending half, the matmul, then the receiving half;
the low-latency halves one by one (``<op> send``, ``<op> recv``: each captured alone, replayed
alternately); and every op as K iterations captured in one graph, divided by K (``<op> graph/K``
rows; combine = (dispatch + combine) - dispatch), which leaves out the per-replay launch of a graph.
``--sweep`` instead times low-latency geometries (``SWEEP``) at W = 1 and virtual W = 2.

    python tools/latency.py [-o tools/results/latency-h200] [--tokens 1 8 32 128 256] [--iters 50] [--sweep]

Writes ``<prefix>.csv`` (family, op, world_size, virtual, tokens, queued_us, host_launched_us,
mean_us, stdev_us, best_us, timing, blocks, warps_per_block, unroll), ``<prefix>.env.txt`` and a
table on stdout.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import torch

from epgen.codegen.config import EpConfig
from epgen.codegen.tuning import Geometry
from epgen.codegen.spec import Op
from epgen.harness.measure import QUEUED, SHORT_SLEEP, capture_graph, environment, measure
from epgen.harness.timing import time_pairs_queued
from epgen.harness.verify import make_inputs, op_arg, op_inputs

COLUMNS = ("family", "op", "world_size", "virtual", "tokens", "queued_us", "host_launched_us", "mean_us", "stdev_us",
           "best_us", "timing", "blocks", "warps_per_block", "unroll")
FAMILIES = ("normal", "low_latency")
WORLDS = ((1, False), (2, True), (8, True))
GRAPH_K = 20
SWEEP = (Geometry(16, 16, 2), Geometry(32, 16, 2), Geometry(64, 16, 2), Geometry(132, 16, 2), Geometry(32, 32, 2),
         Geometry(64, 8, 4), Geometry(132, 8, 2), Geometry(32, 8, 4))
"""Low-latency geometries of ``--sweep`` (warps of 32 lanes: sm_90)."""


def _row(family, op_name, world_size, virtual, tokens, queued, host, covered, geo=None):
    return {"family": family, "op": op_name, "world_size": world_size, "virtual": int(virtual), "tokens": tokens,
            "queued_us": round(queued.median_us, 2), "host_launched_us": round(host.median_us, 2),
            "mean_us": round(queued.mean_us, 2), "stdev_us": round(queued.stdev_us, 2),
            "best_us": round(queued.best_us, 2), "timing": QUEUED if covered else SHORT_SLEEP,
            "blocks": geo.blocks if geo else "", "warps_per_block": geo.warps_per_block if geo else "",
            "unroll": geo.unroll if geo else ""}


def floor_rows(iters: int) -> list[dict]:
    """One and two trivial kernels per graph replay, timed as the ops are: the launch floor."""
    t = torch.zeros(1, device="cuda")
    one = capture_graph(lambda: t.add_(1))
    two = capture_graph(lambda: (t.add_(1), t.add_(1)))
    pair = time_pairs_queued(one.replay, two.replay, iters=iters, warmup=5)
    return [_row("floor", name, 1, False, 0, q, h, pair.delay.covered)
            for name, q, h in (("one_kernel", pair.queued[0], pair.host[0]),
                               ("two_kernels", pair.queued[1], pair.host[1]))]


def family_rows(family: str, world_size: int, virtual: bool, tokens: tuple[int, ...], iters: int,
                geometry: Geometry | None = None, extras: bool = True) -> list[dict]:
    from epgen.op import EpDispatchCombine

    cfg = EpConfig.for_model("deepseek-v3", world_size=world_size, max_tokens_per_rank=max(tokens),
                             kernel_family=family, timeout_s=20.0, low_latency_geometry=geometry)
    op = EpDispatchCombine(cfg, virtual=virtual)
    rows = []
    for i, T in enumerate(tokens):
        pair, _, _ = measure(op, cfg, T, "uniform", 300 + i, iters)
        for name, q, h, o in (("dispatch", pair.queued[0], pair.host[0], Op.DISPATCH),
                              ("combine", pair.queued[1], pair.host[1], Op.COMBINE)):
            spec = op.variant(o if family == "normal" else {Op.DISPATCH: Op.DISPATCH_LL_SEND,
                                                            Op.COMBINE: Op.COMBINE_LL_SEND}[o], T)
            rows.append(_row(family, name, world_size, virtual, T, q, h, pair.delay.covered, spec))
        print(" ".join(f"{r['family']} {r['op']} W={world_size}{'v' if virtual else ''} T={T} {spec.blocks}x"
                       f"{spec.warps_per_block}u{spec.unroll}: {r['queued_us']} us queued, {r['host_launched_us']} host"
                       for r in rows[-2:]), flush=True)
        if extras:
            rows += graph_k_rows(op, cfg, family, world_size, virtual, T, iters)
            if family == "low_latency":
                rows += halves_rows(op, cfg, world_size, virtual, T, iters)
    if family == "low_latency" and extras:
        rows += overlap_rows(op, cfg, world_size, virtual, (1, min(128, max(tokens))), iters)
    op.close()
    return rows


def _calls(op, cfg, world_size, T, seed):
    inputs = make_inputs(cfg, [T] * world_size, "uniform", seed, device=op.device)
    return op_inputs(op, inputs), op_arg(op, [op.combine_input(r) for r in op.local_ranks])


def graph_k_rows(op, cfg, family, world_size, virtual, T, iters) -> list[dict]:
    """Dispatch, and dispatch + combine, GRAPH_K times in one graph each; per-iteration times."""
    args, y = _calls(op, cfg, world_size, T, 700 + T)

    def disp():
        for _ in range(GRAPH_K):
            op.dispatch(*args)

    def pair():
        for _ in range(GRAPH_K):
            op.dispatch(*args)
            op.combine(y)

    disp(), pair()
    torch.cuda.synchronize()
    gd, gp = capture_graph(disp), capture_graph(pair)
    t = time_pairs_queued(gd.replay, gp.replay, iters=max(5, iters // 5), warmup=2)
    d = [s / GRAPH_K for s in t.queued[0].samples_us]
    c = [(b - a) / GRAPH_K for a, b in zip(t.queued[0].samples_us, t.queued[1].samples_us)]
    from epgen.harness.timing import Timing

    op.synchronize()
    return [_row(family, f"{name} graph/{GRAPH_K}", world_size, virtual, T, Timing(tuple(v)), Timing(tuple(v)),
                 t.delay.covered) for name, v in (("dispatch", d), ("combine", c))]


def halves_rows(op, cfg, world_size, virtual, T, iters) -> list[dict]:
    """Each low-latency half captured alone, replayed alternately (send, recv, send, ...)."""
    args, y = _calls(op, cfg, world_size, T, 800 + T)
    rows = []
    for name in ("dispatch", "combine"):
        handle = {}

        def send():
            if name == "combine":
                op.dispatch(*args)
            handle["h"] = op.dispatch(*args, async_recv=True) if name == "dispatch" else op.combine(y, async_recv=True)

        def recv():
            handle["h"].wait()

        send(), recv()
        torch.cuda.synchronize()
        gs = capture_graph(send)
        gr = capture_graph(recv)
        pair = time_pairs_queued(gs.replay, gr.replay, iters=iters, warmup=5)
        rows += [_row("low_latency", f"{name} {half}", world_size, virtual, T, q, h, pair.delay.covered)
                 for half, q, h in (("send" + (" (after a dispatch)" if name == "combine" else ""), pair.queued[0],
                                     pair.host[0]), ("recv", pair.queued[1], pair.host[1]))]
        op.synchronize()
    return rows


def overlap_rows(op, cfg, world_size, virtual, tokens, iters) -> list[dict]:
    """matmul then the whole op (``seq``) against send, matmul, receive (``split``), per op."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    rows = []
    for T in tokens:
        inputs = make_inputs(cfg, [T] * world_size, "uniform", 900 + T, device=op.device)
        args = op_inputs(op, inputs)
        y = op_arg(op, [op.combine_input(r) for r in op.local_ranks])

        def seq_dispatch():
            a @ a
            op.dispatch(*args)

        def split_dispatch():
            h = op.dispatch(*args, async_recv=True)
            a @ a
            h.wait()

        def seq_combine():
            op.dispatch(*args)
            a @ a
            op.combine(y)

        def split_combine():
            op.dispatch(*args)
            h = op.combine(y, async_recv=True)
            a @ a
            h.wait()

        for name, seq, split in (("dispatch+matmul", seq_dispatch, split_dispatch),
                                 ("dispatch+matmul+combine", seq_combine, split_combine)):
            seq(), split()  # eager first: loads every kernel outside the capture
            torch.cuda.synchronize()
            gs, gp = capture_graph(seq), capture_graph(split)
            pair = time_pairs_queued(gs.replay, gp.replay, iters=iters, warmup=5)
            rows += [_row("low_latency", f"{name} {how}", world_size, virtual, T, q, h, pair.delay.covered)
                     for how, q, h in (("seq", pair.queued[0], pair.host[0]), ("split", pair.queued[1], pair.host[1]))]
        op.synchronize()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-o", "--output", default="tools/results/latency-h200")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 128, 256])
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--sweep", action="store_true", help="time SWEEP's low-latency geometries at W = 1 and virtual 2")
    args = p.parse_args()
    rows = floor_rows(args.iters)
    if args.sweep:
        for geometry in SWEEP:
            for world_size, virtual in WORLDS[:2]:
                rows += family_rows("low_latency", world_size, virtual, tuple(args.tokens), args.iters, geometry,
                                    extras=False)
    else:
        for world_size, virtual in WORLDS:
            for family in FAMILIES:
                rows += family_rows(family, world_size, virtual, tuple(args.tokens), args.iters)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    with open(f"{args.output}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)
    Path(f"{args.output}.env.txt").write_text("".join(f"{k}: {v}\n" for k, v in environment().items()))
    print(f"{'family':12} {'op':34} {'W':>3} {'T':>5} {'queued us':>10} {'host us':>9} timing geometry")
    for r in rows:
        print(f"{r['family']:12} {r['op']:34} {r['world_size']:>2}{'v' if r['virtual'] else ' '} {r['tokens']:>5} "
              f"{r['queued_us']:>10} {r['host_launched_us']:>9} {r['timing']} "
              f"{r['blocks']}x{r['warps_per_block']}u{r['unroll']}")


if __name__ == "__main__":
    main()
