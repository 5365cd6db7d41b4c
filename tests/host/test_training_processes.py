"""Layouts and differentiable dispatch/combine as W processes (gloo, one op a rank, the host
emulation's shared-memory arenas, the OS's clock): the deployment mode, where only the kernels'
handshakes order the ranks.

Every rank draws every rank's inputs from one seed, runs its own share on the kernels and the
whole layer on the reference stand-in (``epgen.autograd.ReferenceEp``), and compares its part:
a kept layout combined after another dispatch, the implicit combine in between, a cached-layout
dispatch's rows, and a forward and backward through ``epgen.autograd`` (gradients of x and the
routing weights), both layouts.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from host_cases import PROCS_TIMEOUT_S, cfg, host_module, host_op, in_host_process, seed_of, warm  # noqa: E402

K, L, H = 2, 2, 64
RUN_TIMEOUT_S = 150.0


@pytest.fixture(scope="module", autouse=True)
def _host():
    with host_module():
        yield


def _config(W, layout):
    return cfg(W, "normal", hidden=H, topk=K, experts_per_rank=L, tmax=8, dispatch_transport="pull", layout=layout,
               timeout_s=PROCS_TIMEOUT_S, **({"expert_alignment": 2} if layout == "expert" else {}))


def _inputs(W, seed):
    g = torch.Generator().manual_seed(seed)
    tokens = [5, 0, 3, 4][:W]
    x = [torch.randn(t, H, generator=g).bfloat16() for t in tokens]
    w = [torch.rand(t, K, generator=g) for t in tokens]
    ids = [torch.randint(-1, W * L, (t, K), generator=g, dtype=torch.int32) for t in tokens]
    ids[0][0] = torch.tensor([1, 1], dtype=torch.int32)
    return x, w, ids


def _experts(x, weights, rank_layout: bool):
    """A smooth expert stage on one rank's rows (bf16); the rank layout applies the weights here."""
    if rank_layout:
        return (torch.tanh(x.float()) * weights.float().sum(-1, keepdim=True)).bfloat16()
    return torch.tanh(x.float()).bfloat16()


def _expected(layout, x, w, ids):
    """Every rank's combine of identity experts, from epgen.reference alone (the kernels' exact
    semantics)."""
    import epgen.reference as reference

    recv = reference.dispatch(x, w, ids, experts_per_rank=L)
    tokens = [t.shape[0] for t in x]
    if layout == "rank":
        return [o.to(torch.bfloat16) for o in reference.combine([r.x for r in recv], recv, tokens)]
    rows = reference.expand(recv, experts_per_rank=L, alignment=2)
    return reference.combine_weighted([r.x for r in rows], rows, recv, tokens)


def _body(rank, W, arch, layout, seed):
    from epgen.autograd import ReferenceEp, combine, dispatch

    config = _config(W, layout)
    op = host_op(config, arch, seed + 1000 * rank, virtual=False)
    x, w, ids = _inputs(W, seed)
    x2, w2, ids2 = _inputs(W, seed + 1)
    g = torch.Generator().manual_seed(seed + 2)
    x3 = [torch.randn(t.shape[0], H, generator=g).bfloat16() for t in x]

    # a kept layout after another dispatch, the implicit combine in between, a cached dispatch
    def identity(out):
        return (out.x if layout == "expert" else out.recv_x).clone()

    ya = identity(op.dispatch(x[rank], w[rank], ids[rank], family="normal"))
    la = op.keep_layout()
    yb = identity(op.dispatch(x2[rank], w2[rank], ids2[rank], family="normal"))
    assert torch.equal(op.combine(ya, layout=la), _expected(layout, x, w, ids)[rank]), \
        f"rank {rank}: combine along the kept layout"
    assert torch.equal(op.combine(yb), _expected(layout, x2, w2, ids2)[rank]), \
        f"rank {rank}: the implicit combine of the last dispatch"
    cached = op.dispatch(x3[rank], layout=la)
    recv = cached.recv if layout == "expert" else cached
    n = int(recv.num_recv)
    for i, (s, t) in enumerate(recv.recv_src[:n].tolist()):
        assert torch.equal(recv.recv_x[i], x3[s][t]), f"rank {rank}: cached row {i} from ({s}, {t})"
    assert torch.equal(op.combine(identity(cached)), _expected(layout, x3, w, ids)[rank]), \
        f"rank {rank}: combine after a cached dispatch"

    # forward and backward through epgen.autograd: this rank on the kernels, all on the stand-in
    probe = torch.linspace(-1, 1, H)
    rank_layout = layout == "rank"
    xs, ws = [t.clone().requires_grad_() for t in x], [t.clone().requires_grad_() for t in w]
    d = dispatch(op, xs[rank], ws[rank], ids[rank], family="normal")
    out = combine(op, _experts(d.x, d.weights, rank_layout), d)
    (out.float() * probe).sum().backward()
    ref = ReferenceEp(config, dtype=torch.bfloat16)
    rxs, rws = [t.clone().requires_grad_() for t in x], [t.clone().requires_grad_() for t in w]
    rd = dispatch(ref, rxs, rws, ids)
    routs = combine(ref, [_experts(a, b, rank_layout) for a, b in zip(rd.x, rd.weights)], rd)
    sum((t.float() * probe).sum() for t in routs).backward()
    for what, a, b in (("out", out, routs[rank]), ("grad x", xs[rank].grad, rxs[rank].grad),
                       ("grad weights", ws[rank].grad, rws[rank].grad)):
        a, b = a.double(), b.double()
        scale = (b.abs().max().item() if b.numel() else 0.0) or 1.0
        assert not ((a - b).abs() > 2**-7 * b.abs() + 2**-8 * scale).any(), f"rank {rank}: {what}"
    torch.distributed.barrier()  # every peer is done with this rank's arena
    op.close()


@pytest.mark.parametrize("layout", ["rank", "expert"])
@pytest.mark.parametrize("W", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_layouts_and_autograd_as_processes(layout, W):
    from epgen.harness.ranks import run_ranks

    arch = "sm_90"
    warm([(_config(W, layout), arch, 1)])
    run_ranks(W, in_host_process, _body, arch, layout, seed_of(f"training_processes_{layout}"),
              timeout_s=RUN_TIMEOUT_S)
