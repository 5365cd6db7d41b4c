"""Geometry sweep of the expert layout's local kernels (expand plan + expand, fold) on one GPU:
deepseek-v3, W = 1 and virtual W = 8, 1024 tokens a rank, uniform routing, alignment 16. Each
geometry replaces ``local_geometry`` (the default of shapes without a tuning-table entry) and
times ``op.expand()`` and ``op.fold(y)`` queued (epgen.harness.timing.time_pairs_queued, 20 iterations).
Prints one line per (W, geometry): medians in us and the HBM rate of the bytes each moves."""
import torch

import epgen.codegen.config as config_module
from epgen.codegen.config import EpConfig
from epgen.codegen.tuning import Geometry
from epgen.op import EpDispatchCombine
from epgen.harness.timing import time_pairs_queued

GEOS = [Geometry(*g) for g in ((256, 8, 2), (528, 8, 2), (264, 8, 4), (132, 16, 2), (256, 4, 4), (1056, 4, 2),
                               (256, 16, 1), (132, 16, 1))]
for W in (1, 8):
    for geo in GEOS:
        config_module.local_geometry = lambda arch, op, geo=geo: geo
        cfg = EpConfig.for_model("deepseek-v3", world_size=W, max_tokens_per_rank=1024, layout="expert",
                                 expert_alignment=16)
        try:
            op = EpDispatchCombine(cfg, virtual=W > 1)
        except ValueError as e:
            print(f"W={W} {geo}: refused: {e}")
            continue
        g = torch.Generator(device="cuda").manual_seed(0)
        xs = [torch.randn(1024, 7168, device="cuda", generator=g).to(torch.bfloat16) for _ in range(W)]
        ws = [torch.rand(1024, 8, device="cuda", generator=g) for _ in range(W)]
        ids = [torch.stack([torch.randperm(256, device="cuda", generator=g)[:8] for _ in range(1024)]).int()
               for _ in range(W)]
        one = (lambda v: v) if W > 1 else (lambda v: v[0])
        d = op.dispatch(one(xs), one(ws), one(ids))
        rows = sum(int(o.offsets[-1]) for o in (d if W > 1 else [d]))
        recv = sum(int(o.recv.num_recv) for o in (d if W > 1 else [d]))
        ys = [op.combine_input(r) for r in op.local_ranks]
        for y in ys:
            y.normal_()
        t = time_pairs_queued(op.expand, lambda: op.fold(one(ys)), iters=20)
        moved = (rows + recv) * 7168 * 2  # each kernel reads one side and writes the other
        e, f = t.queued[0].median_us, t.queued[1].median_us
        print(f"W={W} {geo}: expand {e:.1f} us ({moved / e / 1e6:.2f} TB/s), fold {f:.1f} us "
              f"({moved / f / 1e6:.2f} TB/s); {rows} expanded rows, {recv} received", flush=True)
        op.close()
        torch.cuda.empty_cache()
