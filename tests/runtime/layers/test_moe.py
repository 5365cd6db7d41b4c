"""CPU tests of epgen.layers.moe: the router, the expert stage's two paths, the dense reference and its
bound, and MoELayer's glue around an emulated op built from epgen.reference."""

from __future__ import annotations

import re

import attrs
import pytest
import torch

from epgen import reference
from epgen.codegen.config import EpConfig
from epgen.layers.moe import (
                              ExpertWeights,
                              MoELayer,
                              dense_moe,
                              grouped_mm_available,
                              route_topk,
                              swiglu_experts,
                              swiglu_reference,
                              )
from epgen.quant import combine_roundtrip

H, I, L, K = 64, 32, 4, 4


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def ratio(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor) -> float:
    """max |got - want| / bound (0 where both the difference and the bound are 0)."""
    diff = (got.double() - want.double()).abs()
    assert bool((bound > 0).all()), "the bound must be positive everywhere"
    return float((diff / bound).max()) if diff.numel() else 0.0


# --- route_topk ----------------------------------------------------------------------------------


def test_route_topk_is_softmax_top_k():
    logits = torch.randn(50, 16, generator=gen(0))
    w, ids = route_topk(logits, 4)
    assert w.dtype == torch.float32 and ids.dtype == torch.int32 and w.shape == ids.shape == (50, 4)
    probs = torch.softmax(logits, dim=-1)
    top = probs.topk(4, dim=-1)
    assert torch.equal(ids, top.indices.int())
    assert torch.allclose(w, top.values / top.values.sum(-1, keepdim=True))
    assert torch.allclose(w.sum(-1), torch.ones(50))
    assert bool((w[:, :-1] >= w[:, 1:]).all()), "descending"
    assert all(len(set(row)) == 4 for row in ids.tolist()), "distinct experts per token"
    raw, raw_ids = route_topk(logits.to(torch.bfloat16), 4, renormalize=False)
    assert torch.equal(raw, torch.softmax(logits.to(torch.bfloat16).float(), -1).gather(1, raw_ids.long()))
    empty_w, empty_ids = route_topk(torch.zeros(0, 16), 2)
    assert empty_w.shape == empty_ids.shape == (0, 2)


@pytest.mark.parametrize("logits, k, match", [
    (torch.zeros(3, 8), 0, r"k=0: must be an int in \[1, E=8\]"),
    (torch.zeros(3, 8), 9, r"k=9: must be an int in \[1, E=8\]"),
    (torch.zeros(3, 8), 2.0, r"k=2.0: must be an int"),
    (torch.zeros(8), 2, r"logits: shape \(8,\) torch.float32 must be \[T, E\] floating"),
    (torch.zeros(3, 8, dtype=torch.int64), 2, r"logits: .* must be \[T, E\] floating"),
])
def test_route_topk_rejects(logits, k, match):
    with pytest.raises(ValueError, match=match):
        route_topk(logits, k)


@pytest.mark.parametrize("renormalize", ["no", 0, 1, None])
def test_route_topk_refuses_a_renormalize_that_is_not_a_bool(renormalize):
    """renormalize='no' used to renormalize (a non-empty string is true); every non-bool is refused."""
    with pytest.raises(TypeError, match=rf"renormalize={renormalize!r}: must be True or False"):
        route_topk(torch.zeros(3, 8), 2, renormalize=renormalize)


def logits_with(*cells):
    """[4, 8] zeros with the (row, expert, value) cells set."""
    t = torch.zeros(4, 8)
    for row, e, v in cells:
        t[row, e] = v
    return t


def test_route_topk_takes_minus_inf_as_a_mask():
    inf = float("inf")
    logits = logits_with(*((1, e, -inf) for e in range(6)), (2, 0, -inf))  # row 1: two experts left
    w, ids = route_topk(logits, 2)
    assert sorted(ids[1].tolist()) == [6, 7] and torch.allclose(w[1], torch.full((2,), 0.5))
    assert 0 not in ids[2].tolist() and bool(torch.isfinite(w).all())


@pytest.mark.parametrize("cells, k, match", [
    ([(2, 5, float("nan")), (3, 0, float("nan"))], 2,
     r"logits\[2, 5\]=nan: router logits must be finite or -inf \(a masked expert\)"),
    ([(1, 3, float("inf"))], 2, r"logits\[1, 3\]=inf: router logits must be finite or -inf"),
    ([(3, e, float("-inf")) for e in range(8)], 1,
     r"logits\[3\]: 0 of E=8 experts above -inf, fewer than k=1: the row has no top-k"),
    ([(0, e, float("-inf")) for e in range(6)] + [(2, 1, float("nan"))], 3,
     r"logits\[0\]: 2 of E=8 experts above -inf, fewer than k=3"),
])
def test_route_topk_rejects_rows_without_a_top_k(cells, k, match):
    with pytest.raises(ValueError, match=match):
        route_topk(logits_with(*cells), k)
    with pytest.raises(ValueError, match=match):
        route_topk(logits_with(*cells).to(torch.bfloat16), k)


# --- ExpertWeights -------------------------------------------------------------------------------


def test_expert_weights_random_keeps_activations_order_one():
    w = ExpertWeights.random(L, 256, 128, generator=gen(1))
    assert (w.num_experts, w.hidden, w.intermediate) == (L, 256, 128)
    assert w.gate.dtype == w.up.dtype == w.down.dtype == torch.bfloat16
    assert tuple(w.down.shape) == (L, 128, 256) and w.device == torch.device("cpu")
    x = torch.randn(512, 256, generator=gen(2)).to(torch.bfloat16)
    y = swiglu_experts(x, torch.tensor([0, 512, 512, 512, 512], dtype=torch.int32), w)
    rms = float(y.float().pow(2).mean().sqrt())
    assert 0.4 < rms < 0.8, rms  # E[silu(g)^2] ~ 0.36 for g ~ N(0, 1)
    same = ExpertWeights.random(L, 256, 128, generator=gen(1))
    assert torch.equal(same.down, w.down), "one generator seed, one set of weights"


def test_expert_weights_validation():
    g = torch.zeros(2, 8, 4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"ExpertWeights.down: shape \(2, 8, 4\) must be \[L, I, H\] = \[2, 4, 8\]"):
        ExpertWeights(gate=g, up=g, down=g)
    with pytest.raises(ValueError, match=r"ExpertWeights.up: shape \(2, 8, 5\) must equal gate's"):
        ExpertWeights(gate=g, up=torch.zeros(2, 8, 5, dtype=torch.bfloat16), down=torch.zeros(2, 4, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"ExpertWeights.gate.dtype=torch.float32: must be torch.bfloat16"):
        ExpertWeights(gate=g.float(), up=g, down=torch.zeros(2, 4, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"ExpertWeights.down: must be contiguous"):
        ExpertWeights(gate=g, up=g, down=torch.zeros(2, 8, 4, dtype=torch.bfloat16).transpose(1, 2))
    with pytest.raises(ValueError, match=r"hidden=0: must be a positive int"):
        ExpertWeights.random(2, 0, 4, generator=gen(0))


# --- grouped_mm_available ------------------------------------------------------------------------


def test_grouped_mm_available_without_a_visible_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on a torch built without CUDA
    for device in ("cuda", "cuda:1", torch.device("cuda"), torch.device("cuda", 0), 0, "meta"):
        assert grouped_mm_available(device) is False, device
    for device in ("cpu", torch.device("cpu")):
        assert grouped_mm_available(device) is True, device


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a torch that sees no GPU")
def test_grouped_mm_available_on_this_cpu_only_torch():
    assert grouped_mm_available("cuda") is False and grouped_mm_available(torch.device("cuda:0")) is False


@pytest.mark.parametrize("device, error, match", [
    (1.5, TypeError, r"device=1.5: must be a torch.device, a device string or a CUDA device index"),
    (True, TypeError, r"device=True: must be a torch.device"),
    ("nonsense", ValueError, r"device='nonsense': not a torch device"),
    (-1, ValueError, r"device=-1: a CUDA device index must be >= 0"),
])
def test_grouped_mm_available_rejects(device, error, match):
    with pytest.raises(error, match=match):
        grouped_mm_available(device)


# --- swiglu_experts ------------------------------------------------------------------------------


def grouped_rows(counts, alignment, extra, seed, hidden=H):
    """x [offsets[L] + extra, H] in the expert layout: each group's rows random, padding zero, the
    ``extra`` rows past offsets[L] filled with garbage (never read)."""
    g = gen(seed)
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + -(-c // alignment) * alignment)
    x = torch.full((offsets[-1] + extra, hidden), 1e30, dtype=torch.bfloat16)
    x[: offsets[-1]] = 0
    for e, c in enumerate(counts):
        x[offsets[e]: offsets[e] + c] = torch.randn(c, hidden, generator=g).to(torch.bfloat16)
    return x, torch.tensor(offsets, dtype=torch.int32)


@pytest.mark.parametrize("counts, alignment", [([5, 0, 17, 9], 1), ([5, 0, 17, 9], 8), ([0, 0, 0, 0], 4),
                                               ([40, 1, 0, 3], 16)])
def test_swiglu_grouped_and_loop_agree_within_the_bound(counts, alignment):
    w = ExpertWeights.random(L, H, I, generator=gen(3))
    x, offsets = grouped_rows(counts, alignment, extra=5, seed=4)
    n = int(offsets[-1])
    grouped = swiglu_experts(x, offsets, w, grouped=True)
    loop = swiglu_experts(x, offsets, w, grouped=False)
    auto = swiglu_experts(x, offsets, w)
    want, bound = swiglu_reference(x, offsets, w)
    assert want.shape == bound.shape == (n, H)
    for got in (grouped, loop, auto):
        assert got.shape == x.shape and got.dtype == torch.bfloat16
        assert ratio(got[:n], want, bound) <= 1.0
    assert ratio(grouped[:n], loop[:n], bound) <= 1.0
    pad = torch.cat([torch.arange(offsets[e] + c, offsets[e + 1]) for e, c in enumerate(counts)])
    assert bool((loop[pad] == 0).all()) and bool((grouped[pad] == 0).all()), "padding rows give zeros"


def test_swiglu_bound_catches_a_wrong_expert_weight():
    w = ExpertWeights.random(L, H, I, generator=gen(5))
    x, offsets = grouped_rows([20, 20, 20, 20], 1, extra=0, seed=6)
    want, bound = swiglu_reference(x, offsets, w)
    assert float((bound / want.double().abs().clamp(min=2**-4)).median()) < 0.25, "the bound is not vacuous"
    down = w.down.clone()
    down[2, 7] *= 1.25  # one row of one expert's down projection a quarter off
    wrong = ExpertWeights(gate=w.gate, up=w.up, down=down)
    assert ratio(swiglu_experts(x, offsets, wrong, grouped=True)[40:60], want[40:60], bound[40:60]) > 1.0
    assert ratio(swiglu_experts(x, offsets, w, grouped=True), want, bound) <= 1.0
    swapped = ExpertWeights(gate=w.gate[[0, 1, 3, 2]].contiguous(), up=w.up, down=w.down)
    assert ratio(swiglu_experts(x, offsets, swapped, grouped=False), want, bound) > 1.0


def test_swiglu_writes_out_and_checks_its_inputs():
    w = ExpertWeights.random(L, H, I, generator=gen(7))
    x, offsets = grouped_rows([3, 2, 0, 4], 1, extra=3, seed=8)
    for grouped in (True, False):
        out = torch.full_like(x, 7.0)
        assert swiglu_experts(x, offsets, w, grouped=grouped, out=out) is out
        assert torch.equal(out[:9], swiglu_experts(x, offsets, w, grouped=False)[:9])
    assert bool((out[9:] == 7.0).all()), "the loop leaves rows >= offsets[L] as they were"
    with pytest.raises(ValueError, match=r"offsets=\[0, 3, 2, 2, 6\]: must start at 0, never decrease"):
        swiglu_experts(x, torch.tensor([0, 3, 2, 2, 6], dtype=torch.int32), w, grouped=False)
    with pytest.raises(ValueError, match=r"offsets=\[0, 3, 5, 5, 13\]: .* end at most at R=12"):
        swiglu_experts(x, torch.tensor([0, 3, 5, 5, 13], dtype=torch.int32), w, grouped=False)
    for grouped in (None, True, False):  # the grouped path reads them too unless the caller vouches
        for bad in ([0, 3, 2, 2, 6], [0, 3, 5, 5, 13], [1, 3, 5, 5, 9]):
            with pytest.raises(ValueError, match=re.escape(f"offsets={bad}: must start at 0, never decrease")):
                swiglu_experts(x, torch.tensor(bad, dtype=torch.int32), w, grouped=grouped)
    with pytest.raises(TypeError, match=r"offsets_checked=None: must be True or False"):
        swiglu_experts(x, offsets, w, offsets_checked=None)
    assert torch.equal(swiglu_experts(x, offsets, w, grouped=True, offsets_checked=True)[:9],
                       swiglu_experts(x, offsets, w, grouped=True)[:9])
    with pytest.raises(ValueError, match=r"offsets.shape=\[4\]: must be \[5\]"):
        swiglu_experts(x, offsets[:4], w)
    with pytest.raises(ValueError, match=r"offsets.dtype=torch.int64: must be torch.int32"):
        swiglu_experts(x, offsets.long(), w)
    with pytest.raises(ValueError, match=r"x.shape=\[12, 32\]: must be \[\*, 64\]"):
        swiglu_experts(x[:, :32], offsets, w)
    with pytest.raises(ValueError, match=r"out.shape=\[11, 64\]: must be \[12, 64\]"):
        swiglu_experts(x, offsets, w, out=x[:11].clone())
    with pytest.raises(TypeError, match=r"w: must be an ExpertWeights, got tuple"):
        swiglu_experts(x, offsets, (w.gate, w.up, w.down))
    odd = ExpertWeights.random(L, H, 12, generator=gen(9))
    with pytest.raises(ValueError, match=r"grouped=True: H=64, I=12: torch._grouped_mm needs both to be multiples of 8"):
        swiglu_experts(x, offsets, odd, grouped=True)
    assert torch.equal(swiglu_experts(x, offsets, odd)[:9], swiglu_experts(x, offsets, odd, grouped=False)[:9])
    for flag in ("yes", 1, 0):
        with pytest.raises(TypeError, match=rf"grouped={flag!r}: must be None, True or False"):
            swiglu_experts(x, offsets, w, grouped=flag)


# --- dense_moe -----------------------------------------------------------------------------------


def expert_row_float64(x_row, w: ExpertWeights, e: int) -> torch.Tensor:
    """One expert on one row with float64 GEMMs, rounded to bf16 (through float32, so once each
    in effect) at the documented points."""
    def bf16(t):
        return t.float().to(torch.bfloat16)

    x = x_row.double()
    g = bf16(x @ w.gate[e].double())
    v = bf16(x @ w.up[e].double())
    s = bf16(torch.nn.functional.silu(g.double()))
    h = bf16(s.double() * v.double())
    return bf16(h.double() @ w.down[e].double())


def naive_moe(xs, topk_weights, topk_ids, weights, combine_quant="none", fp8_flavour="e4m3fn"):
    """The weighted-combine definition token by token (common semantics of the expert layout)."""
    world, experts_per_rank = len(weights), weights[0].num_experts
    outs = []
    for r in range(world):
        out = torch.zeros(xs[r].shape[0], xs[r].shape[1], dtype=torch.bfloat16)
        for t in range(xs[r].shape[0]):
            ids = topk_ids[r][t].tolist()
            distinct = []  # ascending first slot
            for e in ids:
                if e >= 0 and e not in distinct:
                    distinct.append(e)
            total = torch.zeros(xs[r].shape[1], dtype=torch.float32)
            for d in range(world):
                mine = [e for e in distinct if e // experts_per_rank == d]
                if not mine:
                    continue
                acc = torch.zeros(xs[r].shape[1], dtype=torch.float32)
                for e in mine:
                    w = torch.zeros((), dtype=torch.float32)
                    for k, e2 in enumerate(ids):
                        if e2 == e:
                            w = w + topk_weights[r][t, k]
                    y = expert_row_float64(xs[r][t], weights[d], e % experts_per_rank)
                    acc = acc + w * y.float()
                wire = combine_roundtrip(combine_quant, acc.to(torch.bfloat16)[None], fp8_flavour=fp8_flavour)
                total = total + wire[0]
            out[t] = total.to(torch.bfloat16)
        outs.append(out)
    return outs


def routed_inputs(tokens, world, seed, hidden=H, experts_per_rank=L, topk=K):
    """Per rank x, router weights and ids with -1 slots and duplicate ids mixed in."""
    g = gen(seed)
    xs, ws, ids = [], [], []
    for T in tokens:
        xs.append(torch.randn(T, hidden, generator=g).to(torch.bfloat16))
        w, i = route_topk(torch.randn(T, world * experts_per_rank, generator=g), topk)
        if T:
            i[::5, -1] = -1  # a missing slot
            i[1::7, 1] = i[1::7, 0]  # the same expert in two slots (its weights add up)
            i[3::11] = -1  # a token with no expert at all
        ws.append(w)
        ids.append(i)
    return xs, ws, ids


def rank_weights(world, seed, hidden=H, intermediate=I):
    g = gen(seed)
    return [ExpertWeights.random(L, hidden, intermediate, generator=g) for _ in range(world)]


@pytest.mark.parametrize("fp8_flavour", ["e4m3fn", "e4m3fnuz"])
@pytest.mark.parametrize("combine_quant", ["none", "fp8_direct_cast", "fp8_blockwise", "fp4_blockwise"])
def test_dense_moe_matches_a_naive_token_loop(combine_quant, fp8_flavour):
    """In either fp8 flavour of the wire (e4m3fnuz: gfx942's)."""
    world = 3
    weights = rank_weights(world, 10)
    xs, ws, ids = routed_inputs([23, 0, 31], world, 11)
    outs, bounds = dense_moe(xs, ws, ids, weights, combine_quant=combine_quant, fp8_flavour=fp8_flavour)
    naive = naive_moe(xs, ws, ids, weights, combine_quant, fp8_flavour)
    for r in range(world):
        assert outs[r].shape == bounds[r].shape == xs[r].shape
        assert outs[r].dtype == torch.bfloat16 and bounds[r].dtype == torch.float64
        assert ratio(outs[r], naive[r], bounds[r]) <= 1.0
        none = (ids[r] < 0).all(dim=1)
        assert bool((outs[r][none] == 0).all()), "a token with no expert gets zeros"


def test_dense_moe_bound_catches_a_missing_expert_and_a_wrong_weight():
    world = 2
    weights = rank_weights(world, 12)
    xs, ws, ids = routed_inputs([40, 40], world, 13)
    outs, bounds = dense_moe(xs, ws, ids, weights)
    dropped = [i.clone() for i in ids]
    dropped[1][:, 2] = -1  # every token of rank 1 loses one slot
    missing, _ = dense_moe(xs, ws, dropped, weights)
    assert ratio(missing[1], outs[1], bounds[1]) > 1.0
    scaled = [w.clone() for w in ws]
    scaled[0][:, 0] *= 1.25  # the top routing weight a quarter off
    off, _ = dense_moe(xs, scaled, ids, weights)
    assert ratio(off[0], outs[0], bounds[0]) > 1.0


def test_dense_moe_validation():
    weights = rank_weights(2, 14)
    xs, ws, ids = routed_inputs([3, 4], 2, 15)
    with pytest.raises(ValueError, match=r"xs: must be a list of 2 tensors \(one per rank, like weights\), got 1"):
        dense_moe(xs[:1], ws, ids, weights)
    with pytest.raises(ValueError, match=r"combine_quant='fp8': must be one of none, "):
        dense_moe(xs, ws, ids, weights, combine_quant="fp8")
    with pytest.raises(ValueError, match=r"fp8_flavour='fnuz': unknown fp8 flavour; known: e4m3fn, e4m3fnuz"):
        dense_moe(xs, ws, ids, weights, combine_quant="fp8_blockwise", fp8_flavour="fnuz")
    bad = [i.clone() for i in ids]
    bad[1][2, 1] = 8
    with pytest.raises(ValueError, match=r"topk_ids\[rank 1\]\[token 2, slot 1\]=8: expert ids must be -1 or in \[0, 8\)"):
        dense_moe(xs, ws, bad, weights)
    with pytest.raises(ValueError, match=r"topk_weights\[rank 1\]: shape \(4, 3\) on cpu must be \[T, K\] = \[4, 4\]"):
        dense_moe(xs, [ws[0], ws[1][:, :3]], ids, weights)
    with pytest.raises(ValueError, match=r"xs\[rank 1\]: shape \(4, 32\) on cpu must be \[T, H=64\]"):
        dense_moe([xs[0], xs[1][:, :32]], ws, ids, weights)
    other = ExpertWeights.random(L, H, 16, generator=gen(0))
    with pytest.raises(ValueError, match=r"weights\[rank 1\]: L, H, I = 4, 64, 16 on cpu must equal rank 0's 4, 64, 32"):
        dense_moe(xs, ws, ids, [weights[0], other])
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        with pytest.raises(ValueError, match=r"get_float32_matmul_precision\(\)='high': the dense reference needs 'highest'"):
            dense_moe(xs, ws, ids, weights)
    finally:
        torch.set_float32_matmul_precision(previous)


# --- MoELayer's glue, around an emulated op ------------------------------------------------------


class ReferenceOp:
    """EpDispatchCombine's interface in the expert layout, emulated on the CPU from epgen.reference:
    dispatch = ``reference.dispatch`` then ``reference.expand``; combine_input = one [R_max, H]
    bf16 buffer per rank; combine = ``reference.combine_weighted``. ``drop`` = (rank, local expert)
    whose expanded rows get weight 0 (a fold that loses that expert)."""

    def __init__(self, config, *, virtual, drop=None):
        self.config = config
        self.virtual = virtual
        self.local_ranks = list(range(config.world_size)) if virtual else [0]
        self.device = torch.device("cpu")
        self.drop = drop
        experts = config.experts_per_rank
        rows = config.world_size * config.max_tokens_per_rank * min(config.topk, experts)
        capacity = rows + experts * (config.expert_alignment - 1)
        self.inputs = {r: torch.zeros(capacity, config.hidden, dtype=torch.bfloat16) for r in self.local_ranks}
        self.closed = False

    def dispatch(self, x, weights, indices, family=None):
        xs, ws, ids = (x, weights, indices) if self.virtual else ([x], [weights], [indices])
        cfg = self.config
        self.recv = reference.dispatch(list(xs), list(ws), list(ids), experts_per_rank=cfg.experts_per_rank)
        self.expert = reference.expand(self.recv, experts_per_rank=cfg.experts_per_rank,
                                       alignment=cfg.expert_alignment)
        if self.drop is not None:
            rank, e = self.drop
            rows = self.expert[rank]
            weights = rows.weights.clone()
            weights[int(rows.offsets[e]):int(rows.offsets[e + 1])] = 0.0
            self.expert[rank] = attrs.evolve(rows, weights=weights)
        self.tokens = [t.shape[0] for t in xs]
        return self.expert if self.virtual else self.expert[0]

    def combine_input(self, rank=None):
        return self.inputs[0 if rank is None else rank]

    def combine(self, y):
        ys = list(y) if self.virtual else [y]
        outs = reference.combine_weighted(ys, self.expert, self.recv, self.tokens,
                                          combine_quant=self.config.combine_quant)
        return outs if self.virtual else outs[0]

    def close(self):
        self.closed = True


def layer_config(world, alignment=1, combine_quant="none", layout="expert", **kw):
    return EpConfig(world_size=world, hidden=H, topk=K, num_experts=world * L, max_tokens_per_rank=64,
                    layout=layout, expert_alignment=alignment, combine_quant=combine_quant, **kw)


def reference_layer(config, weights, grouped=None, drop=None):
    virtual = config.world_size > 1
    op = ReferenceOp(config, virtual=virtual, drop=drop)
    return MoELayer(config, weights if virtual else weights[0], virtual=virtual, grouped_mm=grouped, op=op)


def run_layer(layer, xs, ws, ids):
    if layer.op.virtual:
        return layer(xs, ws, ids)
    return [layer(xs[0], ws[0], ids[0])]


@pytest.mark.parametrize("world, tokens", [(1, [37]), (1, [0]), (4, [23, 0, 40, 1]),
                                           (8, [9, 0, 0, 30, 5, 17, 0, 2])])
@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize("alignment, combine_quant", [(1, "none"), (8, "none"), (4, "fp8_blockwise")])
def test_layer_matches_dense_moe_within_the_bound(world, tokens, grouped, alignment, combine_quant):
    weights = rank_weights(world, 20 + world)
    xs, ws, ids = routed_inputs(tokens, world, 30 + world)
    layer = reference_layer(layer_config(world, alignment, combine_quant), weights, grouped)
    assert layer.grouped_mm is grouped and layer.ranks == layer.op.local_ranks
    outs = run_layer(layer, xs, ws, ids)
    want, bounds = dense_moe(xs, ws, ids, weights, combine_quant=combine_quant)
    for r in range(world):
        assert outs[r].shape == xs[r].shape and outs[r].dtype == torch.bfloat16
        assert ratio(outs[r], want[r], bounds[r]) <= 1.0
    layer.close()
    assert layer.op.closed


@pytest.mark.parametrize("grouped", [True, False])
def test_layer_stages_one_by_one(grouped):
    world = 4
    weights = rank_weights(world, 40)
    xs, ws, ids = routed_inputs([11, 0, 20, 3], world, 41)
    layer = reference_layer(layer_config(world), weights, grouped)
    dispatched = layer.dispatch(xs, ws, ids)
    ys = layer.experts(dispatched)
    for rank, y, d in zip(layer.ranks, ys, dispatched):
        assert y.shape == d.x.shape and y.dtype == torch.bfloat16
        in_buffer = y.data_ptr() == layer.op.combine_input(rank).data_ptr()
        assert in_buffer is not grouped, "the loop writes the combine input, the grouped path its own output"
    outs = layer.combine(ys)
    again = run_layer(layer, xs, ws, ids)
    assert all(torch.equal(a, b) for a, b in zip(outs, again))
    with pytest.raises(ValueError, match=r"dispatched: 3 entries, this process drives ranks \[0, 1, 2, 3\]"):
        layer.experts(dispatched[:3])


def test_layer_bound_catches_a_wrong_weight_and_a_lost_expert():
    world = 4
    weights = rank_weights(world, 50)
    xs, ws, ids = routed_inputs([40, 40, 40, 40], world, 51)
    want, bounds = dense_moe(xs, ws, ids, weights)
    right = run_layer(reference_layer(layer_config(world), weights), xs, ws, ids)
    assert max(ratio(right[r], want[r], bounds[r]) for r in range(world)) <= 1.0
    gate = weights[2].gate.clone()
    gate[1, :, 5] *= 1.5  # one of the 32 gate columns of one expert half off
    wrong = list(weights)
    wrong[2] = ExpertWeights(gate=gate, up=weights[2].up, down=weights[2].down)
    outs = run_layer(reference_layer(layer_config(world), wrong), xs, ws, ids)
    assert max(ratio(outs[r], want[r], bounds[r]) for r in range(world)) > 1.0
    lost = run_layer(reference_layer(layer_config(world), weights, drop=(3, 2)), xs, ws, ids)
    assert max(ratio(lost[r], want[r], bounds[r]) for r in range(world)) > 1.0


def test_layer_validation():
    weights = rank_weights(4, 60)
    with pytest.raises(ValueError, match=r"config.layout='rank': MoELayer needs EpConfig\(layout='expert'\)"):
        MoELayer(layer_config(4, layout="rank"), weights, virtual=True)
    with pytest.raises(ValueError, match=r"config.dtype='fp8': MoELayer's experts read bf16 rows"):
        MoELayer(layer_config(4, dtype="fp8"), weights, virtual=True)
    with pytest.raises(TypeError, match=r"config: expected an EpConfig, got dict"):
        MoELayer({"layout": "expert"}, weights)
    cfg = layer_config(4)
    with pytest.raises(ValueError, match=r"weights\[1\]: L=4, H=32 must be the config's experts_per_rank=4, hidden=64"):
        MoELayer(cfg, [weights[0], ExpertWeights.random(L, 32, I, generator=gen(0))], virtual=True,
                 op=ReferenceOp(cfg, virtual=True))
    with pytest.raises(ValueError, match=r"weights: 3 ExpertWeights given, this process drives 4 ranks: "
                                         r"pass a list of 4 \(one per virtual rank\)"):
        MoELayer(cfg, weights[:3], virtual=True, op=ReferenceOp(cfg, virtual=True))
    with pytest.raises(ValueError, match=r"op.config=.*: must equal config="):
        MoELayer(cfg, weights, virtual=True, op=ReferenceOp(layer_config(4, alignment=2), virtual=True))
    with pytest.raises(TypeError, match=r"weights\[0\]: must be an ExpertWeights, got Tensor"):
        MoELayer(cfg, [w.gate for w in weights], virtual=True, op=ReferenceOp(cfg, virtual=True))
    odd = [ExpertWeights.random(L, H, 12, generator=gen(1)) for _ in range(4)]
    with pytest.raises(ValueError, match=r"grouped_mm=True \(weights\[0\]\): H=64, I=12: torch._grouped_mm needs"):
        MoELayer(cfg, odd, virtual=True, grouped_mm=True, op=ReferenceOp(cfg, virtual=True))
    with pytest.raises(TypeError, match=r"grouped_mm='yes': must be None, True or False"):
        MoELayer(cfg, weights, virtual=True, grouped_mm="yes", op=ReferenceOp(cfg, virtual=True))
    layer = MoELayer(cfg, odd, virtual=True, op=ReferenceOp(cfg, virtual=True))
    assert layer.grouped_mm is False, "None falls back to the loop"
    layer = MoELayer(cfg, weights, virtual=True, op=ReferenceOp(cfg, virtual=True))
    assert layer.grouped_mm is True, "CPU has torch._grouped_mm"


def test_layer_refuses_a_mismatch_with_the_op_or_across_ranks():
    weights = rank_weights(4, 61)
    cfg = layer_config(4)
    other = ExpertWeights.random(L, H, 16, generator=gen(2))
    with pytest.raises(ValueError, match=r"weights\[2\]: I=16 must equal weights\[0\]'s I=32 \(every rank's experts "
                                         r"have one intermediate size\)"):
        MoELayer(cfg, [weights[0], weights[1], other, weights[3]], virtual=True, op=ReferenceOp(cfg, virtual=True))
    with pytest.raises(ValueError, match=r"virtual=False: the op given was built with virtual=True; pass its mode"):
        MoELayer(cfg, weights, virtual=False, op=ReferenceOp(cfg, virtual=True))
    one = layer_config(1)
    with pytest.raises(ValueError, match=r"virtual=True: the op given was built with virtual=False"):
        MoELayer(one, weights[:1], virtual=True, op=ReferenceOp(one, virtual=False))
    with pytest.raises(ValueError, match=r"device=1: the op given runs on cpu"):
        MoELayer(cfg, weights, virtual=True, device=1, op=ReferenceOp(cfg, virtual=True))
    with pytest.raises(TypeError, match=r"virtual='yes': must be True or False"):
        MoELayer(cfg, weights, virtual="yes", op=ReferenceOp(cfg, virtual=True))


class BuiltOp(ReferenceOp):
    """Stands in for EpDispatchCombine when MoELayer builds its op: records every build, and puts
    the op on ``DEVICE``."""

    builds: list = []
    DEVICE = torch.device("cpu")

    def __init__(self, config, *, virtual, device):
        super().__init__(config, virtual=virtual)
        self.device = self.DEVICE
        self.asked_device = device
        BuiltOp.builds.append(self)


@pytest.fixture
def built_ops(monkeypatch):
    import epgen.op

    monkeypatch.setattr(epgen.op, "EpDispatchCombine", BuiltOp)
    monkeypatch.setattr(BuiltOp, "builds", [])
    return BuiltOp


def test_layer_checks_everything_before_it_builds_the_op(built_ops, monkeypatch):
    weights = rank_weights(4, 62)
    cfg = layer_config(4)
    odd = [ExpertWeights.random(L, H, 12, generator=gen(3)) for _ in range(4)]
    meta = ExpertWeights(gate=weights[1].gate.to("meta"), up=weights[1].up.to("meta"), down=weights[1].down.to("meta"))
    for kwargs, error, match in [
        (dict(weights=weights[:3], virtual=True), ValueError, r"weights: 3 ExpertWeights given, this process drives 4"),
        (dict(weights=weights[:2]), ValueError,
         r"weights: 2 ExpertWeights given, this process drives 1 rank: pass one"),
        (dict(weights=[weights[0], meta, *weights[2:]], virtual=True), ValueError,
         r"weights\[1\]: on meta, must be on weights\[0\]'s device cpu"),
        (dict(weights=[*weights[:3], odd[0]], virtual=True), ValueError, r"weights\[3\]: I=12 must equal"),
        (dict(weights=odd, virtual=True, grouped_mm=True), ValueError, r"grouped_mm=True \(weights\[0\]\)"),
        (dict(weights=weights, virtual=True, grouped_mm=1), TypeError, r"grouped_mm=1: must be None"),
    ]:
        with pytest.raises(error, match=match):
            MoELayer(cfg, **kwargs)
        assert built_ops.builds == [], f"{match}: raised after the op was built"
    layer = MoELayer(cfg, weights, virtual=True, device=3)
    assert built_ops.builds == [layer.op] and layer.op.asked_device == 3 and layer.op.virtual
    assert layer.ranks == [0, 1, 2, 3] and not layer.op.closed


def test_layer_closes_the_op_it_built_when_the_weights_are_elsewhere(built_ops, monkeypatch):
    weights = rank_weights(4, 63)
    cfg = layer_config(4)
    monkeypatch.setattr(built_ops, "DEVICE", torch.device("cuda", 0))
    with pytest.raises(ValueError, match=r"weights: on cpu, must be on the op's device cuda:0"):
        MoELayer(cfg, weights, virtual=True)
    assert len(built_ops.builds) == 1 and built_ops.builds[0].closed, "the op built for the layer must be closed"
    given = ReferenceOp(cfg, virtual=True)
    given.device = torch.device("cuda", 0)
    with pytest.raises(ValueError, match=r"weights: on cpu, must be on the op's device cuda:0"):
        MoELayer(cfg, weights, virtual=True, op=given)
    assert not given.closed, "an op the caller gave stays open (the caller owns it)"


# --- tools/bench_moe.py's flags ------------------------------------------------------------------


@pytest.fixture(scope="module")
def bench_moe():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[3] / "tools" / "bench_moe.py"
    spec = importlib.util.spec_from_file_location("bench_moe", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def bench_flag_error(bench_moe, argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        bench_moe.parse_args(argv)
    assert e.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize("argv, message", [
    (["--tokens", "128", "0"], "--tokens 0: every value must be at least 1"),
    (["--experts", "7"], "EpConfig.topk=8: must be at most num_experts=7 (--experts 7 with --model deepseek-v3)"),
    (["--world-size", "3"], "EpConfig.num_experts=256: must be a multiple of world_size=3 (--world-size 3 with "
                            "--model deepseek-v3)"),
    (["--world-size", "8", "--experts", "1000000"], "KernelSpec.experts_per_rank=125000: must be in [1, 65536] "
                                                    "(--experts 1000000 with --model deepseek-v3)"),
    (["--world-size", "0"], "--world-size 0: must be at least 1"),
    (["--iters", "4"], "--iters 4: must be at least 5"),
    (["--warmup", "-1"], "--warmup -1: must be at least 0"),
    (["--intermediate", "0"], "--intermediate 0: must be at least 1"),
    (["--tokens", "2000000"], "KernelSpec.max_tokens_per_rank=2000000: must be in [1, 1048576] (--tokens 2000000)"),
    (["--model", "nope"], "--model nope: model='nope': not in the catalogue"),
])
def test_bench_moe_flag_errors_come_before_the_gpu_check(bench_moe, argv, message, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert message in bench_flag_error(bench_moe, argv, capsys)


def test_bench_moe_checks_the_gpu_and_the_rules_that_need_its_count(bench_moe, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "needs a GPU (torch.cuda.is_available() is False)" in bench_flag_error(bench_moe, [], capsys)
    # --experts 1000000 fits 65536 local experts from W = 16 on: without --world-size it waits for the GPU count
    assert "needs a GPU" in bench_flag_error(bench_moe, ["--experts", "1000000"], capsys)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA H200")
    assert bench_flag_error(bench_moe, ["--experts", "1000000"], capsys).endswith(
        "KernelSpec.experts_per_rank=125000: must be in [1, 65536] (--experts 1000000 with --model deepseek-v3)")
    assert bench_flag_error(bench_moe, ["--world-size", "16"], capsys).endswith(
        "--world-size 16: must be in [1, 8] (one process per GPU; this machine has 8)")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    assert bench_flag_error(bench_moe, [], capsys).endswith(
        "EpConfig.num_experts=256: must be a multiple of world_size=3 (W = 3, every GPU (no --world-size) with "
        "--model deepseek-v3)")
    opts = bench_moe.parse_args(["--world-size", "2", "--tokens", "64", "96"])
    assert (opts.world_size, opts.tokens) == (2, (64, 96)) and opts.output.endswith("bench_moe-ep2-h200")


# --- tools/bench_transformers.py without a GPU ---------------------------------------------------


def test_bench_transformers_says_it_needs_a_gpu(monkeypatch, capsys):
    """Without a GPU the transformers bench stops at its flags with one line, as bench_moe does (it
    used to start a one-rank NCCL group and fail inside torch)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[3] / "tools" / "bench_transformers.py"
    spec = importlib.util.spec_from_file_location("bench_transformers", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for argv, message in ((["--tokens", "8"], "needs a GPU (torch.cuda.is_available() is False)"),
                          (["--tokens", "8", "0"], "--tokens 0: every value must be at least 1")):
        with pytest.raises(SystemExit) as e:
            module.main(argv)
        assert e.value.code == 2
        assert capsys.readouterr().err.strip().splitlines()[-1].endswith(message)
