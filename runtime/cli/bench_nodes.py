"""``epgen bench --nodes N``: the hierarchical op's legs, timed one by one, against a flat
``all_to_all_single`` of the same bytes.

N processes play the N nodes on this machine, rendezvous through a file, the network leg on gloo
over CPU tensors (one machine has no network between nodes: its times are those of gloo through
the host, not of a fabric; the output says so). Each process drives its node's G = W / N ranks as
virtual ranks: an ``EpDispatchCombine`` on cuda:0 when there is a GPU (and not ``cpu``), else the
CPU stand-in ``epgen.layers.hierarchical.ReferenceNodeOp``, so CI runs it on tiny shapes.

Per (routing, tokens) point: one round checked bit for bit against the reference
(``epgen.harness.hierarchical_verify.check_round``), then ``iters`` timed rounds of dispatch and combine
with ``HierarchicalEp(time_legs=True)``; each leg's median host wall time (device synchronized at
the leg's ends) and bytes (``HierarchicalEp.legs``), the total, and the median of a flat
``all_to_all_single`` over the same group moving the same bytes as the whole op (network and
node-local legs of dispatch and combine; the most of any node, in equal splits). Node 0's process writes the CSV and
prints the table.
"""

from __future__ import annotations

import csv
import datetime
import os
import shutil
import statistics
import tempfile
import time

import attrs
import torch
import torch.distributed as dist

from epgen.cli.options import model_label

LEGS = ("dispatch network", "dispatch node-local", "combine node-local", "combine network")
CSV_COLUMNS = ("routing", "tokens", "node", "leg", "time_us", "bytes", "gbps", "node_op", "network")
NETWORK_NOTE = ("network leg: gloo over CPU tensors between processes of one machine (no fabric between nodes "
                "here: these are not network times)")


@attrs.frozen
class NodesBenchOptions:
    """What ``epgen bench --nodes`` runs of its layer (an ``EpConfig`` of W = nodes x G ranks,
    with at least the most ``tokens`` a rank): the points, ``iters`` timed rounds a point,
    ``cpu`` (the CPU stand-in even with a GPU), the CSV path (None: none written)."""

    tokens: tuple[int, ...]
    routings: tuple[str, ...]
    iters: int = 5
    cpu: bool = False
    output: str | None = None
    timeout_s: float = 120.0


def _flat_seconds(nbytes: int, group, device, iters: int) -> tuple[float, int]:
    """Median seconds of one ``all_to_all_single`` of the most ``nbytes`` of any process (every
    process moves that many, split evenly over the group), and those bytes."""
    most = torch.tensor([nbytes], dtype=torch.int64, device=device)
    dist.all_reduce(most, op=dist.ReduceOp.MAX, group=group)
    nbytes = int(most.item())
    n = dist.get_world_size(group)
    per = max(1, nbytes // n)
    buf, out = torch.zeros(n * per, dtype=torch.uint8, device=device), torch.empty(n * per, dtype=torch.uint8,
                                                                                     device=device)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        dist.all_to_all_single(out, buf, group=group)
        times.append(time.perf_counter() - start)
    return statistics.median(times), nbytes


def _worker(node: int, nodes: int, store: str, cfg, options: NodesBenchOptions, results: str):
    from epgen.layers.hierarchical import HierarchicalEp, ReferenceNodeOp
    from epgen.harness.hierarchical_verify import check_round, make_inputs

    torch.set_num_threads(1)  # N processes share the cores
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=node, world_size=nodes,
                            timeout=datetime.timedelta(seconds=options.timeout_s))
    try:
        gpu = torch.cuda.is_available() and not options.cpu
        if gpu:
            from epgen.op import EpDispatchCombine

            torch.cuda.set_device(0)
            node_op = EpDispatchCombine(cfg.node_config(), virtual=True, device=0)
        else:
            node_op = ReferenceNodeOp(cfg.node_config(), seed=node)
        op = HierarchicalEp(cfg, node_op, time_legs=True)
        rows = []
        seed = 0
        for routing in options.routings:
            for T in options.tokens:
                seed += 1
                check_round(op, make_inputs(cfg, [T] * cfg.world_size, routing, seed))
                inputs = make_inputs(cfg, [T] * cfg.world_size, routing, seed)
                mine = [inputs[r] for r in op.ranks]
                dev = op.device
                args = [[getattr(i, f).to(dev) if getattr(i, f) is not None else None for i in mine]
                        for f in ("x", "weights", "indices", "scales")]
                samples = {leg: [] for leg in LEGS}
                moved = {}
                for _ in range(options.iters):
                    out = op.dispatch(*args)
                    ys = [o.recv_x[:int(o.num_recv.item())].to(torch.bfloat16) if cfg.dtype == "bf16" else
                          torch.zeros((int(o.num_recv.item()), cfg.hidden), dtype=torch.bfloat16, device=dev)
                          for o in out]
                    op.combine(ys)
                    for leg in LEGS:
                        seconds, moved[leg] = op.legs[leg]
                        samples[leg].append(seconds)
                total_bytes = sum(moved.values())
                flat, flat_bytes = _flat_seconds(total_bytes, op.group, op.wire_device, options.iters)
                medians = {leg: statistics.median(v) for leg, v in samples.items()}
                for leg in LEGS:
                    rows.append((routing, T, node, leg, medians[leg] * 1e6, moved[leg]))
                rows.append((routing, T, node, "total", sum(medians.values()) * 1e6, total_bytes))
                rows.append((routing, T, node, "flat all_to_all_single", flat * 1e6, flat_bytes))
                if node == 0:
                    print(f"bench --nodes: {routing} {T} tokens a rank done ({sum(medians.values()) * 1e6:.1f} us)",
                          flush=True)
        gathered = [None] * nodes
        dist.all_gather_object(gathered, rows)
        if node == 0:
            kind = "EpDispatchCombine (virtual ranks on cuda:0)" if gpu else "ReferenceNodeOp (CPU stand-in)"
            with open(results, "w") as f:
                w = csv.writer(f)
                for part in gathered:
                    for routing, T, n, leg, us, nbytes in part:
                        w.writerow((routing, T, n, leg, f"{us:.1f}", nbytes, f"{nbytes / us / 1e3 if us else 0:.3f}",
                                    kind, "gloo"))
        if gpu:
            node_op.close()
    finally:
        dist.destroy_process_group()


def run(cfg, options: NodesBenchOptions, print_fn=print) -> list[dict]:
    """Run the bench (module docstring) of ``cfg``, a layer across ``cfg.nodes`` nodes, and print
    its table; returns the CSV rows as dicts.

    Raises:
        ValueError: ``cfg`` spans one node, or holds fewer tokens a rank than ``options.tokens``.
        torch.multiprocessing.ProcessRaisedException: a process failed (a check against the
            reference included).
        TimeoutError: the processes ran past their bound.
    """
    from epgen.harness.ranks import MAX_TIMEOUT_S, start_and_join

    if cfg.nodes < 2 or cfg.max_tokens_per_rank < max(options.tokens):  # before any process starts
        raise ValueError(f"EpConfig.nodes={cfg.nodes}, max_tokens_per_rank={cfg.max_tokens_per_rank}: the bench "
                         f"needs at least 2 nodes and {max(options.tokens)} tokens a rank (its largest point)")
    folder = tempfile.mkdtemp(prefix="epgen-bench-nodes-")
    try:
        results = os.path.join(folder, "rows.csv")
        bound = min(MAX_TIMEOUT_S, options.timeout_s * (2 + len(options.tokens) * len(options.routings)))
        start_and_join(_worker, (cfg.nodes, os.path.join(folder, "store"), cfg, options, results), cfg.nodes,
                       timeout_s=bound)
        with open(results) as f:
            rows = [dict(zip(CSV_COLUMNS, r)) for r in csv.reader(f)]
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if options.output:
        from epgen.harness.measure import environment

        with open(f"{options.output}.csv", "w", newline="") as f:
            w = csv.DictWriter(f, CSV_COLUMNS)
            w.writeheader()
            w.writerows(rows)
        with open(f"{options.output}.env.txt", "w") as f:
            f.write("".join(f"{k}: {v}\n" for k, v in environment().items()))
    kind = rows[0]["node_op"] if rows else "-"
    print_fn(f"epgen bench --nodes {cfg.nodes}: {model_label(cfg)}, {cfg.nodes} nodes x {cfg.ranks_per_node} ranks, "
             f"{cfg.dtype}, combine wire {cfg.combine_quant}; node-local op {kind}")
    print_fn(NETWORK_NOTE)
    print_fn(f"{'routing':<10} {'tokens':>7} {'node':>4}  {'leg':<24} {'time_us':>11} {'bytes':>12} {'GB/s':>8}")
    for r in rows:
        print_fn(f"{r['routing']:<10} {r['tokens']:>7} {r['node']:>4}  {r['leg']:<24} {r['time_us']:>11} "
                 f"{r['bytes']:>12} {r['gbps']:>8}")
    if options.output:
        print_fn(f"wrote {options.output}.csv and {options.output}.env.txt")
    return rows
