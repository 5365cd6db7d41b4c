"""Geometry sweep of the expert layout's local kernels (expand plan + expand, fold) on one GPU:
deepseek-v3, W = 1 and virtual W = 8, 1024 tokens a rank, uniform routing, alignment 16. One op a
world size; each geometry's kernels are the op's own (``EpDispatchCombine.kernel``) at that
geometry, loaded by the op's platform and launched alone with the op's launch arguments
(``EpDispatchCombine.launch_kernel``) after one ``op.expand()`` and ``op.fold(y)`` filled them.
The expand plan and expand share a geometry and take at most ``PLAN_BLOCKS`` blocks (the plan's
per-block table has that many rows), as the op's planner gives them. Times expand (plan and
expand) and fold queued (epgen.harness.timing.time_pairs_queued, 20 iterations).
Prints one line per (W, geometry): medians in us and the HBM rate of the bytes each moves."""
import torch

from epgen.codegen.config import EpConfig
from epgen.codegen.spec import PLAN_BLOCKS, Op
from epgen.codegen.tuning import Geometry
from epgen.op import EpDispatchCombine
from epgen.harness.timing import time_pairs_queued

GEOS = [Geometry(*g) for g in ((256, 8, 2), (528, 8, 2), (264, 8, 4), (132, 16, 2), (256, 4, 4), (1056, 4, 2),
                               (256, 16, 1), (132, 16, 1))]


def at_geometry(op, kind: Op, geo: Geometry):
    """(spec, kernel) of the op's ``kind`` at ``geo`` (the expand kernels at most PLAN_BLOCKS blocks)."""
    spec, _ = op.kernel(kind, 0)
    blocks = min(geo.blocks, PLAN_BLOCKS) if kind in (Op.EXPAND_PLAN, Op.EXPAND) else geo.blocks
    spec = spec.replace(blocks=blocks, warps_per_block=geo.warps_per_block, unroll=geo.unroll)
    src = op.platform.render(spec)
    return spec, op.platform.load_kernel(src.text, src.entry, op.device.index)


for W in (1, 8):
    cfg = EpConfig.for_model("deepseek-v3", world_size=W, max_tokens_per_rank=1024, layout="expert",
                             expert_alignment=16)
    op = EpDispatchCombine(cfg, virtual=W > 1)
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
    op.expand()
    op.fold(one(ys))  # the launch arguments the kernels below run with
    moved = (rows + recv) * 7168 * 2  # each kernel reads one side and writes the other
    for geo in GEOS:
        plan, expand, fold = (at_geometry(op, kind, geo) for kind in (Op.EXPAND_PLAN, Op.EXPAND, Op.FOLD))
        t = time_pairs_queued(lambda: (op.launch_kernel(Op.EXPAND_PLAN, 0, plan),
                                       op.launch_kernel(Op.EXPAND, 0, expand)),
                              lambda: op.launch_kernel(Op.FOLD, 0, fold), iters=20)
        op.synchronize()
        e, f = t.queued[0].median_us, t.queued[1].median_us
        print(f"W={W} {geo} (expand {expand[0].blocks} blocks): expand {e:.1f} us ({moved / e / 1e6:.2f} TB/s), "
              f"fold {f:.1f} us ({moved / f / 1e6:.2f} TB/s); {rows} expanded rows, {recv} received", flush=True)
    op.close()
    torch.cuda.empty_cache()
