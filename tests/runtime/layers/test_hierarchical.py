"""The hierarchical op on the CPU: two processes play two nodes (gloo network leg over CPU tensors,
rendezvous through a file in tmp_path), each driving its node's two ranks through
``ReferenceNodeOp``, and four processes play the one-process-per-GPU layout (``process_groups``);
every round is checked bit for bit against ``epgen.reference`` (``epgen.harness.hierarchical_verify``: the
GPU test runs the same cases)."""

import datetime
import os
import time

import pytest
import torch
import torch.distributed as dist

from epgen import reference
from epgen.codegen.config import EpConfig
from epgen.layers.hierarchical import HierarchicalEp, HierarchicalError, ReferenceNodeOp, process_groups
from epgen.harness.hierarchical_verify import CASES, VARIANTS, check_round, make_inputs, run_cases, small_config
from epgen.op import EpError
from epgen.harness.ranks import start_and_join

PROCS_TIMEOUT_S = 120


def _init(rank, world_size, store, timeout_s=60):
    # One intra-op thread a process: two processes on two cores, and torch's CPU index_add_ with a
    # second thread took 65 ms instead of 20 us a call here (threads contending for the cores).
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))


def _cases_worker(rank, world_size, store, fields):
    _init(rank, world_size, store)
    try:
        cfg = small_config(**fields)
        op = HierarchicalEp(cfg, ReferenceNodeOp(cfg.node_config(), seed=rank))
        stats = run_cases(op)
        assert [s["recv"] for s in stats][-2] == [0, 0]  # no tokens at all: nothing received
        if rank == 1:
            skewed = stats[1]["recv"]  # every expert on node 0: node 1 receives nothing
            assert skewed == [0, 0], skewed
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_two_nodes_match_the_reference(tmp_path, variant):
    start_and_join(_cases_worker, (2, os.path.join(tmp_path, "store"), VARIANTS[variant]), 2,
                   timeout_s=PROCS_TIMEOUT_S)


def _groups_worker(rank, world_size, store):
    _init(rank, world_size, store)
    try:
        cfg = small_config(kernel_family="normal")  # 2 nodes x 2 ranks, one process a rank
        node_group, network_group = process_groups(cfg)
        assert dist.get_world_size(node_group) == 2 and dist.get_world_size(network_group) == 2
        node = ReferenceNodeOp(cfg.node_config(), group=node_group)
        assert node.local_ranks == [rank % 2] and not node.virtual
        auto = small_config()
        with pytest.raises(ValueError, match=r"kernel_family='auto': with one process per GPU"):
            HierarchicalEp(auto, ReferenceNodeOp(auto.node_config(), group=node_group), network_group=network_group)
        op = HierarchicalEp(cfg, node, network_group=network_group)
        assert op.ranks == [rank] and op.node == rank // 2
        for i, (tokens, kind) in enumerate(CASES[:6]):
            check_round(op, make_inputs(cfg, tokens, kind, 50 + i))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_one_process_per_rank_groups(tmp_path):
    """The production layout: 4 processes (2 nodes x 2 ranks), node groups and network groups
    from ``process_groups``, tensors instead of lists."""
    start_and_join(_groups_worker, (4, os.path.join(tmp_path, "store")), 4, timeout_s=PROCS_TIMEOUT_S)


def _errors_worker(rank, world_size, store):
    _init(rank, world_size, store, timeout_s=2)
    cfg = small_config()
    node = ReferenceNodeOp(cfg.node_config())
    with pytest.raises(ValueError, match=r"node_op.config=.*must be config.node_config\(\)"):
        HierarchicalEp(cfg, ReferenceNodeOp(small_config(nodes=1).node_config()))
    op = HierarchicalEp(cfg, node)
    inputs = make_inputs(cfg, [3, 2, 4, 1], "uniform", 7)
    mine = [inputs[r] for r in op.ranks]
    xs, ws, ids = [i.x for i in mine], [i.weights for i in mine], [i.indices for i in mine]
    with pytest.raises(RuntimeError, match="combine: needs a dispatch first"):
        op.combine([torch.zeros(0, cfg.hidden, dtype=torch.bfloat16)] * 2)
    with pytest.raises(TypeError, match=r"x: this process drives local ranks \[0, 1\]; give a list of 2"):
        op.dispatch(xs[0], ws[0], ids[0])
    with pytest.raises(ValueError, match=r"x\[rank \d\].shape\[0\]=17: more tokens than max_tokens_per_rank=16"):
        op.dispatch([torch.zeros(17, cfg.hidden, dtype=torch.bfloat16)] * 2, ws, ids)
    # An invalid id on global rank 3 (node 1): both nodes refuse the dispatch, naming it.
    bad = [i.clone() for i in ids]
    if rank == 1:
        bad[1][0, 2] = 8
    with pytest.raises(ValueError, match=r"indices\[rank 3\]\[token 0, slot 2\]=8: expert ids must be -1 or in "
                                         r"\[0, 8\) \(every rank of the network group refuses"):
        op.dispatch(xs, ws, bad)
    out = op.dispatch(xs, ws, ids)  # the op runs on after the refusal
    ys = [o.recv_x[:int(o.num_recv)].clone() for o in out]
    with pytest.raises(ValueError, match=r"out\[rank \d\].shape=\[5, 2048\]: must be \[\d, 2048\]"):
        op.combine(ys, [torch.zeros(5, cfg.hidden, dtype=torch.bfloat16)] * 2)
    op.combine(ys)
    # A node-local fault names the leg and keeps the kernels' recoverable flag.
    op.dispatch(xs, ws, ids)
    with pytest.raises(EpError, match=r"node-local kernel \(combine\) failed.*short input") as e:
        op.combine([y[:0] for y in ys])
    assert e.value.recoverable
    dist.barrier()
    # Node 1 never enters the network leg: node 0's wait ends at the group's timeout (2 s).
    if rank == 0:
        start = time.monotonic()
        with pytest.raises(HierarchicalError, match=r"global ranks 0, 1 \(node 0\): network leg \(dispatch "
                                                    r"counts\) failed"):
            op.dispatch(xs, ws, ids)
        assert time.monotonic() - start < 30
        with pytest.raises(HierarchicalError, match="unusable after a network-leg failure"):
            op.dispatch(xs, ws, ids)
    else:
        time.sleep(4)
    # A gloo group with a timed-out operation can abort the process in its teardown (std::terminate,
    # seen here now and then): leave without it, as a finished rank (a failure above has raised).
    os._exit(0)


@pytest.mark.slow
def test_errors_name_the_rank_and_the_leg(tmp_path):
    start_and_join(_errors_worker, (2, os.path.join(tmp_path, "store")), 2, timeout_s=PROCS_TIMEOUT_S)


# ---- the reference and the config ---------------------------------------------------------------

def test_reference_one_node_is_the_flat_combine():
    g = torch.Generator().manual_seed(1)
    inputs = make_inputs(small_config(), [5, 0, 7, 3], "uniform", 3)
    recv = reference.dispatch([i.x for i in inputs], [i.weights for i in inputs], [i.indices for i in inputs],
                              experts_per_rank=2)
    ys = [torch.randn(r.num_rows, 2048, generator=g).to(torch.bfloat16) for r in recv]
    flat = reference.combine(ys, recv, [5, 0, 7, 3])
    assert all(torch.equal(a, b) for a, b in zip(reference.combine_hierarchical(ys, recv, [5, 0, 7, 3],
                                                                                gpus_per_node=4), flat))


def test_reference_rounds_once_per_node():
    # One token reaching ranks 0, 1 (node 0) and 2 (node 1); bf16 ulp at 1 is 2^-7.
    x = torch.zeros(1, 16, dtype=torch.bfloat16)
    none = torch.zeros(0, 3, dtype=torch.int32)
    recv = reference.dispatch([x, x[:0], x[:0], x[:0]], [torch.ones(1, 3)] + [torch.ones(0, 3)] * 3,
                              [torch.tensor([[0, 1, 2]], dtype=torch.int32), none, none, none], experts_per_rank=1)
    v = [1.0, 2 ** -8, 2 ** -8]  # node 0: bf16(1 + 2^-8) = 1 (tie to even); then 1 + 2^-8 -> 1
    ys = [torch.full((r.num_rows, 16), v[d] if d < 3 else 0.0, dtype=torch.bfloat16) for d, r in enumerate(recv)]
    hier = reference.combine_hierarchical(ys, recv, [1, 0, 0, 0], gpus_per_node=2)[0]
    flat = reference.combine(ys, recv, [1, 0, 0, 0])[0]
    assert float(hier[0, 0]) == 1.0 and float(flat[0, 0]) == 1.0 + 2 ** -7  # flat: 1 + 2^-7 exactly
    with pytest.raises(ValueError, match=r"gpus_per_node=3: must divide the 4 ranks of ys"):
        reference.combine_hierarchical(ys, recv, [1, 0, 0, 0], gpus_per_node=3)


def test_cases_cover_the_edges():
    kinds = {k for _, k in CASES}
    assert kinds == {"uniform", "skewed", "invalid", "duplicates"}
    assert any(t[:2] == [0, 0] for t, _ in CASES) and any(t[2:] == [0, 0] for t, _ in CASES)


# ---- epgen bench --nodes on the CPU stand-in ------------------------------------------------------

@pytest.mark.slow
def test_bench_nodes_on_the_cpu_stand_in(tmp_path, capsys):
    import csv

    from epgen.cli import main

    out = tmp_path / "nodes"
    assert main(["bench", "--nodes", "2", "--world-size", "4", "--model", "mixtral-8x7b", "--tokens", "3", "--iters",
                 "2", "--routing", "uniform", "--cpu", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "gloo over CPU tensors" in text and "ReferenceNodeOp (CPU stand-in)" in text
    assert "gpus: " in (tmp_path / "nodes.env.txt").read_text()
    rows = list(csv.DictReader((tmp_path / "nodes.csv").open()))
    legs = {(r["node"], r["leg"]) for r in rows}
    for node in ("0", "1"):
        for leg in ("dispatch network", "dispatch node-local", "combine node-local", "combine network", "total",
                    "flat all_to_all_single"):
            assert (node, leg) in legs
    total = {r["node"]: r for r in rows if r["leg"] == "total"}
    assert all(int(r["bytes"]) > 0 and float(r["time_us"]) > 0 for r in total.values())
    # the node-local combine's bytes are the wire's: fp8 codes and scales, not bf16
    assert main(["bench", "--nodes", "2", "--world-size", "4", "--model", "mixtral-8x7b", "--tokens", "3", "--iters",
                 "1", "--routing", "uniform", "--cpu", "--quant", "fp8_blockwise", "-o", str(out)]) == 0
    rows = list(csv.DictReader((tmp_path / "nodes.csv").open()))
    legs = {(r["node"], r["leg"]): int(r["bytes"]) for r in rows}
    hidden = EpConfig.for_model("mixtral-8x7b", world_size=4, max_tokens_per_rank=3).hidden
    for node in ("0", "1"):
        received = legs[(node, "dispatch node-local")] // (2 * hidden)  # bf16 x rows
        assert received and legs[(node, "combine node-local")] == received * (hidden + 4 * -(-hidden // 128))


def test_bench_nodes_default_points_fit_the_node_op(monkeypatch):
    """Without --tokens: NODES_SWEEP_CPU with the CPU stand-in (the host reference takes minutes at
    4096 tokens), NODES_SWEEP with the GPU's op; a plain bench keeps its own sweep."""
    import epgen.cli.bench_nodes
    from epgen.cli import main
    from epgen.cli.options import NODES_SWEEP, NODES_SWEEP_CPU

    seen = []
    monkeypatch.setattr(epgen.cli.bench_nodes, "run", lambda cfg, options, print_fn: seen.append(options.tokens))
    assert main(["bench", "--nodes", "2", "--world-size", "4", "--cpu"]) == 0
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert main(["bench", "--nodes", "2", "--world-size", "4"]) == 0
    assert main(["bench", "--nodes", "2", "--world-size", "4", "--tokens", "5"]) == 0
    assert seen == [NODES_SWEEP_CPU, NODES_SWEEP, (5,)]


@pytest.mark.parametrize("argv, message", [
    (["--nodes", "1"], "--nodes 1: the hierarchical bench needs at least 2 nodes"),
    (["--nodes", "2", "--virtual"], "--virtual: not with --nodes"),
    (["--nodes", "3", "--world-size", "4"], "EpConfig.nodes=3: must divide world_size=4"),
    (["--cpu"], "--cpu: applies with --nodes only"),
    (["--nodes", "2", "--world-size", "4", "--dtype", "fp4"], "--dtype fp4: not with --nodes"),
    (["--nodes", "2", "--world-size", "4", "--routing", "shared"], "--routing shared: with --nodes one of uniform, "
                                                                  "skewed, invalid, duplicates"),
    (["--nodes", "2", "--world-size", "4", "--transport", "pull"], "--transport: not with --nodes"),
])
def test_bench_nodes_usage_errors(argv, message, capsys):
    from epgen.cli import main

    with pytest.raises(SystemExit) as e:
        main(["bench", "--tokens", "4"] + argv)
    assert e.value.code == 2 and message in capsys.readouterr().err
