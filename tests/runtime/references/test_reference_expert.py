"""CPU tests of epgen.reference's expert-major layout (expand), weighted combine (fold,
combine_weighted): hand-worked cases, and random cases against a direct per-token computation."""

from __future__ import annotations

import pytest
import torch

from epgen.quant import combine_roundtrip
from epgen.reference import ExpertRows, RecvRows, combine_weighted, dispatch, expand, fold


def i32(rows, k=None):
    t = torch.tensor(rows, dtype=torch.int32)
    return t.reshape(0, k) if k is not None and t.numel() == 0 else t


def bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bit pattern of a tensor (so NaN payloads and -0.0 compare exactly)."""
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def f32(v: float) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float32)


def roundup(n: int, a: int) -> int:
    return (n + a - 1) // a * a


# --- the direct computation the tests compare against ---------------------------------------------


def naive_groups(indices, weights, world, local, d):
    """Per local expert e of rank d, [(r, t, first slot, weight)] in ascending (r, t): the tokens naming
    expert d*L+e, weight the fp32 sum of the slots naming it in ascending slot order."""
    groups = [[] for _ in range(local)]
    for r in range(world):
        for t, row in enumerate(indices[r].tolist()):
            for e in range(local):
                slots = [k for k, v in enumerate(row) if v == d * local + e]
                if slots:
                    w = weights[r][t, slots[0]]
                    for k in slots[1:]:
                        w = w + weights[r][t, k]
                    groups[e].append((r, t, slots[0], w))
    return groups


def dense_combine(indices, weights, outputs, world, local, hidden, mode):
    """out_r[t] straight from the definition: per destination rank d ascending, fold the token's
    distinct experts of d in ascending first slot (fp32, product then sum), round to bf16, apply the
    wire, sum over d in fp32 and round once. ``outputs[(d, e, r, t)]`` is expert e of rank d's [H]
    bf16 output for token (r, t)."""
    folded, owner = [], []  # one bf16 row per (token, destination rank), and its token
    for r in range(world):
        for t, row in enumerate(indices[r].tolist()):
            for d in range(world):
                firsts = {}  # local expert -> [slots] in ascending slot
                for k, v in enumerate(row):
                    if v >= 0 and v // local == d:
                        firsts.setdefault(v - d * local, []).append(k)
                if not firsts:
                    continue
                acc = torch.zeros(hidden, dtype=torch.float32)
                for e, slots in sorted(firsts.items(), key=lambda item: item[1][0]):
                    w = weights[r][t, slots[0]]
                    for k in slots[1:]:
                        w = w + weights[r][t, k]
                    acc = acc + (w * outputs[(d, e, r, t)].float())
                folded.append(acc.to(torch.bfloat16))
                owner.append((r, t))
    wire = combine_roundtrip(mode, torch.stack(folded)) if folded else torch.zeros(0, hidden)
    out = [torch.zeros(indices[r].shape[0], hidden, dtype=torch.float32) for r in range(world)]
    for (r, t), g in zip(owner, wire):  # owner is in (r, t, ascending d) order
        out[r][t] = out[r][t] + g
    return [o.to(torch.bfloat16) for o in out]


def random_case(seed, world, local, topk, tokens, hidden, scale_bytes=3):
    g = torch.Generator().manual_seed(seed)
    indices = [torch.randint(-1, world * local, (t, topk), generator=g, dtype=torch.int32) for t in tokens]
    busy = next(r for r, t in enumerate(tokens) if t >= 3)
    indices[busy][0] = -1  # a token with no expert
    indices[busy][1] = 0  # every slot names expert 0: one expanded row, all weights summed
    indices[busy][2, : min(topk, 2)] = world * local - 1  # slots 0 and 1 both name the last expert
    xs = [torch.randn(t, hidden, generator=g).to(torch.bfloat16) for t in tokens]
    ws = [torch.rand(t, topk, generator=g, dtype=torch.float32) - 0.25 for t in tokens]
    ss = [torch.randint(0, 256, (t, scale_bytes), generator=g, dtype=torch.uint8) for t in tokens]
    return g, indices, xs, ws, ss


def check_layout(rows: ExpertRows, recv: RecvRows, groups, xs, ss, alignment):
    """rows against the naive per-expert sets: offsets, counts, payload, weights, src, padding."""
    local = len(groups)
    counts = [len(gr) for gr in groups]
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + roundup(c, alignment))
    assert rows.counts.dtype == torch.int32 and rows.counts.tolist() == counts
    assert rows.offsets.dtype == torch.int32 and rows.offsets.tolist() == offsets
    assert all(o % alignment == 0 for o in offsets)
    assert rows.num_rows == offsets[-1] and rows.experts_per_rank == local
    recv_pairs = [tuple(p) for p in recv.src.tolist()]
    for e in range(local):
        for j, (r, t, slot, w) in enumerate(groups[e]):
            i = offsets[e] + j
            assert rows.src[i].tolist() == [r, t, slot]
            assert torch.equal(bits(rows.weights[i]), bits(w))
            assert torch.equal(bits(rows.x[i]), bits(xs[r][t]))
            assert torch.equal(rows.scales[i], ss[r][t])
            assert recv_pairs[int(rows.recv_row[i])] == (r, t)
        pad = slice(offsets[e] + counts[e], offsets[e + 1])
        assert not bits(rows.x[pad]).any() and not rows.scales[pad].any()
        assert not bits(rows.weights[pad]).any()  # +0.0
        assert (rows.src[pad] == -1).all() and (rows.recv_row[pad] == -1).all()


def expert_outputs(g, groups_per_rank, hidden, alignment):
    """Random bf16 output per (d, e, r, t), and per rank the y those give in the naive layout: padding
    rows and 5 rows past offsets[L] hold NaN, so reading any of them shows in the result."""
    outputs, ys = {}, []
    for d, groups in enumerate(groups_per_rank):
        rows = []
        for e, gr in enumerate(groups):
            rows.extend((d, e, r, t) for r, t, _, _ in gr)
            rows.extend([None] * (roundup(len(gr), alignment) - len(gr)))
        y = torch.full((len(rows) + 5, hidden), float("nan"), dtype=torch.bfloat16)
        for i, key in enumerate(rows):
            if key is not None:
                outputs[key] = y[i] = torch.randn(hidden, generator=g).to(torch.bfloat16)
        ys.append(y)
    return outputs, ys


# (world, local, topk, tokens per rank, alignment); every case has a zero-token rank but the W=1 ones.
CASES = [
    (3, 1, 1, (9, 0, 7), 1),
    (2, 1, 4, (0, 12), 16),
    (1, 3, 16, (14,), 1),
    (2, 2, 2, (10, 0), 128),
    (3, 2, 8, (8, 0, 11), 64),
    (2, 3, 5, (13, 0), 16),
    (4, 3, 16, (6, 9, 0, 5), 128),
    (3, 3, 3, (0, 10, 7), 64),
]


@pytest.mark.parametrize(("world", "local", "topk", "tokens", "alignment"), CASES)
def test_expand_and_combine_weighted_against_direct(world, local, topk, tokens, alignment):
    hidden = 24
    g, indices, xs, ws, ss = random_case(world * 100 + local * 10 + topk, world, local, topk, tokens, hidden)
    recv = dispatch(xs, ws, indices, experts_per_rank=local, scales=ss)
    expert = expand(recv, experts_per_rank=local, alignment=alignment)
    groups = [naive_groups(indices, ws, world, local, d) for d in range(world)]
    for d in range(world):
        check_layout(expert[d], recv[d], groups[d], xs, ss, alignment)
        assert expert[d].num_rows <= recv[d].num_rows * min(topk, local) + local * (alignment - 1)
    outputs, ys = expert_outputs(g, groups, hidden, alignment)
    got = combine_weighted(ys, expert, recv, list(tokens))
    want = dense_combine(indices, ws, outputs, world, local, hidden, "none")
    for r in range(world):
        assert got[r].dtype == torch.bfloat16 and got[r].shape == (tokens[r], hidden)
        assert torch.equal(bits(got[r]), bits(want[r]))
    busy = next(r for r, t in enumerate(tokens) if t >= 3)
    assert torch.equal(bits(got[busy][0]), bits(torch.zeros(hidden, dtype=torch.bfloat16)))  # no expert


@pytest.mark.parametrize("mode", ["fp8_direct_cast", "fp8_blockwise", "fp4_blockwise"])
@pytest.mark.parametrize(("world", "local", "topk", "tokens", "alignment"), [CASES[4], CASES[6]])
def test_combine_weighted_quantized_wire_against_direct(mode, world, local, topk, tokens, alignment):
    hidden = 160  # fp8_blockwise: one block of 128 and a short one of 32; fp4_blockwise: 5 blocks of 32
    g, indices, xs, ws, ss = random_case(7 + topk, world, local, topk, tokens, hidden)
    recv = dispatch(xs, ws, indices, experts_per_rank=local, scales=ss)
    expert = expand(recv, experts_per_rank=local, alignment=alignment)
    groups = [naive_groups(indices, ws, world, local, d) for d in range(world)]
    outputs, ys = expert_outputs(g, groups, hidden, alignment)
    got = combine_weighted(ys, expert, recv, list(tokens), combine_quant=mode)
    want = dense_combine(indices, ws, outputs, world, local, hidden, mode)
    plain = combine_weighted(ys, expert, recv, list(tokens))
    for r in range(world):
        assert torch.equal(bits(got[r]), bits(want[r]))
    assert any(not torch.equal(a, b) for a, b in zip(got, plain))  # the wire changed something


# --- hand-worked ---------------------------------------------------------------------------------

# W=2, L=3: experts 0..2 on rank 0, 3..5 on rank 1.
IDX_HAND = [
    i32([[4, 1, 4, -1], [0, 2, 0, 0], [-1, -1, -1, -1]]),  # t0: rank 1 {4 (slots 0, 2)}, rank 0 {1}
    i32([[5, 3, 2, 3], [2, -1, -1, -1]]),
]


def test_expand_hand_worked():
    xs = [torch.arange(3 * 2, dtype=torch.float32).reshape(3, 2), 10 + torch.arange(2 * 2.0).reshape(2, 2)]
    ws = [torch.tensor([[0.5, 1.0, 0.25, 9.0], [1.0, 2.0, 4.0, 8.0], [1.0] * 4]),
          torch.tensor([[1.0, 2.0, 3.0, 4.0], [0.5, 9.0, 9.0, 9.0]])]
    recv = dispatch(xs, ws, IDX_HAND, experts_per_rank=3)
    assert [tuple(p) for p in recv[0].src.tolist()] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [tuple(p) for p in recv[1].src.tolist()] == [(0, 0), (1, 0)]
    e0, e1 = expand(recv, experts_per_rank=3, alignment=2)
    assert e0.scales is None and e0.x.dtype == torch.float32
    # Rank 0: expert 0 <- (0,1) slots 0,2,3 (1+4+8); expert 1 <- (0,0) slot 1; expert 2 <- (0,1) slot 1,
    # (1,0) slot 2, (1,1) slot 0.
    assert e0.counts.tolist() == [1, 1, 3] and e0.offsets.tolist() == [0, 2, 4, 8]
    assert e0.src.tolist() == [[0, 1, 0], [-1] * 3, [0, 0, 1], [-1] * 3,
                               [0, 1, 1], [1, 0, 2], [1, 1, 0], [-1] * 3]
    assert e0.weights.tolist() == [13.0, 0.0, 1.0, 0.0, 2.0, 3.0, 0.5, 0.0]
    assert e0.recv_row.tolist() == [1, -1, 0, -1, 1, 2, 3, -1]
    assert e0.x.tolist() == [[2, 3], [0, 0], [0, 1], [0, 0], [2, 3], [10, 11], [12, 13], [0, 0]]
    # Rank 1: expert 3 <- (1,0) slots 1,3 (2+4); expert 4 <- (0,0) slots 0,2; expert 5 <- (1,0) slot 0.
    assert e1.counts.tolist() == [1, 1, 1] and e1.offsets.tolist() == [0, 2, 4, 6]
    assert e1.src.tolist() == [[1, 0, 1], [-1] * 3, [0, 0, 0], [-1] * 3, [1, 0, 0], [-1] * 3]
    assert e1.weights.tolist() == [6.0, 0.0, 0.75, 0.0, 1.0, 0.0]
    assert e1.recv_row.tolist() == [1, -1, 0, -1, 1, -1]
    packed, _ = expand(recv, experts_per_rank=3)  # alignment 1: no padding
    assert packed.offsets.tolist() == [0, 1, 2, 5] and packed.recv_row.tolist() == [1, 0, 1, 2, 3]


def test_duplicate_slots_sum_in_ascending_slot_order():
    # (1 + 2^-24) + 2^-24 rounds to 1 twice (ties to even); 2^-24 + 2^-24 + 1 = 1 + 2^-23 exactly.
    tiny = 2.0**-24
    idx = [i32([[0, 0, 0], [0, 0, 0]])]
    ws = [torch.tensor([[1.0, tiny, tiny], [tiny, tiny, 1.0]])]
    recv = dispatch([torch.zeros(2, 1)], ws, idx, experts_per_rank=1)
    (rows,) = expand(recv, experts_per_rank=1)
    assert rows.src.tolist() == [[0, 0, 0], [0, 1, 0]]
    assert rows.weights.tolist() == [1.0, 1.0 + 2.0**-23]
    # -0.0 alone stays -0.0 (the sum starts from the first slot's weight, not from 0.0).
    recv = dispatch([torch.zeros(1, 1)], [torch.tensor([[-0.0, 5.0]])], [i32([[0, -1]])], experts_per_rank=1)
    (rows,) = expand(recv, experts_per_rank=1)
    assert torch.equal(bits(rows.weights), bits(torch.tensor([-0.0])))


def test_fold_terms_in_first_slot_order():
    # W=1, L=3, one token: slot 0 -> expert 0 (y = 2^24), slot 1 -> expert 2 (-2^24), slot 2 -> expert 1 (1).
    # Ascending first slot: (2^24 - 2^24) + 1 = 1. Ascending expert id would give (2^24 + 1) - 2^24 = 0.
    recv = dispatch([torch.zeros(1, 1)], [torch.ones(1, 3)], [i32([[0, 2, 1]])], experts_per_rank=3)
    (rows,) = expand(recv, experts_per_rank=3)
    assert rows.src.tolist() == [[0, 0, 0], [0, 0, 2], [0, 0, 1]]  # rows of experts 0, 1, 2
    y = torch.tensor([[2.0**24], [1.0], [-(2.0**24)]], dtype=torch.bfloat16)
    assert fold(y, rows, 1).tolist() == [[1.0]]


def test_fold_product_then_sum_not_fused():
    # acc = -(1 + 2^-7), then w * y = (1 + 2^-23)(1 + 2^-7) = 1 + 2^-7 + 2^-23 + 2^-30, rounded to fp32
    # drops 2^-30: the sum is 2^-23. A fused multiply-add keeps 2^-30: 2^-23 (1 + 2^-7), a bf16 value.
    w = torch.tensor([[-1.0, 1.0 + 2.0**-23]])
    recv = dispatch([torch.zeros(1, 1)], [w], [i32([[0, 1]])], experts_per_rank=2)
    (rows,) = expand(recv, experts_per_rank=2)
    y = torch.full((2, 1), 1.0 + 2.0**-7, dtype=torch.bfloat16)
    folded = fold(y, rows, 1)
    assert folded.dtype == torch.bfloat16 and folded.tolist() == [[2.0**-23]]
    (out,) = combine_weighted([y], [rows], recv, [1])
    assert out.tolist() == [[2.0**-23]]


def test_fold_rounds_to_bf16_once():
    # Rounding to bf16 after each term would keep 1.0 (2^-9 is a quarter of bf16's step at 1); the
    # fp32 sum 1 + 3 * 2^-9 is rounded once, up to 1 + 2^-7.
    recv = dispatch([torch.zeros(1, 1)], [torch.ones(1, 4)], [i32([[0, 1, 2, 3]])], experts_per_rank=4)
    (rows,) = expand(recv, experts_per_rank=4)
    y = torch.tensor([[1.0], [2.0**-9], [2.0**-9], [2.0**-9]], dtype=torch.bfloat16)
    assert fold(y, rows, 1).tolist() == [[1.0 + 2.0**-7]]


def test_fp8_payload_and_empty_ranks():
    special = torch.tensor([[float("nan"), -0.0, 448.0, -448.0]]).to(torch.float8_e4m3fn)
    idx = [i32([[1, 0, 1]]), i32([], 3)]
    recv = dispatch([special, torch.zeros(0, 4, dtype=torch.float8_e4m3fn)], [torch.ones(1, 3), torch.ones(0, 3)],
                    idx, experts_per_rank=1)
    e0, e1 = expand(recv, experts_per_rank=1, alignment=16)
    assert e0.x.dtype == torch.float8_e4m3fn and e0.offsets.tolist() == [0, 16]
    assert torch.equal(bits(e0.x[0]), bits(special[0])) and not bits(e0.x[1:]).any()
    assert e1.offsets.tolist() == [0, 16] and e1.weights.tolist()[0] == 2.0
    empty = expand(dispatch([torch.zeros(0, 4)] * 2, [torch.ones(0, 2)] * 2, [i32([], 2)] * 2, experts_per_rank=3),
                   experts_per_rank=3, alignment=64)
    for rows in empty:
        assert rows.num_rows == 0 and rows.offsets.tolist() == [0, 0, 0, 0] and rows.x.shape == (0, 4)
        assert fold(torch.zeros(0, 8, dtype=torch.bfloat16), rows, 0).shape == (0, 8)
    out = combine_weighted([torch.zeros(0, 8, dtype=torch.bfloat16)] * 2, empty,
                           dispatch([torch.zeros(0, 4)] * 2, [torch.ones(0, 2)] * 2, [i32([], 2)] * 2,
                                    experts_per_rank=3), [0, 0], combine_quant="fp8_blockwise")
    assert [o.shape for o in out] == [(0, 8), (0, 8)]


def test_expand_large_is_vectorized():
    # ~30k receive rows x K = 8 on one rank: completes (row loops in Python would take minutes).
    g = torch.Generator().manual_seed(3)
    tokens, topk, local = 30000, 8, 64
    idx = torch.randint(-1, local, (tokens, topk), generator=g, dtype=torch.int32)
    idx[:, 0] = torch.randint(0, local, (tokens,), generator=g, dtype=torch.int32)
    recv = dispatch([torch.zeros(tokens, 8)], [torch.rand(tokens, topk, generator=g)], [idx], experts_per_rank=local)
    (rows,) = expand(recv, experts_per_rank=local, alignment=128)
    distinct = torch.zeros(tokens, local, dtype=torch.bool)
    valid = idx >= 0
    distinct[torch.arange(tokens)[:, None].expand(-1, topk)[valid], idx[valid].long()] = True
    assert rows.counts.tolist() == distinct.sum(dim=0).tolist()
    folded = fold(torch.ones(rows.num_rows, 2, dtype=torch.bfloat16), rows, tokens)
    assert folded.shape == (tokens, 2)


# --- errors ----------------------------------------------------------------------------------------


def hand_recv():
    xs = [torch.zeros(3, 2), torch.zeros(2, 2)]
    ws = [torch.ones(3, 4), torch.ones(2, 4)]
    return dispatch(xs, ws, IDX_HAND, experts_per_rank=3)


@pytest.mark.parametrize("bad", [0, 3, 6, -4, True, 2.0])
def test_expand_rejects_bad_alignment(bad):
    with pytest.raises(ValueError, match=rf"alignment={bad!r}: must be a power of two >= 1"):
        expand(hand_recv(), experts_per_rank=3, alignment=bad)


def test_expand_rejects_bad_inputs():
    recv = hand_recv()
    with pytest.raises(ValueError, match=r"experts_per_rank=0: must be at least 1"):
        expand(recv, experts_per_rank=0)
    with pytest.raises(ValueError, match=r"recv: must be a non-empty list"):
        expand([], experts_per_rank=3)
    with pytest.raises(ValueError, match=r"recv\[rank 1\]: must be a RecvRows, got dict"):
        expand([recv[0], {}], experts_per_rank=3)
    lonely = RecvRows(x=recv[1].x, weights=recv[1].weights, indices=i32([[4, -1, -1, -1], [0, 1, -1, 2]]),
                      scales=None, src=recv[1].src)
    rule = r"recv\[rank 1\].indices\[row 1\]=\[0, 1, -1, 2\]: names no expert of rank 1 \(ids 3..5\)"
    with pytest.raises(ValueError, match=rule):
        expand([recv[0], lonely], experts_per_rank=3)
    with pytest.raises(ValueError, match=r"recv\[rank 0\].indices\[token 0, slot 0\]=6: expert ids must be -1 or in"):
        expand([RecvRows(x=recv[0].x[:1], weights=recv[0].weights[:1], indices=i32([[6, 1, 1, 1]]), scales=None,
                         src=recv[0].src[:1]), recv[1]], experts_per_rank=3)
    with pytest.raises(ValueError, match=r"recv\[rank 0\]: indices .* and weights \(4, 4\) torch.float16 must be"):
        expand([RecvRows(x=recv[0].x, weights=recv[0].weights.half(), indices=recv[0].indices, scales=None,
                         src=recv[0].src), recv[1]], experts_per_rank=3)


def test_fold_rejects_bad_inputs():
    recv = hand_recv()
    rows = expand(recv, experts_per_rank=3, alignment=2)[0]  # offsets [0, 2, 4, 8]
    rule = (r"^y: n=7 rows, fewer than offsets\[L\]=8 of rows: y must hold n >= offsets\[L\] rows "
            r"\(rows >= offsets\[L\] are not read\)$")
    with pytest.raises(ValueError, match=rule):
        fold(torch.zeros(7, 4, dtype=torch.bfloat16), rows, 4)
    assert fold(torch.zeros(9, 4, dtype=torch.bfloat16), rows, 4).shape == (4, 4)  # n > offsets[L]: fine
    with pytest.raises(ValueError, match=r"y\.dtype=torch.float32: must be torch.bfloat16"):
        fold(torch.zeros(8, 4), rows, 4)
    with pytest.raises(ValueError, match=r"rows: receive row 4 has no expanded row"):
        fold(torch.zeros(8, 4, dtype=torch.bfloat16), rows, 5)
    with pytest.raises(ValueError, match=r"rows.recv_row\[6\]=3: must be < num_recv_rows=3"):
        fold(torch.zeros(8, 4, dtype=torch.bfloat16), rows, 3)
    with pytest.raises(ValueError, match=r"num_recv_rows=-1: must be an int >= 0"):
        fold(torch.zeros(8, 4, dtype=torch.bfloat16), rows, -1)
    src, recv_row = rows.src.clone(), rows.recv_row.clone()
    src[4], recv_row[4] = src[2], recv_row[2]  # row 4 now claims row 2's (receive row 0, slot 1)
    twice = ExpertRows(x=rows.x, scales=None, weights=rows.weights, src=src, counts=rows.counts,
                       offsets=rows.offsets, recv_row=recv_row)
    with pytest.raises(ValueError, match=r"rows: two expanded rows share a \(receive row, slot\) pair"):
        fold(torch.zeros(8, 4, dtype=torch.bfloat16), twice, 4)


def test_expert_rows_validates():
    recv = hand_recv()
    rows = expand(recv, experts_per_rank=3, alignment=2)[0]
    fields = {f: getattr(rows, f) for f in ("x", "scales", "weights", "src", "counts", "offsets", "recv_row")}

    def make(**changes):
        return ExpertRows(**{**fields, **changes})

    with pytest.raises(ValueError, match=r"ExpertRows.src.shape=\[8, 2\]: must be \[\*, 3\]"):
        make(src=rows.src[:, :2])
    with pytest.raises(ValueError, match=r"ExpertRows.x: 7 rows must match the 8 rows of ExpertRows.src"):
        make(x=rows.x[:7])
    with pytest.raises(ValueError, match=r"ExpertRows.weights.dtype=torch.float64: must be torch.float32"):
        make(weights=rows.weights.double())
    with pytest.raises(ValueError, match=r"ExpertRows.offsets=\[0, 2, 2, 8\]: must start at 0, end at R=8 and "
                                         r"leave each expert e at least counts\[e\] rows \(counts=\[1, 1, 3\]\)"):
        make(offsets=i32([0, 2, 2, 8]))
    with pytest.raises(ValueError, match=r"ExpertRows.offsets=\[1, 2, 4, 8\]"):
        make(offsets=i32([1, 2, 4, 8]))
    with pytest.raises(ValueError, match=r"ExpertRows.offsets=\[0, 2, 4, 9\]"):
        make(offsets=i32([0, 2, 4, 9]))
    with pytest.raises(ValueError, match=r"ExpertRows.counts=\[1, -1, 3\]: must be >= 0"):
        make(counts=i32([1, -1, 3]))
    with pytest.raises(ValueError, match=r"ExpertRows.recv_row\[1\]=0: must be >= 0 on the rows of an expert group "
                                         r"and -1 on padding"):
        make(recv_row=rows.recv_row.clone().index_fill_(0, torch.tensor([1]), 0))
    with pytest.raises(ValueError, match=r"ExpertRows.recv_row\[4\]=-1"):
        make(recv_row=rows.recv_row.clone().index_fill_(0, torch.tensor([4]), -1))


def test_combine_weighted_rejects_bad_inputs():
    recv = hand_recv()
    expert = expand(recv, experts_per_rank=3, alignment=2)
    ys = [torch.zeros(e.num_rows, 4, dtype=torch.bfloat16) for e in expert]
    with pytest.raises(ValueError, match=r"ys\[rank 1\]: n=5 rows, fewer than offsets\[L\]=6 of expert\[rank 1\]"):
        combine_weighted([ys[0], ys[1][:5]], expert, recv, [3, 2])
    with pytest.raises(ValueError, match=r"expert: must be a list of 2 entries"):
        combine_weighted(ys, expert[:1], recv, [3, 2])
    with pytest.raises(ValueError, match=r"combine_quant='fp9': must be one of none, "):
        combine_weighted(ys, expert, recv, [3, 2], combine_quant="fp9")
    swapped = [expert[0], expert[0]]  # rank 0's rows against rank 1's receive rows
    with pytest.raises(ValueError, match=r"expert\[rank 1\].recv_row\[5\]=2: must be < num_recv_rows=2"):
        combine_weighted([ys[0], ys[0]], swapped, recv, [3, 2])
    wrong = ExpertRows(x=expert[1].x, scales=None, weights=expert[1].weights,
                       src=expert[1].src.clone().index_fill_(0, torch.tensor([2]), 1), counts=expert[1].counts,
                       offsets=expert[1].offsets, recv_row=expert[1].recv_row)
    rule = (r"expert\[rank 1\].src\[2\]=\[1, 1, 1\]: \(source rank, source token\) must be "
            r"recv\[rank 1\].src\[0\]=\[0, 0\], its receive row's")
    with pytest.raises(ValueError, match=rule):
        combine_weighted(ys, [expert[0], wrong], recv, [3, 2])
