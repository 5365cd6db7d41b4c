"""Start one process per GPU with torch.distributed, for real (non-virtual) ranks."""

from __future__ import annotations

import os
import shutil
import tempfile
import time

import torch


def _worker(rank: int, world_size: int, store: str, fn, args):
    import torch.distributed as dist

    # NVLink multicast stays off (shared hosts; see the device notes in tools/NOTES.md).
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    torch.cuda.set_device(rank)
    dist.init_process_group(backend="cpu:gloo,cuda:nccl", init_method=f"file://{store}",
                            rank=rank, world_size=world_size, device_id=torch.device("cuda", rank))
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def run_ranks(world_size: int, fn, *args, timeout_s: float | None = None) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes, rank r on cuda:r.

    ``fn`` must be a module-level function (it is pickled by reference). A rank that ends with
    exit status 0 before ``fn`` returns (``os._exit(0)``, e.g. a test playing a dead peer) counts
    as finished; the others run on.

    Args:
        timeout_s: bound on the whole run (None: no bound). Past it every rank still running is
            killed and TimeoutError raised, so a hung rank fails the caller instead of hanging it.

    Raises:
        ValueError: world_size not an int >= 1.
        RuntimeError: fewer GPUs than ranks.
        torch.multiprocessing.ProcessRaisedException: a rank raised (its traceback included); the
            other ranks are terminated.
        torch.multiprocessing.ProcessExitedException: a rank died with a non-zero status or a signal.
        TimeoutError: ranks still running after ``timeout_s``.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r}: must be an int >= 1")
    if torch.cuda.device_count() < world_size:
        raise RuntimeError(f"world_size={world_size}: needs {world_size} GPU{'s' if world_size > 1 else ''}, this "
                           f"machine has {torch.cuda.device_count()}")
    # The rendezvous goes through a file, not a TCP port: a port found free and bound later by the
    # ranks can be taken in between (EADDRINUSE seen on the device between back-to-back tests).
    folder = tempfile.mkdtemp(prefix="epgen-ranks-")
    try:
        start_and_join(_worker, (world_size, os.path.join(folder, "store"), fn, args), world_size, timeout_s)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def start_and_join(target, args: tuple, nprocs: int, timeout_s: float | None = None) -> None:
    """``torch.multiprocessing.spawn(target, args, nprocs)`` with an optional bound: past
    ``timeout_s`` seconds, kill every process still running and raise TimeoutError naming them.
    Failures propagate as from ``spawn``; no process outlives the call."""
    ctx = torch.multiprocessing.start_processes(target, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=None if deadline is None else max(0.0, deadline - time.monotonic())):
            if deadline is not None and time.monotonic() >= deadline:
                running = [i for i, p in enumerate(ctx.processes) if p.is_alive()]
                raise TimeoutError(f"processes {running} of {nprocs} still running after timeout_s={timeout_s}; "
                                   "killed them")
    finally:
        for p in ctx.processes:
            try:
                if p.is_alive():
                    p.kill()
                p.join()
            except ValueError:  # already closed by the join above
                pass


def run_ranks_or_here(world_size: int, virtual: bool, fn, *args) -> None:
    """``fn(rank, world_size, *args)``: in ``world_size`` processes (one per GPU) when
    ``world_size > 1`` and not ``virtual``, else once in this process as rank 0 (which then drives
    every virtual rank, or the only one)."""
    if world_size > 1 and not virtual:
        run_ranks(world_size, fn, *args)
    else:
        fn(0, world_size, *args)
