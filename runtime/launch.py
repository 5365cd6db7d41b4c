"""Start one process per GPU with torch.distributed, for real (non-virtual) ranks."""

from __future__ import annotations

import os
import socket

import torch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn, args):
    import torch.distributed as dist

    # NVLink multicast stays off (shared hosts; see the device notes in tools/NOTES.md).
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    torch.cuda.set_device(rank)
    dist.init_process_group(backend="cpu:gloo,cuda:nccl", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world_size, device_id=torch.device("cuda", rank))
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def run_ranks(world_size: int, fn, *args) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes, rank r on cuda:r.

    ``fn`` must be a module-level function (it is pickled by reference).

    Raises:
        RuntimeError: fewer GPUs than ranks.
        torch.multiprocessing.ProcessRaisedException: a rank raised (its traceback included).
    """
    if torch.cuda.device_count() < world_size:
        raise RuntimeError(f"world_size={world_size}: needs {world_size} GPUs, this machine has "
                           f"{torch.cuda.device_count()}")
    torch.multiprocessing.spawn(_worker, args=(world_size, _free_port(), fn, args), nprocs=world_size, join=True)


def run_ranks_or_here(world_size: int, virtual: bool, fn, *args) -> None:
    """``fn(rank, world_size, *args)``: in ``world_size`` processes (one per GPU) when
    ``world_size > 1`` and not ``virtual``, else once in this process as rank 0 (which then drives
    every virtual rank, or the only one)."""
    if world_size > 1 and not virtual:
        run_ranks(world_size, fn, *args)
    else:
        fn(0, world_size, *args)
