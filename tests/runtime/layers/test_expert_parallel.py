"""epgen.layers.expert_parallel with no framework: a plain torch SwiGLU MoE (``ExpertWeights``)
through ``ExpertParallel.run`` on ``ReferenceOp`` and on the host emulation, virtual ranks and
gloo processes, against a float64 dense computation; the layouts, backends and refusals."""

import datetime
import os

import pytest
import torch

from epgen.codegen.config import EpConfig
from epgen.layers.expert_parallel import (ExpertParallel, ExpertShard, ReferenceOp, build_op, expert_rows,
                                          resolve_backend, token_layout, token_slices)
from epgen.layers.moe import ExpertWeights

H, I, E, K = 64, 32, 8, 2


def _moe(seed: int, tokens: int):
    g = torch.Generator().manual_seed(seed)
    weights = ExpertWeights.random(E, H, I, generator=g)
    x = torch.randn(tokens, H, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(tokens)]).to(torch.int32)
    w = torch.rand(tokens, K, generator=g).float()
    return weights, x, ids, w


def _dense(weights: ExpertWeights, x, ids, w) -> torch.Tensor:
    """out[t] = sum_k w[t, k] (silu(x gate_e) * (x up_e)) down_e, e = ids[t, k], in float64."""
    gate, up, down = (t.double() for t in (weights.gate, weights.up, weights.down))
    xd, out = x.double(), torch.zeros(x.shape[0], H, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(K):
            e = int(ids[t, k])
            out[t] += w[t, k].double() * (torch.nn.functional.silu(xd[t] @ gate[e]) * (xd[t] @ up[e])) @ down[e]
    return out


def _stage(weights: ExpertWeights, ranks: list[int], L: int):
    """The experts stage of the ranks ``ranks``: SwiGLU on each rank's shard, gate stored apart."""
    shards = [ExpertShard(up=weights.up[r * L:(r + 1) * L], up_bias=None, down=weights.down[r * L:(r + 1) * L],
                          down_bias=None, gate=weights.gate[r * L:(r + 1) * L]) for r in ranks]

    def activate(h, gate):
        return torch.nn.functional.silu(gate.float()).to(h.dtype) * h

    def stage(dispatched):
        return [expert_rows(s, d.x, d.offsets, activate=activate, grouped=True) for s, d in zip(shards, dispatched)]

    return stage


def _error(out, ref) -> float:
    return float((out.double() - ref).norm() / ref.norm())


@pytest.mark.parametrize("backend", ["reference", "epgen"])
@pytest.mark.parametrize("world", [1, 2, 4])
def test_a_plain_torch_moe_through_run_equals_the_dense_layer(backend, world):
    """Virtual ranks: the T tokens split by ``token_slices``, each slice dispatched, the SwiGLU
    stage on each rank's experts, the weighted combine, concatenated; within bf16 rounding of the
    float64 dense layer (measured 0.0041 to 0.0049 relative L2, both backends alike: the bf16
    roundings of the rows, h and y; bound 2^-7); every rank running rank 0's experts exceeds it."""
    weights, x, ids, w = _moe(world, 40)
    cfg = EpConfig(hidden=H, topk=K, num_experts=E, world_size=world, max_tokens_per_rank=64, layout="expert")
    op = build_op(cfg, backend, torch.device("cpu"), None, virtual=True, arch="sm_90" if backend == "epgen" else None)
    ep = ExpertParallel(cfg, op, backend=backend, layout="own_tokens", virtual=True)
    try:
        out = ep.run(x, ids, w, _stage(weights, list(range(world)), cfg.experts_per_rank))
        wrong = ep.run(x, ids, w, _stage(weights, [0] * world, cfg.experts_per_rank)) if world > 1 else None
    finally:
        ep.close()
    assert out.shape == (40, H) and out.dtype == torch.bfloat16
    ref = _dense(weights, x, ids, w)
    assert _error(out, ref) < 2**-7
    assert wrong is None or _error(wrong, ref) > 0.1


def _processes_body(rank, world, store, result_dir):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        cfg = EpConfig(hidden=H, topk=K, num_experts=E, world_size=world, max_tokens_per_rank=64, layout="expert")
        lines = []
        for layout in ("same_tokens", "own_tokens"):
            same = layout == "same_tokens"
            weights = _moe(0, 1)[0]  # the model's weights: the same on every rank
            _, x, ids, w = _moe(0 if same else 10 + rank, 20 if same else 20 + 3 * rank)
            ep = ExpertParallel(cfg, ReferenceOp(cfg), backend="reference", layout=layout, virtual=False,
                                group=dist.group.WORLD)
            out = ep.run(x, ids, w, _stage(weights, [rank], cfg.experts_per_rank))
            ep.close()
            error = _error(out, _dense(weights, x, ids, w))
            lines.append(f"{layout} rank {rank}: {x.shape[0]} tokens, relative error {error:.2e}")
            assert out.shape == x.shape and error < 2**-7, lines[-1]
        with open(os.path.join(result_dir, f"rank{rank}"), "w") as f:
            f.write("\n".join(lines))
    finally:
        dist.destroy_process_group()


def test_both_token_layouts_as_processes(tmp_path):
    """Two gloo processes, ``ReferenceOp``: same_tokens (both ranks the same 20 tokens; each
    dispatches its slice, the outputs gathered) and own_tokens (rank r its own 20 + 3r tokens)."""
    world = 2
    torch.multiprocessing.spawn(_processes_body, args=(world, str(tmp_path / "store"), str(tmp_path)), nprocs=world,
                                join=True)
    for rank in range(world):
        print((tmp_path / f"rank{rank}").read_text())


def test_layouts_backends_and_slices():
    assert token_slices(10, 4) == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert token_slices(1, 4) == [(0, 1), (1, 1), (1, 1), (1, 1)]
    assert token_slices(0, 2) == [(0, 0), (0, 0)]
    for tokens, world, rule in ((5, 0, r"world=0: must be an int >= 1"), (-5, 2, r"tokens=-5: must be an int >= 0"),
                                (5.0, 2, r"tokens=5.0: must be an int >= 0")):
        with pytest.raises(ValueError, match=rule):
            token_slices(tokens, world)
    assert token_layout("same_tokens") == "same_tokens"
    with pytest.warns(DeprecationWarning, match=r"layout='owned' is deprecated: use layout='own_tokens'"):
        assert token_layout("owned") == "own_tokens"
    with pytest.raises(ValueError, match=r"layout='mine': must be one of own_tokens, same_tokens"):
        token_layout("mine")
    assert resolve_backend(None, torch.device("cpu")) == "reference"
    assert resolve_backend(None, torch.device("cuda", 0)) == resolve_backend(None, "cuda") == "epgen"
    with pytest.raises(ValueError, match=r"backend='nccl': must be None or one of epgen, reference"):
        resolve_backend("nccl", None)
    cfg = EpConfig(hidden=H, topk=K, num_experts=E, world_size=2, max_tokens_per_rank=8, layout="expert")
    with pytest.raises(ValueError, match=r"backend='nccl': must be one of epgen, reference"):
        build_op(cfg, "nccl", "cpu", None, virtual=True)
    with pytest.raises(ValueError, match=r"arch='sm_90', schedule=None: only the host emulation takes them"):
        build_op(cfg, "reference", "cpu", None, virtual=True, arch="sm_90")
    op = build_op(cfg, "reference", "cpu", None, virtual=True)
    for kw, rule in ((dict(backend="epgen"), r"backend='epgen': the op is a ReferenceOp"),
                     (dict(backend="bogus"), r"backend='bogus': must be one of epgen, reference"),
                     (dict(virtual=False), r"virtual=False: the op drives every rank in this process"),
                     (dict(config=EpConfig(hidden=H, topk=K, num_experts=E, world_size=4, max_tokens_per_rank=8,
                                           layout="expert")), r"config: must be the op's own EpConfig"),
                     (dict(config=EpConfig(hidden=H, topk=K, num_experts=E, world_size=2, max_tokens_per_rank=8)),
                      r"EpConfig.layout='rank': ExpertParallel runs the expert layout")):
        args = {"config": cfg, "backend": "reference", "virtual": True, **kw}
        with pytest.raises(ValueError, match=rule):
            ExpertParallel(args.pop("config"), op, layout="own_tokens", **args)


def test_the_reference_checks_inputs_and_stage_outputs_as_the_op_does():
    """What ``ReferenceOp`` runs, the op runs: its inputs are checked by the op's rules
    (``check_dispatch_inputs`` / ``check_combine_inputs``), and the experts stage's outputs must be
    one tensor per dispatched rank, on either backend; bad offsets are refused on the CPU's grouped
    path as on the loop path."""
    weights, x, ids, w = _moe(0, 8)
    cfg = EpConfig(hidden=H, topk=K, num_experts=E, world_size=2, max_tokens_per_rank=8, layout="expert")
    ep = ExpertParallel(cfg, ReferenceOp(cfg, virtual=True), backend="reference", layout="own_tokens", virtual=True)
    stage = _stage(weights, [0, 1], cfg.experts_per_rank)
    for args, error, rule in (
            ((x.float(), ids, w), ValueError, r"x\[rank 0\]\.dtype=torch.float32: must be torch.bfloat16"),
            ((x[:, :32], ids, w), ValueError, r"x\[rank 0\]\.shape=\[4, 32\]: must be \[\*, 64\]"),
            ((x, torch.cat([ids, ids[:, :1]], 1), torch.cat([w, w[:, :1]], 1)), ValueError,
             r"experts: 3 routes a token, more than the config's top-k 2"),
            ((x, ids, w[:, :1]), ValueError, r"top-k ids \(8, 2\) and weights \(8, 1\) must both be \[T, k\]"),
            ((x[:6], ids, w), ValueError, r"must both be \[T, k\] for x \(6, 64\) \[T, H\]"),
            ((x.clone().requires_grad_(), ids, w), RuntimeError, r"^x: requires grad, and EpDispatchCombine records "
                                                                 r"no gradients")):
        with pytest.raises(error, match=rule):
            ep.run(*args, stage)
    narrow = lambda d: [y[:, :32].contiguous() for y in stage(d)]  # noqa: E731
    with pytest.raises(ValueError, match=r"y\[rank 0\]\.shape=\[\d+, 32\]: must be \[\*, 64\]"):
        ep.run(x, ids, w, narrow)
    long = lambda d: [torch.cat([y, y]) for y in stage(d)]  # noqa: E731  (rows past the layout's: taken, as the op)
    assert torch.equal(ep.run(x, ids, w, long), ep.run(x, ids, w, stage))
    short = lambda d: [y[:1] for y in stage(d)]  # noqa: E731
    with pytest.raises(ValueError, match=r"y\[rank 0\]\.shape\[0\]=1: fewer rows than the dispatch's expert layout"):
        ep.run(x, ids, w, short)
    for bad, got in ((lambda d: stage(d)[:1], "a list of 1"), (lambda d: None, "a NoneType"),
                     (lambda d: torch.cat(stage(d)), "a Tensor")):
        with pytest.raises(TypeError, match=rf"layer 2: the experts stage must return a list of 2 tensors .*got {got}"):
            ep.run(x, ids, w, bad, name="layer 2")
    with pytest.raises(ValueError, match=r"phase='bogus': must be one of prefill, decode"):
        ep.run(x, ids, w, stage, phase="bogus")
    shard = ExpertShard(up=weights.up[:4], up_bias=None, down=weights.down[:4], down_bias=None, gate=weights.gate[:4])
    rows = torch.zeros(10, H, dtype=torch.bfloat16)
    for offsets, rule in (([0, 5, 3, 8, 10], r"offsets=\[0, 5, 3, 8, 10\]: must start at 0, never decrease"),
                          ([0, 5, 6, 8, 20], r"end at most at R=10"), ([0, 5, 10], r"must be \[L \+ 1\] = \[5\] torch.int32")):
        with pytest.raises(ValueError, match=rule):
            expert_rows(shard, rows, torch.tensor(offsets, dtype=torch.int32), activate=lambda h, g: h, grouped=True)


@pytest.mark.parametrize("backend", ["reference", "epgen"])
def test_a_call_with_one_route_a_row_equals_the_call_with_k(backend):
    """A framework that gives each route its own row (ergo: [T K, 1] ids, unit weights, the
    weighted sum after) calls with fewer routes than the config's top-k: the routes are padded with
    id -1 and weight 0, and each row comes back as its one expert's output, equal to the dense
    computation of that route."""
    weights, x, ids, w = _moe(5, 12)
    cfg = EpConfig(hidden=H, topk=K, num_experts=E, world_size=2, max_tokens_per_rank=32, layout="expert")
    op = build_op(cfg, backend, torch.device("cpu"), None, virtual=True, arch="sm_90" if backend == "epgen" else None)
    ep = ExpertParallel(cfg, op, backend=backend, layout="own_tokens", virtual=True)
    rows, one_ids = x.repeat_interleave(K, 0), ids.reshape(-1, 1)
    try:
        out = ep.run(rows, one_ids, torch.ones(rows.shape[0], 1), _stage(weights, [0, 1], cfg.experts_per_rank))
    finally:
        ep.close()
    assert _error(out, _dense(weights, rows, torch.cat([one_ids, one_ids], 1), torch.tensor([[1.0, 0.0]]).repeat(
        rows.shape[0], 1))) < 2**-7


def test_closed_calls_and_gradients_without_a_backward_refused():
    weights, x, ids, w = _moe(0, 8)
    cfg = EpConfig(hidden=H, topk=K, num_experts=E, world_size=2, max_tokens_per_rank=4, layout="expert")
    ep = ExpertParallel(cfg, ReferenceOp(cfg, virtual=True), backend="reference", layout="own_tokens", virtual=True)
    stage = _stage(weights, [0, 1], cfg.experts_per_rank)
    with pytest.raises(ValueError, match=r"rank 0 passes 5 tokens to one dispatch, more than max_tokens_per_rank=4"):
        ep.run(torch.cat([x, x[:2]]), torch.cat([ids, ids[:2]]), torch.cat([w, w[:2]]), stage)
    with pytest.raises(RuntimeError, match=r"layer 3: gradients need backend='epgen'"):
        ep.train(x, ids, w, stage, name="layer 3")
    ep.close()
    with pytest.raises(RuntimeError, match=r"layer 3: its epgen expert parallelism was closed"):
        ep.run(x, ids, w, stage, name="layer 3")
