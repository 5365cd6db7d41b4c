"""GPU tests of epgen.layers.moe (run on the device machine): the real MoELayer (EpDispatchCombine in the
expert layout around the SwiGLU experts) against dense_moe within its derived bound.

W = 1, and W = 4 and 8 as virtual ranks on one GPU; the grouped (torch._grouped_mm) and the loop
expert paths; -1 slots, duplicate ids, tokens with no expert and ranks with no tokens; a CUDA
graph of the whole forward replayed with fresh inputs. Shape: H = 256, E = 32, K = 4, I = 128.
"""

import pytest

from epgen.codegen.config import EpConfig, Geometry

HIDDEN, EXPERTS, TOPK, INTERMEDIATE, TMAX = 256, 32, 4, 128, 256
GEO = Geometry(blocks=8, warps_per_block=8, unroll=2)  # W x 8 blocks resident at once (tests/gpu/test_expert_layout.py)


@pytest.fixture(autouse=True)
def fp32_accumulating_gemms():
    """dense_moe's bound models bf16 GEMMs that accumulate in float32: cuBLAS may otherwise round
    split-K partial sums to bf16 (the loop path's matmuls)."""
    import torch

    previous = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    yield
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = previous


def _config(world_size, alignment=1, combine_quant="none"):
    return EpConfig(world_size=world_size, hidden=HIDDEN, topk=TOPK, num_experts=EXPERTS,
                    max_tokens_per_rank=TMAX, layout="expert", expert_alignment=alignment,
                    combine_quant=combine_quant, timeout_s=10.0, dispatch_geometry=GEO, combine_geometry=GEO)


def _weights(world_size, seed):
    import torch

    from epgen.layers.moe import ExpertWeights

    g = torch.Generator().manual_seed(seed)  # drawn on the CPU, the same weights on any device
    return [ExpertWeights.random(EXPERTS // world_size, HIDDEN, INTERMEDIATE, generator=g, device="cuda")
            for _ in range(world_size)]


def _inputs(tokens, seed):
    """Per rank x [T, H] bf16 and routed (weights, ids), with a -1 slot on every 5th token, the
    same expert in two slots on every 7th, and no expert at all on every 11th."""
    import torch

    from epgen.layers.moe import route_topk

    g = torch.Generator().manual_seed(seed)
    xs, ws, ids = [], [], []
    for T in tokens:
        x = torch.randn(T, HIDDEN, generator=g).to(torch.bfloat16)
        w, i = route_topk(torch.randn(T, EXPERTS, generator=g), TOPK)
        i[::5, -1] = -1
        i[1::7, 1] = i[1::7, 0]
        i[3::11] = -1
        xs.append(x.cuda())
        ws.append(w.cuda())
        ids.append(i.cuda())
    return xs, ws, ids


def _check(outs, xs, ws, ids, weights, combine_quant, what):
    """Every element of the layer's outputs within dense_moe's bound; returns the worst ratio."""
    from epgen.layers.moe import dense_moe

    want, bounds = dense_moe(xs, ws, ids, weights, combine_quant=combine_quant)
    worst = 0.0
    for r, (got, ref, bound) in enumerate(zip(outs, want, bounds)):
        assert got.shape == ref.shape and got.dtype == ref.dtype, (what, r, got.shape, got.dtype)
        excess = (got.double() - ref.double()).abs() / bound
        beyond = int((excess > 1).sum())
        assert beyond == 0, f"{what}, rank {r}: {beyond} elements beyond the bound (worst {float(excess.max()):.3g}x)"
        worst = max(worst, float(excess.max()) if excess.numel() else 0.0)
    return worst


def _skip_without_grouped_mm(grouped):
    import torch

    from epgen.layers.moe import grouped_mm_available

    if grouped and not grouped_mm_available(torch.device("cuda")):
        pytest.skip(f"torch {torch.__version__} on this GPU has no synchronization-free torch._grouped_mm")


@pytest.mark.gpu
@pytest.mark.parametrize("grouped", [True, False])
def test_expert_paths_agree_within_the_bound(grouped):
    """swiglu_experts on the GPU (CUTLASS grouped GEMM or cuBLAS per expert) against
    swiglu_reference, with empty groups, padding and rows past offsets[L]."""
    import torch

    from epgen.layers.moe import swiglu_experts, swiglu_reference

    _skip_without_grouped_mm(grouped)
    w = _weights(4, 1)[0]  # L = 8
    counts, alignment = [37, 0, 5, 64, 0, 1, 19, 8], 8
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + -(-c // alignment) * alignment)
    g = torch.Generator().manual_seed(2)
    x = torch.zeros(offsets[-1] + 16, HIDDEN, dtype=torch.bfloat16)
    for e, c in enumerate(counts):
        x[offsets[e]:offsets[e] + c] = torch.randn(c, HIDDEN, generator=g).to(torch.bfloat16)
    x, offs = x.cuda(), torch.tensor(offsets, dtype=torch.int32, device="cuda")
    y = swiglu_experts(x, offs, w, grouped=grouped)
    want, bound = swiglu_reference(x, offs, w)
    n = offsets[-1]
    excess = (y[:n].double() - want.double()).abs() / bound
    assert float(excess.max()) <= 1.0, float(excess.max())


@pytest.mark.gpu
@pytest.mark.parametrize("grouped", [True, False])
def test_single_rank(grouped):
    from epgen.layers.moe import MoELayer

    _skip_without_grouped_mm(grouped)
    weights = _weights(1, 3)
    layer = MoELayer(_config(1), weights[0], grouped_mm=grouped)
    assert layer.grouped_mm is grouped
    for seed, T in enumerate([0, 1, 64, 200]):
        xs, ws, ids = _inputs([T], 10 + seed)
        out = layer(xs[0], ws[0], ids[0])
        layer.op.synchronize()  # raises EpError on a kernel fault
        _check([out], xs, ws, ids, weights, "none", f"W=1 T={T}")
    layer.close()


CASES = {
    4: [[64, 200, 0, 1], [200] * 4, [0] * 4, [5, 0, 0, 0]],
    8: [[64] * 8, [0, 1, 200, 64, 64, 200, 1, 0], [0] * 8],
}


@pytest.mark.gpu
@pytest.mark.parametrize("world_size", [4, 8])
@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize("alignment, combine_quant", [(1, "none"), (16, "none"), (8, "fp8_blockwise")])
def test_virtual_ranks(world_size, grouped, alignment, combine_quant):
    from epgen.layers.moe import MoELayer

    _skip_without_grouped_mm(grouped)
    weights = _weights(world_size, 4)
    layer = MoELayer(_config(world_size, alignment, combine_quant), weights, virtual=True, grouped_mm=grouped)
    worst = 0.0
    for seed, tokens in enumerate(CASES[world_size]):
        xs, ws, ids = _inputs(tokens, 20 + seed)
        dispatched = layer.dispatch(xs, ws, ids)  # the stages one by one, as forward runs them
        ys = layer.experts(dispatched)
        for rank, y in zip(layer.ranks, ys):  # combine reads y in place: the loop writes the op's buffer
            assert (y.data_ptr() == layer.op.combine_input(rank).data_ptr()) is not grouped
        outs = layer.combine(ys)
        layer.op.synchronize()
        worst = max(worst, _check(outs, xs, ws, ids, weights, combine_quant, f"W={world_size} tokens={tokens}"))
        outs = layer(xs, ws, ids)
        layer.op.synchronize()
        _check(outs, xs, ws, ids, weights, combine_quant, f"forward, W={world_size} tokens={tokens}")
    layer.close()
    print(f"MoELayer virtual W={world_size} {'grouped' if grouped else 'loop'} A={alignment} {combine_quant}: "
          f"worst {worst:.3f} of dense_moe's bound")


@pytest.mark.gpu
@pytest.mark.parametrize("world_size, tokens", [(1, [200]), (4, [64, 200, 0, 17])])
def test_forward_replays_in_a_cuda_graph(world_size, tokens):
    """One eager forward, then the whole forward captured in a CUDA graph; each replay after new
    x / weights / ids are copied into the captured input tensors matches dense_moe on them."""
    import torch

    from epgen.layers.moe import MoELayer

    _skip_without_grouped_mm(True)
    weights = _weights(world_size, 5)
    virtual = world_size > 1
    layer = MoELayer(_config(world_size), weights if virtual else weights[0], virtual=virtual, grouped_mm=True)

    def run(xs, ws, ids):
        if virtual:
            return layer(xs, ws, ids)
        return [layer(xs[0], ws[0], ids[0])]

    static = _inputs(tokens, 30)
    _check(run(*static), *static, weights, "none", "eager")
    layer.op.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = run(*static)
    for seed in (31, 32, 33):
        fresh = _inputs(tokens, seed)
        for captured, new in zip(static, fresh):
            for dst, src in zip(captured, new):
                dst.copy_(src)
        graph.replay()
        layer.op.synchronize()
        _check(outs, *fresh, weights, "none", f"replay (seed {seed})")
    layer.close()
