"""What every measurement of the op records and shares: the environment of a result, a CUDA
graph of one call, and one verified, timed (dispatch, combine) point.

``epgen bench`` and ``epgen tune`` time through ``measure``; the scripts under ``tools/``
(``latency.py``, ``bench_moe.py``) use the same names, so their figures are taken the same way
(docs/measuring.md: events around graph replays queued behind a GPU-side delay, fresh random
inputs, the environment recorded with every result).
"""

from __future__ import annotations

import datetime
import platform
import subprocess

import torch

from epgen.codegen.config import EpConfig
from epgen.harness.timing import PairTiming, time_pairs_queued
from epgen.harness.verify import make_inputs, op_arg, op_inputs, run_round, zero_copy_inputs
from epgen.reference import route

QUEUED, SHORT_SLEEP = "queued", "queued-short-sleep"
"""The ``timing`` column of a result: queued behind a GPU-side delay that covered the host's
enqueue, or one whose delay ended first (partly host-bound; ``QueueDelay.covered`` False)."""


def environment() -> dict:
    """GPU model and count, driver, versions and commit recorded with every result (on a machine
    without a GPU or CuPy: gpu "none", cupy "not installed")."""
    try:
        import cupy
        cupy_version = cupy.__version__
    except ImportError:
        cupy_version = "not installed"

    def sh(*cmd):
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return "?"

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    return {"gpu": gpu, "gpus": torch.cuda.device_count(),
            "driver": sh("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader").split("\n")[0],
            "torch": torch.__version__, "cupy": cupy_version, "python": platform.python_version(),
            "commit": (sh("git", "rev-parse", "--short", "HEAD") or "unknown (no .git)")
            + ("+dirty" if sh("git", "status", "--porcelain") else ""),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def capture_graph(fn) -> "torch.cuda.CUDAGraph":
    """A CUDA graph of the launches ``fn()`` makes (captured, not run), to be timed by replays.
    The capture is thread-local: CUDA calls of NCCL's and gloo's own threads do not invalidate it."""
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, capture_error_mode="thread_local"):
        fn()
    return g


def gathered_rows(indices: torch.Tensor, experts_per_rank: int, world_size: int, rank: int) -> tuple[int, int]:
    """(rows, rows from other ranks) that the combine of ``rank`` gathers for its tokens: one per
    distinct rank a token's valid experts live on (``reference.route``; indices [T, K] int32 of
    that rank, -1 = none).

    Raises:
        ValueError: ``rank`` not an int in [0, world_size); an expert id that is neither -1 nor in
            [0, W x L), or a bad W or L (from ``reference.route``).
    """
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < max(world_size, 1):
        raise ValueError(f"rank={rank!r}: must be an int in [0, world_size={world_size})")
    reached = route(indices, experts_per_rank=experts_per_rank, world_size=world_size) >= 0  # [T, W]
    rows = int(reached.sum().item())
    return rows, rows - int(reached[:, rank].sum().item())


def measure(op, cfg: EpConfig, tokens: int, routing: str, seed: int,
            iters: int) -> tuple[PairTiming, tuple[int, int], str]:
    """Verify one round against the reference, then time dispatch and combine (each dispatch
    followed by its combine) as CUDA-graph replays on fresh inputs, both ways
    (``timing.time_pairs_queued``: ``.queued`` the primary (dispatch, combine) figure, ``.host``
    host-launched, ``.delay.covered`` False when the delay ran out); every rank calls it
    together. The calls take the family ``op.family(tokens)`` says; a low-latency dispatch or
    combine is one replay of its sending and receiving halves (the synchronous call, no
    ``async_recv``). Where the dispatch may pull (``cfg.dispatch_transport`` not "push", a family
    other than "low_latency"), x sits in the op's ``dispatch_input`` (``zero_copy_inputs``: the
    call a pull dispatch reads in place, as a serving engine would make it). Also returns
    ``gathered_rows`` of the first rank ``op`` drives for the timed inputs, and the transport the
    timed dispatch took ("push" or "pull")."""
    run_round(op, cfg, [tokens] * cfg.world_size, routing, seed)  # checked once before it is timed
    inputs = make_inputs(cfg, [tokens] * cfg.world_size, routing, seed + 7, device=op.device)
    if cfg.dispatch_transport != "push" and cfg.kernel_family != "low_latency":  # a dispatch that may pull
        inputs = zero_copy_inputs(op, inputs)
    me = op.local_ranks[0]
    gathered = gathered_rows(inputs[me].indices, cfg.experts_per_rank, cfg.world_size, me)
    args = op_inputs(op, inputs)
    transport = op.transport(tokens, args[0])
    y_arg = op_arg(op, [op.combine_input(r) for r in op.local_ranks])
    out_arg = op_arg(op, [torch.empty(tokens, cfg.hidden, dtype=torch.bfloat16, device=op.device)
                          for _ in op.local_ranks])

    def disp():
        op.dispatch(*args)

    def comb():
        op.combine(y_arg, out=out_arg)

    s = torch.cuda.Stream(op.device)
    s.wait_stream(torch.cuda.current_stream(op.device))
    with torch.cuda.stream(s):
        disp()
        comb()
    torch.cuda.current_stream(op.device).wait_stream(s)
    gd, gc = capture_graph(disp), capture_graph(comb)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    pair = time_pairs_queued(gd.replay, gc.replay, iters=iters, warmup=5)
    op.synchronize()
    return pair, gathered, transport
