"""``epgen demo --moe``: the whole MoE layer of one model on virtual ranks of one GPU.

Builds ``epgen.layers.moe.MoELayer`` (expert-major dispatch, SwiGLU expert GEMMs, weighted combine) with
random expert weights, routes random tokens with ``route_topk`` on random logits, checks the
layer's output against ``epgen.layers.moe.dense_moe`` (every element within its bound), and times each
stage on the GPU: every stage call (dispatch, expand, experts, fold, combine, the whole forward)
is captured alone in a CUDA graph, and the replays are timed with
``epgen.harness.timing.time_pairs_queued``, queued behind a GPU-side delay, so each sample is the stage's
own device time, not the host's launch rate (one replay is one launch however many kernels the
stage has, which keeps the queue short). Without the grouped expert path (no graph capture) the
eager calls are queued instead, and the table says so.
"""

from __future__ import annotations

import json

import torch
from rich.console import Console

from epgen.codegen.config import EpConfig
from epgen.harness.moe_verify import dense_error, rank_inputs

def memory_bytes(cfg: EpConfig, intermediate: int) -> dict[str, int]:
    """Device memory of the demo by part, bytes: the expert weights (E x 3 x H x I bf16); W x the
    expert-major buffers (R_max rows of x and of y, bf16); W x the rank-major receive rows and
    combine input (W x Tmax rows each, bf16); the GEMM temporaries of one rank (gate and up
    outputs [R_max, I] and the down output [R_max, H], bf16; the ranks' experts run one after the
    other), once eager and once in the timing's graph pool. R_max = N x min(K, L) + L x (A - 1)
    expert-major rows a rank, N = max_recv_tokens or W x Tmax (``KernelSpec.expert_rows``)."""
    W, T, H, K, L = cfg.world_size, cfg.max_tokens_per_rank, cfg.hidden, cfg.topk, cfg.experts_per_rank
    n = cfg.max_recv_tokens or W * T
    r_max = n * min(K, L) + L * (cfg.expert_alignment - 1)
    return {"weights": cfg.num_experts * 3 * H * intermediate * 2, "expert_rows": W * r_max * H * 2 * 2,
            "receive_rows": W * W * T * H * 2 * 2, "gemm_temporaries": 2 * r_max * (2 * intermediate + H) * 2}


def run_moe_demo(cfg: EpConfig, model: str, intermediate: int, iters: int, console: Console, quiet: bool = False,
                 as_json: bool = False) -> int:
    """Run the demo of ``cfg`` (``epgen.harness.moe_verify.moe_config``) with expert intermediate size ``intermediate``
    and ``iters`` timed iterations per stage; returns the exit code: 0 when the layer met the
    dense reference (or there is no GPU to run it on), 1 otherwise. ``quiet`` prints only
    failures; ``as_json`` also prints a JSON summary on stdout."""
    summary = {"model": model, "world_size": cfg.world_size, "tokens": cfg.max_tokens_per_rank,
               "experts": cfg.num_experts, "intermediate": intermediate, "gpu": None, "gpu_skipped": None}
    rc = 0
    if not torch.cuda.is_available():
        summary["gpu_skipped"] = ("no GPU here (torch.cuda.is_available() is False): the MoE layer demo runs on a "
                                  "GPU; nothing was run")
        if not quiet:
            console.print(summary["gpu_skipped"] + ".")
    else:
        # dense_moe's bound models bf16 GEMMs that accumulate in float32; cuBLAS may otherwise round
        # split-K partial sums to bf16 (the dense reference's matmuls run on the GPU here)
        previous = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        try:
            summary["gpu"] = _run_gpu(cfg, model, intermediate, iters, console, quiet)
        finally:
            torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = previous
        rc = 0 if summary["gpu"]["passed"] else 1
    if as_json:
        print(json.dumps(summary))
    return rc


def _per_rank(virtual: bool, values: list):
    """The MoELayer calling convention: a list per rank with virtual ranks, the tensor alone else."""
    return list(values) if virtual else values[0]


def _check(layer, cfg: EpConfig, weights: list, virtual: bool, device: torch.device) -> dict:
    """One forward of every rank on fresh inputs against ``dense_moe`` (``dense_error``; an fp8
    wire in the layer's arch's flavour)."""
    from epgen.quant import arch_fp8_flavour

    gen = torch.Generator(device=device).manual_seed(1)
    xs, ws, ids = zip(*(rank_inputs(cfg, cfg.max_tokens_per_rank, gen) for _ in range(cfg.world_size)))
    outs = layer.forward(_per_rank(virtual, xs), _per_rank(virtual, ws), _per_rank(virtual, ids))
    ratio, err = dense_error(outs if virtual else [outs], xs, ws, ids, weights, cfg.combine_quant,
                             fp8_flavour=arch_fp8_flavour(layer.op.arch))
    return {"bound_ratio": ratio, "max_err": err, "passed": ratio <= 1.0}


def _stage_graphs(calls: dict) -> tuple[dict, list]:
    """Each of ``calls`` (name -> a stage call, in capture order) captured alone in a CUDA graph;
    returns (name -> the graph's replay, what the captured calls returned). The graphs share one
    memory pool: they replay one at a time on one stream, and what a capture returned stays
    allocated while the caller holds the list (no later capture reuses it)."""
    torch.cuda.empty_cache()  # the eager calls' cached blocks: the captures allocate their own
    graphs, keep, pool = {}, [], None
    for name, fn in calls.items():
        g = torch.cuda.CUDAGraph()
        # thread_local: CUDA calls of other threads (CuPy's, torch's) do not invalidate the capture
        with torch.cuda.graph(g, pool=pool, capture_error_mode="thread_local"):
            keep.append(fn())
        pool = g.pool()
        graphs[name] = g
    return {name: g.replay for name, g in graphs.items()}, keep


def _run_gpu(cfg: EpConfig, model: str, intermediate: int, iters: int, console: Console, quiet: bool) -> dict:
    from epgen.layers.moe import ExpertWeights, MoELayer
    from epgen.codegen.report import styled_table
    from epgen.harness.timing import time_pairs_queued

    W, L, H, T = cfg.world_size, cfg.experts_per_rank, cfg.hidden, cfg.max_tokens_per_rank
    virtual = W > 1
    device = torch.device("cuda", torch.cuda.current_device())
    mem = memory_bytes(cfg, intermediate)
    if not quiet:
        console.print(f"{model}: E={cfg.num_experts} experts (L={L} per rank), top-{cfg.topk}, H={H}, I={intermediate},"
                      f" {'virtual ' if virtual else ''}W={W}, {T} tokens per rank; device memory about "
                      + ", ".join(f"{k.replace('_', ' ')} {v / 2**30:.1f} GiB" for k, v in mem.items()))
    gen = torch.Generator(device=device).manual_seed(0)
    with console.status(f"random expert weights ({mem['weights'] / 2**30:.1f} GiB)"):
        weights = [ExpertWeights.random(L, H, intermediate, generator=gen, device=device) for _ in range(W)]
    layer = MoELayer(cfg, _per_rank(virtual, weights), virtual=virtual, device=device.index)
    with console.status("checking the layer against dense_moe"):
        check = _check(layer, cfg, weights, virtual, device)
    verdict = "passed" if check["passed"] else "FAILED"
    if not quiet or not check["passed"]:
        console.print(f"{'[green]' if check['passed'] else '[red]'}check against dense_moe {verdict}[/]: worst error "
                      f"{check['bound_ratio']:.3f} of its bound (max error {check['max_err']:.3e})")

    op = layer.op
    gen = torch.Generator(device=device).manual_seed(2)  # fresh inputs for the timing
    xs, ws, ids = (_per_rank(virtual, v) for v in zip(*(rank_inputs(cfg, T, gen) for _ in range(W))))
    d = layer.dispatch(xs, ws, ids)  # every stage once, eagerly, before any capture
    y = layer.experts(d)
    layer.combine(y)
    torch.cuda.synchronize(device)
    per_rank = d if virtual else [d]
    rows = sum(int(r.counts.sum()) for r in per_rank)
    padded = sum(int(r.offsets[-1]) for r in per_rank)
    eager = {"dispatch": lambda: layer.dispatch(xs, ws, ids), "expand": op.expand, "experts": lambda: layer.experts(d),
             "fold": lambda: op.fold(y), "combine": lambda: layer.combine(y),
             "forward": lambda: layer.forward(xs, ws, ids)}
    if layer.grouped_mm:
        calls, captured = _stage_graphs(eager)
        how = "CUDA graph replays (one stage call a graph)"
    else:
        calls, captured = eager, []
        how = "eager calls (the loop expert path reads offsets to the host: no graph)"
    with console.status(f"timing {iters} iterations of every stage ({how}, queued behind a GPU-side delay)"):
        pairs = {("dispatch", "combine"): time_pairs_queued(calls["dispatch"], calls["combine"], iters=iters),
                 ("experts", "forward"): time_pairs_queued(calls["experts"], calls["forward"], iters=iters)}
        calls["dispatch"]()  # expand and fold run alone after a dispatch (op.expand re-expands its receive rows)
        pairs[("expand", "fold")] = time_pairs_queued(calls["expand"], calls["fold"], iters=iters)
    torch.cuda.synchronize(device)
    del calls, captured  # the graphs and their memory
    stages = {}
    covered = True
    for names, pair in pairs.items():
        covered &= pair.delay.covered
        for name, t, host in zip(names, pair.queued, pair.host):
            stages[name] = {"median_us": t.median_us, "mean_us": t.mean_us, "stdev_us": t.stdev_us,
                            "best_us": t.best_us, "host_launched_us": host.median_us}
    method = f"{how}, {'queued' if covered else 'queued-short-sleep (the delay ended early: partly host-bound)'}"
    gemm_tflops = 2 * 3 * padded * H * intermediate / (stages["experts"]["median_us"] * 1e6)
    what = {"dispatch": "op.dispatch: the rank-major send, then the expansion",
            "expand": "op.expand alone: receive rows into per-expert groups",
            "experts": f"layer.experts: SwiGLU GEMMs on {rows} expanded rows ({padded} with the alignment "
                       f"padding), {gemm_tflops:.0f} TFLOP/s",
            "fold": "op.fold alone: weight and fold each token's expert rows",
            "combine": "op.combine: the fold, then the gather of the folded rows",
            "forward": "layer.forward: the whole layer"}
    table = styled_table(f"{model} MoE layer, {torch.cuda.get_device_name(device)}, {'virtual ' if virtual else ''}"
                         f"W={W}: GPU us per stage, all {W} ranks",
                         f"{T} tokens/rank, E={cfg.num_experts}, top-{cfg.topk}, H={H}, I={intermediate}; {method} "
                         f"(epgen.harness.timing.time_pairs_queued), {iters} iterations.\n"
                         + "\n".join(f"{name}: {text}" for name, text in what.items()))
    for c in ("stage", "median us", "mean ± stdev us", "best us", "host-launched us", "% of forward"):
        table.add_column(c, justify="left" if c == "stage" else "right")
    for name in ("dispatch", "expand", "experts", "fold", "combine", "forward"):
        s = stages[name]
        table.add_row(name, f"{s['median_us']:.1f}", f"{s['mean_us']:.1f} ± {s['stdev_us']:.1f}",
                      f"{s['best_us']:.1f}", f"{s['host_launched_us']:.1f}",
                      f"{100 * s['median_us'] / stages['forward']['median_us']:.1f}")
    med = {name: s["median_us"] for name, s in stages.items()}
    send, gather = med["dispatch"] - med["expand"], med["combine"] - med["fold"]
    if not quiet:
        console.print(table)
        console.print(f"derived from the medians: rank-major send = dispatch - expand = {send:.1f} us; gather = "
                      f"combine - fold = {gather:.1f} us; dispatch + experts + combine = "
                      f"{med['dispatch'] + med['experts'] + med['combine']:.1f} us against forward "
                      f"{med['forward']:.1f} us.")
        if virtual:
            console.print("virtual ranks share one GPU: every stage runs all ranks; the dispatch and combine move "
                          "rows through local memory, not a link.")
    layer.close()
    return {**check, "timing": method, "iters": iters, "expanded_rows": rows, "padded_rows": padded,
            "gemm_tflops": gemm_tflops,
            "stages": stages, "send_us": send, "gather_us": gather, "memory_bytes": mem}
