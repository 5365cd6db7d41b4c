"""``epgen demo``: render, compile-check and (with a GPU) run and time one model's kernels."""

from __future__ import annotations

import torch
from rich.console import Console
from rich.table import Table

from epgen.codegen.arch import ARCHES
from epgen.codegen.catalogue import report_rows
from epgen.codegen.report import resource_table
from epgen.codegen.offline import toolchain_status
from epgen.codegen import planner
from epgen.codegen.config import EpConfig
from epgen.codegen.models import MODELS


def run_demo(cfg: EpConfig, model: str, iters: int, console: Console, quiet: bool = False,
             as_json: bool = False) -> int:
    """Returns the process exit code: 0 when every check passed. ``cfg``: the layer, of catalogue
    ``model`` (or the --hf-config file it was read from), its max tokens per rank the tokens each virtual rank sends (the GPU run times the
    family ``op.family(tokens)`` takes); ``quiet`` prints only failures; ``as_json`` also prints a
    JSON summary (resources and, with a GPU, per-rank results) on stdout."""
    import json

    world_size, tokens = cfg.world_size, cfg.max_tokens_per_rank
    summary = {"model": model, "world_size": world_size, "tokens": tokens, "dtype": cfg.dtype,
               "kernel_family": cfg.kernel_family, "resources": [], "gpu": None, "gpu_skipped": None}
    missing = {arch: toolchain_status(arch) for arch in ARCHES}
    for arch, reason in missing.items():
        if reason:
            console.print(f"{arch}: offline compile check skipped: {reason}")
    specs = planner.specs(cfg, [arch for arch in ARCHES if not missing[arch]])
    rows = []
    if specs:
        with console.status("compiling for " + ", ".join(a for a in ARCHES if not missing[a])):
            rows = report_rows(specs)
    ok = all(r["status"] == "ok" for r in rows)
    summary["resources"] = rows
    if rows and (not quiet or not ok):
        console.print(resource_table(rows, f"{model}: W={world_size}, Tmax={tokens}, {cfg.dtype}"))
        console.print("entry names, in the table's order:\n  " + "\n  ".join(r["entry"] for r in rows))
    checked = "rendering and compile checks only" if rows else "rendering only (no offline compiler installed)"
    rc = 0
    if not ok:
        console.print("[red]offline compile check failed[/red]")
        rc = 1
    elif not torch.cuda.is_available():
        summary["gpu_skipped"] = f"no GPU here (torch.cuda.is_available() is False): {checked}"
        if not quiet:
            console.print(summary["gpu_skipped"] + ".")
    else:
        summary["gpu"] = _run_gpu(cfg, model, tokens, iters, console, quiet)
    if not quiet:
        console.print(next_steps(f"--model {model}" if model in MODELS else f"--hf-config {model}", bool(rows)))
    if as_json:
        print(json.dumps(summary))
    return rc


def next_steps(shape: str, table: bool) -> str:
    """What the demo's notation means (with ``table``: its resource table's), where its kernels
    are and what to run next; ``shape``: the flag that named the shape ("--model NAME" or
    "--hf-config FILE")."""
    legend = ("how to read the table: a variant is PAYLOAD BLOCKSxWARPSuUNROLL, e.g. bf16 2048x16u2: the "
              "dispatched dtype or the combine's wire (bf16, or a quantized wire's tag such as qfp8b), then the "
              "launch geometry, blocks x warps per block, and the copy loop's unroll. The caption's 'every row: "
              "w8 h7168 k8 l32 t4096' is the shape the kernels share: w world size (ranks), h hidden size, k top-k, "
              "l experts per rank, t max tokens per rank (s scale bytes, r receive rows, a expert alignment where "
              "set). regs, AGPR, SGPR: registers a thread uses; LDS and occ: shared memory a block uses and "
              "occupancy, in the caption's units.\n" if table else "")
    return (f"{legend}the kernels: rendered in memory and compiled, not written; `epgen generate {shape} -o "
            "DIR` writes their sources, named by the entry names above (an epgen checkout's generated/ holds the "
            f"catalogue's).\nnext: `epgen check {shape} --arch ARCH` (one arch's resources; --json for "
            f"scripts), `epgen demo --moe` (the whole MoE layer), and on a GPU `epgen bench {shape}` "
            "(time against the link's ceiling and NCCL) or `epgen stress` (many verified rounds).")


def _run_gpu(cfg: EpConfig, model: str, tokens: int, iters: int, console: Console, quiet: bool) -> dict:
    """Verify, time and print; returns the per-rank results (raises on a mismatch)."""
    from epgen.codegen.spec import TIMED_OPS
    from epgen.harness.verify import make_inputs, op_arg, op_inputs, run_round
    from epgen.op import EpDispatchCombine
    from epgen.harness.timing import gbps, time_pairs

    W = cfg.world_size
    virtual = W > 1
    op = EpDispatchCombine(cfg, virtual=virtual)
    with console.status("verifying against the reference"):
        stats = run_round(op, cfg, [tokens] * W, "uniform", seed=1)
    if not quiet:
        console.print(f"verified: every received row bit-equal; every combined element within its error bound "
                      f"(worst {stats['bound_ratio']:.2f} of it, max error {stats['combine_err']:.2e})")
    args = op_inputs(op, make_inputs(cfg, [tokens] * W, "uniform", seed=2, device=op.device))
    for r in op.local_ranks:
        op.combine_input(r).normal_()
    ys = op_arg(op, [op.combine_input(r) for r in op.local_ranks])
    d_t, c_t = time_pairs(lambda: op.dispatch(*args), lambda: op.combine(ys), iters=iters)
    bufs = [op.recv_buffers(r) for r in op.local_ranks]
    family = op.family(tokens)
    dgeo, cgeo = (op.variant(o, tokens) for o in TIMED_OPS[family])
    table = Table(title=f"{model} on {torch.cuda.get_device_name(op.device)}: "
                        f"{'virtual ' if virtual else ''}W={W}, {tokens} tokens/rank, {family} family; "
                        f"dispatch {dgeo.blocks}x"
                        f"{dgeo.warps_per_block} u{dgeo.unroll}, combine {cgeo.blocks}x{cgeo.warps_per_block} "
                        f"u{cgeo.unroll}; median of {iters}")
    for c in ("rank", "recv rows", "from peers", "dispatch us", "disp logical GB/s", "disp wire GB/s",
              "combine us", "comb logical GB/s", "comb wire GB/s"):
        table.add_column(c, justify="right")
    row_bytes = dgeo.row_bytes
    ranks = []
    for r, b in zip(op.local_ranks, bufs):
        n = int(b.num_recv.item())
        peers = int((b.recv_src[:n, 0] != r).sum().item())
        ranks.append({"rank": r, "recv_rows": n, "from_peers": peers, "dispatch_us": d_t.median_us,
                      "combine_us": c_t.median_us})
        table.add_row(str(r), str(n), str(peers), f"{d_t.median_us:.1f}", f"{gbps(n * row_bytes, d_t.median_us):.1f}",
                      f"{gbps(peers * row_bytes, d_t.median_us):.1f}", f"{c_t.median_us:.1f}",
                      f"{gbps(n * cfg.hidden * 2, c_t.median_us):.1f}", f"{gbps(peers * cfg.hidden * 2, c_t.median_us):.1f}")
    if not quiet:
        console.print(table)
        if virtual:
            console.print("virtual ranks share one GPU: these rates are local-memory rates, not link rates.")
    op.synchronize()
    op.close()
    return {"combine_max_err": stats["combine_err"], "combine_bound_ratio": stats["bound_ratio"], "family": family,
            "dispatch": str(dgeo.name), "combine": str(cgeo.name), "ranks": ranks}
