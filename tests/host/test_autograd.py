"""Differentiable dispatch and combine (``epgen.autograd``).

* ``torch.autograd.gradcheck`` in float64 through the reference stand-in (``ReferenceEp``) at
  W = 2 and 3, both layouts, with a zero-token rank, -1 ids and a duplicate id: the Functions'
  derivative formulas (combine's backward = cached dispatch, dispatch's backward = combine, the
  routing weights' gradients).
* The same graph on the generated kernels (the host emulation here; a GPU with the ``gpu``
  parameter, unchanged) against the stand-in in bf16 rows: outputs and every gradient within one
  bf16 rounding of each summed value (the kernels sum in float32, the stand-in in float64, each
  rounds once to bf16), the routing weights' gradients exact up to the float32 order of their
  few terms.
* The cost of the backward in kernel launches against the forward, and the refusals (fp8
  payload, an op without the pull kernels, routing-weight gradients over a quantized wire).
"""

from __future__ import annotations

import pytest
import torch

from epgen.autograd import ReferenceEp, combine, dispatch
from epgen.codegen.config import EpConfig
from tests.host.host_cases import cfg, host_module, host_op, seed_of, seeded

K, L = 2, 2

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with host_module():
        yield


def _config(W: int, layout: str, hidden: int, family: str = "normal", **kw) -> EpConfig:
    return cfg(W, family, hidden=hidden, topk=K, experts_per_rank=L, tmax=8, dispatch_transport="pull",
               layout=layout, **({"expert_alignment": 2} if layout == "expert" else {}), **kw)


def _routing(g, tokens, W):
    ids = [torch.randint(-1, W * L, (t, K), generator=g, dtype=torch.int32) for t in tokens]
    ids[0][0] = torch.tensor([1, 1], dtype=torch.int32)  # a duplicate id
    ids[0][1] = torch.tensor([-1, -1], dtype=torch.int32)  # a token that goes nowhere
    return ids


def _experts(layout, d, dtype):
    """A smooth expert stage that uses the weights (rank layout: as the caller's; expert layout:
    the combine applies them)."""
    acc = torch.promote_types(dtype, torch.float32)
    if layout == "rank":
        return [(torch.tanh(x.to(acc)) * w.to(acc).sum(-1, keepdim=True)).to(dtype) for x, w in zip(d.x, d.weights)]
    return [torch.tanh(x.to(acc)).to(dtype) for x in d.x]


@pytest.mark.parametrize("layout", ["rank", "expert"])
@pytest.mark.parametrize("W", [2, 3])
def test_gradcheck_through_the_reference(layout, W):
    H = 16
    op = ReferenceEp(_config(W, layout, H))
    g = torch.Generator().manual_seed(W)
    tokens = [3, 0, 2][:W]
    ids = _routing(g, tokens, W)
    xs = [torch.randn(t, H, generator=g, dtype=torch.float64).requires_grad_() for t in tokens]
    ws = [torch.rand(t, K, generator=g, dtype=torch.float64).requires_grad_() for t in tokens]

    def f(*args, family=None):
        d = dispatch(op, list(args[:W]), list(args[W:]), ids, family=family)
        return tuple(combine(op, _experts(layout, d, torch.float64), d))

    assert torch.autograd.gradcheck(f, (*xs, *ws))
    for a, b in zip(f(*xs, *ws, family="normal"), f(*xs, *ws)):  # the op's family argument: taken, one path
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match=r"family='bogus': must be None, 'normal' or 'low_latency'"):
        f(*xs, *ws, family="bogus")


def _run(op, layout, x0, w0, ids, dtype, weights_grad=True):
    """Forward and backward of dispatch -> experts -> combine -> a weighted sum; returns
    (outputs, grad x, grad weights) per rank."""
    H = x0[0].shape[1]
    xs = [x.detach().to(device=op.device, dtype=dtype).clone().requires_grad_() for x in x0]
    ws = [w.detach().to(op.device).clone().requires_grad_(weights_grad) for w in w0]
    d = dispatch(op, xs, ws, [i.to(op.device) for i in ids])
    out = combine(op, _experts(layout, d, dtype), d)
    probe = torch.linspace(-1, 1, H, device=op.device)
    sum((o.float() * probe).sum() for o in out).backward()
    return out, [x.grad for x in xs], [w.grad for w in ws]


def _close(got, want, what):
    """Within one bf16 rounding of the larger magnitude (2^-8 relative) plus 2^-8 of the tensor's
    scale, for sums the kernels form in float32 and the stand-in in float64."""
    got, want = got.double().cpu(), want.double().cpu()
    scale = (want.abs().max().item() if want.numel() else 0.0) or 1.0
    bad = (got - want).abs() > 2**-7 * want.abs() + 2**-8 * scale
    assert not bad.any(), f"{what}: {int(bad.sum())} elements off, max error {(got - want).abs().max().item()}"


def _kernel_op(config, device, name):
    if device == "cpu":
        return host_op(config, "sm_90", seed_of(name))
    from epgen.op import EpDispatchCombine

    return EpDispatchCombine(config, virtual=True, validate=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["rank", "expert"])
@pytest.mark.parametrize("family", ["normal", "auto"])
def test_kernels_match_the_reference_gradients(layout, family, device):
    """family "auto": the forward takes the low-latency kernels (5 tokens), the backward the
    layout's combine family and the pull kernels' cached dispatch."""
    W, H = 2, 64
    name = f"autograd_{layout}_{family}"
    op = _kernel_op(_config(W, layout, H, family), device, name)
    g = torch.Generator().manual_seed(seed_of(name))
    tokens = [5, 3]
    ids = _routing(g, tokens, W)
    x0 = [torch.randn(t, H, generator=g).bfloat16() for t in tokens]
    w0 = [torch.rand(t, K, generator=g) for t in tokens]
    with seeded(op):
        before = getattr(op.platform, "launches", None)
        out, gx, gw = _run(op, layout, x0, w0, ids, torch.bfloat16)
        if before is not None and family == "normal":  # the host counts launches, by kernel
            kinds = [entry.split("_sm90")[0].removeprefix("epgen_") for entry, _, _ in op.platform.stats[before:]]
            forward = {"rank": ["dispatch", "dispatch_pull", "combine"],
                       "expert": ["dispatch", "dispatch_pull", "expand_plan", "expand", "fold", "combine"]}[layout]
            # the second combine follows the first with no dispatch between: the dispatch kernel with
            # no tokens runs between them as the barrier (EpDispatchCombine._combine_barrier)
            backward = {"rank": ["dispatch", "dispatch_pull", "combine", "dispatch", "combine"],
                        "expert": ["dispatch", "dispatch_pull", "expand", "fold", "combine", "dispatch", "fold",
                                   "combine"]}[layout]
            assert kinds == forward + backward
    rop = ReferenceEp(_config(W, layout, H), dtype=torch.bfloat16)
    rout, rgx, rgw = _run(rop, layout, x0, w0, ids, torch.bfloat16)
    for r in range(W):
        _close(out[r], rout[r], f"out[rank {r}]")
        _close(gx[r], rgx[r], f"grad x[rank {r}]")
        _close(gw[r], rgw[r], f"grad weights[rank {r}]")
    assert not gx[0][1].any() and not gw[0][1].any()  # the token that reached no rank
    op.close()


def test_quantized_wire_and_refusals():
    """An fp8 combine wire: x gradients flow (through the wire, within its block bound), the
    routing weights' gradients are refused; an op without the pull kernels and an fp8 payload are
    refused before any launch; the op's own dispatch and combine refuse tensors that require grad
    (they record none) and take them under no_grad."""
    W, H = 2, 64
    op = host_op(_config(W, "rank", H, combine_quant="fp8_blockwise"), "sm_90", seed_of("autograd_fp8_wire"))
    g = torch.Generator().manual_seed(3)
    tokens = [4, 2]
    ids = _routing(g, tokens, W)
    x0 = [torch.randn(t, H, generator=g).bfloat16() for t in tokens]
    w0 = [torch.rand(t, K, generator=g) for t in tokens]
    with pytest.raises(ValueError, match="combine_quant='fp8_blockwise'"):
        _run(op, "rank", x0, w0, ids, torch.bfloat16)
    _, gx, _ = _run(op, "rank", x0, w0, ids, torch.bfloat16, weights_grad=False)
    _, rgx, _ = _run(ReferenceEp(_config(W, "rank", H), dtype=torch.float64), "rank", x0, w0, ids, torch.float64,
                     weights_grad=False)
    for a, b in zip(gx, rgx):  # fp8 e4m3 blocks: 2^-4 relative to the block's largest element
        assert (a.double() - b).abs().max() <= 2**-3 * b.abs().max()
    op.close()
    push = host_op(cfg(W, "normal", hidden=H, topk=K, experts_per_rank=L, tmax=8), "sm_90", seed_of("autograd_push"))
    with pytest.raises(ValueError, match="dispatch_transport='pull'"):
        dispatch(push, x0, w0, ids)
    with pytest.raises(TypeError, match=r"^x: virtual mode takes a list of 2 tensors \(one per rank\), got Tensor"):
        dispatch(push, x0[0], w0, ids)  # a tensor where the ranks' list goes: named, not split into rows
    wants_grad = [w.clone().requires_grad_() for w in w0]  # the op itself records no gradients: refused, not cut
    with pytest.raises(RuntimeError, match=r"^weights: requires grad, and EpDispatchCombine records no gradients .*"
                                           r"epgen.autograd.dispatch / combine"):
        push.dispatch(x0, wants_grad, ids)
    with torch.no_grad():
        out = push.dispatch(x0, wants_grad, ids)
    y = [torch.ones(o.recv_x.shape, dtype=torch.bfloat16, requires_grad=True) for o in out]
    with pytest.raises(RuntimeError, match=r"^y: requires grad"):
        push.combine(y)
    push.combine([t.detach() for t in y])
    push.close()
    fp8 = host_op(_config(1, "rank", H, dtype="fp8"), "sm_90", seed_of("autograd_fp8"))
    with pytest.raises(ValueError, match="EpConfig.dtype='fp8'"):
        dispatch(fp8, x0[0].float().to(torch.float8_e4m3fn), w0[0], ids[0].clamp(max=1))
    fp8.close()
