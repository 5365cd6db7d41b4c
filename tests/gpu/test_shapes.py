"""GPU runs of shapes outside the catalogue: top-k 1, 2, 6, 9 and 10 at hidden 2880 and
6144, bf16 dispatch + combine checked against the torch reference with ``check.run_round``
(received rows bit-equal, every combined element within its bound). W = 8 virtual ranks for every
shape; one multi-process test (W = 2, 3 and 4 processes) covers each top-k and each hidden once. Experts per rank from 1
to 384 / W, with a shared-expert column pinned to the token's own rank.
"""

import pytest

from epgen.harness.verify import PROCESS_WORLD_SIZES, per_rank, run_round
from epgen.codegen.config import EpConfig, Geometry

GEO = Geometry(16, 16, 4)
TOPKS = [1, 2, 6, 9, 10]
HIDDENS = [2880, 6144]
TMAX = 64


def shape_config(world_size: int, hidden: int, topk: int, num_experts: int = 128) -> EpConfig:
    """128 experts (rounded up to a multiple of W), 64 tokens a rank, explicit geometry (one
    compiled variant per op)."""
    num_experts = -(-num_experts // world_size) * world_size
    return EpConfig(world_size=world_size, hidden=hidden, topk=topk, num_experts=num_experts, max_tokens_per_rank=TMAX,
                    dispatch_geometry=GEO, combine_geometry=GEO, timeout_s=5.0)


ROUNDS_8 = [([TMAX] * 8, "uniform"), ([0, 1, 37, TMAX, TMAX, 37, 1, 0], "invalid"),
            ([TMAX, 0, 5, TMAX, 0, TMAX, 3, 9], "duplicates"), ([TMAX, 3, 0, TMAX, 17, TMAX, 1, TMAX], "shared")]
ROUNDS_PROCESSES = [([TMAX], "uniform"), ([0, 37], "invalid"), ([TMAX, 1], "duplicates"), ([0], "uniform")]
"""Token patterns (``per_rank``) and routing of the multi-process rounds."""
TWO_PROCESS_SHAPES = [(2880, 1), (6144, 2), (2880, 6), (6144, 9), (2880, 10)]


def _rounds(op, cfg, rounds):
    for seed, (tokens, kind) in enumerate(rounds):
        run_round(op, cfg, tokens, kind, seed)


@pytest.mark.gpu
@pytest.mark.parametrize("hidden", HIDDENS)
@pytest.mark.parametrize("topk", TOPKS)
def test_shape_virtual8(topk, hidden):
    from epgen.op import EpDispatchCombine

    cfg = shape_config(8, hidden, topk)
    op = EpDispatchCombine(cfg, virtual=True, validate=True)
    try:
        _rounds(op, cfg, ROUNDS_8)
    finally:
        op.close()


@pytest.mark.gpu
@pytest.mark.parametrize("num_experts", [8, 384])  # 1 and 48 experts per rank
def test_experts_per_rank_virtual8(num_experts):
    from epgen.op import EpDispatchCombine

    cfg = shape_config(8, 7168, 8 if num_experts > 8 else 2, num_experts)
    op = EpDispatchCombine(cfg, virtual=True, validate=True)
    try:
        _rounds(op, cfg, ROUNDS_8)
    finally:
        op.close()


def _two_process_body(rank, world_size):
    import torch

    from epgen.op import EpDispatchCombine

    for hidden, topk in TWO_PROCESS_SHAPES:
        cfg = shape_config(world_size, hidden, topk)
        op = EpDispatchCombine(cfg, validate=True)
        try:
            _rounds(op, cfg, [(per_rank(p, world_size), kind) for p, kind in ROUNDS_PROCESSES])
        except AssertionError as e:
            raise AssertionError(f"hidden {hidden}, top-k {topk}: {e}") from None
        torch.distributed.barrier()  # the peer's combine may still read this arena
        op.close()


@pytest.mark.processes
@pytest.mark.parametrize("world_size", PROCESS_WORLD_SIZES)
def test_shapes_processes(world_size):
    from epgen.harness.ranks import run_ranks

    run_ranks(world_size, _two_process_body, timeout_s=240.0)
