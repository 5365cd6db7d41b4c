"""CPU tests of epgen.reference: hand-worked routing, dispatch (and its receive cap), combine, align_rows,
relative_l2. The expert-major layout and the weighted combine: test_reference_expert.py."""

from __future__ import annotations

import math

import pytest
import torch

from epgen.reference import RecvRows, align_rows, combine, dispatch, relative_l2, route


def i32(rows, k=None):
    t = torch.tensor(rows, dtype=torch.int32)
    return t.reshape(0, k) if k is not None and t.numel() == 0 else t


def bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bit pattern of a tensor (so NaN payloads and -0.0 compare exactly)."""
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def make_inputs(indices, hidden=4, dtype=torch.bfloat16, seed=0, scale_bytes=None):
    """Per-rank x, weights and (optionally) scales for the given per-rank index lists."""
    g = torch.Generator().manual_seed(seed)
    xs, ws, ss = [], [], []
    for r, idx in enumerate(indices):
        t, k = idx.shape
        xs.append(torch.randn(t, hidden, generator=g).to(dtype))
        ws.append(torch.rand(t, k, generator=g, dtype=torch.float32))
        if scale_bytes is not None:
            ss.append(torch.randint(0, 256, (t, scale_bytes), generator=g, dtype=torch.uint8))
    return xs, ws, (ss if scale_bytes is not None else None)


def src_pairs(rows: RecvRows) -> list[tuple[int, int]]:
    return [tuple(p) for p in rows.src.tolist()]


# --- route ---------------------------------------------------------------------------------------


def test_route_hand_worked():
    # L=2, W=2: experts 0,1 on rank 0; experts 2,3 on rank 1.
    idx = i32([[3, 2, 0, -1], [-1, -1, -1, -1], [1, 0, -1, 3], [-1, 2, 1, 3]])
    got = route(idx, experts_per_rank=2, world_size=2)
    assert got.dtype == torch.int64 and got.shape == (4, 2)
    assert got.tolist() == [
        [2, 0],  # rank 0 first named at slot 2 (expert 0); rank 1 at slot 0 (expert 3), slot 1 dropped
        [-1, -1],  # no valid expert
        [0, 3],
        [2, 1],  # -1 in slot 0 skipped
    ]


def test_route_three_ranks_and_empty():
    idx = i32([[5, 4, 0, 1], [2, 5, 3, 0]])  # L=2, W=3
    assert route(idx, experts_per_rank=2, world_size=3).tolist() == [[2, -1, 0], [3, 0, 1]]
    empty = route(i32([], 4), experts_per_rank=2, world_size=3)
    assert empty.shape == (0, 3) and empty.dtype == torch.int64


def test_route_rejects_bad_ids_and_args():
    with pytest.raises(ValueError, match=r"indices\[token 1, slot 0\]=4: expert ids must be -1 or in \[0, 4\)"):
        route(i32([[0, 1], [4, 0]]), experts_per_rank=2, world_size=2)
    with pytest.raises(ValueError, match=r"indices\.dtype=torch.int64: must be torch.int32"):
        route(torch.tensor([[0, 1]]), experts_per_rank=2, world_size=2)
    with pytest.raises(ValueError, match=r"experts_per_rank=0: must be at least 1"):
        route(i32([[0, 1]]), experts_per_rank=0, world_size=2)


# --- dispatch ------------------------------------------------------------------------------------

# L=2, W=2. Rank 0: t0 -> ranks {1 (slot 0), 0 (slot 2)}; t1 -> nowhere; t2 -> rank 0 only.
# Rank 1: t0 -> rank 1 only (two slots); t1 -> ranks {0 (slot 0), 1 (slot 1)}.
IDX_W2 = [i32([[3, 2, 0, -1], [-1, -1, -1, -1], [1, 0, -1, -1]]), i32([[2, 3, -1, -1], [0, 3, 1, 2]])]


def test_dispatch_dedup_and_src_pairs():
    xs, ws, ss = make_inputs(IDX_W2, scale_bytes=3)
    recv = dispatch(xs, ws, IDX_W2, experts_per_rank=2, scales=ss)
    assert len(recv) == 2
    assert src_pairs(recv[0]) == [(0, 0), (0, 2), (1, 1)]
    assert src_pairs(recv[1]) == [(0, 0), (1, 0), (1, 1)]  # (0,0) once though two slots name rank 1
    assert [r.num_rows for r in recv] == [3, 3]
    for d, rows in enumerate(recv):
        assert rows.src.dtype == torch.int32 and rows.src.shape == (rows.num_rows, 2)
        assert rows.x.dtype == torch.bfloat16 and rows.weights.dtype == torch.float32
        assert rows.indices.dtype == torch.int32 and rows.scales.dtype == torch.uint8
        for i, (r, t) in enumerate(src_pairs(rows)):
            assert torch.equal(bits(rows.x[i]), bits(xs[r][t]))
            assert torch.equal(bits(rows.weights[i]), bits(ws[r][t]))  # sender's full row
            assert torch.equal(rows.indices[i], IDX_W2[r][t])  # full row, -1 entries included
            assert torch.equal(rows.scales[i], ss[r][t])


def test_dispatch_bit_exact_special_values_and_no_scales():
    idx = [i32([[0, -1], [1, 0]]), i32([[1, 1]])]  # L=1, W=2
    special = torch.tensor([[float("nan"), -0.0, float("inf"), 1e-40], [-float("inf"), 3.0, -1e-40, 0.0]])
    xs = [special.clone(), torch.tensor([[7.0, -7.0, 0.5, -0.0]])]
    xs[0][0, 0] = torch.tensor(0x7FC01234, dtype=torch.int32).view(torch.float32)  # NaN with payload
    ws = [torch.ones(2, 2), torch.ones(1, 2)]
    recv = dispatch(xs, ws, idx, experts_per_rank=1)
    assert src_pairs(recv[0]) == [(0, 0), (0, 1)]
    assert src_pairs(recv[1]) == [(0, 1), (1, 0)]
    assert torch.equal(bits(recv[0].x), bits(xs[0]))
    assert torch.equal(bits(recv[1].x[0]), bits(xs[0][1]))
    assert all(r.scales is None for r in recv)


def test_dispatch_fp8_payload():
    idx = [i32([[1, 0]]), i32([[0, -1], [1, -1]])]
    xs = [torch.randn(n, 8).to(torch.float8_e4m3fn) for n in (1, 2)]
    recv = dispatch(xs, [torch.ones(1, 2), torch.ones(2, 2)], idx, experts_per_rank=1)
    assert recv[0].x.dtype == torch.float8_e4m3fn
    assert torch.equal(bits(recv[0].x), bits(torch.cat([xs[0][0:1], xs[1][0:1]])))
    assert torch.equal(bits(recv[1].x), bits(torch.cat([xs[0][0:1], xs[1][1:2]])))


@pytest.mark.parametrize("tokens", [(5, 0), (0, 3)])
def test_zero_token_ranks(tokens):
    g = torch.Generator().manual_seed(1)
    idx = [torch.randint(-1, 4, (t, 3), generator=g, dtype=torch.int32) for t in tokens]
    xs, ws, ss = make_inputs(idx, scale_bytes=2)
    recv = dispatch(xs, ws, idx, experts_per_rank=2, scales=ss)
    busy = 0 if tokens[0] else 1
    for d, rows in enumerate(recv):
        assert all(r == busy for r, _ in src_pairs(rows))
        expected = [(busy, t) for t in range(tokens[busy]) if any(int(e) // 2 == d for e in idx[busy][t] if e >= 0)]
        assert src_pairs(rows) == expected
        assert rows.x.shape == (len(expected), 4) and rows.scales.shape == (len(expected), 2)
    ys = [torch.randn(r.num_rows, 4).to(torch.bfloat16) for r in recv]
    out = combine(ys, recv, list(tokens))
    assert [o.shape for o in out] == [(tokens[0], 4), (tokens[1], 4)]
    assert all(o.dtype == torch.bfloat16 for o in out)


def test_all_ranks_empty():
    idx = [i32([], 2), i32([], 2)]
    xs, ws, _ = make_inputs(idx)
    recv = dispatch(xs, ws, idx, experts_per_rank=3)
    assert [r.num_rows for r in recv] == [0, 0]
    assert recv[0].x.shape == (0, 4) and recv[0].weights.shape == (0, 2) and recv[0].src.shape == (0, 2)
    out = combine([torch.zeros(0, 4, dtype=torch.bfloat16)] * 2, recv, [0, 0])
    assert [o.shape for o in out] == [(0, 4), (0, 4)]


def test_world_size_one():
    idx = [i32([[2, 0, 1], [-1, -1, -1], [1, 1, -1]])]  # L=3, W=1
    xs, ws, _ = make_inputs(idx, hidden=6)
    (rows,) = dispatch(xs, ws, idx, experts_per_rank=3)
    assert src_pairs(rows) == [(0, 0), (0, 2)]
    assert torch.equal(bits(rows.x), bits(xs[0][[0, 2]]))
    assert route(idx[0], experts_per_rank=3, world_size=1).tolist() == [[0], [-1], [0]]
    y = torch.randn(2, 6).to(torch.bfloat16)
    (out,) = combine([y], [rows], [3])
    assert torch.equal(bits(out[0]), bits(y[0])) and torch.equal(bits(out[2]), bits(y[1]))
    assert torch.equal(bits(out[1]), bits(torch.zeros(6, dtype=torch.bfloat16)))


@pytest.mark.parametrize(
    ("bad", "slot_value"),
    [(4, "=4"), (-2, "=-2")],
)
def test_dispatch_rejects_invalid_expert_ids(bad, slot_value):
    idx = [i32([[0, 1, 2], [3, -1, 0]]), i32([[0, 0, 0], [1, 1, 1], [2, 2, 2], [3, 3, 0], [1, 2, 3]])]
    idx[1][3, 2] = bad
    xs, ws, _ = make_inputs(idx)
    with pytest.raises(ValueError) as err:
        dispatch(xs, ws, idx, experts_per_rank=2)
    msg = str(err.value)
    assert f"indices[rank 1][token 3, slot 2]{slot_value}: expert ids must be -1 or in [0, 4)" in msg


def test_dispatch_rejects_inconsistent_inputs():
    idx = [i32([[0, 1]]), i32([[1, 0], [0, 0]])]
    xs, ws, ss = make_inputs(idx, scale_bytes=2)
    with pytest.raises(ValueError, match=r"xs\[rank 1\]: shape \(2, 5\) .* must be \[T, 4\]"):
        dispatch([xs[0], torch.zeros(2, 5, dtype=torch.bfloat16)], ws, idx, experts_per_rank=1)
    with pytest.raises(ValueError, match=r"xs\[rank 1\]: .*torch.float32.* must be .*torch.bfloat16"):
        dispatch([xs[0], xs[1].float()], ws, idx, experts_per_rank=1)
    rule = r"weights\[rank 1\]: shape \(2, 2\) torch.float16 .* must be \[2, 2\] torch.float32"
    with pytest.raises(ValueError, match=rule):
        dispatch(xs, [ws[0], ws[1].half()], idx, experts_per_rank=1)
    rule = r"indices\[rank 0\]: shape \(1, 2\) torch.int64 .* must be \[1, 2\] torch.int32"
    with pytest.raises(ValueError, match=rule):
        dispatch(xs, ws, [idx[0].long(), idx[1]], experts_per_rank=1)
    with pytest.raises(ValueError, match=r"weights\[rank 1\]: shape \(2, 3\) .* must be \[2, 2\]"):
        dispatch(xs, [ws[0], torch.ones(2, 3)], idx, experts_per_rank=1)
    with pytest.raises(ValueError, match=r"scales\[rank 1\]: shape \(2, 3\) .* must be \[2, 2\] torch.uint8"):
        dispatch(xs, ws, idx, experts_per_rank=1, scales=[ss[0], torch.zeros(2, 3, dtype=torch.uint8)])
    with pytest.raises(ValueError, match=r"scales: must be a list of 2 tensors"):
        dispatch(xs, ws, idx, experts_per_rank=1, scales=[ss[0]])
    with pytest.raises(ValueError, match=r"indices: must be a list of 2 tensors"):
        dispatch(xs, ws, idx[:1], experts_per_rank=1)
    with pytest.raises(ValueError, match=r"experts_per_rank=True: must be an int"):
        dispatch(xs, ws, idx, experts_per_rank=True)


def test_dispatch_max_recv_tokens():
    xs, ws, _ = make_inputs(IDX_W2)
    # Each rank receives 3 rows (test_dispatch_dedup_and_src_pairs): a cap of 3 is met exactly.
    capped = dispatch(xs, ws, IDX_W2, experts_per_rank=2, max_recv_tokens=3)
    plain = dispatch(xs, ws, IDX_W2, experts_per_rank=2)
    assert [src_pairs(r) for r in capped] == [src_pairs(r) for r in plain]
    rule = r"max_recv_tokens=2: rank 0 would receive 3 rows, more than the cap \(ranks over the cap: \[0, 1\]\)"
    with pytest.raises(ValueError, match=rule):
        dispatch(xs, ws, IDX_W2, experts_per_rank=2, max_recv_tokens=2)
    # Only rank 1 over the cap: rank 1 receives (0,0), (1,0), (1,1); rank 0 only (1,1).
    idx = [i32([[3, 2, -1, -1]]), i32([[2, 3, -1, -1], [0, 3, 1, 2]])]
    xs, ws, _ = make_inputs(idx)
    with pytest.raises(ValueError, match=r"^max_recv_tokens=2: rank 1 would receive 3 rows, more than the cap$"):
        dispatch(xs, ws, idx, experts_per_rank=2, max_recv_tokens=2)
    for bad, rule in ((0, r"max_recv_tokens=0: must be at least 1"), (True, r"max_recv_tokens=True: must be an int")):
        with pytest.raises(ValueError, match=rule):
            dispatch(xs, ws, idx, experts_per_rank=2, max_recv_tokens=bad)


def test_recv_rows_validates_row_counts():
    with pytest.raises(ValueError, match=r"RecvRows.weights: 1 rows must match the 2 rows"):
        RecvRows(
            x=torch.zeros(2, 4),
            weights=torch.zeros(1, 2),
            indices=torch.zeros(2, 2, dtype=torch.int32),
            scales=None,
            src=torch.zeros(2, 2, dtype=torch.int32),
        )


# --- combine -------------------------------------------------------------------------------------


def test_combine_hand_worked_and_all_minus_one_row_is_zero():
    xs, ws, _ = make_inputs(IDX_W2)
    recv = dispatch(xs, ws, IDX_W2, experts_per_rank=2)
    # recv[0] rows: (0,0), (0,2), (1,1); recv[1] rows: (0,0), (1,0), (1,1). Small integers: exact.
    ys = [
        torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], dtype=torch.bfloat16),
        torch.tensor([[10.0, 20.0], [30.0, 40.0], [50.0, 60.0]], dtype=torch.bfloat16),
    ]
    out = combine(ys, recv, [3, 2])
    assert out[0].dtype == torch.bfloat16 and out[0].shape == (3, 2) and out[1].shape == (2, 2)
    assert out[0].float().tolist() == [[11.0, 22.0], [0.0, 0.0], [3.0, 4.0]]
    assert out[1].float().tolist() == [[30.0, 40.0], [55.0, 66.0]]
    # The token with all -1 reached no rank: exact (+0.0) zeros.
    assert torch.equal(bits(out[0][1]), bits(torch.zeros(2, dtype=torch.bfloat16)))


def test_combine_accumulates_in_fp32_then_casts_once():
    # W=3, L=1: rank 0 token 0 reaches all three ranks. In bf16 (8 significant bits)
    # 1 + 2^-8 rounds (ties-to-even) back to 1, so a bf16 running sum gives 1.0, while the fp32
    # sum 1 + 2^-8 + 2^-8 = 1 + 2^-7 is exactly representable in bf16.
    idx = [i32([[0, 1, 2]]), i32([], 3), i32([], 3)]
    xs, ws, _ = make_inputs(idx, hidden=2)
    recv = dispatch(xs, ws, idx, experts_per_rank=1)
    assert [src_pairs(r) for r in recv] == [[(0, 0)]] * 3
    small = 2.0**-8
    ys = [torch.tensor([[v, -v]], dtype=torch.bfloat16) for v in (1.0, small, small)]
    bf16_running = ys[0] + ys[1] + ys[2]
    assert bf16_running.float().tolist() == [[1.0, -1.0]]  # what the wrong accumulation gives
    (out0, out1, out2) = combine(ys, recv, [1, 0, 0])
    assert out0.dtype == torch.bfloat16
    assert out0.float().tolist() == [[1.0 + 2.0**-7, -(1.0 + 2.0**-7)]]
    assert out1.shape == (0, 2) and out2.shape == (0, 2)


def test_combine_float32_output_dtype():
    idx = [i32([[0, 1]]), i32([[1, -1]])]
    xs, ws, _ = make_inputs(idx)
    recv = dispatch(xs, ws, idx, experts_per_rank=1)
    ys = [torch.full((r.num_rows, 3), 0.25 * (d + 1)) for d, r in enumerate(recv)]
    out = combine(ys, recv, [1, 1])
    assert out[0].dtype == torch.float32
    assert out[0].tolist() == [[0.75] * 3] and out[1].tolist() == [[0.5] * 3]


def test_combine_rejects_bad_inputs():
    xs, ws, _ = make_inputs(IDX_W2)
    recv = dispatch(xs, ws, IDX_W2, experts_per_rank=2)
    ys = [torch.zeros(3, 2, dtype=torch.bfloat16), torch.zeros(3, 2, dtype=torch.bfloat16)]
    with pytest.raises(ValueError, match=r"ys\[rank 1\]: shape \(2, 2\) .* must be \[3, 2\]"):
        combine([ys[0], ys[1][:2]], recv, [3, 2])
    with pytest.raises(ValueError, match=r"source token must be in \[0, 1\) \(num_tokens\[rank 1\]\)"):
        combine(ys, recv, [3, 1])
    with pytest.raises(ValueError, match=r"num_tokens: must be a list of 2 entries"):
        combine(ys, recv, [3])
    with pytest.raises(ValueError, match=r"ys\[rank 0\]: dtype torch.int32 must be a floating dtype"):
        combine([y.int() for y in ys], recv, [3, 2])
    dup = RecvRows(x=recv[0].x, weights=recv[0].weights, indices=recv[0].indices, scales=None,
                   src=i32([[0, 0], [0, 0], [1, 1]]))
    with pytest.raises(ValueError, match=r"pairs \[\(0, 0\)\] appear more than once"):
        combine(ys, [dup, recv[1]], [3, 2])


def test_random_against_loops():
    """Cross-check dispatch and combine against a direct per-token loop (W=3, one empty rank)."""
    g = torch.Generator().manual_seed(7)
    world, local, topk, hidden = 3, 2, 4, 5
    tokens = [6, 0, 4]
    idx = [torch.randint(-1, world * local, (t, topk), generator=g, dtype=torch.int32) for t in tokens]
    xs, ws, ss = make_inputs(idx, hidden=hidden, scale_bytes=1)
    recv = dispatch(xs, ws, idx, experts_per_rank=local, scales=ss)
    reached = {}  # (r, t) -> sorted destination ranks
    for r in range(world):
        for t in range(tokens[r]):
            reached[(r, t)] = sorted({int(e) // local for e in idx[r][t] if e >= 0})
    for d in range(world):
        assert src_pairs(recv[d]) == [k for k, ds in sorted(reached.items()) if d in ds]
    ys = [torch.randn(r.num_rows, hidden, generator=g).to(torch.bfloat16) for r in recv]
    out = combine(ys, recv, tokens)
    for (r, t), ds in reached.items():
        acc = torch.zeros(hidden, dtype=torch.float32)
        for d in ds:
            acc += ys[d][src_pairs(recv[d]).index((r, t))].float()
        assert torch.equal(bits(out[r][t]), bits(acc.to(torch.bfloat16)))


# --- align_rows ----------------------------------------------------------------------------------


def test_align_rows_shuffled():
    ref = i32([[0, 0], [0, 2], [1, 1], [2, 0], [2, 5]])
    shuffle = torch.tensor([3, 0, 4, 2, 1])
    test = ref[shuffle]
    perm = align_rows(ref, test)
    assert perm.dtype == torch.int64
    assert torch.equal(test[perm], ref)
    assert torch.equal(perm, torch.argsort(shuffle))
    assert align_rows(i32([], 2), i32([], 2)).shape == (0,)


def test_align_rows_mismatch_message():
    ref = i32([[0, 0], [0, 2], [1, 1], [2, 0]])
    test = i32([[0, 0], [1, 1], [3, 7], [2, 0]])
    with pytest.raises(AssertionError) as err:
        align_rows(ref, test)
    msg = str(err.value)
    assert "reference has 4 rows, test has 4 rows" in msg
    assert "missing from test (rank, token): [(0, 2)]" in msg
    assert "extra in test (rank, token): [(3, 7)]" in msg


def test_align_rows_duplicates_and_counts():
    ref = i32([[0, 0], [0, 1], [1, 0]])
    with pytest.raises(AssertionError, match=r"duplicated in test \(rank, token\): \[\(0, 1\)\]"):
        align_rows(ref, i32([[0, 1], [0, 0], [1, 0], [0, 1]]))
    many = i32([[9, t] for t in range(8)])
    with pytest.raises(AssertionError) as err:
        align_rows(ref, torch.cat([ref, many]))
    msg = str(err.value)
    assert "reference has 3 rows, test has 11 rows" in msg
    assert "extra in test (rank, token): [(9, 0), (9, 1), (9, 2), (9, 3), (9, 4)] ... (8 in all)" in msg


def test_align_rows_three_columns():
    # Expanded rows' (rank, token, slot) keys: the same (rank, token) may appear with two slots.
    ref = i32([[0, 0, 0], [0, 0, 2], [0, 1, 1], [1, 0, 0], [1, 0, 3], [2, 4, 1]])
    shuffle = torch.tensor([4, 1, 5, 0, 3, 2])
    test = ref[shuffle].long()  # any integer dtype
    perm = align_rows(ref, test)
    assert torch.equal(test[perm], ref.long()) and torch.equal(perm, torch.argsort(shuffle))
    assert align_rows(i32([], 3), i32([], 3)).shape == (0,)
    with pytest.raises(AssertionError) as err:
        align_rows(ref, i32([[0, 0, 0], [0, 0, 1], [0, 1, 1], [1, 0, 0], [1, 0, 3], [2, 4, 1], [2, 4, 1]]))
    msg = str(err.value)
    assert msg.startswith("rows differ: reference has 6 rows, test has 7 rows")
    assert "missing from test (rank, token, slot): [(0, 0, 2)]" in msg
    assert "extra in test (rank, token, slot): [(0, 0, 1)]" in msg
    assert "duplicated in test (rank, token, slot): [(2, 4, 1)]" in msg


def test_align_rows_rejects_bad_keys():
    with pytest.raises(ValueError, match=r"test_src: shape \(2, 2\) must have the 3 columns of ref_src"):
        align_rows(i32([[0, 0, 0], [0, 1, 0]]), i32([[0, 0], [0, 1]]))
    with pytest.raises(ValueError, match=r"ref_src: shape \(2, 1\) torch.int32 must be \[R, C\] integer with C >= 2"):
        align_rows(i32([[0], [1]]), i32([[0], [1]]))
    with pytest.raises(ValueError, match=r"test_src: shape \(1, 3\) torch.float32 must be \[R, C\] integer"):
        align_rows(i32([[0, 0, 0]]), torch.zeros(1, 3))


# --- relative_l2 ---------------------------------------------------------------------------------


def test_relative_l2():
    ref = torch.tensor([3.0, 4.0])
    assert relative_l2(ref.clone(), ref) == 0.0
    assert relative_l2(torch.tensor([3.0, 4.5]), ref) == pytest.approx(0.1)
    assert relative_l2(torch.tensor([3.0, 4.0], dtype=torch.bfloat16), ref) == 0.0
    assert relative_l2(torch.zeros(3), torch.zeros(3)) == 0.0
    assert relative_l2(torch.zeros(0, 4), torch.zeros(0, 4)) == 0.0
    assert relative_l2(torch.tensor([0.0, 1e-30]), torch.zeros(2)) == math.inf
    assert relative_l2(torch.tensor([float("nan"), 4.0]), ref) == math.inf
    assert relative_l2(ref, torch.tensor([3.0, float("nan")])) == math.inf
    with pytest.raises(ValueError, match=r"out: shape \(3,\) must equal ref shape \(2,\)"):
        relative_l2(torch.zeros(3), ref)
