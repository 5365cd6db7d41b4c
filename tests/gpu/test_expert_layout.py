"""GPU tests of the expert layout, the weighted combine, capped receive memory and the short-y
check, against ``epgen.reference`` (virtual ranks on one GPU; W = 1 is a single rank).

Every expanded row is compared bit for bit with the reference row of the same (source rank,
source token, top-k slot); the per-expert sets, counts and offsets must be exact; padding rows
must be zero; every combine must equal ``reference.combine_weighted`` bit for bit, with the rows
the fold must not read (padding, rows past offsets[L]) poisoned with NaN.
"""

from __future__ import annotations

import pytest
import torch

from epgen import reference
from epgen.codegen.config import EpConfig
from epgen.harness.expert_verify import GEO
from epgen.harness.expert_verify import expert_config as _config
from epgen.harness.expert_verify import expert_dispatch as _dispatch
from epgen.harness.expert_verify import expert_inputs as _inputs
from epgen.harness.expert_verify import expert_op as _op
from epgen.harness.expert_verify import expert_reference as _reference
from epgen.harness.expert_verify import run_expert_round as _round


CASES = [  # (W, L, K, alignment, token counts)
    (1, 8, 4, 1, [[0], [1], [77], [96]]),
    (1, 256, 8, 128, [[96], [3]]),
    (4, 1, 1, 16, [[96, 0, 5, 96], [0, 0, 0, 0]]),
    (4, 3, 9, 64, [[96, 1, 0, 40], [96] * 4]),
    (8, 2, 16, 16, [[96] * 8, [0, 1, 2, 3, 96, 0, 7, 0]]),
    (8, 3, 4, 1, [[50, 0, 96, 1, 0, 0, 96, 3]]),
]


@pytest.mark.gpu
@pytest.mark.parametrize("W,L,K,A,rounds", CASES, ids=[f"w{c[0]}-l{c[1]}-k{c[2]}-a{c[3]}" for c in CASES])
def test_expert_layout_and_weighted_combine_match_the_reference(W, L, K, A, rounds):
    cfg = _config(W, experts_per_rank=L, topk=K, alignment=A)
    op = _op(cfg)
    for i, tokens in enumerate(rounds):
        _round(op, cfg, tokens, 10 * i + W, zero_copy=i % 2 == 0)
    op.close()


@pytest.mark.gpu
@pytest.mark.parametrize("quant", ["none", "fp8_direct_cast", "fp8_blockwise", "fp4_blockwise"])
def test_weighted_combine_in_every_wire_format(quant):
    cfg = _config(4, hidden=2880, topk=8, experts_per_rank=4, tmax=64, combine_quant=quant)
    op = _op(cfg)
    _round(op, cfg, [64, 3, 0, 64], 7)
    op.close()


@pytest.mark.gpu
def test_fp8_payload_and_scales_expand_bit_equal():
    cfg = _config(4, hidden=512, topk=6, experts_per_rank=4, dtype="fp8", scale_bytes=16)
    op = _op(cfg)
    _round(op, cfg, [96, 20, 0, 96], 3)
    op.close()


@pytest.mark.gpu
def test_deepseek_v3_shape_virtual_8():
    cfg = EpConfig.for_model("deepseek-v3", world_size=8, max_tokens_per_rank=256, layout="expert",
                             expert_alignment=16, timeout_s=10.0)
    op = _op(cfg)
    _round(op, cfg, [256, 0, 1, 128, 256, 256, 17, 256], 5)
    op.close()


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["rank", "expert"])
def test_capped_receive_memory_overflow_raises_then_the_op_runs_again(layout):
    from epgen.op import EpError

    kw = dict(layout=layout, expert_alignment=16 if layout == "expert" else 1)
    cfg = EpConfig(world_size=4, hidden=256, topk=2, num_experts=8, max_tokens_per_rank=64, max_recv_tokens=70,
                   timeout_s=10.0, dispatch_geometry=GEO, combine_geometry=GEO, **kw)
    op = _op(cfg)
    dev = op.device
    xs = [torch.randn(64, 256, device=dev).to(torch.bfloat16) for _ in range(4)]
    ws = [torch.rand(64, 2, device=dev) for _ in range(4)]
    crowd = [torch.zeros(64, 2, dtype=torch.int32, device=dev) for _ in range(4)]  # 256 rows for rank 0
    with pytest.raises(EpError, match=r"^rank 0: the receive buffer of rank 0 needed 256 rows in this dispatch, "
                                      r"more than its 70") as e:  # the true count: every sender's rows
        op.dispatch(xs, ws, crowd)
    assert e.value.recoverable
    assert int(op.recv_buffers(0).num_recv) == 70  # clamped: no later kernel reads past the buffers
    src = op.recv_buffers(0).recv_src[:70].cpu()  # every row below it is this call's (the rows that fit)
    assert bool(((src[:, 0] >= 0) & (src[:, 0] < 4) & (src[:, 1] >= 0) & (src[:, 1] < 64)).all())
    assert len({tuple(r) for r in src.tolist()}) == 70
    spread = [torch.arange(128, dtype=torch.int32, device=dev).view(64, 2) % 8 for _ in range(4)]
    recv = op.dispatch(xs, ws, spread)  # both experts of a token on one rank: 64 rows a rank, within the cap
    got = [o.recv if layout == "expert" else o for o in recv]
    want = reference.dispatch([x.cpu() for x in xs], [w.cpu() for w in ws], [i.cpu() for i in spread],
                              experts_per_rank=2, max_recv_tokens=70)
    for g, w in zip(got, want):
        n = int(g.num_recv)
        perm = reference.align_rows(w.src, g.recv_src[:n].cpu())
        assert torch.equal(g.recv_x[:n].cpu()[perm], w.x)
    op.close()


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["rank", "expert"])
def test_combine_with_a_short_y_raises_and_the_op_runs_again(layout):
    from epgen.op import EpError

    cfg = _config(4, alignment=16) if layout == "expert" else EpConfig(
        world_size=4, hidden=256, topk=4, num_experts=12, max_tokens_per_rank=96, timeout_s=10.0,
        dispatch_geometry=GEO, combine_geometry=GEO)
    op = _op(cfg)
    inputs = _inputs(cfg, [96] * 4, 1)
    got = _dispatch(op, cfg, inputs)
    need = [int(g.offsets[-1]) if layout == "expert" else int(g.num_recv) for g in got]
    ys = [torch.zeros(n - 1, cfg.hidden, dtype=torch.bfloat16, device=op.device) for n in need]
    with pytest.raises(EpError, match=rf"combine: y has {need[0] - 1} rows but this rank's last dispatch produced "
                                      rf"{need[0]}") as e:
        op.combine(ys)
    assert e.value.recoverable
    if layout == "expert":
        _round(op, cfg, [96, 0, 5, 60], 2)
    op.close()


@pytest.mark.gpu
def test_graph_of_dispatch_expert_stage_and_combine_replays_with_fresh_inputs():
    cfg = _config(4, topk=6, experts_per_rank=4, alignment=16)
    op = _op(cfg, validate=False)
    tokens = [96, 30, 0, 96]
    static = [(x.to(op.device), w.to(op.device), i.to(op.device)) for x, w, i, _ in _inputs(cfg, tokens, 0)]

    def layer():
        outs = op.dispatch(*([s[j] for s in static] for j in range(3)))
        for r, o in zip(op.local_ranks, outs):  # the expert stage: y = 2 x (exact in bf16)
            torch.mul(o.x, 2, out=op.combine_input(r))
        return op.combine([op.combine_input(r) for r in op.local_ranks])

    torch.cuda.synchronize()
    layer()  # eager once before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = layer()
    for seed in (1, 2, 3):
        fresh = _inputs(cfg, tokens, seed)
        for s, (x, w, i, _) in zip(static, fresh):
            s[0].copy_(x), s[1].copy_(w), s[2].copy_(i)
        graph.replay()
        torch.cuda.synchronize()
        op.check()
        recv, want = _reference(cfg, fresh)
        expect = reference.combine_weighted([(e.x.float() * 2).to(torch.bfloat16) for e in want], want, recv, tokens)
        for r, (o, e) in enumerate(zip(outs, expect)):
            assert torch.equal(o.cpu(), e), (seed, r)
    op.close()


@pytest.mark.gpu
def test_an_arena_freed_during_another_graphs_capture_leaves_the_capture_valid():
    """The last view of a closed op's arena dies inside another op's capture: its free waits."""
    cfg = _config(4)
    old = _op(cfg)
    views = _dispatch(old, cfg, _inputs(cfg, [8] * 4, 0))
    old.close()
    del old
    op = _op(cfg, validate=False)
    static = [[t.to(op.device) for t in row[:3]] for row in _inputs(cfg, [8] * 4, 1)]
    op.dispatch(*([s[j] for s in static] for j in range(3)))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = op.dispatch(*([s[j] for s in static] for j in range(3)))
        del views  # frees the old arenas' memory now, were it not deferred
    graph.replay()
    torch.cuda.synchronize()
    op.check()
    assert int(out[0].offsets[-1]) > 0
    op.close()
