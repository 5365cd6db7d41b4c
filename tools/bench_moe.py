"""The epgen MoE layer against the torch-native one, one process per GPU, on the same weights and inputs.

Layers (both on the same ExpertWeights and the same routed tokens, both checked against
``epgen.layers.moe.dense_moe`` within its bound before they are timed):
  epgen       epgen.layers.moe.MoELayer: the generated dispatch (expert-major layout), SwiGLU GEMMs,
              the weighted combine; no host synchronization
  all_to_all  epgen.layers.moe_a2a.AllToAllMoE: all_to_all_single count exchange and row exchange around
              a local permute, the same swiglu_experts; host syncs for the split sizes

Timing (the same for both): per iteration, a barrier, then CUDA events around one forward on
fresh random inputs (generated beforehand, one set per iteration), after warm-up forwards; each
rank times its own stream, and the layer's time of an iteration is its slowest rank's. Reported:
median, mean, stdev and best over the iterations. The events are launched from the host (the
all_to_all layer waits for the device inside each forward, so it cannot be queued); the epgen
layer is also timed queued behind a GPU-side delay (``epgen.harness.timing.time_pairs_queued``,
``queued_us``), its device time without the host's launch rate.

At W = 1 the group is a one-rank NCCL group: no row crosses a link, so the run checks both layers
and times their local work; it measures no expert parallelism.

Writes <prefix>.csv and <prefix>.env.txt (GPU, driver, torch, CuPy, commit: epgen.harness.measure.environment),
default prefix tools/results/bench_moe-ep<W>-<gpu>, and prints a table (rank 0).

Usage: python tools/bench_moe.py [--world-size W] [--tokens 128 1024 4096] [--experts E]
       [--intermediate I] [--iters 20] [--warmup 3] [-o PREFIX]
"""
from __future__ import annotations

import argparse
import csv
import statistics
import sys
from pathlib import Path

import attrs

CSV_COLUMNS = ("layer", "tokens", "rank", "world_size", "experts", "topk", "hidden", "intermediate", "median_us",
               "mean_us", "stdev_us", "best_us", "iters", "timing", "queued_us", "bound_ratio", "max_err", "passed")


@attrs.frozen
class Options:
    model: str
    world_size: int
    tokens: tuple[int, ...]
    experts: int | None
    intermediate: int
    iters: int
    warmup: int
    output: str
    seed: int = 0


def _stats(samples: list[float]) -> dict:
    return {"median_us": round(statistics.median(samples), 2), "mean_us": round(statistics.fmean(samples), 2),
            "stdev_us": round(statistics.stdev(samples), 2) if len(samples) > 1 else 0.0,
            "best_us": round(min(samples), 2)}


def _time_forwards(layer, inputs: list, warmup: int) -> list[float]:
    """Device microseconds of ``layer.forward`` on each of ``inputs`` after the first ``warmup``
    of them: a barrier, then events around the forward, launched from the host."""
    import torch
    import torch.distributed as dist

    samples = []
    for i, (x, w, ids) in enumerate(inputs):
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        layer.forward(x, w, ids)
        end.record()
        end.synchronize()
        if i >= warmup:
            samples.append(start.elapsed_time(end) * 1e3)
    return samples


def _queued(layer, inputs: list, iters: int) -> tuple[float, bool]:
    """Median device microseconds of ``layer.forward`` queued behind a GPU-side delay, cycling
    through ``inputs``, and whether the delay covered the enqueue."""
    import itertools

    import torch.distributed as dist
    from epgen.harness.timing import time_pairs_queued

    cycle = itertools.cycle(inputs)
    dist.barrier()
    pair = time_pairs_queued(lambda: layer.forward(*next(cycle)), lambda: None, iters=iters)
    return pair.queued[0].median_us, pair.delay.covered


def bench_rank(rank: int, world_size: int, opts: Options) -> None:
    """The body of one rank (epgen.harness.ranks.run_ranks has set its device and process group)."""
    import torch
    import torch.distributed as dist

    from epgen.layers.moe import ExpertWeights, MoELayer
    from epgen.layers.moe_a2a import AllToAllMoE
    from epgen.harness.moe_verify import dense_error, moe_config, rank_inputs

    # dense_moe's bound models bf16 GEMMs that accumulate in float32 (no bf16 split-K partial sums)
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    device = torch.device("cuda", rank)
    cfg = moe_config(opts.model, world_size, max(opts.tokens), opts.experts)
    L, H, I, E = cfg.experts_per_rank, cfg.hidden, opts.intermediate, cfg.num_experts
    gen = torch.Generator(device=device).manual_seed(opts.seed * 1000 + rank)
    own = ExpertWeights.random(L, H, I, generator=gen, device=device)
    parts = {}
    for name in ("gate", "up", "down"):  # every rank's experts, for the dense reference of this rank's tokens
        t = getattr(own, name)
        parts[name] = [torch.empty_like(t) for _ in range(world_size)]
        dist.all_gather(parts[name], t)
    every = [ExpertWeights(gate=g, up=u, down=d) for g, u, d in zip(parts["gate"], parts["up"], parts["down"])]
    epgen_layer = MoELayer(cfg, own, virtual=False, device=rank)
    # every rank passes the same T at each point: the family its T picks is every rank's
    stated = type("StatedFamily", (), {"forward": staticmethod(
        lambda x, w, ids: epgen_layer.forward(x, w, ids, epgen_layer.op.family(x.shape[0])))})
    layers = {"epgen": stated,
              "all_to_all": AllToAllMoE(own, num_experts=E, topk=cfg.topk)}
    env = None
    if rank == 0:
        from epgen.harness.measure import environment

        env = environment()
    rows = []
    for T in opts.tokens:
        x, w, ids = rank_inputs(cfg, T, gen)
        def mine(t):  # per-rank lists holding this rank's tokens alone: the reference of those only
            return [t if r == rank else t[:0] for r in range(world_size)]

        checks = {}
        for name, layer in layers.items():
            out = layer.forward(x, w, ids)
            ratio, err = dense_error(mine(out), mine(x), mine(w), mine(ids), every, cfg.combine_quant)
            checks[name] = {"bound_ratio": round(ratio, 4), "max_err": err, "passed": ratio <= 1.0}
        inputs = [rank_inputs(cfg, T, gen) for _ in range(opts.warmup + opts.iters)]
        point = []
        for name, layer in layers.items():
            samples = _time_forwards(layer, inputs, opts.warmup)
            queued_us, covered = _queued(layer, inputs, opts.iters) if name == "epgen" else (float("nan"), True)
            point.append({"layer": name, "tokens": T, "rank": rank, "world_size": world_size, "experts": E,
                          "topk": cfg.topk, "hidden": H, "intermediate": I, **_stats(samples), "iters": opts.iters,
                          "timing": "host-launched events" + ("" if covered else "; queued-short-sleep"),
                          "queued_us": round(queued_us, 2), **checks[name], "samples": samples})
        gathered = [None] * world_size
        dist.all_gather_object(gathered, point)
        if rank == 0:
            for name_index, name in enumerate(layers):
                per = [g[name_index] for g in gathered]
                slowest = [max(s) for s in zip(*(p["samples"] for p in per))]
                rows.extend({k: v for k, v in p.items() if k != "samples"} for p in per)
                rows.append({**{k: v for k, v in per[0].items() if k != "samples"}, "rank": "slowest",
                             **_stats(slowest), "queued_us": max(p["queued_us"] for p in per),
                             "bound_ratio": max(p["bound_ratio"] for p in per),
                             "max_err": max(p["max_err"] for p in per), "passed": all(p["passed"] for p in per)})
            summary = {r["layer"]: r for r in rows if r["tokens"] == T and r["rank"] == "slowest"}
            print(f"bench_moe {T} tokens/rank: " + "; ".join(
                f"{n} {r['median_us']} us (check {'passed' if r['passed'] else 'FAILED'}, {r['bound_ratio']} of "
                f"the bound)" for n, r in summary.items()), flush=True)
            write_results(rows, opts.output, env, quiet=True)
    epgen_layer.close()
    if rank == 0:
        write_results(rows, opts.output, env)
        if world_size == 1:
            print("W = 1: a one-rank NCCL group; no row crossed a link: this run checks both layers and times their "
                  "local work, it measures no expert parallelism.")
        if not all(r["passed"] for r in rows):
            raise AssertionError("a layer missed dense_moe's bound: see the passed and bound_ratio columns")


def write_results(rows: list[dict], prefix: str, env: dict, quiet: bool = False) -> None:
    """``<prefix>.csv`` (CSV_COLUMNS) and ``<prefix>.env.txt``; a table of the slowest-rank rows
    unless ``quiet``."""
    from rich.console import Console
    from rich.table import Table

    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    with open(f"{prefix}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        w.writeheader()
        w.writerows(rows)
    Path(f"{prefix}.env.txt").write_text("".join(f"{k}: {v}\n" for k, v in env.items()))
    if quiet:
        return
    first = rows[0]
    t = Table(title=f"bench_moe: W={first['world_size']}, E={first['experts']}, top-{first['topk']}, "
                    f"H={first['hidden']}, I={first['intermediate']}; slowest rank per iteration, median of "
                    f"{first['iters']} host-launched forwards on fresh inputs; {env['gpu']}, commit {env['commit']}")
    for c in ("layer", "tokens/rank", "median us", "mean ± stdev us", "best us", "queued us", "x epgen",
              "check (error / bound)"):
        t.add_column(c, justify="right")
    slow = [r for r in rows if r["rank"] == "slowest"]
    base = {r["tokens"]: r["median_us"] for r in slow if r["layer"] == "epgen"}
    for r in slow:
        t.add_row(r["layer"], str(r["tokens"]), f"{r['median_us']:.1f}", f"{r['mean_us']:.1f} ± {r['stdev_us']:.1f}",
                  f"{r['best_us']:.1f}", f"{r['queued_us']:.1f}", f"{r['median_us'] / base[r['tokens']]:.2f}",
                  f"{'passed' if r['passed'] else 'FAILED'} {r['bound_ratio']:.3f}")
    Console(width=200).print(t)
    print(f"wrote {prefix}.csv and {prefix}.env.txt")


W_INDEPENDENT_FIELDS = ("num_experts", "topk", "max_tokens_per_rank", "hidden")
"""EpConfig / KernelSpec fields whose rules do not depend on W (num_experts at W = 1: its
positive-int rule only): a config error of one of them at W = 1 is an error at every W. The local
expert count L = E / W and the tuned geometries do depend on W."""


def _config_error(a, world_size: int) -> ValueError | None:
    """The error of ``moe_config`` with these flags at ``world_size`` ranks (None: it builds)."""
    from epgen.harness.moe_verify import moe_config

    try:
        moe_config(a.model, world_size, max(a.tokens), a.experts)
    except ValueError as e:
        return e
    return None


def _blamed_flag(error: ValueError, a, world: str) -> str:
    """The flag (and its value) a config error comes from, by its field (``FieldError.field``);
    ``world`` says where W came from."""
    field = getattr(error, "field", None)
    if field == "max_tokens_per_rank":
        return f"--tokens {max(a.tokens)}"
    if field in ("num_experts", "topk", "experts_per_rank") and a.experts is not None:
        return f"--experts {a.experts} with --model {a.model}"
    if field in ("hidden", "topk"):
        return f"--model {a.model}"
    return f"{world} with --model {a.model}"


def check_flags(a, p: argparse.ArgumentParser) -> None:
    """The flags' rules that need no GPU, as parser errors naming the flag: --iters, --warmup,
    --tokens, --intermediate, --world-size and --model alone, then the layer's EpConfig at
    --world-size W (without --world-size, the rules that hold at every W: W_INDEPENDENT_FIELDS)."""
    from epgen.codegen.models import model

    if a.iters < 5:
        p.error(f"--iters {a.iters}: must be at least 5")
    if a.warmup < 0:
        p.error(f"--warmup {a.warmup}: must be at least 0")
    if min(a.tokens) < 1:
        p.error(f"--tokens {min(a.tokens)}: every value must be at least 1")
    if a.intermediate < 1:
        p.error(f"--intermediate {a.intermediate}: must be at least 1")
    if a.world_size is not None and a.world_size < 1:
        p.error(f"--world-size {a.world_size}: must be at least 1")
    try:
        model(a.model)
    except ValueError as e:
        p.error(f"--model {a.model}: {e}")
    error = _config_error(a, a.world_size or 1)
    if error is not None and (a.world_size is not None or getattr(error, "field", None) in W_INDEPENDENT_FIELDS):
        p.error(f"{error} ({_blamed_flag(error, a, f'--world-size {a.world_size}')})")


def parse_args(argv=None) -> Options:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="deepseek-v3", help="catalogue model (default deepseek-v3)")
    p.add_argument("--world-size", type=int, default=None, help="ranks, one process per GPU (default: every GPU)")
    p.add_argument("--tokens", type=int, nargs="+", default=[128, 1024, 4096], help="tokens per rank to sweep "
                   "(default 128 1024 4096)")
    p.add_argument("--experts", type=int, default=None, help="routed experts E (default the model's)")
    p.add_argument("--intermediate", type=int, default=2048, help="expert intermediate size I (default 2048)")
    p.add_argument("--iters", type=int, default=20, help="timed forwards per layer and point (default 20, at least 5)")
    p.add_argument("--warmup", type=int, default=3, help="untimed forwards first (default 3)")
    p.add_argument("-o", "--output", default=None, help="path prefix of the .csv/.env.txt (default "
                   "tools/results/bench_moe-ep<W>-<gpu>)")
    a = p.parse_args(argv)
    check_flags(a, p)
    import torch

    if not torch.cuda.is_available():
        p.error("needs a GPU (torch.cuda.is_available() is False)")
    W = a.world_size or torch.cuda.device_count()
    if W > torch.cuda.device_count():
        p.error(f"--world-size {W}: must be in [1, {torch.cuda.device_count()}] (one process per GPU; this machine "
                f"has {torch.cuda.device_count()})")
    if a.world_size is None:  # W is the GPU count: the rules that depend on it are checked now
        error = _config_error(a, W)
        if error is not None:
            p.error(f"{error} ({_blamed_flag(error, a, f'W = {W}, every GPU (no --world-size)')})")
    gpu = torch.cuda.get_device_name(0).split()[-1].lower()
    output = a.output or str(Path(__file__).resolve().parent / "results" / f"bench_moe-ep{W}-{gpu}")
    return Options(model=a.model, world_size=W, tokens=tuple(a.tokens), experts=a.experts,
                   intermediate=a.intermediate, iters=a.iters, warmup=a.warmup, output=output)


def main(argv=None) -> int:
    from epgen.harness.ranks import run_ranks

    opts = parse_args(argv)
    run_ranks(opts.world_size, bench_rank, opts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
