"""The all_to_all_single MoE layer on the CPU with gloo: W = 1 (a one-rank group) and W = 2 (two
processes), against epgen.layers.moe.dense_moe within its bound."""

import os

import pytest
import torch
import torch.distributed as dist

from epgen.layers.moe import ExpertWeights, dense_moe
from epgen.harness.ranks import start_and_join
from epgen.harness.verify import PROCESS_WORLD_SIZES, per_rank

H, I, L, K = 64, 48, 5, 4  # hidden, intermediate, local experts, top-k


def _inputs(world_size: int, tokens: list[int], seed: int):
    """Every rank's (x, weights, ids) and every rank's ExpertWeights, the same in every process:
    ids mix distinct experts, -1 slots, a row of -1 only, and one expert named in two slots."""
    gen = torch.Generator().manual_seed(seed)
    E = world_size * L
    experts = [ExpertWeights.random(L, H, I, generator=gen, device="cpu") for _ in range(world_size)]
    xs, ws, ids = [], [], []
    for T in tokens:
        xs.append(torch.randn(T, H, generator=gen).to(torch.bfloat16))
        ws.append(torch.rand(T, K, generator=gen))
        i = torch.rand(T, E, generator=gen).argsort(dim=1)[:, :K].to(torch.int32)
        if T >= 3:
            i[0, 2] = i[0, 0]  # one expert in two slots: one expanded row, the weights summed
            i[1] = -1  # reaches no rank: zeros
            i[2, 1:] = -1
        ids.append(i)
    return xs, ws, ids, experts


def _check_rank(rank: int, world_size: int, tokens: list[int], seed: int) -> None:
    from epgen.layers.moe_a2a import AllToAllMoE

    xs, ws, ids, experts = _inputs(world_size, tokens, seed)
    layer = AllToAllMoE(experts[rank], num_experts=world_size * L, topk=K)
    out = layer.forward(xs[rank], ws[rank], ids[rank])
    refs, bounds = dense_moe(xs, ws, ids, experts, combine_quant="none")
    assert out.shape == (tokens[rank], H) and out.dtype == torch.bfloat16
    err = (out.double() - refs[rank].double()).abs()
    worst = float((err - bounds[rank]).max()) if err.numel() else 0.0
    assert worst <= 0, f"rank {rank}: error exceeds dense_moe's bound by {worst}"
    if tokens[rank] >= 3:
        assert not out[1].any(), "a token with no valid expert must get zeros"
    assert out.abs().sum() > 0 or tokens[rank] == 0


def _gloo_worker(rank: int, world_size: int, store: str, tokens: list[int], seed: int) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        _check_rank(rank, world_size, tokens, seed)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("tokens", [[9], [0]])
def test_one_rank_group_meets_dense_moe(tmp_path, tokens):
    start_and_join(_gloo_worker, (1, os.path.join(tmp_path, "store"), tokens, 3), 1, timeout_s=240)


@pytest.mark.slow
@pytest.mark.parametrize("tokens", [[11, 6], [0, 8]])
def test_two_ranks_meet_dense_moe(tmp_path, tokens):
    start_and_join(_gloo_worker, (2, os.path.join(tmp_path, "store"), tokens, 5), 2, timeout_s=240)


def _errors_worker(rank: int, world_size: int, store: str) -> None:
    from epgen.layers.moe_a2a import AllToAllMoE

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        w = ExpertWeights.random(L, H, I, generator=torch.Generator().manual_seed(0), device="cpu")
        with pytest.raises(ValueError, match=r"num_experts=4: must be world_size x local experts = 1 x 5 = 5"):
            AllToAllMoE(w, num_experts=4, topk=K)
        with pytest.raises(ValueError, match=r"topk=6: must be an int in \[1, num_experts=5\]"):
            AllToAllMoE(w, num_experts=5, topk=6)
        with pytest.raises(TypeError, match="weights: expected an epgen.layers.moe.ExpertWeights, got tuple"):
            AllToAllMoE((w.gate, w.up, w.down), num_experts=5, topk=2)
        layer = AllToAllMoE(w, num_experts=5, topk=2)
        x, wt, ids = torch.zeros(2, H, dtype=torch.bfloat16), torch.ones(2, 2), torch.zeros(2, 2, dtype=torch.int32)
        with pytest.raises(ValueError, match=r"x.dtype=torch.float32: must be torch.bfloat16"):
            layer.forward(x.float(), wt, ids)
        with pytest.raises(ValueError, match=r"topk_ids.shape=\[2, 3\]: must be \[2, 2\]"):
            layer.forward(x, wt, torch.zeros(2, 3, dtype=torch.int32))
        bad = ids.clone()
        bad[1, 1] = 5
        with pytest.raises(ValueError, match=r"topk_ids\[1, 1\]=5: expert ids must be -1 or in \[0, 5\)"):
            layer.forward(x, wt, bad)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_bad_arguments_name_the_rule(tmp_path):
    start_and_join(_errors_worker, (1, os.path.join(tmp_path, "store")), 1, timeout_s=240)


def test_needs_a_process_group():
    from epgen.layers.moe_a2a import AllToAllMoE

    if dist.is_initialized():
        pytest.skip("this process already has a process group")
    w = ExpertWeights.random(L, H, I, generator=torch.Generator().manual_seed(0), device="cpu")
    with pytest.raises(RuntimeError, match="needs torch.distributed initialized"):
        AllToAllMoE(w, num_experts=L, topk=2)


def _nccl_rank(rank: int, world_size: int, tokens: list[int], seed: int) -> None:
    """On the GPU and with the group epgen.harness.ranks made (NCCL on a GPU of its own, gloo when the ranks
    share cuda:0): the layer against dense_moe."""
    from epgen.layers.moe_a2a import AllToAllMoE
    from epgen.harness.ranks import rank_device

    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False  # dense_moe's bound assumes it
    dev = torch.device("cuda", rank_device(rank, world_size))
    xs, ws, ids, experts = _inputs(world_size, tokens, seed)
    xs, ws, ids = ([t.to(dev) for t in v] for v in (xs, ws, ids))
    experts = [ExpertWeights(gate=e.gate.to(dev), up=e.up.to(dev), down=e.down.to(dev)) for e in experts]
    out = AllToAllMoE(experts[rank], num_experts=world_size * L, topk=K).forward(xs[rank], ws[rank], ids[rank])
    refs, bounds = dense_moe(xs, ws, ids, experts, combine_quant="none")
    err = (out.double() - refs[rank].double()).abs()
    assert out.device == dev
    assert bool((err <= bounds[rank]).all()), f"rank {rank}: worst excess {(err - bounds[rank]).max()}"


@pytest.mark.gpu
def test_one_rank_nccl_group_meets_dense_moe():
    from epgen.harness.ranks import run_ranks

    run_ranks(1, _nccl_rank, [40], 7, timeout_s=240)


@pytest.mark.processes
@pytest.mark.parametrize("world_size", PROCESS_WORLD_SIZES)
def test_ranks_as_processes_meet_dense_moe(world_size):
    from epgen.harness.ranks import run_ranks

    run_ranks(world_size, _nccl_rank, per_rank([33, 0, 5], world_size), 8, timeout_s=240)
