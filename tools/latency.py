"""Decode latency of both kernel families on one GPU: W = 1 and virtual W = 2 and 8.

For every (family, world size, tokens): one round verified against the reference, then dispatch
and combine captured in CUDA graphs and timed both ways (``epgen.timing.time_pairs_queued``: the
replays queued behind a GPU-side delay, the primary figure, and launched from the host), 50
iterations, deepseek-v3, bf16, uniform routing, the tuning table's geometry. Also times the floor
of a graph of one and of two trivial kernels the same way, and the overlap the split offers: a
matmul then a dispatch (or combine) against the sending half, the matmul, then the receiving half.

    python tools/latency.py [-o tools/results/latency-h200] [--tokens 1 8 32 128 256] [--iters 50]

Writes ``<prefix>.csv`` (family, op, world_size, virtual, tokens, queued_us, host_launched_us,
mean_us, stdev_us, best_us, timing, blocks, warps_per_block, unroll), ``<prefix>.env.txt`` and a
table on stdout.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import torch

from epgen.bench import QUEUED, SHORT_SLEEP, _graph, environment, measure
from epgen.codegen.config import EpConfig
from epgen.codegen.spec import Op
from epgen.timing import time_pairs_queued
from epgen.verify import make_inputs, op_arg, op_inputs

COLUMNS = ("family", "op", "world_size", "virtual", "tokens", "queued_us", "host_launched_us", "mean_us", "stdev_us",
           "best_us", "timing", "blocks", "warps_per_block", "unroll")
FAMILIES = ("normal", "low_latency")
WORLDS = ((1, False), (2, True), (8, True))


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
    one = _graph(lambda: t.add_(1))
    two = _graph(lambda: (t.add_(1), t.add_(1)))
    pair = time_pairs_queued(one.replay, two.replay, iters=iters, warmup=5)
    return [_row("floor", name, 1, False, 0, q, h, pair.delay.covered)
            for name, q, h in (("one_kernel", pair.queued[0], pair.host[0]),
                               ("two_kernels", pair.queued[1], pair.host[1]))]


def family_rows(family: str, world_size: int, virtual: bool, tokens: tuple[int, ...], iters: int) -> list[dict]:
    from epgen.op import EpDispatchCombine

    cfg = EpConfig.for_model("deepseek-v3", world_size=world_size, max_tokens_per_rank=max(tokens),
                             kernel_family=family, timeout_s=20.0)
    op = EpDispatchCombine(cfg, virtual=virtual)
    rows = []
    for i, T in enumerate(tokens):
        pair, _ = measure(op, cfg, T, "uniform", 300 + i, iters)
        for name, q, h, o in (("dispatch", pair.queued[0], pair.host[0], Op.DISPATCH),
                              ("combine", pair.queued[1], pair.host[1], Op.COMBINE)):
            spec = op.variant(o if family == "normal" else {Op.DISPATCH: Op.DISPATCH_LL_SEND,
                                                            Op.COMBINE: Op.COMBINE_LL_SEND}[o], T)
            rows.append(_row(family, name, world_size, virtual, T, q, h, pair.delay.covered, spec))
        print(" ".join(f"{r['family']} {r['op']} W={world_size}{'v' if virtual else ''} T={T}: "
                       f"{r['queued_us']} us queued, {r['host_launched_us']} host" for r in rows[-2:]), flush=True)
    if family == "low_latency":
        rows += overlap_rows(op, cfg, world_size, virtual, (1, min(128, max(tokens))), iters)
    op.close()
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
            gs, gp = _graph(seq), _graph(split)
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
    args = p.parse_args()
    rows = floor_rows(args.iters)
    for world_size, virtual in WORLDS:
        for family in FAMILIES:
            rows += family_rows(family, world_size, virtual, tuple(args.tokens), args.iters)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    with open(f"{args.output}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)
    Path(f"{args.output}.env.txt").write_text("".join(f"{k}: {v}\n" for k, v in environment().items()))
    print(f"{'family':12} {'op':34} {'W':>3} {'T':>5} {'queued us':>10} {'host us':>9} timing")
    for r in rows:
        print(f"{r['family']:12} {r['op']:34} {r['world_size']:>2}{'v' if r['virtual'] else ' '} {r['tokens']:>5} "
              f"{r['queued_us']:>10} {r['host_launched_us']:>9} {r['timing']}")


if __name__ == "__main__":
    main()
