"""Explicit dispatch layouts on the generated kernels (host emulation): ``keep_layout``,
``combine(y, layout=...)`` and the cached-layout ``dispatch(x, layout=...)`` after other calls,
in both layouts and both kernel families, against the torch reference; the implicit combine of
the last dispatch unchanged in between; stale and foreign layouts refused before any launch.

The experts are the identity (y = the dispatched rows), so every combine has an exact reference
computed from the inputs alone (``epgen.reference``): no row alignment is needed.
"""

from __future__ import annotations

import pytest
import torch

import epgen.reference as ref
from epgen.op import DispatchLayout, EpError
from tests.host.host_cases import cfg, host_module, host_op, seed_of, seeded

W, T, K, L = 2, 6, 2, 2


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with host_module():
        yield


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _op(layout: str, name: str, family: str = "auto", device: str = "cpu", **kw):
    config = cfg(W, family, hidden=64, topk=K, experts_per_rank=L, tmax=8, dispatch_transport="pull",
                 layout=layout, **({"expert_alignment": 2} if layout == "expert" else {}), **kw)
    if device == "cpu":
        return host_op(config, "sm_90", seed_of(name))
    from epgen.op import EpDispatchCombine

    return EpDispatchCombine(config, virtual=True, validate=True)


def _on(op, tensors):
    return [t.to(op.device) for t in tensors]


def _inputs(g, tokens):
    x = [torch.randn(t, 64, generator=g).bfloat16() for t in tokens]
    w = [torch.rand(t, K, generator=g) for t in tokens]
    ids = [torch.randint(-1, W * L, (t, K), generator=g, dtype=torch.int32) for t in tokens]
    if tokens[0]:
        ids[0][0] = torch.tensor([1, 1], dtype=torch.int32)  # a duplicate id
    return x, w, ids


def _expected(op, x, w, ids):
    """The op's combine of identity experts, from the reference alone."""
    recv = ref.dispatch(x, w, ids, experts_per_rank=L)
    tokens = [t.shape[0] for t in x]
    if not op.expert_layout:
        return [o.to(torch.bfloat16) for o in ref.combine([r.x for r in recv], recv, tokens)]
    rows = ref.expand(recv, experts_per_rank=L, alignment=op.config.expert_alignment)
    return ref.combine_weighted([r.x for r in rows], rows, recv, tokens)


def _identity(outs):
    return [o.x.clone() if hasattr(o, "offsets") else o.recv_x.clone() for o in outs]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["rank", "expert"])
@pytest.mark.parametrize("family", ["normal", "low_latency"])
def test_layout_outlives_other_calls(layout, family, device):
    """Dispatch A (kept), dispatch B, combine A along its layout, combine B implicitly, a cached
    dispatch of new rows along A, and its combines: every output equals the reference."""
    name = f"layout_outlives_{layout}_{family}"
    op = _op(layout, name, device=device)
    g = torch.Generator().manual_seed(seed_of(name))
    with seeded(op):
        xa, wa, ia = _inputs(g, [T, 0 if family == "normal" else T - 1])
        outs = op.dispatch(_on(op, xa), _on(op, wa), _on(op, ia), family=family)
        la = op.keep_layout()
        assert isinstance(la, DispatchLayout) and la.family == family and la.tokens == [T, xa[1].shape[0]]
        assert op.keep_layout() is la
        ya = _identity(outs)
        xb, wb, ib = _inputs(g, [T - 2, T])
        yb = _identity(op.dispatch(_on(op, xb), _on(op, wb), _on(op, ib), family=family))
        for got, want in zip(op.combine(ya, layout=la), _expected(op, xa, wa, ia)):
            assert torch.equal(got.cpu(), want)
        for got, want in zip(op.combine(yb), _expected(op, xb, wb, ib)):  # the implicit combine: B
            assert torch.equal(got.cpu(), want)
        with pytest.raises(RuntimeError, match="needs a dispatch first"):
            op.combine(yb)
        # cached dispatch of new rows along A: the same places, the layout's metadata
        x2 = [torch.randn(t.shape[0], 64, generator=g).bfloat16() for t in xa]
        cached = op.dispatch(_on(op, x2), layout=la)
        for d in range(W):
            n = int(cached[d].recv.num_recv if layout == "expert" else cached[d].num_recv)
            assert n == int(la.table(d, "num_recv"))
            recv = cached[d].recv if layout == "expert" else cached[d]
            assert torch.equal(recv.recv_src[:n], la.table(d, "recv_src")[:n])
            for i, (s, t) in enumerate(recv.recv_src[:n].tolist()):
                assert torch.equal(recv.recv_x[i].cpu(), x2[s][t])
            if layout == "expert":
                e = cached[d]
                used = int(e.offsets[-1])
                assert torch.equal(e.offsets, la.table(d, "expert_offsets"))
                for p, (s, t, _) in enumerate(e.src[:used].tolist()):
                    assert torch.equal(e.x[p].cpu(), x2[s][t] if s >= 0 else torch.zeros(64, dtype=torch.bfloat16))
        want = _expected(op, x2, wa, ia)
        y2 = _identity(cached)
        for got, w_ in zip(op.combine(y2), want):  # implicit: the cached dispatch is the last one
            assert torch.equal(got.cpu(), w_)
        op.dispatch(_on(op, xb), _on(op, wb), _on(op, ib), family=family)
        for got, w_ in zip(op.combine(y2, layout=la), want):  # and along the layout again
            assert torch.equal(got.cpu(), w_)
        op.synchronize()
    op.close()


def test_layout_errors():
    """A foreign, stale or mismatched layout, and calls the cached dispatch does not take, raise
    before any launch; a layout survives nothing but its op's faults."""
    op = _op("rank", "layout_errors", "normal")
    other = _op("rank", "layout_errors_other", "normal")
    g = torch.Generator().manual_seed(seed_of("layout_errors"))
    with seeded(op):
        with pytest.raises(RuntimeError, match="needs a dispatch first"):
            op.keep_layout()
        x, w, ids = _inputs(g, [T, T])
        outs = op.dispatch(x, w, ids)
        la = op.keep_layout()
        other.dispatch(x, w, ids)
        with pytest.raises(ValueError, match="kept by another op"):
            other.combine(_identity(outs), layout=la)
        with pytest.raises(ValueError, match=r"x\[rank 0\].shape=\[5, 64\]: must be \[6, 64\]"):
            op.dispatch([t[:5] for t in x], layout=la)
        with pytest.raises(ValueError, match="weights given"):
            op.dispatch(x, w, layout=la)
        with pytest.raises(TypeError, match="must be a DispatchLayout"):
            op.combine(_identity(outs), layout="call 1")
        with pytest.raises(ValueError, match="weighted=False"):
            op.combine(_identity(outs), layout=la, weighted=False)
        # a fault cleared after the layout was kept makes it stale
        bad = [i.clone() for i in ids]
        bad[1][0, 0] = 99
        op.validate = False
        op.dispatch(x, w, bad)
        with pytest.raises(EpError):
            op.synchronize()
        with pytest.raises(ValueError, match="is stale"):
            op.combine(_identity(outs), layout=la)
        with pytest.raises(ValueError, match="is stale"):
            op.dispatch(x, layout=la)
    push = host_op(cfg(W, "normal", hidden=64, topk=K, experts_per_rank=L, tmax=8), "sm_90", seed_of("layout_push"))
    push.dispatch(x, w, ids)
    with pytest.raises(ValueError, match="dispatch_transport='pull'"):
        push.dispatch(x, layout=push.keep_layout())
    for o in (op, other, push):
        o.close()


def test_layout_bytes():
    """nbytes is the tables' size: 8 T W + N (8 + 8 K) + 4 per rank in the rank layout (N receive rows)."""
    op = _op("rank", "layout_bytes", "normal")
    g = torch.Generator().manual_seed(1)
    x, w, ids = _inputs(g, [T, 3])
    op.dispatch(x, w, ids)
    N = op.arena_layout.capacity_rows
    assert op.keep_layout().nbytes == sum(8 * t * W + N * (8 + 8 * K) + 4 for t in (T, 3))
    op.close()
