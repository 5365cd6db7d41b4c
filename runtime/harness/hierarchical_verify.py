"""Rounds of the hierarchical op checked bit for bit against ``epgen.reference`` (the CPU and GPU
tests and ``epgen bench --nodes`` share them).

Every process builds every rank's inputs from the seed (so all agree without communicating),
runs its own ranks through the op and checks them against the reference of the whole layer.
"""

from __future__ import annotations

import attrs
import torch

from epgen import reference
from epgen.codegen.config import EpConfig
from epgen.codegen.dtypes import dtype_info
from epgen.harness.verify import wire_fp8_flavour

__all__ = ["CASES", "ROUTINGS", "VARIANTS", "RankInputs", "check_round", "expert_stage", "make_inputs", "run_cases",
           "small_config"]

ROUTINGS = ("uniform", "skewed", "invalid", "duplicates")
"""Routing kinds of ``make_inputs``: uniform distinct experts; every expert on node 0 (the other
nodes receive nothing); uniform with a third of the slots -1 and every fourth token all -1; and
each token naming its first expert twice."""


@attrs.frozen
class RankInputs:
    """One global rank's dispatch inputs: x [T, H], weights [T, K] f32, indices [T, K] i32, scales
    [T, S] u8 or None."""

    x: torch.Tensor
    weights: torch.Tensor
    indices: torch.Tensor
    scales: torch.Tensor | None


def make_inputs(cfg: EpConfig, tokens: list[int], kind: str, seed: int) -> list[RankInputs]:
    """Inputs of every global rank (CPU tensors), the same in every process for the same seed.

    Args:
        cfg: the layer (payload bf16 or fp8).
        tokens: T per global rank (world_size entries, each <= max_tokens_per_rank).
        kind: one of ``ROUTINGS``.
        seed: generator seed.

    Raises:
        ValueError: tokens of the wrong length or size, an unknown kind, or "skewed" with fewer
            experts on a node than top-k.
    """
    if len(tokens) != cfg.world_size or any(not 0 <= t <= cfg.max_tokens_per_rank for t in tokens):
        raise ValueError(f"tokens={tokens}: must be {cfg.world_size} counts in [0, {cfg.max_tokens_per_rank}]")
    if kind not in ROUTINGS:
        raise ValueError(f"kind={kind!r}: must be one of {', '.join(ROUTINGS)}")
    E, K = cfg.num_experts, cfg.topk
    pool = cfg.ranks_per_node * cfg.experts_per_rank if kind == "skewed" else E
    if pool < K:
        raise ValueError(f"kind='skewed': node 0 holds {pool} experts, fewer than topk={K}")
    g = torch.Generator().manual_seed(seed)
    info = dtype_info(cfg.dtype)
    out = []
    for T in tokens:
        x = torch.randn((T, cfg.hidden), generator=g).to(info.torch_dtype)
        w = torch.rand((T, K), generator=g)
        ids = torch.stack([torch.randperm(pool, generator=g)[:K] for _ in range(T)]) if T else \
            torch.zeros((0, K), dtype=torch.int64)
        ids = ids.to(torch.int32)
        if kind == "invalid" and T:
            ids[torch.rand((T, K), generator=g) < 1 / 3] = -1
            ids[::4] = -1
        if kind == "duplicates" and K > 1:
            ids[:, 1] = ids[:, 0]
        scales = torch.randint(0, 256, (T, cfg.scale_bytes), generator=g, dtype=torch.uint8) if cfg.scale_bytes \
            else None
        out.append(RankInputs(x=x, weights=w, indices=ids, scales=scales))
    return out


def expert_stage(recv_x: torch.Tensor, recv_src: torch.Tensor, rank: int) -> torch.Tensor:
    """The test's expert output of received rows on global ``rank``: bf16(x (1 + rank / 8) +
    source token / 64), a function of the row alone, so the op's rows and the reference's give
    the same y whatever their order. [R, H] bf16."""
    return (recv_x.to(torch.float32) * (1 + rank / 8) + recv_src[:, 1:2].to(torch.float32) / 64).to(torch.bfloat16)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def check_round(op, inputs: list[RankInputs]) -> dict:
    """Dispatch and combine this process's ranks of ``inputs`` through the hierarchical ``op``
    (``epgen.layers.hierarchical.HierarchicalEp``) and compare them with the reference bit for bit:
    every received row (payload, weights, global ids, scales; keyed by global (source rank,
    source token)) against ``reference.dispatch`` of W ranks, and combine's output against
    ``reference.combine_hierarchical`` (an fp8 wire in the node-local op's arch's flavour,
    ``verify.wire_fp8_flavour``).

    Returns:
        {"recv": rows received per local rank}.

    Raises:
        AssertionError: a row or an output differs (naming the global rank and what differs).
    """
    cfg = op.config
    mine = [inputs[r] for r in op.ranks]
    dev = op.device

    def arg(field):
        vals = [getattr(i, field).to(dev) if getattr(i, field) is not None else None for i in mine]
        return vals if op.node_op.virtual else vals[0]

    got = op.dispatch(arg("x"), arg("weights"), arg("indices"), arg("scales"))
    got = got if op.node_op.virtual else [got]
    ref = reference.dispatch([i.x for i in inputs], [i.weights for i in inputs], [i.indices for i in inputs],
                             experts_per_rank=cfg.experts_per_rank,
                             scales=[i.scales for i in inputs] if cfg.scale_bytes else None)
    ys, received = [], []
    for o, r in zip(got, op.ranks):
        n = int(o.num_recv.item())
        received.append(n)
        src = o.recv_src[:n].cpu()
        perm = reference.align_rows(ref[r].src, src)
        for name, want in (("recv_x", ref[r].x), ("recv_weights", ref[r].weights), ("recv_indices", ref[r].indices),
                           ("recv_scales", ref[r].scales)):
            if want is None:
                assert getattr(o, name) is None, f"rank {r}: {name} must be None without scale bytes"
                continue
            have = getattr(o, name)[:n].cpu()[perm]
            assert torch.equal(_bits(have), _bits(want)), f"rank {r}: {name} differs from the reference's rows"
        ys.append(expert_stage(o.recv_x[:n], o.recv_src[:n], r))
    out = op.combine(ys if op.node_op.virtual else ys[0])
    out = out if op.node_op.virtual else [out]
    ref_y = [expert_stage(ref[d].x, ref[d].src, d) for d in range(cfg.world_size)]
    want = reference.combine_hierarchical(ref_y, ref, [i.x.shape[0] for i in inputs],
                                          gpus_per_node=cfg.ranks_per_node, combine_quant=cfg.combine_quant,
                                          fp8_flavour=wire_fp8_flavour(op.node_op))
    for o, r in zip(out, op.ranks):
        o = o.cpu()
        assert o.shape == want[r].shape and o.dtype == torch.bfloat16, f"rank {r}: combine output {o.shape} {o.dtype}"
        if not torch.equal(_bits(o), _bits(want[r])):
            bad = (o.view(torch.int16) != want[r].view(torch.int16)).any(dim=1).nonzero().flatten()
            raise AssertionError(f"rank {r}: combine differs from combine_hierarchical at {bad.numel()} tokens, first "
                                 f"{bad[:5].tolist()}")
    return {"recv": received}


CASES = (
    ([5, 7, 3, 6], "uniform"),
    ([5, 7, 3, 6], "skewed"),
    ([8, 0, 4, 2], "invalid"),
    ([4, 4, 4, 4], "duplicates"),
    ([0, 3, 0, 5], "uniform"),
    ([6, 3, 0, 0], "uniform"),
    ([0, 0, 5, 9], "skewed"),
    ([0, 0, 0, 0], "uniform"),
    ([16, 16, 16, 16], "uniform"),
)
"""(tokens per global rank, routing) of the tests' rounds on 2 nodes x 2 ranks: uniform, skewed
to node 0, -1 rows, duplicate ids, zero-token ranks, a zero-token node (node 1 in the sixth, node
0 in the seventh, whose tokens all go to node 0), no tokens at all, and every rank full."""


VARIANTS = {
    "bf16": {},
    "fp8-scales-blockwise-wire": {"dtype": "fp8", "scale_bytes": 3, "combine_quant": "fp8_blockwise"},
    "capped-recv-direct-cast": {"max_recv_tokens": 60, "combine_quant": "fp8_direct_cast"},
    "normal-family": {"kernel_family": "normal"},
}
"""The tests' layers, by name: ``small_config`` overrides (bf16; fp8 with 3 scale bytes, padded to
4 in the node-local scale bytes, and the fp8 blockwise wire; receive rows capped at 60 of 64 with
the fp8 direct-cast wire; the normal kernel family alone, where "auto" takes the low-latency family
for the small node-local calls of these cases on a GPU)."""


def small_config(**kw) -> EpConfig:
    """The tests' layer: 2 nodes x 2 ranks, H 2048, top-4 of 8 experts (2 a rank, so "skewed"
    fits node 0), at most 16 tokens a rank; ``kw`` overrides fields."""
    fields = dict(world_size=4, nodes=2, hidden=2048, topk=4, num_experts=8, max_tokens_per_rank=16, timeout_s=10.0)
    fields.update(kw)
    return EpConfig(**fields)


def run_cases(op, seed: int = 0) -> list[dict]:
    """``check_round`` of every case of ``CASES`` (seed, seed + 1, ...)."""
    return [check_round(op, make_inputs(op.config, tokens, kind, seed + i)) for i, (tokens, kind) in enumerate(CASES)]
